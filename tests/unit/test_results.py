"""Results.json: atomic appends, concurrent writers, bad files reported and kept, ordinary permissions.
(Resuming by case key is the experiment protocol's: tests/unit/test_protocol_unit.py.)"""

import os
import subprocess
import sys
import textwrap

import pytest

from moe_lab import results
from moe_lab.results import ResultsFileError


def _rec(i, **kw):
    return {"config": {"seed": i}, "cut": 90, "world": 4, "cross_rank": {"mismatch_frac": 0.1 * i}, **kw}


def test_append_and_load_round_trip(tmp_path):
    p = tmp_path / "sub" / "results.json"
    assert results.load(p) == []
    new = results.append(p, [_rec(1), _rec(2)], notebook="01")
    assert [r["notebook"] for r in new] == ["01", "01"]
    results.append(p, [_rec(3)], notebook="02")
    assert [r["config"]["seed"] for r in results.load(p)] == [1, 2, 3]
    assert not [f for f in os.listdir(p.parent) if f.endswith(".tmp")]
    df = results.tidy(results.load(p))
    assert list(df["cross_rank.mismatch_frac"].round(2)) == [0.1, 0.2, 0.3]


def test_an_append_reads_the_file_again_only_when_someone_else_changed_it(tmp_path, monkeypatch):
    """Each append writes the whole list, one record per line; the file is read again only where it is not what
    this process wrote last (the control: a change made by hand between two appends is read, kept and checked)."""
    p = tmp_path / "results.json"
    reads = []
    real = results._read
    monkeypatch.setattr(results, "_read", lambda q: reads.append(q) or real(q))
    for i in range(5):
        results.append(p, [_rec(i)], notebook="01")
    assert reads == []  # the file was this process's own every time
    lines = p.read_text().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == 7  # one record per line
    import json

    edited = json.loads(p.read_text())
    edited[0]["cut"] = 7
    p.write_text(json.dumps(edited))  # by hand, in place: the same inode, another size and time
    results.append(p, [_rec(9)], notebook="01")
    assert reads == [p]
    assert [r["cut"] for r in results.load(p)] == [7, 90, 90, 90, 90, 90]
    p.write_text('[{"a": 1}, {"b": ')  # broken by someone else: refused, not overwritten
    with pytest.raises(ResultsFileError, match="is not valid JSON"):
        results.append(p, [_rec(10)], notebook="01")
    assert p.read_text() == '[{"a": 1}, {"b": '


@pytest.mark.parametrize("content, message", [
    ('[{"a": 1}, {"b": ', "is not valid JSON"),  # a partial write by something else
    ("", "is not valid JSON"),
    ('{"a": 1}', "must hold a JSON list of records, found dict"),
    ('[{"a": 1}, 3]', "entries [1] are not records"),
    (b"\xff\xfe[]", "is not UTF-8"),
])
def test_a_bad_file_is_reported_and_never_overwritten(tmp_path, content, message):
    p = tmp_path / "results.json"
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    before = p.read_bytes()
    with pytest.raises(ResultsFileError) as e:
        results.load(p)
    assert message in str(e.value) and "not overwritten" in str(e.value) and str(p) in str(e.value)
    with pytest.raises(ResultsFileError):
        results.append(p, [_rec(1)])
    assert p.read_bytes() == before


def test_a_failed_rename_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "results.json"
    results.append(p, [_rec(1)])
    before = p.read_bytes()

    def crash(*a):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        results.append(p, [_rec(2)])
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_process_killed_between_write_and_rename_leaves_the_old_file(tmp_path):
    p = tmp_path / "results.json"
    results.append(p, [_rec(1)])
    before = p.read_bytes()
    code = textwrap.dedent(f"""
        import os
        from moe_lab import results
        os.replace = lambda *a: os._exit(9)   # the process dies after writing the temp file, before the rename
        results.append({str(p)!r}, [{{"config": {{"seed": 2}}}}])
    """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 9
    assert p.read_bytes() == before
    assert [x["config"]["seed"] for x in results.load(p)] == [1]  # the stray temp file does not confuse load


def test_concurrent_appends_lose_nothing(tmp_path):
    p = tmp_path / "results.json"
    code = textwrap.dedent("""
        import sys
        from moe_lab import results
        for i in range(8):
            results.append(sys.argv[1], [{"writer": sys.argv[2], "i": i, "pad": "x" * 20000}])
    """)  # the padding makes each read-modify-write slow enough that, without the lock, writers overwrite each other
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p), str(w)]) for w in range(3)]
    assert [pr.wait(timeout=120) for pr in procs] == [0, 0, 0]
    got = {(r["writer"], r["i"]) for r in results.load(p)}
    assert got == {(str(w), i) for w in range(3) for i in range(8)}


def test_the_file_gets_ordinary_permissions(tmp_path):
    """Mkstemp makes 0600 files; results.json is a report file like the HTML beside it (umask applies)."""
    p = tmp_path / "results.json"
    old = os.umask(0o022)
    try:
        results.append(p, [_rec(1)])
    finally:
        os.umask(old)
    assert oct(p.stat().st_mode & 0o777) == oct(0o644)
