"""Engine side of megatron-core's releases: every probe of megatron's shape (which method takes the probs, where the
combine can be patched, which router method gives the logits), building a real MoELayer, megatron's own remedies and
the training hooks (what each release has — versions, options, features — is `moe_lab.releases`, torch-free, read by
the controller too). The CPU and gloo shims megatron-core needs without CUDA are `engine/shims.py`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys

import torch

# what each release has is the torch-free table in moe_lab/releases.py; the names used here:
from ..releases import FEATURE_FIELDS, check_router_dtype, installed_version, parse_version
from . import shims

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- dispatcher API

# Token dispatcher methods → stage name and the names of their outputs. 0.13+ split the dispatch into pre / comm /
# post steps; 0.11–0.12 had one permutation and one unpermutation method.
DISPATCHER_METHODS = {
    "dispatch_preprocess": ("dispatch.pre", ("tokens", "probs")),
    "token_dispatch": ("dispatch.comm", ("tokens", "probs")),
    "dispatch_postprocess": ("dispatch.post", ("tokens", "tokens_per_expert", "probs")),
    "combine_preprocess": ("combine.pre", None),
    "token_combine": ("combine.comm", None),
    "combine_postprocess": ("combine.post", None),
    # 0.11 / 0.12
    "token_permutation": ("dispatch.permuted", ("tokens", "tokens_per_expert", "probs")),
    "token_unpermutation": ("combine.unpermuted", ("out", "bias")),
}


def router_logits_method(router) -> str | None:
    """The router method whose output is the logits (`gating`, every release so far), or None where a release has
    none to wrap."""
    return "gating" if hasattr(router, "gating") else None


@contextlib.contextmanager
def patched_unpermute(make):
    """Replace megatron's module-level `token_dispatcher.unpermute` (the combine's sum of each token's expert
    outputs) by `make(original)` for a block; the dispatchers look it up there at call time. Its signature in
    0.11–0.19: (permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
    drop_and_pad=False); `probs` is given only by releases that weight in the combine (<= 0.12)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    orig = td.unpermute
    td.unpermute = make(orig)
    try:
        yield
    finally:
        td.unpermute = orig


def dispatcher_entry(dispatcher) -> tuple[str, int]:
    """The dispatcher method that receives the routing probs, and the position of `probs` among its arguments:
    `dispatch_preprocess(hidden, routing_map, probs)` from 0.13, `token_permutation(hidden, probs, routing_map)`
    before."""
    if hasattr(dispatcher, "dispatch_preprocess"):
        return "dispatch_preprocess", 2
    return "token_permutation", 1


# ---------------------------------------------------------------------------------------------- building


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def transformer_config(cfg, layout, *, device: str):
    """A megatron TransformerConfig for `cfg` (a MoEConfig) split as `layout` (a resolved `moe_lab.layout.Layout`),
    with only the fields this release knows."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    version = installed_version()
    check_router_dtype(cfg.router_dtype, version)
    tp, ep = layout.tp, layout.ep
    kwargs = dict(
        num_layers=1,
        hidden_size=cfg.hidden,
        num_attention_heads=tp,
        ffn_hidden_size=cfg.ffn_hidden,
        moe_ffn_hidden_size=cfg.ffn_hidden,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.topk,
        moe_token_dispatcher_type=cfg.dispatcher,
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=layout.sequence_parallel,
        bf16=cfg.dtype == "bf16",
        fp16=cfg.dtype == "fp16",
        params_dtype=torch_dtype(cfg.dtype),
        use_cpu_initialization=device == "cpu",
        # model.init_weights overwrites every parameter from the seed: megatron's own init would be done twice
        perform_initialization=False,
    )
    if layout.expert_tp != tp:
        kwargs["expert_tensor_parallel_size"] = layout.expert_tp
    if cfg.router_dtype != "none":
        kwargs["moe_router_dtype"] = cfg.router_dtype
    for opt in getattr(cfg, "options", ()):
        kwargs[opt] = True
    features = cfg.features() if hasattr(cfg, "features") else {}
    for name, value in features.items():  # only what is set: the seed layer's config is built as before
        kwargs[FEATURE_FIELDS[name]] = value
    if features.get("gated"):
        kwargs["activation_func"] = torch.nn.functional.silu  # SwiGLU, as every preset model's experts
    known = TransformerConfig.__dataclass_fields__
    missing = [FEATURE_FIELDS[n] for n in features if FEATURE_FIELDS[n] not in known]
    if missing:  # a feature the user asked for is never dropped quietly
        raise ValueError(f"megatron-core {version} has no {missing}: this layer cannot be built on it")
    dropped = [k for k in kwargs if k not in known]
    for k in dropped:
        kwargs.pop(k)
    if dropped:
        logger.debug("megatron-core %s has no %s; left out", version, dropped)
    return TransformerConfig(**kwargs)


def _local_moe_spec(num_experts: int):
    from megatron.core.models.gpt import gpt_layer_specs

    if parse_version(installed_version())[:2] == (0, 10):
        # 0.10's local spec names TE grouped-linear classes it never imported without TE.
        for name in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"):
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("megatron.core") and not hasattr(mod, name):
                    try:
                        setattr(mod, name, None)
                    except Exception:  # noqa: BLE001 - modules that refuse attributes are not the spec's
                        pass
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return spec.submodules.mlp


def build_moe_layer(cfg, layout, *, device: str):
    """The real megatron-core MoELayer (local spec: SequentialMLP, no TE), in eval mode on `device`."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    tc = transformer_config(cfg, layout, device=device)
    mlp = _local_moe_spec(cfg.num_experts)
    if isinstance(mlp, functools.partial):  # 0.19: the spec's mlp is partial(MoELayer, submodules=...)
        layer = mlp(config=tc)
    elif getattr(mlp, "module", None) is MoELayer:
        layer = MoELayer(tc, mlp.submodules)
    else:
        raise RuntimeError(f"megatron-core {installed_version()}: unexpected local MoE spec {mlp!r}")
    if device == "cuda":
        layer = layer.cuda()
    layer = layer.to(torch_dtype(cfg.dtype))
    layer.eval()
    return layer


def moe_forward(layer, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None, *,
                grad: bool = False) -> torch.Tensor:
    """One MoE forward without autograd (grad=True: with it, as a training step's forward runs — 0.18+ orders the
    top-k differently then); returns the output tensor, detached (the bias, always None here, dropped).

    `padding_mask` ([seq, batch], True = real token) is passed only to releases whose forward takes it.
    """
    with torch.enable_grad() if grad else torch.no_grad():
        if padding_mask is not None:
            if not supports_padding_mask(layer):
                raise ValueError(f"megatron-core {installed_version()} MoELayer.forward has no padding_mask")
            # MoELayer.forward transposes [bsz, seq] → [seq, bsz]; hand it [bsz, seq].
            out = layer(tokens, padding_mask=padding_mask.transpose(0, 1))
        else:
            out = layer(tokens)
    return moe_output(out).detach()


def moe_output(out):
    """The output tensor of a MoELayer call ((output, bias) in every release so far)."""
    return out[0] if isinstance(out, tuple) else out


def supports_padding_mask(layer) -> bool:
    import inspect

    return "padding_mask" in inspect.signature(type(layer).forward).parameters


# ---------------------------------------------------------------------------------------------- megatron's own remedies


@contextlib.contextmanager
def routing_replay(layer, action: str):
    """megatron's router replay (0.16+, `moe_enable_routing_replay`) for the block: 'record' the top-k indices of the
    forwards inside, or 'replay' the last recorded ones (every token gets the experts it had when recorded)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rr = getattr(layer.router, "router_replay", None)
    if rr is None:
        raise ValueError("routing replay needs a layer built with options=('moe_enable_routing_replay',)")
    if action == "replay":
        rr.set_target_indices(rr.get_recorded_indices())
    rr.set_router_replay_action(RouterReplayAction.RECORD if action == "record" else RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        rr.clear_router_replay_action()


def batch_invariant_available() -> str | None:
    """None if megatron's batch-invariant kernels can run here, else why not (they are Triton GPU kernels)."""
    try:
        from megatron.core.transformer.custom_layers import batch_invariant_kernels  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an old release, or no triton
        return f"megatron-core {installed_version()} has no batch_invariant_kernels ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "megatron's batch-invariant kernels are Triton GPU kernels: GPU only"
    return None


@contextlib.contextmanager
def batch_invariant_mode():
    """megatron's `set_batch_invariant_mode(True)` (0.16.1: a Triton persistent matmul patched over aten::mm/addmm,
    log_softmax, mean) for the block. Without TransformerEngine its enable step imports TE after patching aten::mm, so
    the failed enable would leak the patch: this shim skips megatron's TE patching when TE is absent (the layers
    here use no TE kernels) and always restores aten on exit."""
    why = batch_invariant_available()
    if why:
        raise ValueError(why)
    import importlib.util

    from megatron.core.transformer.custom_layers import batch_invariant_kernels as bik

    saved = None
    if importlib.util.find_spec("transformer_engine") is None:
        saved = (bik._te_patch_for_batch_invariant, bik._te_unpatch_for_batch_invariant)
        bik._te_patch_for_batch_invariant = lambda: None
        bik._te_unpatch_for_batch_invariant = lambda: None
        shims.note("batch_invariant_without_te")
    try:
        with bik.set_batch_invariant_mode(True):
            yield
    finally:
        if bik.is_batch_invariant_mode_enabled():  # never leave aten patched
            bik.disable_batch_invariant_mode()
        if saved is not None:
            bik._te_patch_for_batch_invariant, bik._te_unpatch_for_batch_invariant = saved


@contextlib.contextmanager
def fp32_gather_grad_reduce():
    """Lab remedy for the backward: the allgather dispatcher's all-gathers (`gather_from_sequence_parallel_region` as
    bound in megatron's token_dispatcher) keep their forward, but their backward — the reduce-scatter that sums each
    token's gradient over the EP ranks — runs in fp32 and casts back (megatron runs it in the gradient's dtype, bf16,
    in a rank-dependent order). No megatron option does this."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher as td

    orig = td.gather_from_sequence_parallel_region

    class _Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, output_split_sizes, use_global_buffer):
            ctx.group, ctx.splits, ctx.dtype = group, output_split_sizes, x.dtype
            return mappings._gather_along_first_dim(x, group, output_split_sizes, use_global_buffer)

        @staticmethod
        def backward(ctx, g):
            out = mappings._reduce_scatter_along_first_dim(g.float(), ctx.group, ctx.splits)
            return out.to(ctx.dtype), None, None, None

    def gather(input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None, use_global_buffer=False):
        if not (input_.is_floating_point() and input_.requires_grad and tensor_parallel_output_grad):
            return orig(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        group = mappings.get_tensor_model_parallel_group_if_none(group)
        return _Gather.apply(input_, group, output_split_sizes, use_global_buffer)

    td.gather_from_sequence_parallel_region = gather
    try:
        yield
    finally:
        td.gather_from_sequence_parallel_region = orig


# ---------------------------------------------------------------------------------------------- training


@contextlib.contextmanager
def capture_routing(router, keep):
    """Call keep(logits, routing_map) on every routing decision of `router` inside the block: its `routing(logits,
    ...)` method (0.11-0.19: `forward` computes `logits = self.gating(input)` and hands them to `self.routing`, which
    returns (probs, routing_map [tokens, experts] bool)) is wrapped on the instance, never in megatron's class."""
    orig = router.routing

    def routing(logits, *a, **k):
        probs, routing_map = orig(logits, *a, **k)
        keep(logits, routing_map)
        return probs, routing_map

    router.routing = routing
    try:
        yield
    finally:
        del router.routing  # the class's method again


def parallel_state_kwargs(backend: str | None) -> dict:
    """`initialize_model_parallel`'s extra arguments for a process group of `backend`: where gloo is the default
    backend, megatron's gloo copies of its data-parallel groups (`create_gloo_process_groups`, 0.12+; used by its
    distributed optimizer and checkpointing, which run on NCCL only) would be second gloo groups of the same ranks:
    not made (3 of 20 groups a layout on 4 CPU engines)."""
    import inspect

    from megatron.core import parallel_state as ps

    if backend == "gloo" and "create_gloo_process_groups" in inspect.signature(ps.initialize_model_parallel).parameters:
        return {"create_gloo_process_groups": False}
    return {}


def megatron_ddp_and_optimizer(module, transformer_config, *, lr: float, weight_decay: float, betas: tuple,
                               eps: float, clip_grad: float, grad_reduce_in_fp32: bool = False):
    """megatron-core's own DistributedDataParallel around `module` and get_megatron_optimizer over it (Adam, bf16
    params with fp32 main weights, no distributed optimizer, no overlap): the reference the lab's training step
    (engine/train.py) is tested against. NCCL with one rank per GPU only — over gloo megatron's bucket sync fails
    ("ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda", at world 1 too) and the optimizer
    allocates on 'cuda' (no CPU run). 0.16: DistributedDataParallel(config, ddp_config, module);
    get_megatron_optimizer(config, model_chunks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if not torch.cuda.is_available() or not torch.distributed.get_backend() == "nccl":
        raise ValueError("megatron's DistributedDataParallel + optimizer run on NCCL with one rank per GPU only "
                         "(gloo: allreduce_coalesced rejects CUDA tensors; CPU: the optimizer allocates on 'cuda')")
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    model = DistributedDataParallel(config=transformer_config, ddp_config=ddp_cfg, module=module)
    dtype = next(module.parameters()).dtype
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
                              adam_beta2=betas[1], adam_eps=eps, clip_grad=clip_grad, bf16=dtype == torch.bfloat16,
                              params_dtype=dtype, use_distributed_optimizer=False)
    return model, get_megatron_optimizer(opt_cfg, [model])


def megatron_train_step(model, optimizer, loss_fn) -> tuple[float, float]:
    """One step of megatron's own: zero the grad buffers, loss_fn(model).backward(), finish the grad sync, step.
    Returns (loss, grad norm) — `optimizer.step()` returns (success, grad_norm, num_zeros) from 0.11 on."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = loss_fn(model)
    loss.backward()
    model.finish_grad_sync()
    ok, norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("megatron's optimizer skipped the step (inf/nan gradients)")
    return float(loss.detach()), float(norm)


@contextlib.contextmanager
def replay_targets(layers):
    """megatron's router replay (0.16+, `moe_enable_routing_replay`) driven from outside: yields set(per_layer) that
    makes each layer's next forwards route every token to the given top-k experts ([tokens, k] indices; the probs
    are gathered from the current scores, as megatron's REPLAY_FORWARD does); replay state cleared on exit."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rrs = [getattr(lyr.router, "router_replay", None) for lyr in layers]
    if any(r is None for r in rrs):
        raise ValueError("routing replay needs layers built with options=('moe_enable_routing_replay',)")

    def set_targets(per_layer):
        for r, idx in zip(rrs, per_layer):
            r.set_target_indices(idx)

    for r in rrs:
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield set_targets
    finally:
        for r in rrs:
            r.clear_router_replay_action()
            r.clear_indices()
