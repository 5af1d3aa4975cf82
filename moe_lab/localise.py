"""Where two ranks stop agreeing: stage-by-stage comparison of a captured forward, fingerprints first.

Under EP each rank holds different experts, so not every stage must be equal across ranks. Every rank is fed the
same tokens, so each stage is compared the way it *must* agree:
- replicated: the same tensor on every rank (router outputs, gathered tokens/probs, combined output): rank 0 vs r;
- copies: a rank-local tensor made of `world` blocks, one per identical copy of the input (alltoall receive buffer,
  allgather partial combine): block c vs block 0 on the same rank;
- copies/expert: per local expert, a segment of `world` equal parts, one per copy (permuted tokens, expert outputs):
  part c vs part 0 of every segment, on the same rank;
- local: rank-specific by design (token counts of local experts): not compared.
Assumes tp=1 (the copy layouts change with TP).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from . import capture, measure, metrics, model, toggles
from .config import MoEConfig
from .dist import STATE

REPLICATED, COPIES, COPIES_PER_EXPERT, LOCAL = "replicated", "copies", "copies/expert", "local"


def comparison_kind(stage: str, dispatcher: str) -> str:
    if stage.startswith("router.") or stage in ("moe.out", "combine.post", "combine.comm", "combine.unpermuted.out"):
        return REPLICATED
    if stage.endswith("tokens_per_expert") or stage == "combine.unpermuted.bias":
        return LOCAL
    if stage.startswith("dispatch.pre."):
        return REPLICATED  # allgather: reshaped input; alltoall: local permutation of identical tokens
    if stage.startswith("dispatch.comm."):
        return REPLICATED if dispatcher == "allgather" else COPIES
    if stage.startswith(("dispatch.post.", "dispatch.permuted.")) or stage == "experts.out":
        return COPIES_PER_EXPERT
    if stage == "combine.pre":
        return COPIES
    return LOCAL


def _tokens_per_expert(cache: capture.Cache) -> list[int] | None:
    for name in ("dispatch.post.tokens_per_expert", "dispatch.permuted.tokens_per_expert"):
        if name in cache.tensors:
            return [int(x) for x in cache.tensors[name].reshape(-1).tolist()]
    return None


def copy_parts(t: torch.Tensor, kind: str, world: int, tpe: list[int] | None) -> list[torch.Tensor] | str:
    """Split a rank-local tensor into its `world` copies (each the concatenation of its parts), or say why not."""
    n = t.shape[0]
    if kind == COPIES:
        if n % world:
            return f"{n} rows not divisible by world {world}"
        return list(t.reshape(world, n // world, *t.shape[1:]).unbind(0))
    if tpe is None:
        return "tokens per expert not captured"
    if sum(tpe) != n:
        return f"tokens per expert sum {sum(tpe)} != rows {n}"
    if any(c % world for c in tpe):
        return f"a segment is not divisible by world {world}: {tpe}"
    parts = [[] for _ in range(world)]
    for seg in torch.split(t, tpe, dim=0):
        for c, piece in enumerate(seg.chunk(world, dim=0) if seg.shape[0] else [seg] * world):
            parts[c].append(piece)
    return [torch.cat(p, dim=0) for p in parts]


def compare_any(a: torch.Tensor, b: torch.Tensor) -> dict:
    """metrics.compare for float tensors; exact element equality for bool/int (no ULPs there)."""
    if a.is_floating_point():
        return metrics.compare(a, b)
    ne = int((a != b).sum())
    n = a.numel()
    return {"numel": n, "n_mismatch": ne, "mismatch_frac": ne / n if n else 0.0, "bitwise_equal": ne == 0,
            "max_abs": float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if n else 0.0,
            "max_rel": float("nan"), "max_ulp": float("nan"), "mean_ulp": float("nan"),
            "allclose_1e3": ne == 0, "assert_close": ne == 0}


def _compare_copies(t, kind, world, tpe) -> dict:
    parts = copy_parts(t, kind, world, tpe)
    if isinstance(parts, str):
        return {"skipped": parts}
    base = parts[0]
    fps = [metrics.fingerprint(p) for p in parts]
    worst, worst_c = None, 0
    for c in range(1, world):
        cmp = compare_any(base, base) if fps[c] == fps[0] else compare_any(base.cpu(), parts[c].cpu())
        if worst is None or (cmp["mismatch_frac"], cmp["max_ulp"]) > (worst["mismatch_frac"], worst["max_ulp"]):
            worst, worst_c = cmp, c
    return {**worst, "worst_copy": worst_c}


def localise_case(cfg_dict: dict) -> dict:
    """Engine side: capture one forward, compare every stage as it must agree; rank 0 also returns cross-rank results."""
    cfg = MoEConfig(**cfg_dict)
    probs_fp32_gather = cfg.probs_fp32_gather
    measure.set_deterministic(cfg.deterministic)
    try:
        layer = measure.get_layer(cfg)
        tokens = model.make_tokens(cfg, STATE["torch_device"])
        with toggles.probs_fp32_before_gather(layer, probs_fp32_gather):
            out, cache = capture.run_with_capture(layer, tokens, hidden=cfg.hidden, num_experts=cfg.num_experts)
        measure._sync()
    finally:
        measure.set_deterministic(False)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    tpe = _tokens_per_expert(cache)
    stages = []
    for order, (name, t) in enumerate(cache.tensors.items()):
        kind = comparison_kind(name, cfg.dispatcher)
        row = {"stage": name, "order": order, "kind": kind, "dtype": str(t.dtype).removeprefix("torch."),
               "shape": list(t.shape), "fingerprint": metrics.fingerprint(t)}
        if kind in (COPIES, COPIES_PER_EXPERT):
            row["copies"] = _compare_copies(t, kind, world, tpe)
        stages.append(row)

    # Replicated stages across ranks: 48-byte fingerprints first; full tensors only for stages that differ.
    mine = {s["stage"]: (s["fingerprint"], s["shape"]) for s in stages if s["kind"] == REPLICATED}
    everyone: list = [None] * world
    tdist.all_gather_object(everyone, mine)
    cross, moved = {}, 48 * len(mine) * world
    for name in mine:  # same insertion order on every rank: every rank issues the same collectives
        fps = [e.get(name, (None, None)) for e in everyone]
        pairs = {}
        if len({f for f, _ in fps}) == 1:
            t = cache.tensors[name]
            zero = compare_any(t, t)
            pairs = {f"0-{r}": dict(zero) for r in range(1, world)}
        elif len({tuple(s) if s else None for _, s in fps}) > 1:
            pairs = {f"0-{r}": {"shape_differs": True, "mismatch_frac": 1.0, "bitwise_equal": False}
                     for r in range(1, world)}
        else:
            t = cache.tensors[name].contiguous()
            if t.dtype == torch.bool:
                t = t.to(torch.uint8)
            g = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            tdist.all_gather_into_tensor(g, t)
            moved += g.numel() * g.element_size()
            g = g.view(world, *t.shape).cpu()
            if rank == 0:
                for r in range(1, world):
                    pairs[f"0-{r}"] = compare_any(g[0], g[r])
        cross[name] = pairs
    res = {"rank": rank, "stages": stages, "ledger": cache.ledger, "bytes_compared": moved}
    if rank == 0:
        res["cross"] = cross
    return res


# ---------------------------------------------------------------------------------------------- controller side

VARIANTS = {  # name → (router_dtype, probs_fp32_gather): the seed report's controlled experiment on the probs path
    "bf16 (nothing)": ("none", False),
    "probs fp32 before gather (reporter's fix)": ("none", True),
    "moe_router_dtype=fp32": ("fp32", False),
}


def stage_rows(per_rank: list[dict]) -> list[dict]:
    """Per-rank engine results → one row per (stage, comparison unit), in execution order, + first divergence."""
    r0 = per_rank[0]
    rows = []
    for s in r0["stages"]:
        base = {k: s[k] for k in ("stage", "order", "kind", "dtype", "shape")}
        if s["kind"] == REPLICATED:
            for pair, c in r0["cross"][s["stage"]].items():
                rows.append({**base, "unit": f"rank {pair}", **_metrics(c)})
        elif s["kind"] in (COPIES, COPIES_PER_EXPERT):
            for r in per_rank:
                c = r["stages"][s["order"]]["copies"]
                if "skipped" in c:
                    rows.append({**base, "unit": f"copies on rank {r['rank']}", "skipped": c["skipped"]})
                else:
                    rows.append({**base, "unit": f"copies on rank {r['rank']}", **_metrics(c)})
    first = first_divergent(rows)
    for row in rows:
        row["first_divergent_stage"] = first
    return rows


def _metrics(c: dict) -> dict:
    return {k: c.get(k) for k in ("numel", "n_mismatch", "mismatch_frac", "bitwise_equal", "max_ulp", "max_abs")}


def first_divergent(rows: list[dict], unit: str | None = None) -> str | None:
    """The first stage, in execution order, with any differing element (optionally for one comparison unit)."""
    bad = [r for r in rows if r.get("bitwise_equal") is False and (unit is None or r["unit"] == unit)]
    return min(bad, key=lambda r: r["order"])["stage"] if bad else None


def first_divergent_by_pair(rows: list[dict], world: int) -> dict[str, str | None]:
    """For each rank pair 0-r: first stage where they disagree (cross-rank) or a copy on rank 0 or r disagrees."""
    out = {}
    for r in range(1, world):
        units = {f"rank 0-{r}", "copies on rank 0", f"copies on rank {r}"}
        bad = [x for x in rows if x.get("bitwise_equal") is False and x["unit"] in units]
        out[f"0-{r}"] = min(bad, key=lambda x: x["order"])["stage"] if bad else None
    return out
