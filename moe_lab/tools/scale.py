"""Scale model: per-GPU memory of one MoE layer forward as the lab runs it, by explicit calculation; the
plan built from it (totals, whether it fits, compute, the placement check) is `tools.scale_plan`.

What is counted, per rank (TP=1, megatron-core 0.16.1's non-fused path: local spec, `SequentialMLP`, no TE, eval,
`torch.no_grad()`, which is what `engine.toolkit.forward` runs):

- **parameters**: the router weight [experts x hidden] and, per local expert (experts / EP), `linear_fc1`
  [ffn (x2 if gated) x hidden] and `linear_fc2` [hidden x ffn], all in the layer dtype. megatron creates the router
  weight in fp32 but casts it to `params_dtype` in `reset_parameters`, and the lab's `layer.to(dtype)` would anyway;
  no biases (`add_bias_linear=False`). A cluster test checks these bytes against the real layer exactly.
- **forward**: a timeline of the tensors alive at each step of one forward (`forward_phases`), read from the code
  of 0.16.1 (router.py, moe_utils.py, token_dispatcher.py, experts.py, mlp.py); the forward's peak is the largest
  step. Tensors die when Python drops the last reference, so the timeline follows the variables that stay bound:
  e.g. in `MoELayer.forward` the dispatched tokens stay referenced until the combine returns.
  - allgather: every rank gathers all ranks' tokens, [seq x EP, hidden], into megatron's global memory buffer,
    which *stays allocated* after the forward (counted as persistent), plus the gathered probs and routing map
    [seq x EP, experts]; it permutes the rows routed to its local experts, runs them, scatters them back into a
    zeroed [seq x EP, hidden] tensor and reduce-scatters it (in the probs dtype: fp32/fp64 with a promoted
    router). Activations grow linearly with EP.
  - alltoall: each rank permutes its seq x topk rows, sends and receives them (all-to-all), sorts the received rows
    by local expert, runs them, sorts back, returns them (all-to-all) and un-permutes into [seq, hidden].
    Activations do not grow with EP (only with imbalance).
  - experts (`SequentialMLP`): one expert at a time, so fc1/activation/fc2 intermediates are per *expert*
    ([rows of that expert x ffn]); each expert's [rows x hidden] output is kept in a list and concatenated.
- **rows**: how many routed rows the busiest rank's experts get. `scenario="balanced"`: seq x topk per rank (the
  expected value under uniform routing), times `imbalance`. `scenario="truncation"`: the lab's own truncation input,
  the same on every rank with tokens[cut:] = 0; zero tokens have all-zero logits and go to experts 0..topk-1, so the
  rank holding those experts gets EP x (seq - cut) x min(topk, local experts) rows — EP times the balanced load.
- **the lab around the layer** (the probe, `experiments.probe.on_engine`, one trial): the input tokens, up to three kept outputs and the truncated
  input, `metrics.compare` (up to 65 B per compared element when all differ, int64/fp64 temporaries; pinned by a unit test with the
  CPU allocator's profiler) and `metrics.fingerprint` (bounded: it hashes in chunks of 2**22 words on GPUs, 2**18 on
  CPU, 16 B per word of a chunk, + 8 on CPU; a fixed 1.06 MiB weight table per device stays). On GPUs the comparisons run on the device, so they
  count. With capture on (`capture.run_with_capture`) every stage output is cloned and kept.
- **not counted**: CUDA context, NCCL's own buffers, cuBLAS workspace and caching-allocator fragmentation (they are
  outside `torch.cuda.max_memory_allocated`, or small); a `reserve` is subtracted from the GPU for them.

Checked against the real layer (`measure_layer`, `measured`): parameter bytes exactly; forward peaks within 5 % on
4 CPU engines (tests/cluster/test_scale.py, with the CPU terms of `forward_phases(device="cpu")`), and forward and
`run_case` peaks within 3 % on 2x H200 at EP=2 (reports/published/scale-h200x2-2026-11-30/).
"""

from __future__ import annotations

import math

from ..config import MoEConfig, check_cut

GIB = 2**30
H200_HBM_BYTES = 141 * 10**9
"""H200's HBM as sold (141 GB)."""
H200_USABLE_BYTES = 139 * GIB
"""What torch can allocate on one H200 (the device machine reports 143771 MiB; ~139 GiB usable)."""
DEFAULT_RESERVE_BYTES = 4 * GIB
"""Held back for what the calculation does not count: CUDA context, NCCL buffers, allocator fragmentation."""
DEFAULT_TFLOPS = 600.0
DEEPSEEK_V3_MOE_LAYERS = 58  # 61 layers, the first 3 dense (first_k_dense_replace=3)

COMPARE_BYTES_PER_ELEMENT = 65
"""`metrics.compare` peak, bytes per compared element (bf16), when every element differs (its worst case: it measures
only the differing ones): the mismatch mask, the gathered elements, int64 ordered bits, fp64 copies, abs/rel errors."""
FINGERPRINT_CHUNK_WORDS = {"cuda": 1 << 22, "cpu": 1 << 18}
"""`metrics.FP_CHUNK` / `metrics.FP_CHUNK_CPU`: how many words `metrics.fingerprint` hashes at a time."""
FINGERPRINT_BYTES_PER_WORD = {"cuda": 16, "cpu": 24}
"""`metrics.fingerprint` working set per word of a chunk: two int64 lanes of products (16); on CPU also an int64
copy of the chunk (8). A bf16/fp16/fp32 element is one word, an fp64/int64 one two."""
FINGERPRINT_TABLE_BYTES = 2 * ((1 << 16) + (1 << 12)) * 8
"""The weight table `metrics.fingerprint` keeps per device (`metrics._FP_TABLES`): 1.06 MiB, whatever the sizes."""


def fingerprint_peak_bytes(words: int, device: str = "cuda") -> int:
    """`metrics.fingerprint`'s peak beyond its input for a tensor of `words` words: one chunk's working set."""
    dev = "cpu" if device == "cpu" else "cuda"
    return min(words, FINGERPRINT_CHUNK_WORDS[dev]) * FINGERPRINT_BYTES_PER_WORD[dev]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
SCENARIOS = ("balanced", "truncation")


def presets() -> dict[str, MoEConfig]:
    """The layers of the scale plan: the seed report's, and one of DeepSeek-V3's routed-expert shape."""
    return {
        "seed": MoEConfig.seed_report(),
        # DeepSeek-V3: hidden 7168, 256 routed experts, top-8, expert ffn 2048; 4096 tokens per rank here. As the lab
        # builds it: gelu experts (V3 uses SwiGLU: `gated=True`), softmax top-k (V3: sigmoid, grouped), no shared expert.
        "deepseek-v3": MoEConfig(hidden=7168, num_experts=256, topk=8, ffn_hidden=2048, seq_len=4096, dtype="bf16"),
    }


def dtype_bytes(cfg: MoEConfig) -> tuple[int, int]:
    """(layer dtype bytes, router/probs dtype bytes): router_dtype 'none' keeps the layer dtype."""
    d = _DTYPE_BYTES[cfg.dtype]
    r = d if cfg.router_dtype == "none" else _DTYPE_BYTES[cfg.router_dtype]
    return d, r


def check_ep(cfg: MoEConfig, ep) -> int:
    """EP checked against the layer: a positive integer that divides num_experts (the plan counts TP 1)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep ({ep!r}) must be a positive integer")
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts ({cfg.num_experts}) must be divisible by ep ({ep})")
    return ep


# ---------------------------------------------------------------------------------------------- parameters


def param_bytes(cfg: MoEConfig, ep: int, *, gated: bool | None = None) -> dict[str, int]:
    """Bytes of this rank's parameters: the router and the shared expert (replicated over EP) and its experts / EP
    local experts. `gated` None: the layer's own (`cfg.gated`, SwiGLU: fc1 twice as tall)."""
    check_ep(cfg, ep)
    gated = cfg.gated if gated is None else gated
    d, _ = dtype_bytes(cfg)
    local = cfg.num_experts // ep
    fc1 = (2 if gated else 1) * cfg.ffn_hidden * cfg.hidden * d
    fc2 = cfg.hidden * cfg.ffn_hidden * d
    router = cfg.num_experts * cfg.hidden * d
    shared = ((2 if gated else 1) + 1) * cfg.shared_ffn * cfg.hidden * d
    return {"router": router, "experts": local * (fc1 + fc2), "per_expert": fc1 + fc2, "local_experts": local,
            "shared": shared, "total": router + shared + local * (fc1 + fc2)}


# ---------------------------------------------------------------------------------------------- rows


def rows_per_expert(cfg: MoEConfig, ep: int, *, scenario: str = "balanced", imbalance: float = 1.0,
                    cut: int = 90) -> list[int]:
    """Rows each local expert of the busiest rank gets in one forward, in the order SequentialMLP runs them.

    Every rank is fed the same seq tokens (the lab's setup), so the busiest rank's experts see EP copies of them.
    balanced:   seq x topk rows per rank (EP x seq x topk / experts per expert), times `imbalance` (>= 1).
    truncation: tokens[cut:] = 0 on every rank; zero tokens route to experts 0..topk-1 (all-zero logits, lowest
                indices win the tie), which sit on rank 0: EP x (seq - cut) rows for each of its first
                min(topk, local) experts, plus a balanced share of the cut kept tokens. The busiest expert
                runs last here (the order that makes the peak largest).
    """
    check_ep(cfg, ep)
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario ({scenario!r}) must be one of {', '.join(map(repr, SCENARIOS))}")
    if not isinstance(imbalance, (int, float)) or isinstance(imbalance, bool) or not imbalance >= 1:
        raise ValueError(f"imbalance ({imbalance!r}) must be a number >= 1 (1 = uniform routing)")
    local = cfg.num_experts // ep
    tokens = cfg.seq_len * ep  # every rank's tokens: gathered (allgather) or sent here (alltoall)
    if scenario == "balanced":
        per_expert = min(tokens, math.ceil(tokens * cfg.topk / cfg.num_experts * imbalance))
        return [per_expert] * local
    check_cut(cut, cfg.seq_len)
    kept = math.ceil(ep * cut * cfg.topk / cfg.num_experts)
    hot = min(cfg.topk, local)
    counts = [kept] * (local - hot) + [ep * (cfg.seq_len - cut) + kept] * hot
    return counts


# ---------------------------------------------------------------------------------------------- forward


def _expert_steps(counts: list[int], cfg: MoEConfig, *, gated: bool, base: dict[str, int],
                  device: str = "cuda") -> list[tuple]:
    """SequentialMLP: experts one after another; each keeps its [n x hidden] output in a list, then one cat."""
    d, r = dtype_bytes(cfg)
    p = max(d, r)  # gelu(fc1) * probs promotes to the probs dtype, then `.to(dtype)` casts back
    H, F = cfg.hidden, cfg.ffn_hidden
    steps = []
    done = 0
    for i, n in enumerate(counts):
        if gated:  # glu: fc1 out [n, 2F], act(x_glu), x_linear + offset, their product
            act = n * F * d * (2 + 1 + 1 + 1)
        else:  # fc1 out [n, F] and gelu's output
            act = n * F * d * 2
        # activation + (activation * probs); or the promoted product + its cast back. On CPU a bf16 x fp32
        # multiply first copies the bf16 operand to fp32 (CUDA kernels cast on the fly).
        scale = n * F * (d + p + (p if device == "cpu" and p != d else 0))
        fc2 = n * F * d + n * H * d  # scaled activation + fc2 output (kept)
        worst = max(act, scale, fc2)
        steps.append((f"experts.{i}", dict(base, **{"experts.outputs_so_far": done * H * d,
                                                    "experts.intermediates": worst})))
        done += n
    if len(counts) > 1:
        steps.append(("experts.cat", dict(base, **{"experts.outputs_list": done * H * d, "experts.out": done * H * d})))
    return steps


def forward_phases(cfg: MoEConfig, ep: int, *, counts: list[int] | None = None, gated: bool = False,
                   scenario: str = "balanced", imbalance: float = 1.0, cut: int = 90,
                   device: str = "cuda") -> list[tuple[str, dict]]:
    """The tensors alive at each step of one forward on the busiest rank: [(step, {tensor: bytes})].

    Not included: the input tokens (the caller's) and the parameters. Included: allgather's global buffer (the
    gathered tokens), which megatron allocates in the first forward and keeps (see `persistent_bytes`).
    counts: rows per local expert in run order (default `rows_per_expert(...)`; a measurement can pass its own).
    device: 'cuda' (NCCL; the plan) or 'cpu' (gloo: its reduce-scatter works on a copy of the input; CPU kernels
            copy a bf16 operand to fp32 before a mixed multiply) — the CPU terms let a CPU test check the timeline.
    """
    check_ep(cfg, ep)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device ({device!r}) must be 'cuda' or 'cpu'")
    d, r = dtype_bytes(cfg)
    S, H, E, k = cfg.seq_len, cfg.hidden, cfg.num_experts, cfg.topk
    L = E // ep
    if counts is None:
        counts = rows_per_expert(cfg, ep, scenario=scenario, imbalance=imbalance, cut=cut)
    if len(counts) != L:
        raise ValueError(f"counts has {len(counts)} entries; this rank has {L} local experts")
    R = sum(counts)
    det = cfg.deterministic
    steps: list[tuple[str, dict]] = []

    # router: logits = x @ W^T in the router dtype (x and W cast first if it differs); top-k; softmax over the k;
    # probs and routing map scattered into [S, E] (the map through an int32 copy).
    cast = (S * H * r + E * H * r) if r != d else 0
    steps.append(("router.gating", {"router.casts": cast, "router.logits": S * E * r}))
    steps.append(("router.topk", {"router.logits": S * E * r, "router.topk": S * k * (r + 8 + 4),
                                  "router.probs": S * E * r, "router.map_int": 2 * S * E * 4}))
    route = {"router.probs": S * E * r, "router.routing_map": S * E}

    if cfg.dispatcher == "allgather":
        G = S * ep
        gath = {"dispatch.gathered_tokens (global buffer)": G * H * d} if ep > 1 else {}
        big = dict(route, **gath)
        if ep > 1:
            big.update({"dispatch.gathered_probs": G * E * r, "dispatch.gathered_map": G * E})
        steps.append(("dispatch.all_gather", dict(big)))
        # local map/probs [G, L]; permute: map.T, token index [G] int64, sorted indices [R], permuted rows [R, H]
        steps.append(("dispatch.permute", dict(big, **{"dispatch.local_map_probs": G * L * (1 + r),
                                                       "permute.map_T_and_index": G * L + G * 8,
                                                       "permute.sorted_indices": R * 8,
                                                       "dispatch.permuted": R * H * d})))
        # self.routing_map = None frees the gathered map; `probs` was rebound to the gathered probs
        drop = ("dispatch.gathered_map", "router.probs") if ep > 1 else ()
        keep = {k_: v for k_, v in big.items() if k_ not in drop}
        keep.update({"dispatch.local_map": G * L, "dispatch.local_probs": R * r, "permute.sorted_indices": R * 8,
                     "dispatch.permuted": R * H * d})
        steps += _expert_steps(counts, cfg, gated=gated, base=keep, device=device)
        # unpermute: zeros [G, H] + scatter_add_ (deterministic: index_add_ into a second zeros)
        steps.append(("combine.unpermute", dict(keep, **{"experts.out": R * H * d,
                                                         "combine.unpermuted": G * H * d * (2 if det else 1)})))
        after = {k_: v for k_, v in keep.items() if k_ not in ("dispatch.permuted", "permute.sorted_indices")}
        after.update({"combine.unpermuted": G * H * d, "permute.sorted_indices": R * 8})
        if ep > 1:  # reduce-scatter in the probs dtype: [G, H] cast, [S, H] result, cast back to the layer dtype
            steps.append(("combine.reduce_scatter", dict(after, **{
                "combine.cast_to_probs_dtype": G * H * r if r != d else 0,
                "combine.reduce_scattered": S * H * r, "combine.out": S * H * d if r != d else 0,
                "combine.gloo_copy": G * H * r if device == "cpu" else 0})))
        return steps

    # alltoall: permute the S x topk rows (probs travel with them), all-to-all, sort by local expert
    Sk = S * k
    steps.append(("dispatch.permute", dict(route, **{"permute.map_T_and_index": S * E + S * 8,
                                                     "permute.probs_T": S * E * r, "permute.sorted_indices": Sk * 8,
                                                     "dispatch.permuted_probs": Sk * r,
                                                     "dispatch.permuted": Sk * H * d})))
    held = dict(route, **{"permute.sorted_indices": Sk * 8, "dispatch.permuted": Sk * H * d,
                          "dispatch.permuted_probs": Sk * r})
    recv = dict(held, **{"dispatch.received": R * H * d, "dispatch.received_probs": R * r})
    steps.append(("dispatch.all_to_all", dict(recv)))
    sort = L > 1  # sort_chunks_by_idxs only with several local experts
    if sort:
        recv.update({"dispatch.sorted": R * H * d, "dispatch.sorted_probs": R * r})
        steps.append(("dispatch.sort_by_expert", dict(recv)))
    steps += _expert_steps(counts, cfg, gated=gated, base=recv, device=device)
    out = dict(recv, **{"experts.out": R * H * d})
    if sort:
        steps.append(("combine.sort_back", dict(out, **{"combine.sorted_back": R * H * d})))
        out = {k_: v for k_, v in out.items() if k_ not in ("dispatch.sorted", "dispatch.sorted_probs", "experts.out")}
        out["combine.sorted_back"] = R * H * d
    steps.append(("combine.all_to_all", dict(out, **{"combine.returned": Sk * H * d})))
    last = {k_: v for k_, v in out.items() if k_ not in ("combine.sorted_back", "experts.out")}
    steps.append(("combine.unpermute", dict(last, **{"combine.returned": Sk * H * d,
                                                     "combine.out": S * H * d * (2 if det else 1)})))
    return steps


def persistent_bytes(cfg: MoEConfig, ep: int) -> int:
    """Allocated by the first forward and kept: allgather's global buffer of gathered tokens (EP > 1)."""
    check_ep(cfg, ep)
    d, _ = dtype_bytes(cfg)
    return cfg.seq_len * ep * cfg.hidden * d if cfg.dispatcher == "allgather" and ep > 1 else 0


def forward_peak(cfg: MoEConfig, ep: int, **kw) -> dict:
    """The largest step of `forward_phases`: {'bytes', 'step', 'tensors'}; bytes include the global buffer."""
    steps = forward_phases(cfg, ep, **kw)
    name, tensors = max(steps, key=lambda s: sum(s[1].values()))
    return {"bytes": sum(tensors.values()), "step": name, "tensors": tensors}


# ---------------------------------------------------------------------------------------------- the lab around it


def capture_bytes(cfg: MoEConfig, ep: int, counts: list[int]) -> int:
    """Stage clones kept by `capture.run_with_capture` (router logits/probs/map, every dispatcher step, experts, out)."""
    d, r = dtype_bytes(cfg)
    S, H, E, k = cfg.seq_len, cfg.hidden, cfg.num_experts, cfg.topk
    R, L = sum(counts), len(counts)
    router = S * E * (r + r + 1)  # logits, probs, routing map
    if cfg.dispatcher == "allgather":
        G = S * ep
        stages = (S * H * d + S * E * r  # dispatch.pre tokens, probs
                  + G * H * d + G * E * r  # dispatch.comm tokens, probs
                  + R * H * d + R * r + L * 8  # dispatch.post tokens, probs, tokens_per_expert
                  + R * H * d  # experts.out
                  + G * H * d  # combine.pre (unpermuted)
                  + 3 * S * H * d)  # combine.comm, combine.post, moe.out
    else:
        Sk = S * k
        stages = (Sk * H * d + Sk * r + R * H * d + R * r + R * H * d + R * r + L * 8 + R * H * d
                  + R * H * d + Sk * H * d + 2 * S * H * d)
    return router + stages


def lab_phases(cfg: MoEConfig, ep: int, *, fwd_plain: int, fwd_trunc: int, cut: int, capture: bool,
               cap_bytes: int, device: str = "cuda") -> list[tuple[str, int]]:
    """The probe (one trial) on one rank: [(step, bytes)] beyond parameters + persistent buffer + the input tokens +
    the fingerprint's weight table (1.06 MiB per device, kept from the first call).

    Forwards 1-3 (plain, rerun, truncated input) keep their outputs; `time_forward` runs once more; the two
    comparisons (rerun: [seq x hidden]; truncation: [cut x hidden]); the cross-rank fingerprint; and, only if the
    ranks' fingerprints differ, the all-gather of every rank's full output ([EP x seq, hidden]).
    """
    d, _ = dtype_bytes(cfg)
    out = cfg.seq_len * cfg.hidden * d
    n = cfg.seq_len * cfg.hidden
    cap = cap_bytes if capture else 0
    fp_warm = fingerprint_peak_bytes(n, device)
    return [
        ("forward 1 (plain)", fwd_plain + cap),
        ("forward 2 (rerun)", out + fwd_plain + cap),
        ("forward 3 (truncated input)", 2 * out + out + fwd_trunc + cap),
        ("time_forward", 3 * out + fwd_plain),
        ("compare rerun", 3 * out + COMPARE_BYTES_PER_ELEMENT * n),
        ("compare truncation", 3 * out + COMPARE_BYTES_PER_ELEMENT * cut * cfg.hidden),
        ("fingerprint (cross-rank)", 3 * out + fp_warm),
        ("cross-rank all-gather (if ranks differ)", 3 * out + ep * out),
    ]
