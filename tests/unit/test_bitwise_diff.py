"""`.ci/bitwise_diff.py`, the check that a refactor or a remake changed no mismatch count: a changed count is found
(the control), equal counts pass, notebook 05's gradient counts are compared, and a case measured nondeterministically
(its own reruns differ, or two records of it disagree) is listed apart instead of failing the comparison."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bitwise_diff", ROOT / ".ci" / "bitwise_diff.py")
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)


def _cmp(n):
    return {"n_mismatch": n, "numel": 100}


def case(nb="01", cross=5, rerun=0, **kw):
    return {"notebook": nb, "kind": "case", "megatron_core": "0.16.1", "dispatcher": "allgather", "router_dtype": "none",
            "cross_rank": _cmp(cross), "rerun": _cmp(rerun), **kw}


def backward(setting="plain", dx=7, rerun_dx=0):
    return {"notebook": "05", "kind": "backward", "megatron_core": "0.16.1", "dispatcher": "allgather",
            "router_dtype": "none", "setting": setting, "cross_dx": _cmp(dx), "rerun_dx": _cmp(rerun_dx)}


def run(tmp_path, before, after, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(before))
    b.write_text(json.dumps(after))
    rc = bd.main(str(a), str(b))
    return rc, capsys.readouterr().out


def test_equal_counts_pass_and_a_changed_count_is_found(tmp_path, capsys):
    recs = [case(), case(dispatcher="alltoall", cross=0), backward()]
    rc, out = run(tmp_path, recs, recs, capsys)
    assert rc == 0 and "0 differ" in out
    rc, out = run(tmp_path, recs, [case(cross=6), *recs[1:]], capsys)  # control: one count moved by one
    assert rc == 1 and "1 differ" in out and "DIFF" in out


def test_notebook_05_gradient_counts_are_compared(tmp_path, capsys):
    rc, out = run(tmp_path, [backward(dx=7)], [backward(dx=8)], capsys)
    assert rc == 1 and "'setting': '\"plain\"'" in out
    rc, _ = run(tmp_path, [backward(setting="plain")], [backward(setting="router fp32")], capsys)
    assert rc == 1  # another setting is another case, not the same one renamed


def test_nondeterministic_cases_are_listed_apart(tmp_path, capsys):
    rc, out = run(tmp_path, [backward(dx=7, rerun_dx=3)], [backward(dx=9, rerun_dx=2)], capsys)
    assert rc == 0 and "VARIES" in out and "1 nondeterministic" in out
    # two device calls that disagree on a case with rerun 0 in each: run-to-run variation seen, not compared
    rc, out = run(tmp_path, [backward(dx=7), backward(dx=8)], [backward(dx=9)], capsys)
    assert rc == 0 and "VARIES" in out
    # repeated records that agree are one deterministic case: a change there is still a difference
    rc, out = run(tmp_path, [backward(dx=7), backward(dx=7)], [backward(dx=9)], capsys)
    assert rc == 1 and "DIFF" in out
