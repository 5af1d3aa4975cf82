"""The check that holds notebook 04's real-layer records against this CPU's bf16 GEMM (tests/conftest.py
`truncation_story`), fed records of both kinds of CPU: batch invariant (AVX2, as on the CI machine) and batch variant
(oneDNN's AMX kernels: the probe's rows differ from M = 256, the real layer fails by one element — or, on a Xeon whose
AMX rows differ in one element of 16,384 in half the draws, neither shows it) — so the AMX branch is exercised
without an AMX CPU — and records that contradict what the CPU was measured to do."""

from __future__ import annotations

import pytest

from moe_lab.questions.truncation.record import KernelRecord, TruncationCase
from moe_lab.records import Comparison

MS = (128, 256, 512)


def _kernel(m, equal, *, remedy="none", emulated=False, linear="fc2"):
    return {"kind": "kernel", **KernelRecord.of_row(dict(emulation="splitk" if emulated else "none", remedy=remedy,
                                                         linear=linear, M=m, kernel=_cmp(equal))).asdict()}


def _case(d, trunc_equal, *, remedy="none", rerun_equal=True, emulated=False):
    rec = TruncationCase(remedy=remedy, emulation="splitk+atomics" if emulated else "none", emulated=emulated, tile=None,
                         available=True, truncation=_cmp(trunc_equal), rerun=_cmp(rerun_equal))
    return {"kind": "case", "dispatcher": d, **rec.asdict()}


def _cmp(equal: bool) -> Comparison:
    return Comparison.counted(128, 0 if equal else 1)


def _records(*, variant_from=None, plain_equal=True, tiled_equal=True, rerun_equal=True):
    recs = [{"kind": "routing", "emulated": False}]
    for lin in ("fc1", "fc2"):
        recs += [_kernel(m, variant_from is None or m < variant_from, linear=lin) for m in MS]
        recs += [_kernel(m, tiled_equal, remedy="tiled_experts", linear=lin) for m in MS]
        recs += [_kernel(m, m == MS[0], emulated=True, linear=lin) for m in MS]  # the EMULATION varies everywhere
    for d in ("allgather", "alltoall"):
        recs += [_case(d, plain_equal, rerun_equal=rerun_equal), _case(d, tiled_equal, remedy="tiled_experts"),
                 _case(d, False, emulated=True)]
    recs.append({"kind": "case", **TruncationCase(remedy="padding_mask", emulation="none", emulated=False, tile=None,
                                                  available=False, reason="n/a").asdict()})
    return recs


def test_a_batch_invariant_cpu(truncation_story):
    truncation_story(_records(), True)


def test_an_amx_cpu(truncation_story):
    amx = _records(variant_from=256, plain_equal=False)
    truncation_story(amx, False)
    with pytest.raises(AssertionError, match=r"batch invariant, but notebook 04's kernel probe says rows differ at "
                                             r"\[\('fc1', 256\), \('fc1', 512\), \('fc2', 256\)"):
        truncation_story(amx, True)


@pytest.mark.parametrize("records", [dict(), dict(variant_from=512), dict(variant_from=256, plain_equal=True)],
                         ids=["no-draw-shows-it", "probe-only", "layer-passes"])
def test_an_amx_cpu_whose_variance_is_rare(truncation_story, records):
    """Measured batch variant over several draws, but the probe's one draw and the layer's one draw may miss it."""
    truncation_story(_records(**records), False)


@pytest.mark.parametrize("records,invariant,why", [
    (dict(plain_equal=False), True, "allgather: the real layer fails the truncation test"),
    (dict(variant_from=256, plain_equal=False, tiled_equal=False), False, "fixed-row tiles did not make"),
    (dict(rerun_equal=False), True, "a rerun differs on CPU"),
], ids=["invariant-but-fails", "tiles-fail", "rerun-differs"])
def test_records_that_contradict_the_cpu_fail(truncation_story, records, invariant, why):
    with pytest.raises(AssertionError, match=why):
        truncation_story(_records(**records), invariant)


def test_records_without_the_real_layer_fail(truncation_story):
    emulated_only = [r for r in _records() if r.get("emulated")]
    with pytest.raises(AssertionError, match="no kernel probe of the real expert GEMMs"):
        truncation_story(emulated_only, True)
    no_plain = [r for r in _records() if not (r["kind"] == "case" and r["remedy"] == "none")]
    with pytest.raises(AssertionError, match="no plain case of the real layer"):
        truncation_story(no_plain, True)
