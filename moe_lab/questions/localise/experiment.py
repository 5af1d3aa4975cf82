"""Notebook 02 — where two ranks stop agreeing: stage-by-stage comparison of a captured forward, fingerprints first.

Under EP each rank holds different experts, so not every stage must be equal across ranks. Every rank is fed the
same tokens, so each stage is compared the way it *must* agree:
- replicated: the same tensor on every rank (router outputs, gathered tokens/probs, combined output): rank 0 vs r;
- copies: a rank-local tensor made of `world` blocks, one per identical copy of the input (alltoall receive buffer,
  allgather partial combine): block c vs block 0 on the same rank;
- copies/expert: per local expert, a segment of `world` equal parts, one per copy (permuted tokens, expert outputs):
  part c vs part 0 of every segment, on the same rank;
- local: rank-specific by design (token counts of local experts): not compared.
Assumes tp=1 (the copy layouts change with TP). Cases: dispatcher x the three probs-path VARIANTS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ...run_config import RunConfig

from . import QUESTION
from .record import CollectiveRecord, LocaliseCase, StageRecord
from ...experiments.protocol import Case

NAME = "localise"
NOTEBOOK = QUESTION.number

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


def tokens_per_expert(cache) -> list[int] | None:
    for name in ("dispatch.post.tokens_per_expert", "dispatch.permuted.tokens_per_expert"):
        if name in cache.tensors:
            return [int(x) for x in cache.tensors[name].reshape(-1).tolist()]
    return None


def copy_parts(t: torch.Tensor, kind: str, world: int, tpe: list[int] | None) -> list[torch.Tensor] | str:
    """Split a rank-local tensor into its `world` copies (each the concatenation of its parts), or say why not."""
    import torch

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


def on_engine(payload: dict) -> dict:
    """Engine side: `trials` captured forwards, every stage compared as it must agree in each; per stage the worst over
    trials with the trials in which it differed. Rank 0 also gets the cross-rank comparison of the replicated stages."""
    from ... import metrics
    from ...engine import toolkit

    s = toolkit.setup(payload["moe"], payload.get("layout"))
    trials = [_capture_and_compare(s) for _ in range(payload.get("knobs", {}).get("trials", 1))]
    first = trials[0]
    stages = first["stages"]
    same = all([x["stage"] for x in t["stages"]] == [x["stage"] for x in stages] for t in trials)
    use = trials if same else [first]  # a forward that captured other stages: trial 1 alone
    for i, row in enumerate(stages):
        if "copies" in row and "skipped" not in row["copies"]:
            row["copies"] = metrics.over_trials([t["stages"][i]["copies"] for t in use])
    res = {"rank": first["rank"], "stages": stages, "ledger": first["ledger"], "trials": len(use)}
    if first["cross"] is not None:
        res["bytes_compared"] = sum(t["bytes_compared"] for t in use)
        res["cross"] = {n: ({p: metrics.over_trials([t["cross"][n][p] for t in use]) for p in pairs}
                            if pairs is not None else None) for n, pairs in first["cross"].items()}
    return res


def _capture_and_compare(s) -> dict:
    """One captured forward on this rank, its stages compared as copies (rank-local) and across ranks (replicated)."""
    from ...engine import capture, toolkit
    from ...experiments.remedies import probs_fp32_before_gather

    cfg = s.cfg
    with toolkit.deterministic(cfg.deterministic), probs_fp32_before_gather(s.layer, cfg.probs_fp32_gather):
        out, cache = capture.run_with_capture(s.layer, s.tokens, hidden=cfg.hidden, num_experts=cfg.num_experts)
        toolkit.sync()
    res = compare_stages(cache.tensors, lambda name: comparison_kind(name, cfg.dispatcher), tokens_per_expert(cache))
    res["ledger"] = cache.ledger
    return res


def grad_kind(stage: str, dispatcher: str) -> str:
    """How the gradient reaching a forward stage must agree: as the stage itself, except the allgather's gathered
    tensors — each rank back-propagates only its local experts into them, so their gradients are copies within a rank
    (one block per input copy), not replicated; the reduce-scatter of the backward makes the input gradient
    replicated again."""
    if dispatcher == "allgather" and stage.startswith("dispatch.comm."):
        return COPIES
    return comparison_kind(stage, dispatcher)


def compare_stages(tensors: dict, kind_of, tpe: list[int] | None) -> dict:
    """Engine side: every named tensor of a capture compared the way it must agree (`kind_of(name)`): copies within
    this rank now, replicated ones across ranks (rank 0 gets those pairs). Every rank must call it with the same
    names in the same order."""
    from ... import metrics
    from ...engine import toolkit

    rank, world = toolkit.tdist.get_rank(), toolkit.world()
    stages = []
    for order, (name, t) in enumerate(tensors.items()):
        kind = kind_of(name)
        row = {"stage": name, "order": order, "kind": kind, "dtype": str(t.dtype).removeprefix("torch."),
               "shape": list(t.shape), "fingerprint": metrics.fingerprint(t)}
        if kind in (COPIES, COPIES_PER_EXPERT):
            parts = copy_parts(t, kind, world, tpe) if world > 1 else "world size 1: a single copy of the input"
            row["copies"] = {"skipped": parts} if isinstance(parts, str) else toolkit.compare_parts(parts)
        stages.append(row)
    replicated = {n: tensors[n] for n in (s_["stage"] for s_ in stages if s_["kind"] == REPLICATED)}
    cross = toolkit.compare_across_ranks(replicated)
    res = {"rank": rank, "stages": stages, "cross": None, "bytes_compared": 0}
    if cross is not None:
        res["bytes_compared"] = cross.pop("bytes_compared")
        res["cross"] = {n: (c["pairs"] if c.get("applicable", True) else None) for n, c in cross.items()}
    return res




# ---------------------------------------------------------------------------------------------- controller side

VARIANTS = {  # name → (router_dtype, probs_fp32_gather): the seed report's controlled experiment on the probs path
    "bf16 (nothing)": ("none", False),
    "probs fp32 before gather (reporter's fix)": ("none", True),
    "moe_router_dtype=fp32": ("fp32", False),
}


def stage_rows(per_rank: list[dict]) -> list[dict]:
    """Per-rank engine results → one row per (stage, comparison unit), in execution order, + first divergence. A row
    is a stage record's fields (`record.StageRecord`): the stage's own kind is `stage_kind`."""
    r0 = per_rank[0]
    rows = []
    for s in r0["stages"]:
        base = {"stage": s["stage"], "order": s["order"], "stage_kind": s["kind"], "dtype": s["dtype"],
                "shape": s["shape"]}
        if s["kind"] == REPLICATED:
            for pair, c in (r0["cross"][s["stage"]] or {}).items():  # None: one rank, nothing to compare
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
    return {k: c.get(k) for k in ("numel", "n_mismatch", "mismatch_frac", "bitwise_equal", "max_ulp", "max_abs",
                                  "trials", "n_differ", "per_trial")}


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


def cases(config: RunConfig) -> list[Case]:
    base = config.layer
    out = []
    for d in config.run.dispatchers:
        for v, (router_dtype, fp32_gather) in VARIANTS.items():
            cfg = base.replace(dispatcher=d, router_dtype=router_dtype, probs_fp32_gather=fp32_gather)
            out.append(Case(experiment=NAME, moe=cfg, cut=config.run.cut, knobs={"variant": v, "trials": config.run.trials},
                            release=config.release, layout=config.layout, label=f"{d}/{v}"))
    return out


def _first(ledger: list[dict], pred) -> dict:
    return next((c for c in ledger if pred(c)), {})


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    """One `case` record (first divergent stage, output mismatch, dtypes from the ledger), one `stage` record per
    stage x comparison unit, one `collective` record per collective of rank 0's ledger."""
    world = len(per_rank)
    rows = stage_rows(per_rank)
    ledger = per_rank[0]["ledger"]
    final = [r for r in rows if r["stage"] == "moe.out"]
    first = first_divergent(rows)
    probs = _first(ledger, lambda c: c["role"] == "probs" and c["stage"].startswith("dispatch"))
    combine = _first(ledger, lambda c: c["stage"].startswith("combine"))
    n = per_rank[0].get("trials", 1)
    per_trial = [min((r["order"] for r in rows if (r.get("per_trial") or [0] * n)[t]), default=None) for t in range(n)]
    by_order = {r["order"]: r["stage"] for r in rows}
    summary = LocaliseCase(first_divergent_stage=first, trials=n,
                           first_divergent_per_trial=[by_order.get(o) for o in per_trial],
                           first_divergent_kind=next((r["stage_kind"] for r in rows if r["stage"] == first), None),
                           first_divergent_by_pair=first_divergent_by_pair(rows, world),
                           out_mismatch_frac=max((r["mismatch_frac"] for r in final), default=None),
                           out_max_ulp=max((r["max_ulp"] for r in final), default=None),
                           cross_rank_applicable=world > 1,
                           probs_gather_dtype=probs.get("dtype"), combine_dtype=combine.get("dtype"),
                           combine_op=combine.get("op"), out_dtype=next((s["dtype"] for s in per_rank[0]["stages"]
                                                                         if s["stage"] == "moe.out"), None),
                           bytes_compared=world * per_rank[0].get("bytes_compared", 0))
    return ([summary.asdict()] + [StageRecord(**r).asdict() for r in rows]
            + [CollectiveRecord(extra=dict(c)).asdict() for c in ledger])


def _first_row(records: list[dict], case: dict) -> dict | None:
    """The stage rows of `case` at its first divergent stage, the one that differed in most trials."""
    rows = [r for r in records if r.get("kind") == "stage" and r["case_key"] == case["case_key"]
            and r["stage"] == case["first_divergent_stage"] and r.get("bitwise_equal") is False]
    return max(rows, key=lambda r: (r.get("n_differ") or 0, r.get("mismatch_frac") or 0), default=None)


def verdict(records: list[dict]) -> str:
    """Notebook 02's verdict: its findings (moe_lab.questions.localise.findings), rendered."""
    from . import findings as found
    from ...findings import render

    c0 = next((r for r in records if r.get("kind") == "case"), None)
    title = (f"megatron-core {c0['megatron_core']}, {c0['world']} EP rank(s) on {c0.get('gpu') or c0['device']} "
             f"({c0.get('placement', '')}), {c0.get('trials', 1)} trial(s) per case:") if c0 else ""
    return render.verdict(found.findings(records), title=title)


__all__ = ["cases", "on_engine", "records", "verdict", "stage_rows", "first_divergent", "comparison_kind", "grad_kind",
           "compare_stages", "tokens_per_expert",
           "copy_parts", "VARIANTS", "REPLICATED", "COPIES", "COPIES_PER_EXPERT", "LOCAL"]
