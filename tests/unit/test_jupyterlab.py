"""JupyterLab as a person uses it: widget progress bars in its kernels (text in a terminal, none in the headless
runner's reports), tracked notebooks that a started kernel does not mark modified and that a save by nbformat does
not reformat, and `moe-lab lab` with autosave off so a run's outputs reach git only when the person saves."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from moe_lab.experiments import protocol
from moe_lab.reporting import runner
from moe_lab.tools import wheelhouse

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL_S = 60  # start + kernel_info of a local ipykernel: about a second here


# --------------------------------------------------------------------------------------------------
# ipywidgets: declared, installed, and the progress bar that uses it
# --------------------------------------------------------------------------------------------------


def _declared() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {Requirement(d).name.lower(): Requirement(d) for d in deps}


def test_ipywidgets_is_declared_everywhere_and_installed():
    import importlib.metadata

    import ipywidgets

    declared = _declared()
    assert "ipywidgets" in declared and Version(ipywidgets.__version__) in declared["ipywidgets"].specifier
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert str(declared["ipywidgets"]) in pip
    assert str(declared["ipywidgets"]) in wheelhouse.REQUIREMENTS  # the kernel's side, also on GPU nodes
    # tqdm's notebook bar draws with ipywidgets 8 from tqdm 4.64.1 on; the lab extension comes with ipywidgets
    assert Version("4.64.0") not in declared["tqdm"].specifier and Version("4.64.1") in declared["tqdm"].specifier
    assert Version(importlib.metadata.version("jupyterlab_widgets")) >= Version("3")


class _KernelShell:
    """What IPython.get_ipython() returns inside a Jupyter kernel, as far as the kernel test reads it."""

    config = {"IPKernelApp": {"connection_file": "kernel.json"}}


def _bar(monkeypatch, *, kernel: bool, headless: bool):
    import IPython

    if kernel:
        monkeypatch.setattr(IPython, "get_ipython", lambda: _KernelShell())
    if headless:
        monkeypatch.setenv(protocol.HEADLESS_ENV, "1")
    else:
        monkeypatch.delenv(protocol.HEADLESS_ENV, raising=False)
    return protocol.progress_bar(range(3), "cases")


def test_progress_bar_is_a_widget_in_a_kernel(monkeypatch, capsys):
    from tqdm.notebook import tqdm as notebook_tqdm

    bar = _bar(monkeypatch, kernel=True, headless=False)
    assert isinstance(bar, notebook_tqdm) and list(bar) == [0, 1, 2]
    bar.close()
    assert "IProgress not found" not in capsys.readouterr().err


def test_control_progress_bar_is_text_in_a_terminal(monkeypatch):
    from tqdm.std import tqdm as text_tqdm

    assert not protocol.in_jupyter_kernel()  # pytest is no kernel: the fake shell above is what makes one
    bar = _bar(monkeypatch, kernel=False, headless=False)
    assert type(bar) is text_tqdm and list(bar) == [0, 1, 2]


def test_progress_bar_is_none_under_the_headless_runner(monkeypatch):
    """The runner's kernels: the cases themselves, no bar saved into the report (in a kernel or not)."""
    items = _bar(monkeypatch, kernel=True, headless=True)
    assert type(items) is range and list(items) == [0, 1, 2]


def test_progress_bar_in_a_kernel_without_ipywidgets_is_text(monkeypatch, capsys):
    from tqdm.std import tqdm as text_tqdm

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # find_spec answers None: as if not installed
    bar = _bar(monkeypatch, kernel=True, headless=False)
    assert type(bar) is text_tqdm
    bar.close()
    assert "IProgress" not in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# a started kernel: what JupyterLab writes into a notebook's metadata, and the bar in a real kernel
# --------------------------------------------------------------------------------------------------

_IN_KERNEL = f"""
import os
from moe_lab.experiments import protocol
os.environ.pop(protocol.HEADLESS_ENV, None)
bar = protocol.progress_bar(range(2), "cases")
print("interactive:", type(bar).__module__, type(bar).__name__)
bar.close()
os.environ[protocol.HEADLESS_ENV] = "1"
print("headless:", type(protocol.progress_bar(range(2), "cases")).__name__)
"""


@pytest.fixture(scope="module")
def kernel():
    """A python3 kernel as JupyterLab starts one: its kernelspec, kernel_info's language_info, and the printed
    output and stderr of _IN_KERNEL run in it."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT), env={k: v for k, v in os.environ.items() if k != protocol.HEADLESS_ENV})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=KERNEL_S)
        info = kc.kernel_info(reply=True, timeout=KERNEL_S)["content"]
        out = {"stdout": "", "stderr": ""}

        def hook(msg):
            if msg["msg_type"] == "stream":
                out[msg["content"]["name"]] += msg["content"]["text"]

        reply = kc.execute_interactive(_IN_KERNEL, timeout=KERNEL_S, output_hook=hook)
        assert reply["content"]["status"] == "ok", reply["content"]
        spec = km.kernel_spec
        yield {"kernelspec": {"name": km.kernel_name, "display_name": spec.display_name, "language": spec.language},
               "language_info": info["language_info"], **out}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(3 * KERNEL_S)
def test_progress_bar_in_a_started_kernel(kernel):
    assert "interactive: tqdm.notebook tqdm_notebook" in kernel["stdout"]
    assert "headless: range" in kernel["stdout"]
    assert "IProgress not found" not in kernel["stderr"]


@pytest.mark.timeout(3 * KERNEL_S)
def test_notebooks_carry_the_metadata_a_started_kernel_gives_them(kernel):
    """JupyterLab sets metadata.kernelspec and metadata.language_info from the kernel it starts, and marks the
    notebook modified only when the value differs (a deep compare). Every field is the kernel's; language_info's
    version is the Python of the environment that wrote the notebooks (the same in all): on another Python a
    started kernel marks the notebook modified, and with `moe-lab lab`'s autosave off the file stays as it is."""
    assert NOTEBOOKS
    versions = set()
    for p in NOTEBOOKS:
        meta = nbformat.read(p, as_version=4).metadata
        assert meta["kernelspec"] == kernel["kernelspec"], p.name
        got, want = dict(meta["language_info"]), dict(kernel["language_info"])
        assert got.keys() == want.keys(), p.name
        versions.add(got.pop("version"))
        want.pop("version")
        assert got == want, p.name
    assert len(versions) == 1 and re.fullmatch(r"3\.\d+\.\d+", versions.pop())


def test_the_metadata_check_sees_a_difference(kernel):
    """The control: the metadata a notebook gets from nbformat's own defaults (kernelspec display_name "Python 3",
    language_info with its name only) is not what a kernel writes: JupyterLab would mark such a notebook modified."""
    assert {"display_name": "Python 3", "language": "python", "name": "python3"} != kernel["kernelspec"]
    assert {"name": "python"}.keys() != kernel["language_info"].keys()


def test_notebooks_are_in_the_form_a_save_writes():
    """A save (JupyterLab's server and papermill both write through nbformat) gives back the committed bytes."""
    for p in NOTEBOOKS:
        buf = io.StringIO()
        nbformat.write(nbformat.read(p, as_version=4), buf)
        assert buf.getvalue().encode("utf-8") == p.read_bytes(), f"{p.name} is not in nbformat's form"


def test_control_a_reordered_notebook_is_not_in_that_form():
    raw = json.loads(NOTEBOOKS[0].read_text())
    raw["cells"][0] = dict(reversed(list(raw["cells"][0].items())))
    text = json.dumps(raw, indent=1, ensure_ascii=False) + "\n"
    buf = io.StringIO()
    nbformat.write(nbformat.reads(text, as_version=4), buf)
    assert buf.getvalue() != text


# --------------------------------------------------------------------------------------------------
# moe-lab lab: autosave off, the person's own settings kept
# --------------------------------------------------------------------------------------------------


def _user_settings(folder: Path) -> Path:
    theme = folder / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    theme.parent.mkdir(parents=True)
    theme.write_text('{\n  // the theme\n  "theme": "JupyterLab Dark"\n}\n')
    docmanager = folder / runner.AUTOSAVE_SETTINGS
    docmanager.parent.mkdir(parents=True)
    docmanager.write_text('{\n  // Document Manager\n  "autosave": true,\n  "autosaveInterval": 30\n}\n')
    return folder


def test_lab_environment_turns_autosave_off_in_a_copy_of_the_users_settings(tmp_path):
    user = _user_settings(tmp_path / "user")
    session = tmp_path / "session"
    env, note = runner.lab_environment({"PATH": "/bin", protocol.HEADLESS_ENV: "1"}, session, user)
    assert env == {"PATH": "/bin", "JUPYTERLAB_SETTINGS_DIR": str(session)}  # the runner's signal is not passed on
    assert json.loads((session / runner.AUTOSAVE_SETTINGS).read_text()) == {"autosave": False, "autosaveInterval": 30}
    assert (session / "@jupyterlab/apputils-extension/themes.jupyterlab-settings").read_text() == \
        (user / "@jupyterlab/apputils-extension/themes.jupyterlab-settings").read_text()
    assert "autosave off" in note and str(session) in note and str(user) in note
    assert '"autosave": true' in (user / runner.AUTOSAVE_SETTINGS).read_text()  # the person's own file untouched


def test_lab_environment_without_settings_of_ones_own(tmp_path):
    env, note = runner.lab_environment({}, tmp_path / "session", tmp_path / "absent")
    assert env == {"JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "session")}
    assert json.loads((tmp_path / "session" / runner.AUTOSAVE_SETTINGS).read_text()) == {"autosave": False}
    assert "JupyterLab's defaults" in note


def test_lab_environment_leaves_a_settings_dir_the_person_set(tmp_path):
    own = _user_settings(tmp_path / "own")
    before = (own / runner.AUTOSAVE_SETTINGS).read_text()
    env, note = runner.lab_environment({"JUPYTERLAB_SETTINGS_DIR": str(own)}, tmp_path / "session", tmp_path / "u")
    assert env == {"JUPYTERLAB_SETTINGS_DIR": str(own)}
    assert (own / runner.AUTOSAVE_SETTINGS).read_text() == before and not (tmp_path / "session").exists()
    assert str(own) in note and "left as they are" in note


def test_the_autosave_file_is_the_one_the_installed_jupyterlab_reads():
    from jupyterlab.commands import get_app_dir

    schema = Path(get_app_dir()) / "schemas" / runner.AUTOSAVE_SETTINGS.parent / "plugin.json"
    assert json.loads(schema.read_text())["properties"]["autosave"]["type"] == "boolean"


def test_lab_command():
    cmd = runner.lab_command(port=8890, open_browser=False, extra_args=["--ServerApp.token=x"])
    assert cmd[:4] == [sys.executable, "-m", "jupyterlab", f"--notebook-dir={ROOT / 'notebooks'}"]
    assert "--port=8890" in cmd and "--no-browser" in cmd and cmd[-1] == "--ServerApp.token=x"


def test_lab_starts_jupyterlab_with_that_environment(tmp_path, monkeypatch, caplog):
    import logging
    import subprocess

    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("JUPYTERLAB_SETTINGS_DIR", raising=False)
    _user_settings(tmp_path / "config" / "lab" / "user-settings")
    started = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: started.append((cmd, env)) or 7)
    with caplog.at_level(logging.INFO, logger="moe_lab"):
        assert runner.lab(port=8890, open_browser=False) == 7
    (cmd, env), = started
    assert cmd == runner.lab_command(port=8890, open_browser=False)
    session = tmp_path / "cache" / "jupyterlab" / "user-settings"
    assert env["JUPYTERLAB_SETTINGS_DIR"] == str(session)
    assert json.loads((session / runner.AUTOSAVE_SETTINGS).read_text())["autosave"] is False
    assert "autosave off" in caplog.text


# --------------------------------------------------------------------------------------------------
# moe-lab run: executed copies go to the report folder, never over the tracked notebooks
# --------------------------------------------------------------------------------------------------


def test_a_run_writes_executed_copies_into_the_report_folder(tmp_path, monkeypatch):
    import papermill

    calls = []

    def execute_notebook(src, dst, **kw):
        calls.append((src, dst))
        raise RuntimeError("not run here")

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    src = NOTEBOOKS[0]
    before = src.read_bytes()
    row = runner.run_one(src.name[:2], src, tmp_path, {}, "cpu", 60)
    assert calls == [(str(src), str(tmp_path / src.name))] and row["status"] == "failed"
    assert src.read_bytes() == before
    with pytest.raises(ValueError, match="tracked by git"):
        runner.check_out(str(ROOT / "notebooks"))  # --out notebooks/ is refused before anything runs
