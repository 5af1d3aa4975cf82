"""How records are named in tables, figures and verdicts — text only (no torch: plotting imports this)."""

from __future__ import annotations


def rem_label(remedy: str, tile) -> str:
    """'tiled_experts T=256', 'no_splitk'."""
    return remedy + (f" T={tile}" if tile else "")


def label(r: dict) -> str:
    """'EMULATED splitk+atomics / tiled_experts T=256' — emulated cases always say so."""
    emu = f"EMULATED {r['emulation']}" if r.get("emulated") else "real"
    return f"{emu} / {rem_label(r['remedy'], r.get('tile'))}"


EP_DOMINANCE = 100
"""Ranks whose outputs differ in every trial by at least this many times the elements any rerun changes: EP order,
with run-to-run nondeterminism on top ('ep+nondeterminism')."""


def attribution(cross: dict, rerun: dict) -> str:
    """Why ranks differ (the attribution rule), from a cross-rank and a rerun comparison over trials: 'equal'; 'ep' (the ranks
    differ in every trial and a rerun never does); 'ep+nondeterminism' (the ranks differ in every trial, reruns differ
    too but in every trial the ranks differ in >= EP_DOMINANCE times the elements of the worst rerun: the GPU's
    atomics add a little run-to-run noise to an EP-order difference); 'nondeterminism' (reruns differ about as much);
    'mixed' (ranks differ in some trials only, reruns never); 'n/a' (one rank)."""
    if not cross.get("applicable", True):
        return "n/a"
    if cross["bitwise_equal"]:
        return "equal"
    every = cross.get("n_differ", 1) == cross.get("trials", 1)
    if every and rerun["bitwise_equal"]:
        return "ep"
    if every and not rerun["bitwise_equal"]:
        least = min(cross.get("per_trial") or [cross["n_mismatch"]])
        most = max(rerun.get("per_trial") or [rerun["n_mismatch"]])
        if least >= EP_DOMINANCE * most:
            return "ep+nondeterminism"
    return "nondeterminism" if not rerun["bitwise_equal"] else "mixed"


def placement_note(rec: dict) -> str:
    """Where the ranks ran, in words, and — for virtual EP — what it shows and what it cannot (every report says it)."""
    where = (f"{rec['world']} rank(s), {rec.get('placement') or rec.get('device')}, backend {rec.get('backend')}"
             + (f", on {rec['gpu']}" if rec.get("gpu") else ""))
    if (rec.get("ranks_per_gpu") or 1) > 1:
        return (f"{where}. Virtual EP: the ranks run the real layer with the GPU's own kernels (cuBLAS split-K, "
                "atomics in the combine), so what those kernels do to the bits is measured; the collectives go through "
                "gloo, staged on the host, whose reductions run in one fixed order — NCCL's own ring/tree reduction "
                "order, NVLink (NVLS) and links between nodes are NOT exercised. Hold a finding that depends on them "
                "against one rank per GPU (notebooks on several GPUs).")
    if rec.get("world") == 1:
        return f"{where}. One rank: nothing to compare across ranks; reruns and truncation are measured."
    return where + "."


FWD_CMPS = ("cross_out", "rerun_out", "truncation_out")
"""Notebook 05's forward comparisons, and its gradient comparisons below (record fields of a backward case)."""
GRAD_CMPS = ("cross_dx", "rerun_dx", "truncation_dx", "cross_router_grad", "rerun_router_grad",
             "truncation_router_grad", "experts_rerun", "experts_truncation")


__all__ = ["label", "rem_label", "attribution", "EP_DOMINANCE", "placement_note", "FWD_CMPS", "GRAD_CMPS"]
