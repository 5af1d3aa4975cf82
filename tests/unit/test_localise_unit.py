"""Pure parts of the stage comparison: how each stage is compared, copy splitting, first divergence."""

import pytest
import torch

from moe_lab.engine import toolkit
from moe_lab.questions.localise import experiment as localise
from moe_lab.questions.localise.experiment import COPIES, COPIES_PER_EXPERT, LOCAL, REPLICATED


@pytest.mark.parametrize("stage, dispatcher, kind", [
    ("router.probs", "allgather", REPLICATED),
    ("dispatch.comm.probs", "allgather", REPLICATED),    # every rank gathers the same thing
    ("dispatch.comm.tokens", "alltoall", COPIES),        # one block per source rank = per input copy
    ("dispatch.post.tokens", "allgather", COPIES_PER_EXPERT),
    ("experts.out", "alltoall", COPIES_PER_EXPERT),
    ("dispatch.post.tokens_per_expert", "alltoall", LOCAL),
    ("combine.pre", "allgather", COPIES),
    ("combine.comm", "allgather", REPLICATED),
    ("moe.out", "alltoall", REPLICATED),
])
def test_comparison_kind(stage, dispatcher, kind):
    assert localise.comparison_kind(stage, dispatcher) == kind


def test_copy_parts_per_expert_segments():
    # 2 local experts with 4 and 2 rows, world 2: expert segments [a0 a1 a0' a1'] and [b0 b0'].
    t = torch.tensor([[1.], [2.], [1.], [2.], [3.], [3.]])
    parts = localise.copy_parts(t, COPIES_PER_EXPERT, 2, [4, 2])
    assert [p.flatten().tolist() for p in parts] == [[1, 2, 3], [1, 2, 3]]
    assert "not divisible" in localise.copy_parts(t, COPIES_PER_EXPERT, 4, [4, 2])
    assert "sum" in localise.copy_parts(t, COPIES_PER_EXPERT, 2, [2, 2])


def test_copy_parts_blocks_and_a_planted_difference():
    t = torch.arange(6, dtype=torch.bfloat16).repeat(3).reshape(9, 2)  # 3 blocks of 3 rows, identical
    parts = localise.copy_parts(t, COPIES, 3, None)
    assert all(torch.equal(p, parts[0]) for p in parts)
    t[4, 1] = t[4, 1] + 1
    cmp = toolkit.compare_parts(localise.copy_parts(t, COPIES, 3, None))
    assert cmp["n_mismatch"] == 1 and cmp["worst_copy"] == 1


def test_first_divergent_uses_execution_order():
    rows = [dict(stage="moe.out", order=9, unit="rank 0-1", bitwise_equal=False),
            dict(stage="combine.comm", order=7, unit="rank 0-1", bitwise_equal=False),
            dict(stage="experts.out", order=5, unit="copies on rank 2", bitwise_equal=True)]
    assert localise.first_divergent(rows) == "combine.comm"
    assert localise.first_divergent_by_pair(rows, 3) == {"0-1": "combine.comm", "0-2": None}


def test_compare_any_handles_bool_and_int():
    a = torch.tensor([True, False, True])
    c = toolkit.compare_any(a, torch.tensor([True, True, True]))
    assert c["n_mismatch"] == 1 and not c["bitwise_equal"]


def test_a_stage_that_diverges_in_some_trials_only_is_mixed_as_in_notebook_01():
    """02 words a divergence in 1 of 3 trials as 01 does (MIXED), in 3 of 3 as FAIL (the control)."""
    from records_factory import ENV, case02

    from moe_lab.findings.model import FAIL, MIXED
    from moe_lab.questions.localise import findings as f02

    def first(k):
        case = case02("allgather", "bf16 (nothing)", "combine.comm")
        row = {**ENV, "notebook": "02", "kind": "stage", "case_key": case["case_key"], "stage": "combine.comm",
               "stage_kind": "replicated", "unit": "rank 0-1", "bitwise_equal": False, "n_differ": k, "trials": 3,
               "mismatch_frac": 0.1}
        return next(f for f in f02.findings([case, row]) if f.question == "first divergent stage")

    assert first(1).status == MIXED and "in 1 of 3 trials" in first(1).claim
    assert first(3).status == FAIL
