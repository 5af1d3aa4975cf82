"""Notebook 04 in two reports, per case `moe_lab.reporting.compare` matched: does the truncation test hold on the real
layer (the finding's status), which remedy keeps the first tokens and a rerun bitwise equal in every trial (the remedy
it names), the first tokens' routing, and whether the expert GEMMs are batch variant on the device that ran them.
Magnitudes: the first-token elements that differ under truncation (the no-remedy case, worst trial), and the row
counts M at which a GEMM's first rows changed."""

from __future__ import annotations

from ..reproduce.compare import side_by_side
from ...findings.model import Count

MARKED = ("device",)
"""Subject fields that say where a kernel ran (the GPU, or the CPU model and ISA): named where they differ, never
part of the case."""


def magnitude(case: dict):
    f, recs = case["finding"], case["records"]
    if f.question == "truncation":
        plain = [r for r in recs if r.get("remedy") == "none"]
        t = plain[0].get("truncation") if len(plain) == 1 else None
        if isinstance(t, dict) and "numel" in t:
            what = "first-token elements differing under truncation (no remedy, worst trial)"
            return what, Count(t.get("n_mismatch"), t.get("numel"), what)
    if f.question == "expert GEMM batch invariance":
        ks = [r for r in recs if isinstance(r.get("kernel"), dict)]
        if ks:
            what = "row counts M probed at which the GEMM's first rows change"
            return what, Count(sum(not r["kernel"].get("bitwise_equal") for r in ks), len(ks), what)
    return "", None


rows = side_by_side(magnitude)
