"""Headless runner: numbered notebooks → papermill → executed .ipynb + HTML (full and code-hidden) + index +
results.json. Each notebook's HTML, failure banner and what the index reads from it: reporting.notebook_pages."""

from __future__ import annotations

import contextlib
import datetime
import html
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from .. import profiles
from ..controller import interrupts
from ..fsio import ReportWriteError, check_writable, failed_write, writable_dir
from .. import results
from .notebook_pages import NB_PATTERN, ROOT, error_of, mark_failure, render_html, title_of, verdict_of

logger = logging.getLogger(__name__)

NOTEBOOKS = ROOT / "notebooks"
REPORTS = ROOT / "reports"
PUBLISHED = REPORTS / "published"
"""The curated GPU evidence the repository keeps (tracked); every other folder under reports/ is git-ignored."""


def check_out(out: str | None) -> Path | None:
    """`--out` as a folder, refused in one line before anything starts: '' (names no folder), a folder
    inside reports/published/ (the curated evidence), a folder holding files git tracks (a run would change them), a
    folder that cannot be written."""
    if out is None:
        return None
    if not str(out).strip():
        raise ValueError("--out '' names no folder; leave --out out (reports/<profile>-<date>, git-ignored) or "
                         "give a folder")
    out_dir = Path(out).expanduser().resolve()
    refuse_tracked(out_dir)
    # first, before the profile, the GPU probe and the release check: a wrong --out is known at once (and nothing
    # is left of the test: a run refused later for other input leaves no folder)
    check_writable(out_dir, "--out")
    return out_dir


def refuse_tracked(out_dir: Path) -> None:
    """ValueError (one line) if a run into `out_dir` would write into the published reports or over tracked files."""
    pub = PUBLISHED.resolve()
    if out_dir == pub or pub in out_dir.parents:
        raise ValueError(f"--out ({out_dir}) is inside reports/published/, the curated reports the repository keeps; "
                         "a run writes elsewhere (default reports/<profile>-<date>, git-ignored)")
    tracked = tracked_files(out_dir)
    if tracked:
        raise ValueError(f"--out ({out_dir}) holds {len(tracked)} file(s) tracked by git (e.g. {tracked[0]}) that a "
                         "run would change; give a folder git does not track (default reports/<profile>-<date>)")


def tracked_files(folder: Path) -> list[str]:
    """The files git tracks under `folder` (none if it is no folder, not in a work tree, or git is missing)."""
    import subprocess

    if not folder.is_dir():
        return []
    try:
        p = subprocess.run(["git", "-C", str(folder), "ls-files", "-z", "--", "."], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [x for x in p.stdout.decode(errors="replace").split("\0") if x] if p.returncode == 0 else []


def numbered_notebooks(nb_dir: Path = NOTEBOOKS) -> dict[str, Path]:
    return {m.group(1): p for p in sorted(nb_dir.glob("*.ipynb")) if (m := NB_PATTERN.match(p.name))}


def select(only: str | None, nb_dir: Path = NOTEBOOKS) -> list[tuple[str, Path]]:
    nbs = numbered_notebooks(nb_dir)
    if not nbs:
        raise ValueError(f"no numbered notebooks (NN_name.ipynb) in {nb_dir}")
    if not only:
        return list(nbs.items())
    want = [w.strip().zfill(2) for w in only.split(",") if w.strip()]
    bad = [w for w in want if w not in nbs]
    if bad:
        raise ValueError(f"--only {only!r}: no notebook {bad}; available: {', '.join(nbs)}")
    return [(w, nbs[w]) for w in want]


def default_profile() -> str:
    from ..controller.placement import visible_gpus

    return "gpu" if visible_gpus() else "cpu"


def _row(num: str, src: Path, status: str, error: str, seconds: float) -> dict:
    return {"notebook": num, "file": src.name, "status": status, "error": error, "seconds": round(seconds, 1),
            "title": "", "verdict": ""}


def _cases_run(out_dir: Path, num: str) -> dict:
    """{"measured": n, "reused": m} of notebook `num`'s run in this `moe-lab run` (protocol.note_run's counts in
    cases-NN.json under this run's id), or {} when the notebook ran no case in this run."""
    p = out_dir / f"cases-{num}.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(d, dict) or d.get("run_id") != os.environ.get("MOE_LAB_RUN_ID"):
        return {}
    return {k: d[k] for k in ("measured", "reused") if isinstance(d.get(k), int)}


def _finish_row(row: dict, dst: Path) -> dict:
    """Title, verdict, error and HTML of an executed (or partly executed) notebook into its index row."""
    import nbformat

    if not dst.exists():
        return row
    if row["status"] != "ok":
        try:
            mark_failure(dst, row["error"] or row["status"])
        except Exception as e:  # noqa: BLE001 - keep the run's other results
            _raise_if_write_failed(e, dst.parent)
            logger.error("marking the failure in %s failed: %s", dst.name, e)
    nb = nbformat.read(dst, as_version=4)
    row["title"], row["verdict"] = title_of(nb), verdict_of(nb)
    row["error"] = row["error"] or (error_of(nb) if row["status"] != "ok" else "")
    try:
        row["html"] = render_html(dst).name
        row["shared_html"] = render_html(dst, exclude_input=True).name
    except Exception as e:  # noqa: BLE001 - report it in the index rather than lose the run
        _raise_if_write_failed(e, dst.parent)
        row["error"] += f" (HTML rendering failed: {e})"
        logger.error("rendering %s failed: %s", dst.name, e)
    return row


def _raise_if_write_failed(e: BaseException, out_dir: Path) -> None:
    """A file under the report folder that could not be written ends the run (ReportWriteError, one line, exit 3):
    the notebooks after it could not save anything either."""
    path = failed_write(e, out_dir)
    if path:
        raise ReportWriteError(path, next(x for x in _chain(e) if isinstance(x, OSError))) from e


def _chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def run_one(num: str, src: Path, out_dir: Path, params: dict, profile: str, timeout: float) -> dict:
    import papermill as pm

    from .kernels import RunKernelManager

    dst = out_dir / src.name
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        pm.execute_notebook(str(src), str(dst), parameters=dict(profile=profile, params=params, out_dir=str(out_dir)),
                            cwd=str(src.parent), kernel_name="python3", progress_bar=sys.stderr.isatty(),
                            execution_timeout=timeout, log_output=False, request_save_on_cell_execute=True,
                            kernel_manager_class=RunKernelManager)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a failing notebook still gets its HTML and an index row
        _raise_if_write_failed(e, out_dir)
        status, error = "failed", f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if type(e).__name__ == "DeadKernelError":
            error = "DeadKernelError: the kernel died (killed, out of memory, or a crash in native code)"
        if getattr(e, "ename", None) == "ClusterError":  # the notebook's cluster failed: said as under probe
            status, error = "cluster fault", f"cluster fault: {getattr(e, 'evalue', '')}"
        logger.error("notebook %s failed: %s", src.name, error)
    row = _finish_row(_row(num, src, status, error, time.perf_counter() - t0), dst)
    row.update(_cases_run(out_dir, num))
    if "measured" in row:  # a resume is said in the terminal too, not only in the notebook
        logger.info("%s: %d case(s) measured, %d reused from results.json", src.name, row["measured"], row["reused"])
    return row


def _counts(row: dict) -> str:
    """', 60 measured, 12 reused' for an index row that has the counts (older index rows have none)."""
    return f", {row['measured']} measured, {row['reused']} reused" if "measured" in row else ""


def _files(out_dir: Path) -> str:
    """Every file a reader may want, linked: the report's records, each notebook's pages and run list, text
    findings and comparisons, and the index of each report folder inside it."""
    names = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*")
                   if p.is_file() and (p.name != "index.html" or p.parent != out_dir)
                   and not any(part.startswith(".") for part in p.relative_to(out_dir).parts))
    if not names:
        return "<p>(none yet)</p>"
    return "<ul class='files'>" + "".join(f'<li><a href="{html.escape(n)}">{html.escape(n)}</a></li>'
                                         for n in names) + "</ul>"


def write_index(out_dir: Path, rows: list[dict], meta: dict) -> Path:
    """index.html + index.json: the one-screen answer (banner and answer table from results.json), the evidence per
    subject, the provenance header, every file of the folder, and one row
    per notebook with its run status apart from its finding (PASS / FAIL / n/a). Rows of notebooks not in this run
    (an earlier `--only` run into the same dir) are kept."""
    from . import summary

    prev = out_dir / "index.json"
    if prev.exists():
        try:
            old = json.loads(prev.read_text()).get("notebooks", [])
        except (json.JSONDecodeError, AttributeError):
            old = []
        now = {r["notebook"] for r in rows}
        rows = sorted([r for r in old if r.get("notebook") not in now] + list(rows), key=lambda r: r["notebook"])
    from ..experiments import protocol

    try:
        records = protocol.latest(results.load(out_dir / "results.json"), out_dir)
    except results.ResultsFileError:
        records = []
    for r in rows:
        r["finding"], r["headline"] = _guarded(summary.headline, ("NOT MEASURED", "(its records could not be "
                                               "summarised)"), r["notebook"], records) if r["status"] == "ok" \
            else ("NOT MEASURED", f"the notebook did not finish ({r['status']}): nothing is claimed from it")
    trs = []
    for r in rows:
        ok = r["status"] == "ok"
        links = " · ".join(f'<a href="{html.escape(r[k])}">{label}</a>' for k, label in
                           (("shared_html", "report"), ("html", "with code")) if r.get(k))
        state = "ran" if ok else {"interrupted": "INTERRUPTED", "not run": "not run",
                                  "cluster fault": "CLUSTER FAULT"}.get(r["status"], "FAILED")
        detail = html.escape(r["verdict"] or r["error"] or "")
        trs.append(f"<tr class='{'' if ok else 'run-failed'}'><td>{r['notebook']}</td><td>{html.escape(r['title'])}</td>"
                   f"<td>{state} ({r['seconds']:.0f} s{_counts(r)})</td><td>{summary.status_badge(r['finding'])} "
                   f"{html.escape(r['headline'])}<details><summary>verdict</summary><pre>{detail}</pre></details></td>"
                   f"<td>{links}</td></tr>")
    rows_ = _guarded(summary.answers, [], records)
    title = summary.title(meta.get("profile", ""), records)
    from ..findings import render

    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{summary.CSS}</style></head><body><h1>{html.escape(title)}</h1>
<p>Does a megatron-core MoE layer give other bits across expert-parallel ranks or layouts, where, what fixes it and at
what cost — per subject, from <a href="results.json">results.json</a> (the question:
<a href="{summary.ISSUE}">Megatron-LM #1421</a>). A subject's evidence is a click away.</p>
{summary.render_answers(rows_)}
<h2>Evidence per subject</h2>{render.evidence(rows_) or "<p>(no records yet)</p>"}
<h2>Notebooks</h2><table><tr><th>#</th><th>question</th><th>run</th><th>finding</th><th>HTML</th></tr>
{''.join(trs)}</table>
<h2>Files of this report</h2>{_files(out_dir)}
<h2>Where these numbers come from</h2>{summary.render_provenance(_guarded(summary.provenance, {}, records))}
<p><small>run started {html.escape(str(meta.get('date', '')))}; page generated
{html.escape(summary.generated_after(records))} by moe-lab run, profile {html.escape(str(meta.get('profile')))}
</small></p>
<script>function openHash(){{var d=document.getElementById(location.hash.slice(1));if(d&&d.tagName==='DETAILS')d.open=true;}}
window.addEventListener('hashchange',openHash);openHash();</script></body></html>"""
    p = out_dir / "index.html"
    try:
        p.write_text(page)
        (out_dir / "index.json").write_text(json.dumps({"meta": meta, "notebooks": rows,
                                                       "answers": summary.answers_json(rows_)}, indent=1, default=str))
    except OSError as e:
        _raise_if_write_failed(e, out_dir)
        raise
    return p


def run_all(*, profile: str | None = None, only: str | None = None, overrides: dict | None = None,
            out: str | None = None, timeout: float | None = None, nb_dir: Path = NOTEBOOKS) -> int:
    """Execute the selected notebooks in order; returns 0 if all ran, 1 if any failed. Input is checked first."""
    out_dir = check_out(out)  # '', reports/published/…, a folder of tracked files: one line, nothing started
    profile = profile or default_profile()
    config = profiles.load(profile, overrides)  # parsed once; raises ValueError before anything starts
    chosen = select(only, nb_dir)
    from ..tools import scale_plan, versions

    # Also before any kernel or engine (the preflight builds the cluster's config from the run config's cluster
    # settings, probing the GPUs): GPU count vs engines, a launcher and its options, timeouts, experts vs EP, memory.
    from ..controller.placement import from_settings

    ccfg = from_settings(config.cluster)
    config.layout.on(ccfg.engines).check_layer(config.layer)
    scale_plan.check_memory([config.layer], ccfg, cut=config.run.cut, layout=config.layout)  # ranks that do not fit
    # The releases the chosen notebooks use, installed side by side now if missing (from `wheels` offline): the one
    # install step of a run, before any kernel or engine — the experiments only look releases up.
    versions.prepare(versions.wanted_by(config, [num for num, _ in chosen]), from_dir=config.cluster.wheels)
    # absolute: the kernels run with cwd=notebooks/, so a relative --out would put results.json elsewhere
    if out_dir is None:  # reports/<profile>-<date>: git-ignored (.gitignore keeps only reports/published/)
        out_dir = REPORTS / default_name(profile, ccfg)
        refuse_tracked(out_dir)
    writable_dir(out_dir, "--out")  # create it, or one line saying why not, before anything starts
    results.load(out_dir / "results.json")  # a corrupt file is refused before anything is measured
    from ..experiments.protocol import HEADLESS_ENV

    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ[HEADLESS_ENV] = "1"  # kernels inherit it: no progress bars inside the reports (protocol.progress_bar)
    os.environ["MOE_LAB_RUN_ID"] = f"{os.getpid()}-{time.time():.0f}"  # and the run id (protocol.note_run)
    rows = []
    meta = _meta(profile, config)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    current, t0 = None, time.perf_counter()
    with interrupts.handling(), _run_lock(out_dir), _shared_cluster(config, out_dir, len(chosen)):
        # the bar only once the lock is held: a refused second run prints its one line and nothing else
        it = tqdm(chosen, desc="notebooks", unit="nb") if tqdm else chosen
        try:
            for num, src in it:
                if tqdm:
                    it.set_postfix_str(src.name)
                logger.info("running %s (profile %s) → %s", src.name, profile, out_dir)
                current, t0 = (num, src), time.perf_counter()
                rows.append(run_one(num, src, out_dir, overrides or {}, profile, timeout or 1800))
                current = None
                write_index(out_dir, rows, meta)
        except KeyboardInterrupt as e:
            # Ctrl-C or SIGTERM: papermill has interrupted and killed the running kernel (kernels.RunKernelManager);
            # end any other kernel (one still starting), then keep what was run. The shared cluster stops as the
            # block exits; the CLI ends whatever is left and counts it (interrupts.finish).
            why = str(e) or "Ctrl-C"
            stop_kernels()
            try:
                if current is not None:
                    num, src = current
                    rows.append(_finish_row(_row(num, src, "interrupted", f"KeyboardInterrupt: interrupted ({why})",
                                                 time.perf_counter() - t0), out_dir / src.name))
                done = {r["notebook"] for r in rows}
                rows += [_row(n, s, "not run", "not run: the run was interrupted", 0.0) for n, s in chosen
                         if n not in done]
                write_index(out_dir, rows, meta)
            except Exception as w:  # noqa: BLE001 - the interrupt is what the user sees; the index is best effort
                logger.error("interrupted: the index could not be updated (%s)", w)
            raise
        except ReportWriteError as e:  # the folder stopped taking writes: the notebooks after it could not save
            ok = [r["notebook"] for r in rows if r["status"] == "ok"]
            kept = (f"notebook(s) {', '.join(ok)} finished and their records are kept in {out_dir / 'results.json'}"
                    if ok else f"no notebook had finished; {out_dir / 'results.json'} is as it was")
            raise ReportWriteError(e.path, e.error, kept) from e.__cause__
    failed = [r["file"] for r in rows if r["status"] != "ok"]
    logger.info("report: %s (%d notebooks, %d failed)", out_dir / "index.html", len(rows), len(failed))
    faults = [r for r in rows if r["status"] == "cluster fault"]
    if faults:  # exit 3 with the fault's own line, as `probe` prints it (the notebook's HTML has the rest)
        print(f"moe-lab run: {faults[0]['file']}: {faults[0]['error']}", file=sys.stderr)
        return 3
    return 1 if failed else 0


SHARED_FILE = ".moe_lab-cluster.json"


def _shared_cluster(config, out_dir: Path, n_notebooks: int):
    """One cluster for the run's notebooks (controller.shared) when there are several; MOE_LAB_SHARE_CLUSTER=0
    gives each notebook its own, as a notebook run alone has."""
    import contextlib

    if n_notebooks < 2 or os.environ.get("MOE_LAB_SHARE_CLUSTER") == "0":
        return contextlib.nullcontext()
    from ..controller import shared
    from ..experiments import protocol

    return shared.for_run(protocol.shared_config(config), out_dir / SHARED_FILE)


def _guarded(fn, fallback, *args):
    """The index must render whatever the records hold (a notebook of one's own, an older record layout): a summary
    that cannot read them is logged and left out, never a failed report."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        logger.warning("index: %s could not summarise the records (%s: %s)", fn.__name__, type(e).__name__, e)
        return fallback


def default_name(profile: str, ccfg) -> str:
    """reports/<profile>-<date> on CPU, reports/<profile>-<gpu>x<count>-<date> on GPUs (e.g. gpu-h200x1-2026-12-01)."""
    name = Path(profile).stem if profile not in profiles.PROFILES else profile
    date = datetime.date.today().isoformat()
    if ccfg.device != "cuda":
        return f"{name}-{date}"
    from ..controller.placement import gpu_name

    gpu = re.sub(r"[^a-z0-9]+", "", (gpu_name() or "gpu").lower().replace("nvidia", "")) or "gpu"
    return f"{name}-{gpu}x{ccfg.engines // ccfg.ranks_per_gpu}-{date}"


@contextlib.contextmanager
def _run_lock(out_dir: Path):
    """One run at a time per report directory: a second `moe-lab run` into it refuses in one line instead of
    silently replacing the first run's HTML."""
    import fcntl

    path = out_dir / ".moe_lab-run.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a directory of that name, no permission: the path and why, one line
        raise ValueError(f"{path}: the run lock cannot be opened ({e.strerror or type(e).__name__}); remove it if "
                         "no moe-lab run is writing into this folder, or give another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"another moe-lab run (pid {other}) is writing into {out_dir}: wait for it to finish, "
                             "or give this run another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def stop_kernels() -> list[int]:
    """After an interrupt: every notebook kernel this runner still has (papermill has stopped the one that ran a cell;
    one still starting is left) gets Ctrl-C, so a cell inside `with Cluster(...)` stops its own engines, a moment to
    do it (bounded by the interrupt's budget), then SIGKILL. Returns their pids."""
    import psutil

    kernels = []
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any("ipykernel" in a for a in p.cmdline()):
                kernels.append(p)
    for k in kernels:
        with contextlib.suppress(psutil.Error):
            k.send_signal(signal.SIGINT)
    until = min(time.monotonic() + 3.0, interrupts.deadline() - 3.0)
    for k in kernels:
        interrupts.wait_descendants_gone(k.pid, until)
        with contextlib.suppress(psutil.Error):
            k.kill()
    psutil.wait_procs(kernels, timeout=1.0)
    return [k.pid for k in kernels]


def _meta(profile: str, config) -> dict:
    import platform

    import torch

    from .. import releases

    return {"profile": profile, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "megatron-core (controller)": releases.installed_version(),
            "parameters": json.dumps(config.public())}


AUTOSAVE_SETTINGS = Path("@jupyterlab", "docmanager-extension", "plugin.jupyterlab-settings")
"""JupyterLab's Document Manager settings file, relative to a user settings dir (it holds "autosave")."""


def lab_settings_dir() -> Path:
    """The user settings `moe-lab lab` gives JupyterLab: in the lab's cache (per user, outside the checkout)."""
    from ..release_dirs import cache_dir

    return cache_dir() / "jupyterlab" / "user-settings"


def _settings_json(path: Path) -> dict:
    """A .jupyterlab-settings file as a dict: JSON with `//` comment lines (what the settings editor writes); {} for
    a file that is absent or more than that (JSON5), whose other settings the session then goes without."""
    try:
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("//"))
        data = json.loads(text)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lab_environment(environ, session_dir: Path, user_dir: Path) -> tuple[dict, str]:
    """The environment of a `moe-lab lab` session and the line that says what it did about autosave.

    JupyterLab autosaves every two minutes by default, and the notebooks it opens are the tracked ones: a notebook
    someone only ran would be written with its outputs into git. The session reads its user settings from
    `session_dir` (JUPYTERLAB_SETTINGS_DIR): a copy of `user_dir` (the person's own settings: theme, shortcuts)
    with autosave off, so a notebook changes on disk only when it is saved. A JUPYTERLAB_SETTINGS_DIR set in
    `environ` is the person's choice and is left as it is. The headless runner's signal is dropped: a person watches
    these kernels (widget progress bars)."""
    import shutil

    from ..experiments.protocol import HEADLESS_ENV

    env = {k: v for k, v in environ.items() if k != HEADLESS_ENV}
    own = environ.get("JUPYTERLAB_SETTINGS_DIR")
    if own:
        return env, (f"JupyterLab settings from JUPYTERLAB_SETTINGS_DIR={own}, left as they are: autosave is what "
                     f"they say (with it on, running a notebook writes its outputs into the tracked file; "
                     f'{{"autosave": false}} in {AUTOSAVE_SETTINGS} there turns it off)')
    copied = user_dir.is_dir()
    if copied:
        shutil.copytree(user_dir, session_dir, dirs_exist_ok=True)
    target = session_dir / AUTOSAVE_SETTINGS
    docmanager = _settings_json(target)
    docmanager["autosave"] = False
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(docmanager, indent=2) + "\n")
    env["JUPYTERLAB_SETTINGS_DIR"] = str(session_dir)
    source = f"your settings from {user_dir}" if copied else "JupyterLab's defaults"
    return env, (f"JupyterLab with autosave off: a notebook changes on disk only when you save it (settings: "
                 f"{session_dir}, {source} with autosave off; set JUPYTERLAB_SETTINGS_DIR to use your own as they are)")


def lab_command(port: int | None = None, open_browser: bool = True, extra_args: list[str] | None = None) -> list[str]:
    """JupyterLab on notebooks/, with this Python (which has moe_lab installed) as the kernel."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={NOTEBOOKS}"]
    if port:
        cmd.append(f"--port={port}")
    if not open_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; jupyter refuses it otherwise
    return cmd + list(extra_args or [])


def lab(port: int | None = None, open_browser: bool = True, extra_args: list[str] | None = None) -> int:
    """`moe-lab lab`: JupyterLab on notebooks/ (lab_command) with autosave off (lab_environment)."""
    import subprocess

    from jupyter_core.paths import jupyter_config_dir

    env, note = lab_environment(os.environ, lab_settings_dir(), Path(jupyter_config_dir()) / "lab" / "user-settings")
    logger.info("%s", note)
    return subprocess.call(lab_command(port, open_browser, extra_args), env=env)
