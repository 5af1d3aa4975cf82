"""Headless runner: numbered notebooks → papermill → executed .ipynb + HTML (full and code-hidden) + index +
results.json. Each notebook's HTML, failure banner and what the index reads from it: reporting.notebook_pages."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import html
import json
import logging
import os
import re
import signal
import stat
import sys
import time
from pathlib import Path

from .. import fsio, profiles, switches
from ..controller import interrupts
from ..fsio import ReportWriteError, check_writable, write_failure, writable_dir
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
        raise ValueError(f"--out {str(out)!r} names no folder; leave --out out (reports/<profile>-<date>, "
                         "git-ignored) or give a folder")
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
    try:
        d = results.read_cases(results.cases_path(out_dir, num))
    except results.ResultsFileError as e:  # the notebook's own list, unreadable: its row goes without the counts
        logger.warning("%s", e)
        return {}
    if d is None or d.get("run_id") != os.environ.get("MOE_LAB_RUN_ID"):
        return {}
    return {k: d[k] for k in ("measured", "reused") if isinstance(d.get(k), int)}


QUIET_FILE_S = 0.3
QUIET_FILE_MAX_S = 1.5


def _unwritten_for(path: Path, quiet_s: float = QUIET_FILE_S, most_s: float = QUIET_FILE_MAX_S) -> None:
    """Wait until `path` has not changed for `quiet_s` (at most `most_s`). After its kernel died papermill's client can
    still save the executed notebook from the thread its event loop runs in, after `run_one` has returned: a failure
    marked before that save is lost with it, and the page shows the notebook without the reason it stopped."""
    until = time.monotonic() + most_s
    last = None
    while time.monotonic() < until:
        try:
            st = path.stat()
        except OSError:
            return
        now = (st.st_mtime_ns, st.st_size)
        if now == last:
            return
        last = now
        time.sleep(quiet_s)


def _finish_row(row: dict, dst: Path) -> dict:
    """Title, verdict, error and HTML of an executed (or partly executed) notebook into its index row. An interrupted
    notebook's file can still be saved once more by papermill after its kernel died (`_unwritten_for`): its failure is
    marked and its pages rendered again where that save took the mark away (twice at most)."""
    for _ in range(2 if row["status"] == "interrupted" else 1):
        if not dst.exists():
            return row
        if row["status"] == "interrupted":
            _unwritten_for(dst)
        _mark_and_render(row, dst)
        if row["status"] != "interrupted" or _marked(dst):
            break
    return row


def _marked(dst: Path) -> bool:
    """Whether the executed notebook holds its failure banner (`mark_failure`) after a last quiet spell."""
    import nbformat

    _unwritten_for(dst)
    try:
        nb = nbformat.read(dst, as_version=4)
    except Exception:  # noqa: BLE001 - unreadable now: mark it again
        return False
    return any("moe_lab-failure" in c.get("metadata", {}).get("tags", []) for c in nb.cells)


def _mark_and_render(row: dict, dst: Path) -> None:
    import nbformat

    if row["status"] != "ok":
        try:
            mark_failure(dst, row["error"] or row["status"], replace=row["status"] == "interrupted")
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


def _raise_if_write_failed(e: BaseException, out_dir: Path) -> None:
    """A file under the report folder that could not be written ends the run (ReportWriteError, one line, exit 3):
    the notebooks after it could not save anything either."""
    found = write_failure(e, out_dir)  # an OSError naming a file there, a full disk naming none, a kernel's record
    if found:
        raise ReportWriteError(*found) from e


def run_one(num: str, src: Path, out_dir: Path, params: dict, profile: str, timeout: float, *,
            cell_bar: bool | None = None) -> dict:
    """Execute one notebook (papermill) and render its pages → its index row. `cell_bar`: papermill's bar of cells
    (default: where stderr is a terminal)."""
    import papermill as pm

    dst = out_dir / src.name
    t0 = time.perf_counter()
    status, error = "ok", ""
    kernel: dict = {}  # the kernel's pid and process state as papermill shut it down
    try:
        pm.execute_notebook(str(src), str(dst), parameters=dict(profile=profile, params=params, out_dir=str(out_dir)),
                            cwd=str(src.parent), kernel_name="python3",
                            progress_bar=sys.stderr.isatty() if cell_bar is None else cell_bar,
                            execution_timeout=timeout, log_output=False, request_save_on_cell_execute=True,
                            kernel_manager_class=_kernel_manager(kernel))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a failing notebook still gets its HTML and an index row
        from .kernels import quiet

        if quiet():  # its kernel was ended by the run's interrupt or failure: the main thread says so
            return _row(num, src, "interrupted", "", time.perf_counter() - t0)
        _raise_if_write_failed(e, out_dir)
        status, error = "failed", f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if type(e).__name__ == "DeadKernelError":
            error = "DeadKernelError: the kernel died (killed, out of memory, or a crash in native code)"
        if type(e).__name__ == "CellTimeoutError":  # its text ends in the cell's source between dashes
            error = _timed_out(dst, timeout, kernel)
        elif kernel.get("state"):  # e.g. stopped while it started: "Kernel didn't respond in 60 seconds"
            error = (f"kernel stopped: the notebook's kernel (pid {kernel['pid']}) is {kernel['state']} ({error}); "
                     "the kernel was ended — run the notebook again (finished cases are reused)")
        if getattr(e, "ename", None) == "ClusterError":  # the notebook's cluster failed: said as under probe
            status, error = "cluster fault", f"cluster fault: {getattr(e, 'evalue', '')}"
        logger.error("notebook %s failed: %s", src.name, error)
    executed = time.perf_counter() - t0
    row = _finish_row(_row(num, src, status, error, executed), dst)
    # where a notebook's time goes, in the log: papermill (kernel start, the cells) apart from the HTML pages
    logger.info("%s: executed in %.1f s (kernel start and cells), pages rendered in %.1f s", src.name, executed,
                time.perf_counter() - t0 - executed)
    row.update(_cases_run(out_dir, num))
    if "measured" in row:  # a resume is said in the terminal too, not only in the notebook
        logger.info("%s: %d case(s) measured, %d reused from results.json", src.name, row["measured"], row["reused"])
    return row


def _kernel_manager(noted: dict):
    """papermill's kernel manager for one notebook (kernels.RunKernelManager) that notes, in `noted`, the kernel's
    pid and its process state when it is shut down — after a cell timed out, whether the kernel was stopped."""
    from ..controller.diagnosis import process_state
    from .kernels import RunKernelManager

    class NotingKernelManager(RunKernelManager):
        async def shutdown_kernel(self, now: bool = False, restart: bool = False):
            pid = getattr(self.provisioner, "pid", None)
            if pid:
                noted.update(pid=pid, state=process_state(pid))
            await super().shutdown_kernel(now=now, restart=restart)

    return NotingKernelManager


def _timed_out(dst: Path, timeout: float, kernel: dict) -> str:
    """A cell that timed out, in words: which cell (its number in the executed notebook and first line), after how
    long, and whether the kernel was stopped (SIGSTOP, Ctrl-Z, a debugger) rather than busy."""
    cell = "a cell"
    try:
        import nbformat

        nb = nbformat.read(dst, as_version=4)
        started = [i for i, c in enumerate(nb.cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
        if started:
            i = started[-1]
            line = next((ln.strip() for ln in nb.cells[i].source.splitlines() if ln.strip()), "")
            cell = f"cell {i + 1} of {len(nb.cells)}" + (f" (`{line[:80]}`)" if line else "")
    except Exception as e:  # noqa: BLE001 - the notebook may be partly written; the rest is still said
        logger.debug("%s: the timed-out cell could not be read (%s)", dst, e)
    if kernel.get("state"):
        return (f"kernel stopped: the notebook's kernel (pid {kernel['pid']}) is {kernel['state']}, so {cell} "
                f"timed out after {timeout:g} s; the kernel was ended — run the notebook again (finished cases "
                "are reused)")
    return (f"cell timed out: {cell} ran longer than the notebook timeout ({timeout:g} s, --timeout) and the "
            "kernel was ended; give a longer --timeout (or fewer cases) and run again: finished cases are reused")


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


def _profile_and_sizing_notes(meta: dict) -> str:
    """The profile's own description (what it runs and leaves out) and the run's sizing for this machine
    (`reporting.budget`), in their own words, under the answers."""
    about, words = meta.get("profile_about"), meta.get("sizing")
    overridden = meta.get("overridden")
    out = (f"<p class='sizing'><b>The {html.escape(str(meta.get('profile', '')))} profile</b>"
           f"{' (as written; this run overrides ' + html.escape(', '.join(overridden)) + ')' if overridden else ''}: "
           f"{html.escape(str(about))}</p>") if about else ""
    machine = html.escape(str(meta.get("sizing_for", "CPU")))
    out += f"<p class='sizing'><b>Sized for this {machine}:</b> {html.escape(str(words))}</p>" if words else ""
    if meta.get("whole_notebook_turns"):
        out += (f"<p class='sizing'><b>One notebook's cases at a time:</b> "
                f"{html.escape(str(meta['whole_notebook_turns']))}.</p>")
    elif meta.get("notebooks_at_once", 1) > 1:
        out += ("<p class='sizing'><b>Two notebooks at a time:</b> each notebook's figures and pages were drawn while "
                "the next one's cases ran (the cases took turns on the engines), so the run's seconds below overlap; "
                "a cost measured on a CPU shared its cores with that work (its records say notebooks_at_once = 2; "
                "MOE_LAB_OVERLAP=0 runs one notebook at a time).</p>")
    return out


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
{_profile_and_sizing_notes(meta)}
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
            out: str | None = None, timeout: float | None = None, nb_dir: Path = NOTEBOOKS,
            budget: float | None = None) -> int:
    """Execute the selected notebooks in order; returns 0 if all ran, 1 if any failed. Input is checked first.
    `budget`: the run's seconds on this machine (`reporting.budget`; None: the profile's default, 0: no sizing)."""
    out_dir = check_out(out)  # '', reports/published/…, a folder of tracked files: one line, nothing started
    if budget is not None and not (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                                   and 0 <= budget < float("inf")):
        raise ValueError(f"budget ({budget!r}) must be a number of seconds >= 0 (0: no sizing for this machine)")
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
    from ..experiments.protocol import HEADLESS_ENV

    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ[HEADLESS_ENV] = "1"  # kernels inherit it: no progress bars inside the reports (protocol.progress_bar)
    os.environ["MOE_LAB_RUN_ID"] = f"{os.getpid()}-{time.time():.0f}"  # and the run id (protocol.note_run)
    rows, started = [], time.perf_counter()
    from .kernels import STOPPING

    STOPPING.clear()  # a new run in a long-lived process: no earlier run's stop counts
    meta = _meta(profile, config)
    meta.update(profile_about=config.about, overridden=sorted(overrides or {}))
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    # the files of earlier runs are checked once the lock is held (no other run is rewriting them), before the
    # cluster starts: each item of a `with` is entered before the next one is evaluated
    with interrupts.handling(), _run_lock(out_dir), _checked_out_files(out_dir, chosen), \
            _shared_cluster(config, out_dir, len(chosen)) as cluster:
        if cluster is not None:  # the shared cluster's start, for `moe-lab timing` (reporting.timing)
            meta["cluster_timings"] = {k: round(v, 2) for k, v in cluster.timings.items()
                                       if isinstance(v, (int, float))}
        sizing = _size_for_this_machine(cluster, config, profile, overrides or {}, [n for n, _ in chosen],
                                        budget)
        own_params: dict = {}  # notebook → its parameters, where they are not the run's (`Sizing.kept`)
        if sizing is not None:
            meta["sizing"] = sizing.words()
            meta["sizing_for"] = "GPU" if config.cluster.device == "cuda" else "CPU"
            meta["sizing_numbers"] = dataclasses.asdict(sizing)  # what a later calibration reads (reporting.budget)
            logger.info("sizing: %s", meta["sizing"])
            if sizing.overrides:
                given = dict(overrides or {})
                overrides = {**given, **sizing.overrides}
                config = profiles.load(profile, overrides)
                meta["parameters"] = json.dumps(config.public())  # the index shows the layer that ran
                # a notebook whose question stops at fewer cuts runs its own, bigger layer (the sizing says so)
                own_params = {nb: {**given, **ov} for nb, ov in getattr(sizing, "kept", {}).items()}
        # the bar only once the lock is held: a refused second run prints its one line and nothing else
        shared_gib = _shared_gpu_gib(cluster, config)
        at_once = notebooks_at_once(len(chosen))
        whole = at_once > 1 and whole_notebook_turns(shared_gib)
        meta["notebooks_at_once"] = at_once
        if whole:
            meta["whole_notebook_turns"] = (
                f"the {shared_gib:.0f} GiB GPU the ranks share is under {SHARED_GPU_OVERLAP_MIN_GIB:.0f} GiB, so a "
                f"notebook's layers and state left on the shared ranks until it ends would leave a notebook beside it "
                f"short of memory: each notebook ran its cases once the one before it had ended, and started "
                f"meanwhile (its kernel, set-up and first engines of its own) (MOE_LAB_OVERLAP=1: two notebooks' "
                f"cases take turns; 0: one notebook at a time)")
            logger.info("one notebook's cases at a time: %s", meta["whole_notebook_turns"])
        bar = tqdm(total=len(chosen), desc="notebooks", unit="nb") if tqdm else None
        todo, running = list(chosen), []
        params = overrides or {}
        try:
            with engine_turns(out_dir, at_once, whole=whole):
                while todo or running:
                    while todo and len(running) < at_once:  # at most `at_once`: the next starts as one ends
                        num, src = todo.pop(0)
                        logger.info("running %s (profile %s) → %s", src.name, profile, out_dir)
                        running.append(_Running(num, src, out_dir, own_params.get(num, params), profile,
                                                timeout or 1800, threaded=at_once > 1))
                        if bar is not None:
                            bar.set_postfix_str(" + ".join(r.src.name for r in running))
                    # whichever ends first: a short notebook beside a long one hands its place to the next, whose
                    # kernel starts and waits for the engines' turn instead of for the long one's figures
                    done = _first_done(running)
                    running.remove(done)
                    rows.append(done.result())
                    rows.sort(key=lambda r: r["notebook"])  # the index and its rows stay in notebook order
                    meta["elapsed_s"] = round(time.perf_counter() - started, 1)  # the command's, so far
                    write_index(out_dir, rows, meta)
                    if bar is not None:
                        bar.update(1)
        except KeyboardInterrupt as e:
            # Ctrl-C or SIGTERM: papermill has interrupted and killed the kernel of a notebook run in this thread
            # (kernels.RunKernelManager); every other kernel is ended here (one still starting, one run beside it).
            # Then keep what was run. The shared cluster stops as the block exits; the CLI ends whatever is left
            # and counts it (interrupts.finish).
            why = str(e) or "Ctrl-C"
            stop_kernels()
            try:
                for r in running:
                    rows.append(r.interrupted(f"KeyboardInterrupt: interrupted ({why})"))
                done = {r["notebook"] for r in rows}
                rows += [_row(n, s, "not run", "not run: the run was interrupted", 0.0) for n, s in chosen
                         if n not in done]
                rows.sort(key=lambda r: r["notebook"])
                write_index(out_dir, rows, meta)
            except Exception as w:  # noqa: BLE001 - the interrupt is what the user sees; the index is best effort
                logger.error("interrupted: the index could not be updated (%s)", w)
            raise
        except ReportWriteError as e:  # the folder stopped taking writes: the notebooks after it could not save
            ok = [r["notebook"] for r in rows if r["status"] == "ok"]
            kept = (f"notebook(s) {', '.join(ok)} finished and their records are kept in {out_dir / 'results.json'}"
                    if ok else f"no notebook had finished; {out_dir / 'results.json'} is as it was")
            raise ReportWriteError(e.path, e.error, kept) from e.__cause__
        finally:
            if not interrupts.interrupted():  # a failure stops the run: end what still runs beside it, quietly
                _stop_beside(running)
            if bar is not None:
                bar.close()
    failed = [r["file"] for r in rows if r["status"] != "ok"]
    logger.info("report: %s (%d notebooks, %d failed, %d at a time; %.0f s in all)",
                out_dir / "index.html", len(rows), len(failed), meta.get("notebooks_at_once", 1),
                time.perf_counter() - started)
    faults = [r for r in rows if r["status"] == "cluster fault"]
    if faults:  # exit 3 with the fault's own line, as `probe` prints it (the notebook's HTML has the rest)
        print(f"moe-lab run: {faults[0]['file']}: {faults[0]['error']}", file=sys.stderr)
        return 3
    return 1 if failed else 0


SIZED_KEYS = ("hidden", "num_experts", "topk", "ffn_hidden", "seq_len", "cut", "seq_lens", "model", "scale")
"""Profile keys whose override makes a run's layer another than the one its calibration (`reporting.budget`) was
measured on."""


def _size_for_this_machine(cluster, config, profile: str, overrides: dict, notebooks: list[str],
                           budget: float | None):
    """The run sized for this machine (`reporting.budget`): the cpu profile for this CPU's bf16 GEMM, the gpu profile
    for the transport of ranks sharing one GPU (virtual EP). None where it is not sized: --budget 0, another profile or
    placement (one rank per GPU), a layer other than the calibrated one (a layer key overridden), or no shared cluster
    to measure on (a single notebook: its own cluster starts inside it)."""
    from . import budget as budget_mod

    if budget == 0 or cluster is None:
        return None
    device = config.cluster.device
    virtual_ep = profile == "gpu" and _ranks_share_a_gpu(cluster, config)
    if not (device == "cpu" and profile == "cpu") and not virtual_ep:
        return None
    touched = sorted(k for k in overrides
                     if k.split(".")[-1] in SIZED_KEYS or (virtual_ep and k in budget_mod.VIRTUAL_EP_KEYS))
    if touched:
        logger.info("sizing: not sized (the calibration is the %s profile's layer; %s overridden)", profile,
                    ", ".join(touched))
        return None
    from ..controller import calls

    if virtual_ep:
        plain = config.layer.replace(dispatcher="allgather", router_dtype="none", probs_fp32_gather=False,
                                     deterministic=False)
        world = len(cluster.state.engine_ids)
        per_rank = calls.run(cluster.state, budget_mod.measure_forward_on_engines, plain.asdict(),
                             config.layout.on(world).asdict(), what="timing a plain forward of the profile's layer",
                             timeout=300)
        return budget_mod.size_virtual_ep(max(per_rank) * 1e3, cluster.state.config.ranks_per_gpu,
                                          budget_mod.virtual_ep_work(config), notebooks,
                                          budget_s=budget_mod.GPU_BUDGET_S if budget is None else budget,
                                          transport=(cluster.state.info or [{}])[0].get("transport"))
    from ..questions import BY_NUMBER

    took = calls.call(cluster.state, 0, budget_mod.measure_on_engine, what="timing one bf16 GEMM", timeout=120)
    layer = budget_mod.layer_work(config)
    floors = {nb: (BY_NUMBER[nb].max_cuts, BY_NUMBER[nb].max_cuts_why) for nb in notebooks
              if nb in BY_NUMBER and BY_NUMBER[nb].max_cuts is not None}
    return budget_mod.size(took["bf16_ms"], took["fp32_ms"], layer, notebooks, floors=floors,
                           budget_s=budget_mod.DEFAULT_BUDGET_S if budget is None else budget)


SHARED_FILE = ".moe_lab-cluster.json"
TURN_FILE = ".moe_lab-engines.lock"
OVERLAP_ENV = "MOE_LAB_OVERLAP"


SHARED_GPU_OVERLAP_MIN_GIB = 100.0
"""Two notebooks' cases taking turns on one GPU that a run's ranks share only where the GPU has at least this much
memory: a notebook's cases leave its layers and state on the shared ranks until it ends, so the notebook beside it
builds on top of them. On 80 GB H100s two runs of the gpu profile each lost a notebook to out-of-memory with another
beside it (08 beside 06 with the shared ranks at 13-29 GiB each: reports/published/gpu-h100x1-2026-12-06-shims); on
a 141 GB H200 the whole profile ran two at a time (gpu-h200x1-2026-12-05-whole-profile). Under it a notebook keeps
the engines' turn until it ends (`whole_notebook_turns`)."""


def notebooks_at_once(n_notebooks: int) -> int:
    """Notebooks a run executes at once: `turns.AT_ONCE` (the next one starts while the current one runs) where
    there are several; MOE_LAB_OVERLAP=0, or a single notebook, gives 1. A small shared GPU decides whose cases take
    turns (`whole_notebook_turns`), not how many notebooks run."""
    from ..controller import turns

    if n_notebooks < 2 or switches.forced(OVERLAP_ENV) is False:
        return 1
    return turns.AT_ONCE


def whole_notebook_turns(shared_gpu_gib: float | None) -> bool:
    """Whether a notebook keeps the engines' turn from its first case until it ends (`controller.turns`: the next one
    starts meanwhile and runs its cases after it): where the run's ranks share a GPU with less memory than
    SHARED_GPU_OVERLAP_MIN_GIB (`shared_gpu_gib`: its total), unless MOE_LAB_OVERLAP=1 (cases of two notebooks take
    turns anyway)."""
    return switches.forced(OVERLAP_ENV) is None and shared_gpu_gib is not None \
        and shared_gpu_gib < SHARED_GPU_OVERLAP_MIN_GIB


def _ranks_share_a_gpu(cluster, config) -> bool:
    """Whether the run's shared cluster puts several ranks on one GPU (virtual EP over gloo)."""
    return cluster is not None and config.cluster.device == "cuda" \
        and getattr(cluster.state.config, "ranks_per_gpu", 1) > 1


def _shared_gpu_gib(cluster, config) -> float | None:
    """The memory of the GPU the shared cluster's ranks share (GiB, as its engines' torch reads it; the smallest
    where there are several); None where ranks do not share a GPU, or an engine did not say."""
    if not _ranks_share_a_gpu(cluster, config):
        return None
    sizes = [i.get("gpu_memory_bytes") for i in (cluster.info or [])]
    return min(sizes) / 2**30 if sizes and all(sizes) else None


@contextlib.contextmanager
def engine_turns(out_dir: Path, at_once: int, whole: bool = False):
    """For a run of `at_once` > 1 notebooks: the engines' turn file in the report folder, named to the kernels in
    MOE_LAB_ENGINE_TURN (they inherit it; with `whole`, MOE_LAB_ENGINE_TURN_WHOLE=1 too: each keeps the turn until
    it exits), unnamed and removed afterwards, whatever happened."""
    from ..controller import turns

    if at_once < 2:
        yield
        return
    path = out_dir / TURN_FILE
    os.environ[turns.ENV] = str(path)
    if whole:
        os.environ[turns.WHOLE_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(turns.ENV, None)
        os.environ.pop(turns.WHOLE_ENV, None)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _stop_beside(running: list) -> None:
    """The notebooks still running when the run stops on another one's failure (a report file it could not write):
    their kernels ended (`stop_kernels`, until their threads end, at most 3 s) with their stderr dropped
    (`kernels.STOPPING`), so the run's one line is its last and no kernel is left."""
    from .kernels import STOPPING

    alive = [r for r in running if r.alive()]
    if not alive:
        return
    STOPPING.set()
    until = time.monotonic() + 3.0
    while any(r.alive() for r in alive) and time.monotonic() < until:
        stop_kernels()  # again while a thread lives: a kernel still being launched is a child only once started
        for r in alive:
            r.join(0.2)


def _first_done(running: list["_Running"]) -> "_Running":
    """The first of the running notebooks to end (the only one where they run in the caller's thread). Short
    joins: Ctrl-C reaches the main thread while it waits."""
    while True:
        for r in running:
            if not r.alive():
                return r
        running[0].join(0.2)


class _Running:
    """One notebook of the run: executed by `run_one` in a thread of its own where notebooks run at once (the main
    thread waits for the first to end and takes the signals), else in the caller's thread when its result is asked
    for."""

    def __init__(self, num: str, src: Path, out_dir: Path, params: dict, profile: str, timeout: float, *,
                 threaded: bool):
        import threading

        self.num, self.src, self.out_dir = num, src, out_dir
        self._args = (num, src, out_dir, params, profile, timeout)
        self.t0 = time.perf_counter()
        self._row: dict | None = None
        self._error: BaseException | None = None
        self._thread = None
        if threaded:  # a daemon: an interrupted run never waits at exit for a thread its kernel's end left behind
            self._thread = threading.Thread(target=self._work, name=f"notebook-{num}", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            self._row = run_one(*self._args, cell_bar=False if self._thread is not None else None)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by result()
            self._error = e

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def result(self) -> dict:
        """Its index row once it has run (what run_one raised, raised here)."""
        if self._thread is None:
            self.t0 = time.perf_counter()
            self._work()
        else:
            while self.alive():
                self.join(0.2)  # short joins: Ctrl-C reaches the main thread while it waits
        if self._error is not None:
            raise self._error
        return self._row

    def interrupted(self, why: str) -> dict:
        """Its row after an interrupt: 'interrupted', with its title, pages and what its notebook holds where its
        thread has ended (bounded by the interrupt's budget: its kernel was ended by `stop_kernels`)."""
        if self._thread is not None:
            self.join(max(0.0, min(3.0, interrupts.deadline() - 4.0 - time.monotonic())))
            if self._row is not None and self._row["status"] == "ok":  # it had finished before the signal
                return self._row
            if self.alive():  # still writing its notebook: the row without what the file holds
                return _row(self.num, self.src, "interrupted", why, time.perf_counter() - self.t0)
        return _finish_row(_row(self.num, self.src, "interrupted", why, time.perf_counter() - self.t0),
                           self.out_dir / self.src.name)


def _shared_cluster(config, out_dir: Path, n_notebooks: int):
    """One cluster for the run's notebooks (controller.shared) when there are several; MOE_LAB_SHARE_CLUSTER=0
    gives each notebook its own, as a notebook run alone has."""
    import contextlib

    if n_notebooks < 2 or switches.forced("MOE_LAB_SHARE_CLUSTER") is False:
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


RUN_HOLDER = ".moe_lab-run.json"
"""Who holds a report folder's run lock (pid and command), for the line a second run prints; only a note: the lock
is the folder's own (`_run_lock`)."""


@contextlib.contextmanager
def _run_lock(out_dir: Path):
    """One run at a time per report folder: an exclusive flock on the folder itself, held for the whole run. The
    operating system ends it with the process (exit, crash, SIGKILL), so there is no lock file to remove by hand, and
    removing files in the folder does not release it. A second `moe-lab run` into the folder refuses in one line
    naming the holder's pid and command. (results.append locks a file of its own beside results.json, so the
    notebooks' appends go on under this lock.)"""
    import fcntl

    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ValueError(f"--out ({out_dir}) cannot be opened to lock it for this run "
                         f"({e.strerror or type(e).__name__}); give another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another moe-lab run ({_holder(out_dir)}) is writing into {out_dir}: wait for it to "
                             "finish (its lock ends with it), or give this run another --out") from None
        note = out_dir / RUN_HOLDER
        try:
            fsio.write_atomic(note, json.dumps({"pid": os.getpid(), "command": _command(os.getpid())}))
        except OSError as e:  # the note only names the holder; /proc/locks names its pid anyway
            logger.debug("%s: not written (%s)", note, e)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(note)
    finally:
        os.close(fd)  # closing releases the lock


def _holder(out_dir: Path) -> str:
    """'pid N: COMMAND' of the process holding `out_dir`'s run lock: its pid from the kernel's lock table
    (/proc/locks), else from the holder's note; its command line from the process, else from the note."""
    pid = _flock_holder(out_dir)
    try:
        note = json.loads(fsio.read_regular(out_dir / RUN_HOLDER))
        note = note if isinstance(note, dict) else {}
    except (OSError, ValueError):
        note = {}
    if pid is None and isinstance(note.get("pid"), int):
        pid = note["pid"]
    if pid is None:
        return "pid unknown"
    command = _command(pid) or (note.get("command") if note.get("pid") == pid else "") or "command unknown"
    return f"pid {pid}: {command}"


def _flock_holder(folder: Path) -> int | None:
    """The pid holding a flock on `folder` (Linux: /proc/locks lists `FLOCK ... WRITE pid major:minor:inode`), or
    None where that cannot be read."""
    try:
        st = os.stat(folder)
        table = fsio.read_regular("/proc/locks").decode(errors="replace")
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    by_inode = []
    for line in table.splitlines():
        f = line.split()
        if len(f) < 6 or f[1] != "FLOCK" or not f[4].isdigit():  # '->' marks a waiter, not a holder
            continue
        if f[5] == dev:
            return int(f[4])
        if f[5].rsplit(":", 1)[-1] == str(st.st_ino):  # an overlay may show another device number
            by_inode.append(int(f[4]))
    return by_inode[0] if len(by_inode) == 1 else None


def _command(pid: int) -> str:
    """The command line of `pid` on one line (`python -c` code spans several), shortened to 200 characters ('' when
    it cannot be read)."""
    import psutil

    try:
        cmd = " ".join(" ".join(psutil.Process(pid).cmdline()).split())
    except psutil.Error:
        return ""
    return cmd if len(cmd) <= 200 else cmd[:197] + "..."


def _checked_out_files(out_dir: Path, chosen: list[tuple[str, Path]]):
    """Every file of an earlier run in `out_dir` that this run reads or rewrites, checked before anything starts:
    results.json and every run list (cases-NN.json) as their readers take them, index.json as the index keeps its
    rows, and no file the run writes is a FIFO, socket or device (a write to a FIFO waits for a reader). A problem is
    one line naming the file, what is wrong and what to do (results.ResultsFileError or ValueError: exit 2). Returns
    a no-op context for run_all's `with`."""
    records = results.load(out_dir / "results.json")  # a case measured twice is said (once) as it is read
    results.say_unreadable(out_dir / "results.json", records)  # and records no finding reads
    for p in sorted(out_dir.glob("cases-*.json")):
        results.read_cases(p)
    _check_index(out_dir / "index.json")
    written = {"results.json", "index.json", "index.html"} | {f"cases-{num}.json" for num, _ in chosen} | {
        src.stem + suffix for _, src in chosen for suffix in (".ipynb", ".html", ".shared.html")}
    for name in sorted(written):
        p = out_dir / name
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a directory fails its write in one line, mid-run
            raise ValueError(f"{p} is {_kind(mode)}, where this run writes a file (writing it would wait, or go "
                             "nowhere); move it away, or give another --out")
    return contextlib.nullcontext()


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


INDEX_ROW = {"notebook": str, "status": str, "title": str, "error": str, "verdict": str, "seconds": (int, float)}
"""The fields of an index.json row (`_row`) the index reads when it keeps the rows of notebooks not in a run."""


def _check_index(p: Path) -> None:
    """index.json of an earlier run, as write_index keeps its rows: a JSON object whose "notebooks" is a list of
    rows with INDEX_ROW's fields. ValueError in one line naming the file and what to do otherwise."""
    if not (p.exists() or p.is_symlink()):
        return
    d, what = fsio.read_json(p)
    if what is None:
        if not isinstance(d, dict):
            what = f"must hold a JSON object, found {type(d).__name__}"
        elif not isinstance(d.get("notebooks", []), list):
            what = f"must hold its rows as a list under \"notebooks\", found {type(d['notebooks']).__name__}"
        else:
            for i, r in enumerate(d.get("notebooks", [])):
                bad = [k for k, t in INDEX_ROW.items() if not isinstance(r, dict) or not isinstance(r.get(k), t)
                       or isinstance(r.get(k), bool)]
                if bad:
                    what = (f"row {i} is not an index row ({type(r).__name__})" if not isinstance(r, dict) else
                            f"row {i} lacks {', '.join(bad)} (or has another type there)")
                    break
    if what is not None:
        raise ValueError(f"{p} {what}: it is not the index moe-lab writes; move it away or delete it (this run "
                         "writes a new one, without the rows of notebooks it does not run)")


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
    from .kernels import remove_socket_folders

    remove_socket_folders()  # the killed kernels' Unix sockets; jupyter_client cleans up only kernels it shut down
    return [k.pid for k in kernels]


def _meta(profile: str, config) -> dict:
    import importlib.metadata
    import platform

    from .. import releases

    try:  # the installed distribution's version: importing torch here would cost the run 1.5 s for one string
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch without metadata (built from source on a node)
        import torch

        torch_version = str(torch.__version__)
    return {"profile": profile, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "torch": torch_version,
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
