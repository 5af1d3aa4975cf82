"""`moe-lab`: parse, check, call, exit code — the one error contract of every command:

- bad input (a value, a file, a profile, an unwritable --out): one line on stderr, exit 2, before any engine starts;
- a cluster fault (an engine died, a collective failed or hung, a call timed out): one line naming the rank, engine,
  pid, what it was doing and the signal or exit code, exit 3 — the traceback only with --debug, and in the log file;
- pip or a release failing (`versions install` with no index reachable, a release that does not import): one line,
  exit 3, the traceback in the log file;
- a report folder that cannot be written any more mid-run: one line naming the file, exit 3, every finished record
  kept;
- Ctrl-C, SIGTERM or SIGHUP: every process the command started is stopped within 10 s (controller.interrupts), then
  one line with how many, exit 128 + the signal (Ctrl-C 130, SIGTERM 143, SIGHUP 129); no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from .. import bytecode, switches
from .argtypes import notebooks as _notebooks, nonempty as _nonempty, number as _number, whole_seconds as _whole_seconds
from .options import add_launcher_arguments, kv as _kv, launcher_kwargs

logger = logging.getLogger("moe_lab")
EXIT_INPUT, EXIT_FAULT = 2, 3


class Parser(argparse.ArgumentParser):
    """argparse with the contract's one-line errors (argparse prints the usage too; `-h` still shows it)."""

    def error(self, message: str):
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


class _Version(argparse.Action):
    """`moe-lab --version`: the package version and the commit (and whether moe_lab/ has local changes)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print version and commit")

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import provenance

        v = provenance.code_version()
        dirty = " (moe_lab/ has local changes)" if v.get("dirty") else ""
        print(f"moe-lab {v['moe_lab']} commit {v.get('commit') or 'unknown'} source {v['source_sha']}{dirty}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="moe-lab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=_Version)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ap.add_argument("--debug", action="store_true", help="debug logging, and full tracebacks on errors")
    ap.add_argument("--log", default=None, help="where an error's traceback goes (default ~/.cache/moe_lab/error.log)")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    from . import probe

    p = sub.add_parser("probe", help="one-line check of EP divergence on this machine: one JSON object per config")
    probe.add_arguments(p)

    r = sub.add_parser("run", help="execute the numbered notebooks with papermill and render HTML reports")
    r.add_argument("--profile", type=_nonempty("--profile"), default=None, help="cpu | gpu | path to a JSON profile (default: gpu if a GPU is visible)")
    r.add_argument("--only", type=_notebooks, default=None, help="comma list of notebook numbers, e.g. 01,03")
    r.add_argument("-p", dest="params", type=_kv, action="append", default=[], help="override a parameter: key=value or section.field=value (e.g. training.steps=5, layer.seq_len=256, run.trials=2)")
    r.add_argument("--out", default=None, help="output dir (default reports/<profile>-<date>, git-ignored; never reports/published/ "
                   "or a folder of files git tracks)")
    r.add_argument("--timeout", type=_whole_seconds, default=None, help="seconds per notebook (default 1800; whole "
                   "seconds, a fraction is rounded up)")
    r.add_argument("--budget", type=_number("--budget", least=0, most=7 * 86400), default=None,
                   help="seconds the run may take: the cpu profile on this CPU (default 300; the run times one bf16 "
                   "GEMM), the gpu profile where its ranks share one GPU (default 600; the run times a plain "
                   "forward); where the prediction is over it the run does less work, said in the report; 0: the "
                   "profile's work whatever it takes")
    add_launcher_arguments(r)

    lab = sub.add_parser("lab", help="open JupyterLab on notebooks/ with the lab's kernel")
    lab.add_argument("--port", type=int, default=None)
    lab.add_argument("--no-browser", action="store_true")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="passed on to jupyter lab (after --)")

    v = sub.add_parser("versions", help="megatron-core releases side by side")
    vs = v.add_subparsers(dest="vcmd", required=True)
    vi = vs.add_parser("install", help="install a release into the lab's cache (no deps)")
    vi.add_argument("version")
    vi.add_argument("--from", dest="from_dir", default=None, help="offline: a dir with its wheel or sdist")
    vi.add_argument("--force", action="store_true")
    vs.add_parser("list", help="releases installed side by side")

    w = sub.add_parser("wheelhouse", help="gather the wheels an air-gapped GPU node needs (all but torch)")
    w.add_argument("-o", "--out", required=True)
    w.add_argument("--python", default="3.12")
    w.add_argument("--platform", default="manylinux_2_28_x86_64")
    w.add_argument("--megatron", default="0.16.1", help="comma list of megatron-core releases")
    w.add_argument("--jupyterlab", action="store_true", help="also JupyterLab (interactive nodes)")

    cmp = sub.add_parser("compare", help="hold one report's findings against another's, case by case (e.g. one rank "
                                         "per GPU over NCCL vs the same EP as virtual EP on one GPU, or two days): "
                                         "verdicts, magnitudes, what differs, cases held by one side only")
    cmp.add_argument("a", help="report folder A (or its results.json)")
    cmp.add_argument("b", help="report folder B (or its results.json)")
    cmp.add_argument("--factor", type=float, default=2.0, help="magnitudes agree within this factor (a finite "
                                                               "number above 1; default 2)")
    cmp.add_argument("--allow-unlike", action="store_true", help="compare cases across another release, layer or "
                     "numerics environment too (refused otherwise), each row marked")
    cmp.add_argument("--html", default=None, metavar="PATH", help="also write the comparison as a self-contained "
                                                                  "HTML page to PATH")

    fnd = sub.add_parser("findings", help="the findings of a report folder from its results.json alone (no engines, "
                                          "no torch): status, claim and evidence per finding")
    fnd.add_argument("report", nargs="*", help="report folder(s) (or their results.json)")
    fmt = fnd.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="every finding as JSON (one object per report)")
    fmt.add_argument("--markdown", action="store_true", help="the card findings as markdown")
    fmt.add_argument("--published", action="store_true", help="rewrite reports/published/FINDINGS.md from the "
                                                            "published reports' records")

    tim = sub.add_parser("timing", help="where a report's time went, from its folder alone: per notebook papermill's "
                                        "phases, the cases' own seconds by experiment and kind, the cluster's start")
    tim.add_argument("report", help="report folder (`moe-lab run --out`)")

    from . import bench

    b = sub.add_parser("bench", help="the warm lab against one fresh spawn per config: ready time, sweep, capture "
                                     "overhead, bytes compared, peak memory (table + JSON)")
    bench.add_arguments(b)

    from . import scale

    sc = sub.add_parser("scale", help="per-GPU memory and compute of one MoE layer forward at each EP, by explicit "
                                      "calculation (--measure: against the real layer on engines)")
    scale.add_arguments(sc)

    from . import preflight

    from . import oracle

    orc = sub.add_parser("oracle", help="is this gap expected: each layout's bf16 output against an fp64 truth of the "
                                        "same weights and tokens, with planted faults as controls (notebook 08)")
    oracle.add_arguments(orc)

    pf = sub.add_parser("preflight", help="what a model preset on a layout will run, what is left out, memory per "
                                          "rank and GPU (no engines); a layout the layer cannot take is exit 2")
    preflight.add_arguments(pf)
    return ap


def cmd_probe(a) -> int:
    from . import probe

    return probe.cmd(a)


def cmd_run(a) -> int:
    from ..reporting import runner

    overrides = dict(a.params)
    overrides.update(launcher_kwargs(a))
    profile = check_run(a, overrides)
    return runner.run_all(profile=profile, only=a.only, overrides=overrides, out=a.out, timeout=a.timeout,
                          budget=a.budget)


def check_run(a, overrides: dict) -> str:
    """Everything `moe-lab run` is given, checked at once before any kernel or engine starts (a ValueError, one line,
    exit 2): --out, the profile file, every key of every question's parameters with the -p overrides, --only, the
    cluster the run will start (engines against the machine, the launcher and its options) and what each chosen
    question's parameters need of it (`RunConfig.check_world`), and the memory of CPU engines. Paths are handed on
    absolute (the kernels run in notebooks/): the profile's is returned, a relative `wheels` is made absolute in
    `overrides`."""
    from .. import profiles
    from ..controller.placement import from_settings
    from ..tools import preflight
    from ..reporting import runner

    runner.check_out(a.out)
    profile = profiles.locate(a.profile) if a.profile is not None else runner.default_profile()
    for key in ("wheels", "cluster.wheels"):
        if isinstance(overrides.get(key), str) and overrides[key].strip():
            overrides[key] = str(Path(overrides[key]).expanduser().resolve())
    config = profiles.load(profile, overrides)
    wheels = config.cluster.wheels
    if wheels is not None and not Path(wheels).expanduser().is_dir():
        raise ValueError(f"wheels ({wheels!r}) is not a folder: give the folder `moe-lab wheelhouse -o DIR` made, or "
                         "leave wheels out (releases then come from the package index)")
    chosen = [num for num, _ in runner.select(a.only)]
    ccfg = from_settings(config.cluster)
    config.check_world(ccfg, chosen)
    preflight.check_host_memory([config.layer], ccfg, cut=config.run.cut, layout=config.layout)
    return profile


def cmd_lab(a) -> int:
    from ..reporting import runner

    extra = [x for x in a.jupyter_args if x != "--"]
    return runner.lab(port=a.port, open_browser=not a.no_browser, extra_args=extra)


def cmd_versions(a) -> int:
    from .. import release_dirs
    from ..tools import versions

    if a.vcmd == "install":
        path = versions.install(a.version, from_dir=a.from_dir, force=a.force)
        print(path)
    else:
        try:
            rows = release_dirs.list_installed()
        except OSError as e:  # a cache folder that cannot be listed: its path and why, one line
            raise ValueError(f"the release cache {e.filename or release_dirs.cache_dir()} cannot be read "
                             f"({e.strerror or type(e).__name__}); fix it, or set MOE_LAB_CACHE to another "
                             "folder") from None
        if not rows:
            print("no megatron-core releases installed side by side; `moe-lab versions install X.Y.Z`")
        for row in rows:
            print(f"{row['version']:10s} python {row['python']:5s} {row['path']}")
    return 0


def cmd_wheelhouse(a) -> int:
    from ..fsio import writable_dir
    from ..tools import wheelhouse

    from ..tools.errors import InstallError

    mvs = tuple(v.strip() for v in a.megatron.split(",") if v.strip())
    if not mvs:
        raise ValueError(f"--megatron {a.megatron!r} names no release; give one or more, e.g. --megatron 0.16.1,0.12.3")
    writable_dir(a.out, "-o")  # a path under a file or in /proc: one line before anything is downloaded
    try:
        wheels = wheelhouse.build(a.out, python=a.python, platform=a.platform, megatron_versions=mvs,
                                  jupyterlab=a.jupyterlab)
    except OSError as e:  # the folder filled up or went away mid-way: what was being done, where, one line (exit 3)
        raise InstallError(f"gathering wheels into {a.out}: {e.strerror or type(e).__name__}"
                           + (f" ({e.filename})" if e.filename else "") + "; free space or give another -o, and "
                           "run again") from e
    print(f"{len(wheels)} wheels in {a.out}")
    print("install on the node with:\n  " + wheelhouse.install_command(a.out))
    return 0


def cmd_compare(a) -> int:
    from ..reporting import compare

    factor = compare.check_factor(a.factor)  # before either report is read
    html_path = Path(a.html) if a.html else None
    if html_path is not None and not html_path.parent.is_dir():
        raise ValueError(f"--html {a.html}: its folder {html_path.parent} does not exist; give a path in an existing "
                         "folder")
    (fa, ra), (fb, rb) = compare.load(a.a), compare.load(a.b)
    result = compare.compare(ra, rb, factor=factor, allow_unlike=a.allow_unlike, where=(str(fa), str(fb)))
    print(compare.text(result))
    if html_path is not None:
        try:
            html_path.write_text(compare.page(result))
        except OSError as e:
            raise ValueError(f"--html {a.html}: cannot be written ({e.strerror or e}); give another path") from None
        print(f"HTML page: {html_path}")
    return 0


def load_report(p: str) -> tuple[Path, list[dict]]:
    """A report folder (or its results.json, or results.json.xz) → (folder, the records its notebooks' latest runs
    showed). A file there that is not a report's — not a regular file (a FIFO is refused, never waited on), not
    UTF-8, malformed JSON, a record or run list (cases-NN.json) of a shape moe-lab does not write — is one
    ResultsFileError naming it (exit 2)."""
    from .. import results

    path = Path(p)
    path = path / "results.json" if path.is_dir() else path
    if path.name.endswith(".xz"):
        path = path.with_name(path.name[: -len(".xz")])
    if not (path.exists() or path.is_symlink()) and not path.with_name(path.name + ".xz").is_file():
        raise ValueError(f"{p}: no results.json there (give a report folder, e.g. reports/published/gpu-h200x1-2026-12-01)")
    records = results.load(path)
    results.say_unreadable(path, records)  # records of another layout read as NOT MEASURED: said once
    return path.parent, results.latest(records, path.parent)


def cmd_findings(a) -> int:
    from ..reporting import published

    if a.published:
        root = Path(__file__).resolve().parents[2]
        changed = published.update(root / published.FILE, root)
        print(f"{published.FILE} {'rewritten' if changed else 'already matches the published reports'}")
        redone = [p for p in published.pages(root) if published.refresh_page(p)]
        print(f"published pages: {len(redone)} re-worded from the current findings"
              + (f" ({', '.join(str(p.relative_to(root)) for p in redone)})" if redone else ""))
        changed = published.update_readme_table(root / "README.md")
        print(f"README.md question table {'rewritten' if changed else 'already matches the registry'}")
        return 0
    if not a.report:
        raise ValueError("give a report folder (e.g. reports/published/gpu-h200x1-2026-12-01), or --published")
    out = []
    for p in a.report:
        folder, records = load_report(p)
        try:
            out.append(_findings_of(a, folder, records))
        except Exception as e:  # noqa: BLE001 - a record no finding can take: the file and why, one line (exit 2)
            if isinstance(e, ValueError) and str(folder) in str(e):
                raise
            raise ValueError(f"{folder / 'results.json'}: its records cannot be read into findings "
                             f"({type(e).__name__}: {str(e)[:200]}); a record holds a field of a shape moe-lab does "
                             "not write — was the file edited by hand? (--debug shows where)") from e
    print(json.dumps(out if len(out) > 1 else out[0], indent=1, default=str) if a.json else "\n\n".join(out))
    return 0


def cmd_timing(a) -> int:
    from ..reporting import timing

    print(timing.markdown(a.report))
    return 0


def _findings_of(a, folder: Path, records: list[dict]):
    """One report's findings as `moe-lab findings` prints them: a JSON object (--json), markdown, or text."""
    from .. import questions
    from ..findings import render

    by_nb = questions.findings(records)
    if a.json:
        return {"report": str(folder), "records": len(records),
                "findings": {nb: [f.to_dict() for f in fs] for nb, fs in by_nb.items()},
                "headlines": {nb: render.headline(fs) for nb, fs in by_nb.items()}}
    if a.markdown:
        return render.markdown(folder.name, by_nb)
    from ..reporting import summary

    return (f"# {folder} ({len(records)} records)\n\n## The answer, per subject\n"
            + render.answers_text(summary.answers(records)) + "\n\n## Per question\n"
            + render.terminal(by_nb, {q.number: q.name for q in questions.QUESTIONS}))


def cmd_bench(a) -> int:
    from . import bench

    return bench.cmd(a)


def cmd_preflight(a) -> int:
    from . import preflight

    return preflight.cmd(a)


def cmd_oracle(a) -> int:
    from . import oracle

    return oracle.cmd(a)


def cmd_scale(a) -> int:
    from . import scale

    return scale.cmd(a)


def _log_path(a) -> Path:
    return Path(a.log or os.environ.get("MOE_LAB_LOG") or Path.home() / ".cache" / "moe_lab" / "error.log")


def _write_traceback(a, exc: BaseException) -> str:
    """The full traceback into the log file (appended, timestamped); returns where, or '' if it cannot be written."""
    import datetime
    import traceback

    p = _log_path(a)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as f:
            f.write(f"--- {datetime.datetime.now().isoformat(timespec='seconds')} moe-lab {a.cmd}\n")
            f.write("".join(traceback.format_exception(exc)))
        return str(p)
    except OSError:
        return ""


def _print_traceback(exc: BaseException) -> None:
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()


def main(argv=None) -> int:
    from ..controller import interrupts

    ap = build_parser()
    a = ap.parse_args(argv)  # a bad flag: one line, SystemExit(2) (argparse's exit, like -h and --version)
    # jupyter lab asks on Ctrl-C itself; every other command handles SIGINT/SIGTERM/SIGHUP for as long as it runs and
    # gives the caller its own handlers back (an in-process caller — a test, a notebook — is not left with ours)
    with interrupts.handling() if a.cmd != "lab" else contextlib.nullcontext():
        return _main(a)


def _main(a) -> int:
    from ..controller.diagnosis import ClusterError
    from ..results import ResultsFileError
    from ..tools.errors import InstallError

    from ..controller import interrupts
    from ..fsio import ReportWriteError

    debug = a.debug or a.verbose
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("megatron").setLevel(logging.DEBUG if debug else logging.WARNING)
    handler = {"probe": cmd_probe, "run": cmd_run, "lab": cmd_lab, "versions": cmd_versions,
               "wheelhouse": cmd_wheelhouse, "bench": cmd_bench, "scale": cmd_scale, "compare": cmd_compare,
               "findings": cmd_findings, "preflight": cmd_preflight, "oracle": cmd_oracle,
               "timing": cmd_timing}[a.cmd]
    try:
        switches.check()  # an on/off switch set to something else: refused before anything starts
        bytecode.use_for_started_processes()  # before the command starts a kernel, controller or engine
        return handler(a)
    except (ValueError, ResultsFileError) as e:  # bad input: one line, exit 2, nothing launched
        if a.debug:  # the traceback too; the exit code stays the contract's
            _print_traceback(e)
        print(f"moe-lab {a.cmd}: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except InstallError as e:  # pip or a release failed (no index, a timeout): one line, exit 3, traceback logged
        where = _write_traceback(a, e)
        if a.debug:
            _print_traceback(e)
        print(f"moe-lab {a.cmd}: failed: {e}" + (f" (traceback: {where})" if where else ""), file=sys.stderr)
        return EXIT_FAULT
    except ClusterError as e:  # a cluster fault: one line naming the rank and what happened; the traceback is logged
        where = _write_traceback(a, e)
        if a.debug:
            _print_traceback(e)
        print(f"moe-lab {a.cmd}: cluster fault: {e}" + (f" (traceback: {where})" if where else ""), file=sys.stderr)
        return EXIT_FAULT
    except ReportWriteError as e:  # the report folder stopped taking writes mid-run: one line, exit 3
        where = _write_traceback(a, e)
        print(f"moe-lab {a.cmd}: failed: {e}" + (f" (traceback: {where})" if where else ""), file=sys.stderr)
        return EXIT_FAULT
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: everything this process started is ended, then one line
        stopped, left, took = interrupts.finish()
        why = interrupts.interrupted() or "SIGINT"
        tail = "none left running" if not left else f"{len(left)} could not be stopped (pids {left})"
        print(f"moe-lab {a.cmd}: interrupted ({'Ctrl-C' if why == 'SIGINT' else why}); stopped {stopped} "
              f"process(es) in {took:.1f} s, {tail}", file=sys.stderr)
        sys.stderr.flush()
        logging.disable(logging.CRITICAL)  # library atexit hooks (torch's cache stats) after the last line: none
        # ipyparallel's sync wrappers cut off mid-start leave a coroutine that Python warns about when it is collected
        # (`Cluster.connect_client was never awaited`): nothing is lost — the engines were ended above —, so no line
        warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
        return interrupts.exit_code()

