"""Output folders are checked before anything starts: one line naming the flag and the path, and the check of a
folder that did not exist leaves nothing behind (input refused later must not leave an empty report folder)."""

import os

import pytest

from moe_lab.fsio import check_writable, writable_dir
from moe_lab.reporting import runner


def test_check_writable_proves_a_new_folder_and_removes_what_it_made(tmp_path):
    assert check_writable(tmp_path / "a" / "b" / "c") == tmp_path / "a" / "b" / "c"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_writable(tmp_path / "kept")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_writable_dir_creates_the_folder(tmp_path):  # the control: the same probe, kept
    writable_dir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_an_unusable_folder_is_one_line_naming_flag_and_path(tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "f").write_text("")
        target = tmp_path / "f" / "out"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        (tmp_path / "ro").mkdir(mode=0o500)
        target = tmp_path / "ro" / "out"
    with pytest.raises(ValueError) as e:
        check_writable(target, "--out")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--out ({target}) is not a writable directory")


def test_run_names_a_bad_out_before_it_reads_the_profile(tmp_path):
    """A bad --out is the first thing said, even beside a bad profile parameter (so before the GPU probe too)."""
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^--out .* is not a writable directory"):
        runner.run_all(profile="cpu", overrides={"seq_len": "abc"}, out=str(tmp_path / "f" / "out"))
    with pytest.raises(ValueError, match="seq_len"):  # the control: a usable --out, the parameter is refused
        runner.run_all(profile="cpu", overrides={"seq_len": "abc"}, out=str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
