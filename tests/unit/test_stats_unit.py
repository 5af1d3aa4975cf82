"""One cost definition: slowest rank per round, median of paired ratios, an order-statistics interval of
the median, and the A/A noise floor that decides 'no measurable cost'. Numbers by hand."""

import math

import pytest

from moe_lab import stats


def test_median_ci_uses_binomial_order_statistics():
    xs = list(range(1, 16))  # 15 rounds: P(B(15, .5) < 4) = 0.0176 <= 0.025 < P(B < 5) = 0.059 → x(4), x(12)
    assert stats.median_ci(xs) == (4, 12)
    assert stats.median_ci(list(range(1, 7))) == (1, 6)  # n = 6: only min..max reaches 95 %
    assert stats.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few rounds for 95 %: the whole range
    assert all(math.isnan(v) for v in stats.median_ci([]))


def test_paired_rounds_take_the_slowest_rank_and_the_median_ratio():
    ranks_case = [[2.0, 3.0, 2.0], [1.0, 4.0, 2.0]]
    ranks_plain = [[1.0, 1.0, 2.0], [2.0, 1.0, 1.0]]
    case, plain = stats.slowest(ranks_case), stats.slowest(ranks_plain)
    assert case == [2.0, 4.0, 2.0] and plain == [2.0, 1.0, 2.0]
    c = stats.paired(case, plain)  # ratios 1, 4, 1
    assert c["ratio"] == 1.0 and c["ci"] == [1.0, 4.0] and c["rounds"] == 3
    assert stats.paired([], [])["ratio"] is None


def test_drift_between_rounds_cancels():
    plain = [1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0]  # the machine slows down in rounds 2 and 5
    c = stats.paired([1.1 * p for p in plain], plain)
    assert c["ratio"] == pytest.approx(1.1) and c["ci"] == pytest.approx([1.1, 1.1])


def test_a_cost_overlapping_the_noise_floor_is_not_resolved():
    floor = {"ratio": 1.0, "ci": [0.95, 1.06]}
    assert stats.measurable({"ratio": 1.03, "ci": [0.99, 1.08]}, floor) is False
    assert stats.measurable({"ratio": 1.9, "ci": [1.8, 2.1]}, floor) is True
    assert stats.measurable({"ratio": 1.9, "ci": [1.8, 2.1]}, None) is None
    assert stats.describe({"ratio": 1.02, "ci": [0.99, 1.05], "rounds": 7}, floor) == \
        "1.02x (95 % CI 0.99–1.05), no measurable cost (interval inside the A/A noise floor)"
    assert stats.describe({"ratio": 1.9, "ci": [1.8, 2.1], "rounds": 9}, floor) == "1.90x (95 % CI 1.80–2.10)"
    # too few rounds for 95 %: the interval is their min–max, worded with its own confidence
    assert stats.describe({"ratio": 1.9, "ci": [1.8, 2.1], "rounds": 3}, floor) == \
        "1.90x (min–max of 3 rounds, a 75 % interval: 1.80–2.10)"
    assert stats.describe({"ratio": 1.9, "ci": [1.8, 2.1]}, floor) == "1.90x (interval 1.80–2.10)"
    assert stats.describe(None) == "n/a"


@pytest.mark.parametrize("ci, floor, relation", [
    ((0.99, 1.05), (0.95, 1.06), "inside"),
    ((0.95, 1.06), (0.95, 1.06), "inside"),      # the floor's own interval: inside, edges included
    ((0.99, 1.08), (0.95, 1.06), "overlaps"),    # reaches past the floor: not "no measurable cost"
    ((1.02, 2.44), (0.76, 1.29), "overlaps"),    # a committed CPU router-fp32 cost: far above 1, not inside
    ((0.90, 1.10), (0.95, 1.06), "overlaps"),    # wider than the floor on both sides
    ((1.8, 2.1), (0.95, 1.06), "above"),
    ((0.5, 0.9), (0.95, 1.06), "below"),
    ((1.0, float("nan")), (0.95, 1.06), None), ((1.0, 1.1), None, None), ((1.1, 1.0), (0.9, 1.2), None),
])
def test_a_cost_is_worded_by_where_its_interval_lies_against_the_floor(ci, floor, relation):
    """One rule (stats.against_floor): 'no measurable cost' only inside the floor; overlapping it is 'not told
    apart'."""
    assert stats.against_floor(ci, floor) == relation
    text = stats.describe({"ratio": 1.0, "ci": list(ci)}, {"ci": list(floor)} if floor else None)
    assert ("no measurable cost" in text) == (relation == "inside")
    assert ("not told apart" in text) == (relation == "overlaps")


def test_driver_version_is_read_from_the_kernel_module_line(tmp_path, monkeypatch):
    """The report header's driver (a parse that once read 'for' from 'Kernel Module for x86_64 580.159.04')."""
    from pathlib import Path

    from moe_lab import provenance

    line = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder)  Sun Oct 12"
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line if str(self) == "/proc/driver/nvidia/version"
                        else real(self, *a, **k))
    assert provenance.cuda_libraries()["driver"] == "580.159.04"


def _rounds(wall: dict, coll: dict | None = None, placement: dict | None = None) -> dict:
    """One rank's toolkit.paired_rounds result from per-fn lists (milliseconds → seconds)."""
    out = {"wall_s": {m: [v / 1e3 for v in ws] for m, ws in wall.items()},
           "collective_s": {m: [v / 1e3 for v in cs] for m, cs in (coll or {}).items()},
           "calls": {m: [3] * len(cs) for m, cs in (coll or {}).items()}}
    if placement:
        out["placement"] = placement
    return out


VIRTUAL = {"world": 2, "ranks_per_gpu": 2, "backend": "gloo", "device": "cuda"}


def test_compute_cost_is_the_paired_ratio_of_wall_minus_collective_seconds():
    # two ranks; per round compute = wall - collective: case 6, 9, 8 (rank 0) / 4, 10, 8 (rank 1) → slowest 6, 10, 8
    case0 = _rounds({"case": [10, 12, 10], "plain": [10, 10, 10]}, {"case": [4, 3, 2], "plain": [6, 5, 6]}, VIRTUAL)
    case1 = _rounds({"case": [10, 12, 10], "plain": [9, 10, 11]}, {"case": [6, 2, 2], "plain": [4, 7, 8]}, VIRTUAL)
    c = stats.paired_cost([case0, case1], "case", "plain")
    # plain compute: rank 0 4, 5, 4; rank 1 5, 3, 3 → slowest 5, 5, 4; ratios 6/5, 10/5, 8/4 → median 2.0
    assert c["compute"]["ratio"] == pytest.approx(2.0)
    assert c["compute"]["ratios"] == pytest.approx([1.2, 2.0, 2.0]) and c["compute"]["rounds"] == 3
    assert c["compute"]["ci"] == pytest.approx([1.2, 2.0])  # 3 rounds: the whole range
    assert c["compute"]["t_with_s"] == pytest.approx(0.008) and c["compute"]["t_without_s"] == pytest.approx(0.005)
    assert c["ratio"] == pytest.approx(1.0)  # the wall figure as ever: slowest walls 10, 12, 10 / 10, 10, 11
    # per round the least transport-bound rank: plain min(6/10, 4/9), min(5/10, 7/10), min(6/10, 8/11) → median 0.5
    assert c["collective_share"]["without"] == pytest.approx(0.5)
    assert c["collective_share"]["with"] == pytest.approx(0.2)  # rounds min(.4, .6), min(.25, .167), .2 → .2
    assert c["transport_bound"] is False and stats.headline_cost(c) == "wall"  # exactly half is not more than half
    assert c["collective_calls"] == {"with": 3, "without": 3}
    assert c["placement"] == "2 ranks share one GPU over gloo (virtual EP)" and c["placement_fields"] == VIRTUAL


def test_a_transport_bound_wall_ratio_hides_a_twofold_compute_cost():
    """The virtual-EP control: gloo is ~92 % of the plain forward; the remedy doubles the compute (6 → 12 ms) while
    the ranks wait less inside the collectives, so the wall ratio reads ~1.0x. compute shows the 2x."""
    plain_coll = [74, 75, 73, 74, 76, 74, 75]
    plain_wall = [c + 6 for c in plain_coll]
    case_coll = [c - 5 for c in plain_coll]
    case_wall = [c + 12 for c in case_coll]
    ranks = [_rounds({"case": case_wall, "plain": plain_wall}, {"case": case_coll, "plain": plain_coll},
                     {"world": 4, "ranks_per_gpu": 4, "backend": "gloo", "device": "cuda"}) for _ in range(4)]
    c = stats.paired_cost(ranks, "case", "plain", environment={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert c["ratio"] == pytest.approx(81 / 80, rel=0.01)
    assert c["compute"]["ratio"] == pytest.approx(2.0) and c["compute"]["ci"] == pytest.approx([2.0, 2.0])
    assert c["collective_share"]["without"] == pytest.approx(74 / 80, abs=0.005)
    assert c["transport_bound"] is True
    assert stats.headline_cost(c) == "compute" and stats.figure(c) is c["compute"]
    assert stats.figure(c, "wall") is c
    assert c["environment"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert c["placement"] == "4 ranks share one GPU over gloo (virtual EP)"
    # against its A/A floor (plain against plain, same fields): measurable on compute, not on wall
    floor = stats.paired_cost([_rounds({"case": plain_wall, "plain": plain_wall[1:] + plain_wall[:1]},
                                       {"case": plain_coll, "plain": plain_coll[1:] + plain_coll[:1]})] * 4,
                              "case", "plain")
    assert floor["transport_bound"] is True and "compute" in floor
    assert stats.measurable(stats.figure(c), stats.figure(floor)) is True
    assert stats.measurable(c, floor) is False


def test_costs_without_collective_timings_keep_the_wall_figures_only():
    old = [{"case": [0.02, 0.021, 0.02], "plain": [0.01, 0.01, 0.01]}] * 2  # an engine of before the timer
    c = stats.paired_cost(old, "case", "plain")
    assert c["ratio"] == pytest.approx(2.0)
    assert not {"compute", "collective_share", "transport_bound", "placement"} & set(c)
    assert stats.headline_cost(c) == "wall" and stats.figure(c) is c
    untimed = [_rounds({"case": [2, 2, 2], "plain": [1, 1, 1]}, {"case": [1, 1, 1]})]  # plain's collectives untimed
    assert "compute" not in stats.paired_cost(untimed, "case", "plain")
    # a record's cost as older reports stored it, and no cost at all
    rec_cost = {"ratio": 1.13, "ci": [0.97, 1.54], "rounds": 7, "environment": {}}
    assert stats.headline_cost(rec_cost) == "wall" and stats.figure(rec_cost, "compute") is None
    assert stats.headline_cost({"ratio": 1.1, "ci": [1, 1.2], "transport_bound": True}) == "wall"  # no compute: wall
    assert stats.headline_cost(None) is None and stats.figure(None) is None
    assert stats.headline_cost({"ratio": None, "ci": None, "rounds": 0}) is None
    assert stats.paired_cost([_rounds({"case": [], "plain": []}, {"case": [], "plain": []})], "case",
                             "plain")["ratio"] is None


def test_placement_in_words():
    assert stats.placement(4, 4, "gloo", "cuda") == "4 ranks share one GPU over gloo (virtual EP)"
    assert stats.placement(8, 4, "gloo", "cuda") == "4 ranks share each of 2 GPUs over gloo (virtual EP)"
    assert stats.placement(2, 1, "nccl", "cuda") == "one rank per GPU over NCCL (2 GPUs)"
    assert stats.placement(1, 1, "nccl", "cuda") == "one rank on one GPU over NCCL"
    assert stats.placement(4, None, "gloo", "cpu") == "4 CPU engines over gloo"
    assert stats.placement(4, 4, "gloo", "cuda", "CUDA IPC") == \
        "4 ranks share one GPU over gloo, all-to-alls through CUDA IPC (virtual EP)"
    assert stats.placement() is None
    assert stats.carried(None) == "" and stats.carried("CUDA IPC") == ", all-to-alls through CUDA IPC"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 9, 12])
def test_the_intervals_confidence_is_what_median_ci_covers(n):
    """The confidence a cost's words give its interval is the interval's coverage of the true median, counted over
    draws of n values from a continuous distribution (its median 0): min–max below 6 values, order statistics from
    there. A label of 95 % on 5 rounds would fail here (93.75 %)."""
    import random

    rng = random.Random(n)
    draws = 20000
    covered = sum(lo <= 0.0 <= hi for lo, hi in (stats.median_ci([rng.gauss(0, 1) for _ in range(n)])
                                                  for _ in range(draws)))
    conf = stats.interval_confidence(n)
    assert covered / draws == pytest.approx(conf, abs=0.012)
    assert (conf >= 0.95) == (n >= 6)
    assert stats.interval_words([1.0, 1.2], n).startswith("95 % CI" if n >= 6 else f"min–max of {n} rounds, a ")


def test_a_figures_interval_name_says_what_its_costs_intervals_are():
    assert stats.interval_name([7, 9]) == "95 % CI"
    assert stats.interval_name([5, 5]) == "min–max of 5 rounds, a 93.75 % interval"
    assert stats.interval_name([3]) == "min–max of 3 rounds, a 75 % interval"
    for mixed in ([3, 7], [5, None], []):  # rounds that differ or were not recorded: no single confidence to name
        assert stats.interval_name(mixed) == "interval (95 % CI from 6 rounds, min–max below)"


def test_rounds_counted_as_numpy_or_pandas_integers_name_the_same_interval():
    import numpy as np

    assert stats.interval_name(np.array([5, 5])) == "min–max of 5 rounds, a 93.75 % interval"
    assert stats.interval_words([1.0, 1.2], np.int64(7)) == "95 % CI 1.00–1.20"
    assert stats.interval_name([5.0]) == "interval (95 % CI from 6 rounds, min–max below)"  # not a count
