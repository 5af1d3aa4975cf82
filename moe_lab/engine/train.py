"""Runs on engines: a data-parallel training step over a stack of megatron-core MoE layers with megatron's
gradient arithmetic and optimizer semantics, and what every step leaves behind (loss, gradient norm, weight
fingerprints and sketches, the routing of every layer).

The arithmetic is megatron-core's DistributedDataParallel + finalize_model_grads + get_megatron_optimizer (0.16,
`average_in_collective` off, one micro-batch). The global batch is split into DP x TP contiguous shares: data-parallel
rank d, tensor-parallel rank r feeds share d*TP + r (with TP > 1 the layout must be sequence parallel, as megatron
requires for MoE with TP; each TP rank's loss is its share's mean / TP, so the TP ranks' losses sum to their DP
share's mean). Every gradient is scaled by 1/DP (DP = world / tp, for expert parameters too: their gradient already
sums the tokens of the whole EP x ETP group) and summed — dense (router) parameters over the data-parallel group,
then over the TP group (megatron's all-reduce of sequence-parallel parameters), expert parameters over the
expert-data-parallel group — in the parameters' dtype (bf16) or, with `grad_reduce_fp32`, in fp32 (megatron's
`grad_reduce_in_fp32`); then fp32 main weights take the gradient, the global norm (the TP-replicated router counted
once, expert² summed over the ETP x EP group) clips it at `clip_grad`, AdamW steps, and the bf16 weights are the main
weights cast back. Over gloo megatron's own DDP cannot run (its bucket sync uses torch's `_coalescing_manager`, which
gloo rejects for CUDA tensors) and its optimizer allocates on 'cuda': this is the same arithmetic written out, tested
equal to megatron's on a GPU (tests/gpu/test_training_gpu.py) and to EP=1 in fp64 at EP 2, 4 and TP 2 x EP 2
(tests/cluster/test_training.py)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .. import metrics
from ..config import MoEConfig
from ..layout import Layout
from . import compat, layer as layer_mod
from .dist import STATE
from .forward_pass import stack_forward

logger = logging.getLogger(__name__)

SKETCH = 16
"""Random projections per weight tensor: ||w_a - w_b|| is estimated from the sketches of two runs (JL, ~±35 %)."""
PRECISIONS = {"bf16": torch.bfloat16, "fp64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class Optim:
    """megatron-core OptimizerConfig's Adam fields (its defaults, but lr)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class _Param:
    name: str
    """'layer{i}.router' or 'layer{i}.expert{g}.linear_fc1' (g global: the same name at every EP)."""
    model: torch.nn.Parameter
    main: torch.Tensor
    expert: bool


def build_stack(cfg: MoEConfig, layers: int, *, layout: Layout, precision: str = "bf16") -> list:
    """`layers` fresh (uncached: training changes them) MoE layers at `layout` (the rest of the world data parallel),
    layer i seeded from seed + i: expert g's weights depend on (seed, i, g) only, never on the layout."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {', '.join(PRECISIONS)}")
    cfg = cfg.replace(dtype="fp32" if precision == "fp64" else cfg.dtype)
    # the one build path: parallel_state for the layout, then build + seed each layer
    return [lyr.to(PRECISIONS[precision]) for lyr in layer_mod.fresh_layers(cfg, layout, layers)]


def named_params(stack) -> list[tuple[str, torch.nn.Parameter, bool]]:
    """(global name, parameter, is expert) of every parameter of the stack, names independent of EP."""
    from megatron.core import parallel_state as ps

    out = []
    for i, lyr in enumerate(stack):
        n_local = len(lyr.experts.local_experts)
        base = ps.get_expert_model_parallel_rank() * n_local
        for name, p in lyr.named_parameters():
            m = layer_mod.EXPERT_PARAM.search(name)
            if m:
                out.append((f"layer{i}.expert{base + int(m.group(1))}.{m.group(2)}", p, True))
            elif name.endswith("router.weight"):
                out.append((f"layer{i}.router", p, False))
            else:
                raise RuntimeError(f"megatron-core {compat.installed_version()}: parameter {name} is neither router "
                                   "nor expert weight; teach engine.train its name")
    return out


MISTAKES = ("none", "expert_dp", "no_sp_reduce")
"""Deliberate errors for the tests' controls: 'expert_dp' divides expert gradients by the size of the group they are
summed over instead of DP (equal at EP = ETP = 1 only); 'no_sp_reduce' skips the router's all-reduce over TP that
sequence parallelism needs (a no-op at TP = 1)."""


class Trainer:
    """The DP step of one stack on this rank (see the module docstring)."""

    def __init__(self, stack, *, optim: Optim, grad_reduce_fp32: bool = False, mistake: str = "none"):
        from megatron.core import parallel_state as ps

        if mistake not in MISTAKES:
            raise ValueError(f"mistake ({mistake!r}) must be one of {', '.join(MISTAKES)}")
        self.stack, self.layers, self.optim, self.mistake = stack, stack, optim, mistake
        self.dense_group = ps.get_data_parallel_group()
        self.expert_group = ps.get_expert_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.expert_mp_group = ps.get_expert_tensor_and_model_parallel_group()  # ETP x EP: who holds distinct shards
        self.dp = tdist.get_world_size(self.dense_group)
        self.tp = tdist.get_world_size(self.tp_group)
        self.etp = tdist.get_world_size(self.etp_group)
        self.sequence_parallel = bool(stack[0].config.sequence_parallel)
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError(f"training at tp {self.tp} needs sequence parallelism (megatron requires it for MoE with "
                             "TP): add 'sp' to the layout, e.g. tp2,ep2,sp")
        self.share, self.shares = ps.get_data_parallel_rank() * self.tp + ps.get_tensor_model_parallel_rank(), \
            self.dp * self.tp
        """This rank's share of the global batch: index d*TP + r of DP x TP contiguous shares."""
        self.gated = bool(stack[0].config.gated_linear_unit)
        self.grad_reduce_fp32 = grad_reduce_fp32
        self.expert_div = self.dp if mistake != "expert_dp" else tdist.get_world_size(self.expert_group)
        main_dtype = torch.float64 if stack[0].router.weight.dtype == torch.float64 else torch.float32
        self.params = [_Param(n, p, p.detach().clone().to(main_dtype), e) for n, p, e in named_params(stack)]
        self._projections: dict[str, torch.Tensor] = {}
        self.opt = torch.optim.AdamW([q.main for q in self.params], lr=optim.lr, weight_decay=optim.weight_decay,
                                     betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)

    def my_share(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global per-token tensor (tokens along dim 0)."""
        return shard(t, self.share, self.shares)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stack with residual connections: h <- h + moe_i(h) (StackModule's forward)."""
        return stack_forward(self.layers, x)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """One optimizer step on this rank's share (x, y) of the global batch; returns this rank's local loss (the
        mean squared error over its tokens, fp32 or fp64) and the global gradient norm before clipping; with TP the
        backward starts from loss / TP (the TP ranks' losses sum to the DP share's mean)."""
        for q in self.params:
            q.model.grad = None
        with torch.enable_grad():
            h = self.forward(x)
            diff = h.to(y.dtype) - y
            loss = (diff * diff).mean()
            (loss / self.tp if self.tp > 1 else loss).backward()
        self.reduce_grads()
        norm = self.grad_norm()
        if self.optim.clip_grad > 0:  # megatron's clip_grad_by_total_norm_fp32
            coeff = self.optim.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for q in self.params:
                    q.main.grad.mul_(coeff)
        self.opt.step()
        with torch.no_grad():
            for q in self.params:
                q.model.copy_(q.main.to(q.model.dtype))
        return {"loss": float(loss.detach()), "grad_norm": float(norm)}

    def reduce_grads(self) -> None:
        """megatron DDP: grads x 1/DP, summed over each group in one flat buffer (a bucket), into the main grads; the
        dense (router) buffer then summed over TP (finalize_model_grads' sequence-parallel all-reduce, in the buffer's
        dtype, after the DP reduce)."""
        for expert, group in ((False, self.dense_group), (True, self.expert_group)):
            ps_ = [q for q in self.params if q.expert == expert]
            if not ps_:
                continue
            own = ps_[0].model.dtype
            dtype = torch.float32 if self.grad_reduce_fp32 and own != torch.float64 else own
            flat = torch.cat([(q.model.grad if q.model.grad is not None else torch.zeros_like(q.model))
                              .reshape(-1).to(dtype) for q in ps_])
            flat.mul_(1.0 / (self.expert_div if expert else self.dp))
            if tdist.get_world_size(group) > 1:
                tdist.all_reduce(flat, group=group)
            if not expert and self.tp > 1 and self.sequence_parallel and self.mistake != "no_sp_reduce":
                tdist.all_reduce(flat, group=self.tp_group)
            off = 0
            for q in ps_:
                n = q.main.numel()
                q.main.grad = flat[off:off + n].view_as(q.main).to(q.main.dtype)
                off += n

    def grad_norm(self) -> float:
        """megatron's global norm of the main grads: sqrt(dense² + expert²), the router (replicated over TP) counted
        once, expert² summed over the ETP x EP group (each of its ranks holds distinct expert shards)."""
        sq = {e: torch.zeros((), dtype=torch.float64 if self.params[0].main.dtype == torch.float64 else torch.float32,
                             device=self.params[0].main.device) for e in (False, True)}
        for q in self.params:
            sq[q.expert] = sq[q.expert] + torch.norm(q.main.grad, 2) ** 2
        if tdist.get_world_size(self.expert_mp_group) > 1:
            tdist.all_reduce(sq[True], group=self.expert_mp_group)
        return math.sqrt(float(sq[False]) + float(sq[True]))

    def _full_experts(self) -> dict[str, torch.Tensor]:
        """Every expert main weight of this rank whole: its ETP shards gathered (one flat all-gather) and put back
        together (`whole`)."""
        mine = [q for q in self.params if q.expert]
        if self.etp == 1 or not mine:
            return {q.name: q.main.detach() for q in mine}
        flat = torch.cat([q.main.detach().reshape(-1) for q in mine])
        parts = [torch.empty_like(flat) for _ in range(self.etp)]
        tdist.all_gather(parts, flat, group=self.etp_group)
        out, off = {}, 0
        for q in mine:
            n = q.main.numel()
            out[q.name] = whole(q.name, [p[off:off + n].view_as(q.main) for p in parts], gated=self.gated)
            off += n
        return out

    def weights(self, seed: int) -> dict:
        """This rank's share of the weight state: per owned global tensor (each on exactly one rank: the router on
        data- and tensor-parallel rank 0, an expert's on expert-data-parallel and expert-tensor-parallel rank 0, its
        ETP shards gathered whole) its fingerprint, squared norm and SKETCH random projections of the main weights
        (fp64, seeded by (seed, name): equal on every layout). Every rank must call it (the ETP gather)."""
        from megatron.core import parallel_state as ps

        own_dense = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        own_expert = ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
        experts = self._full_experts()
        out = {}
        for q in self.params:
            if not (own_expert if q.expert else own_dense):
                continue
            full = experts[q.name] if q.expert else q.main.detach()
            w = full.reshape(-1).to(torch.float64)
            r = self._projections.get(q.name)
            if r is None:  # drawn once per run (kept in fp32 on GPUs: half the memory), the same at every layout
                g = layer_mod.generator(w.device, seed, "sketch", q.name)
                r = torch.randn((SKETCH, w.numel()), generator=g, device=w.device, dtype=torch.float32)
                self._projections[q.name] = r = r if w.is_cuda else r.double()
            out[q.name] = (metrics.fingerprint(full), float(w @ w), (r.double() @ w).tolist())
        return out


def whole(name: str, shards: list[torch.Tensor], *, gated: bool) -> torch.Tensor:
    """An expert weight put back together from its ETP shards (in ETP-rank order): fc1 ([ffn, hidden],
    column-parallel: rows; a GLU's [gate; up] halves each sharded on its own, so the gates first, then the ups), fc2
    ([hidden, ffn], row-parallel: columns) — the inverse of layer.init_weights' `_shard`."""
    if name.endswith("linear_fc1"):
        if gated:
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=0)
    if name.endswith("linear_fc2"):
        return torch.cat(shards, dim=1)
    raise ValueError(f"{name}: not an expert weight (linear_fc1 or linear_fc2)")


def combine_weights(shares: list[dict]) -> dict:
    """Every rank's `Trainer.weights` → the global state: one fingerprint over every tensor (sorted by its global
    name), the squared norm and the sketch (summed in that order: the same bits for the same weights at any EP)."""
    allw = {}
    for s in shares:
        allw.update(s)
    h = hashlib.sha256()
    norm2, sk = 0.0, [0.0] * SKETCH
    for name in sorted(allw):
        fp, n2, proj = allw[name]
        h.update(f"{name}:{fp};".encode())
        norm2 += n2
        sk = [a + b for a, b in zip(sk, proj)]
    return {"fingerprint": h.hexdigest()[:32], "norm": math.sqrt(norm2), "sketch": sk, "tensors": len(allw)}


@contextlib.contextmanager
def routing(stack, sink: list[list]):
    """Per layer, the top-k experts (sorted) and the margin of the top-k boundary (k-th minus (k+1)-th router logit)
    of every token of every forward inside the block, appended to sink[layer]."""
    with contextlib.ExitStack() as st:
        for i, lyr in enumerate(stack):
            def keep(logits, routing_map, i=i, k=lyr.config.moe_router_topk):
                sink[i].append(topk_and_margin(logits, routing_map, k))
            st.enter_context(compat.capture_routing(lyr.router, keep))
        yield


def topk_and_margin(logits: torch.Tensor, routing_map: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its top-k experts (ascending, uint8, from megatron's routing map [tokens, experts]) and the margin
    of the top-k boundary: the k-th largest router logit minus the (k+1)-th (fp32; inf with k = experts)."""
    lg = logits.detach().float().reshape(routing_map.shape[0], -1)
    top = torch.sort(lg, dim=1, descending=True).values
    margin = top[:, k - 1] - top[:, k] if lg.shape[1] > k else torch.full_like(top[:, 0], math.inf)
    idx = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)
    return idx.to(torch.uint8).cpu(), margin.cpu()


def batch(cfg: MoEConfig, step: int, tokens: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: tokens x [tokens, 1, hidden] standard normal (in the params' dtype) and the
    regression target y = tanh(x T) (T fixed by the seed; fp32, or fp64 for fp64 runs): the same on every layout."""
    g = layer_mod.generator(device, cfg.seed, "batch", step)
    x = torch.randn((tokens, 1, cfg.hidden), generator=g, device=device, dtype=torch.float32)
    gt = layer_mod.generator(device, cfg.seed, "teacher")
    T = torch.randn((cfg.hidden, cfg.hidden), generator=gt, device=device, dtype=torch.float32) / math.sqrt(cfg.hidden)
    ydt = torch.float64 if dtype == torch.float64 else torch.float32
    return x.to(dtype), torch.tanh(x.to(ydt) @ T.to(ydt))


def shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Share `rank` of `n` contiguous shares of the global batch (tokens along dim 0)."""
    if t.shape[0] % n:
        raise ValueError(f"tokens per step ({t.shape[0]}) must be divisible by the number of shares ({n}: "
                         "data-parallel x tensor-parallel size)")
    per = t.shape[0] // n
    return t[rank * per:(rank + 1) * per]




class StackModule(torch.nn.Module):
    """The stack as one module (what megatron's DistributedDataParallel wraps): h <- h + moe_i(h)."""

    def __init__(self, stack):
        super().__init__()
        self.layers = torch.nn.ModuleList(stack)

    def forward(self, x):
        return stack_forward(self.layers, x)


def versus_megatron(payload: dict) -> dict:
    """Engine side of the GPU test: the same stack, weights and batches through megatron's own
    DistributedDataParallel + get_megatron_optimizer and through `Trainer`; per step both losses and gradient norms,
    and after the last step every weight compared (metrics.compare). payload: moe (a MoEConfig dict), layers, steps,
    tokens, lr, grad_reduce_fp32, and lr_factor (the control: the lab's run with another learning rate)."""
    cfg = MoEConfig(**payload["moe"])
    lay = layer_mod.layout_here(payload.get("layout"))
    opt = Optim(lr=payload["lr"])
    ours = Trainer(build_stack(cfg, payload["layers"], layout=lay),
                   optim=Optim(lr=payload["lr"] * payload.get("lr_factor", 1.0)),
                   grad_reduce_fp32=payload.get("grad_reduce_fp32", False))
    mstack = build_stack(cfg, payload["layers"], layout=lay)
    module = StackModule(mstack)
    model, optimizer = compat.megatron_ddp_and_optimizer(
        module, mstack[0].config, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps, clip_grad=opt.clip_grad, grad_reduce_in_fp32=payload.get("grad_reduce_fp32", False))
    out = {"lab": [], "megatron": []}
    for t in range(payload["steps"]):
        x, y = batch(cfg, t, payload["tokens"], torch.bfloat16, STATE["torch_device"])
        xs, ys = ours.my_share(x), ours.my_share(y)
        out["lab"].append(ours.step(xs, ys))

        def loss_fn(m, xs=xs, ys=ys):
            with torch.enable_grad():
                d = m(xs).to(ys.dtype) - ys
                return (d * d).mean()

        loss, norm = compat.megatron_train_step(model, optimizer, loss_fn)
        out["megatron"].append({"loss": loss, "grad_norm": norm})
    mine = {n: p for n, p, _ in named_params(ours.stack)}
    theirs = {n: p for n, p, _ in named_params(mstack)}
    out["weights"] = {n: metrics.compare(mine[n].detach(), theirs[n].detach()) for n in sorted(mine)}
    out["rank"] = tdist.get_rank()
    return out


__all__ = ["Optim", "Trainer", "build_stack", "named_params", "combine_weights", "routing", "batch", "shard",
           "SKETCH", "PRECISIONS", "MISTAKES", "whole", "topk_and_margin", "StackModule", "versus_megatron"]
