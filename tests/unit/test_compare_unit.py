"""Holding one placement against another: verdicts and magnitudes per case, and why they may differ."""

from moe_lab.records import Comparison
from moe_lab.reporting import compare


def c(n, trials=5, n_differ=None):
    n_differ = (trials if n else 0) if n_differ is None else n_differ
    return Comparison.counted(1000, n, trials=trials, n_differ=n_differ).asdict()


def rec01(place, d, r, cross, rerun):
    return dict(notebook="01", dispatcher=d, router_dtype=r, cross_rank=c(cross), rerun=c(rerun), truncation=c(0),
                world=4, placement=place, backend="nccl" if place == "one rank per GPU" else "gloo")


def test_verdicts_and_magnitudes_per_case():
    nccl = [rec01("one rank per GPU", "allgather", "none", 300, 0), rec01("one rank per GPU", "alltoall", "none", 2, 2)]
    virt = [rec01("4 ranks share each GPU (virtual EP)", "allgather", "none", 320, 0),
            rec01("4 ranks share each GPU (virtual EP)", "alltoall", "none", 9, 0)]
    rows = {r["case"]: r for r in compare.compare(nccl, virt)}
    assert rows["allgather/router none"]["agree"] and rows["allgather/router none"]["within_factor"]
    a2a = rows["alltoall/router none"]
    assert not a2a["agree"] and a2a["a"].startswith("nondeterminism") and a2a["b"].startswith("ep")
    assert not a2a["within_factor"] and "NCCL's own reduction order" in a2a["why"]
    s = compare.summary(nccl, virt)
    assert "verdicts agree in 1 of 2" in s and "B: 4 ranks, 4 ranks share each GPU (virtual EP), gloo" in s


def test_no_common_case():
    assert compare.summary([], []) == "No case is in both record sets."


def test_cli_compare(tmp_path, capsys):
    import json

    from moe_lab import cli

    for name, cross in (("a", 300), ("b", 310)):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps([rec01("one rank per GPU", "allgather", "none", cross, 0)]))
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json")]) == 0
    assert "verdicts agree in 1 of 1; mismatch magnitudes within 2x in 1 of 1" in capsys.readouterr().out
    assert cli.main(["compare", str(tmp_path / "nothing"), str(tmp_path / "b")]) == 2


def run06(ep, **kw):
    from records_factory import train06

    det = kw.get("det", True)
    label = f"plain, 1 layer(s), ep{ep}, {'det' if det else 'nondet'}, run 0"
    return dict(train06(ep, label=label, precision="bf16", config={"hidden": 8}, **kw), steps=6, tokens=4)


def test_training_trajectories_held_bit_for_bit():
    """06: the same runs on two machines. Equal trajectories agree; the controls — B's ep2 run with other weights
    after step 2 (its losses equal), then with its loss parting at step 1 — are caught with the step and where; a
    layout effect ten times larger fails the factor; a run of another configuration is not compared."""
    a = [run06(1), run06(2, part_at=2, how_far=1e-3), run06(4, part_at=1, how_far=1e-2, det=False)]
    b = [run06(1), run06(2, part_at=2, how_far=1e-3), run06(4, part_at=1, how_far=1e-2, det=False)]
    rows = {r["case"]: r for r in compare.compare(a, b)}
    assert len(rows) == 3 and all(r["agree"] and r["within_factor"] for r in rows.values())
    assert "with deterministic mode 2 of 2; without it 1 of 1" in compare.summary(a, b)

    b[1] = run06(2, part_at=2, how_far=1e-3, tag="other machine")  # same losses, other weights after step 2
    row = {r["case"]: r for r in compare.compare(a, b)}["plain, 1 layer(s), ep2, det, run 0"]
    assert not row["agree"] and row["within_factor"]
    assert "parts after step 2 of 6 (in the backward or the gradient reduce" in row["why"]
    b[1] = run06(2, part_at=1, how_far=1e-3, tag="other machine")
    row = {r["case"]: r for r in compare.compare(a, b)}["plain, 1 layer(s), ep2, det, run 0"]
    assert "parts after step 1 of 6 (in the forward: step 1's loss bits" in row["why"]
    assert "with deterministic mode 1 of 2" in compare.summary(a, b)

    b[1] = run06(2, part_at=2, how_far=1e-1)  # the layout effect ten times larger on B
    row = {r["case"]: r for r in compare.compare(a, b)}["plain, 1 layer(s), ep2, det, run 0"]
    assert not row["agree"] and not row["within_factor"]

    b[1] = dict(run06(2, part_at=2, how_far=1e-3), config={"hidden": 16})
    assert "plain, 1 layer(s), ep2, det, run 0" not in {r["case"] for r in compare.compare(a, b)}
