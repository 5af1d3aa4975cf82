"""One cost definition (#12, #14): slowest rank per round, median of paired ratios, an order-statistics interval of
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


def test_a_cost_inside_the_noise_floor_is_not_measurable():
    floor = {"ratio": 1.0, "ci": [0.95, 1.06]}
    assert stats.measurable({"ratio": 1.03, "ci": [0.99, 1.08]}, floor) is False
    assert stats.measurable({"ratio": 1.9, "ci": [1.8, 2.1]}, floor) is True
    assert stats.measurable({"ratio": 1.9, "ci": [1.8, 2.1]}, None) is None
    assert stats.describe({"ratio": 1.03, "ci": [0.99, 1.08]}, floor) == "1.03x (95 % CI 0.99–1.08), no measurable cost"
    assert stats.describe({"ratio": 1.9, "ci": [1.8, 2.1]}, floor) == "1.90x (95 % CI 1.80–2.10)"
    assert stats.describe(None) == "n/a"


def test_driver_version_is_read_from_the_kernel_module_line(tmp_path, monkeypatch):
    """The report header's driver (a parse that once read 'for' from 'Kernel Module for x86_64 580.159.04')."""
    from pathlib import Path

    from moe_lab import provenance

    line = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder)  Sun Oct 12"
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line if str(self) == "/proc/driver/nvidia/version"
                        else real(self, *a, **k))
    assert provenance.cuda_libraries()["driver"] == "580.159.04"
