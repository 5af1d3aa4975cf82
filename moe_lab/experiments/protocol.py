"""The one experiment protocol: cases from parameters → one engine-side function → tidy records → a verdict
computed from records; and the one runner that streams records to results.json and resumes by ONE key.

An experiment is a module of `moe_lab.experiments` with
    NAME, NOTEBOOK                     its name in records, and the notebook it answers ('' for none)
    cases(params) -> list[Case]        what to measure, from profile parameters (checked before anything starts)
    on_engine(payload) -> dict         runs on every rank at once (payload = Case.payload(world)), returns small dicts
    records(case, per_rank) -> list    rank 0's and every rank's results → tidy records (one or more per case)
    verdict(records) -> str            the finding, computed from the records alone
`run(experiment, params)` does the rest: checks, cluster (started, or engines restarted for another megatron-core
release), progress, streaming, resume, and the environment and provenance stamped on every record.

The key of a case covers the whole measurement: the experiment and case kind, the layer config (shape, seq_len,
seed, dtypes, dispatcher, ...), its layout on the world, cut and the experiment's knobs, the megatron-core release,
device, world, placement (ranks per GPU, backend), the GPU, the environment switches the engines start with, and the lab's own
source hash: a record is reused only for exactly that measurement, never for another parameter.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from ..config import ClusterConfig, MoEConfig, check_cut
from ..controller import turns
from ..controller.engine_sets import EngineSets
from ..layout import WORLD, Layout, state_major
from .. import fsio, results as results_file
from ..records import HEADER_OVERLAPS, Header, as_json, compose, stamp as schema_stamp
from ..results import latest  # noqa: F401 - the records a notebook's latest run showed

logger = logging.getLogger(__name__)

INSTALLED = "installed"  # the megatron-core release the controller's Python imports
# Environment fields of a record (from the engines' description) that take part in the key. The rest (torch,
# python, host, library versions) is provenance: recorded, but a rerun on the same machine shares it anyway.
ENV_KEY = ("device", "world", "backend", "ranks_per_gpu", "gpu", "megatron_core")
# Of the records' environment, what is reported once per record (rank 0's description, minus per-rank fields)
_PER_RANK = ("rank", "pid", "local_rank", "ep_rank", "gpu_index", "host", "megatron_path")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One measurement: the layer and input (`moe`), the truncation cut, and the experiment's own knobs."""

    experiment: str
    """Module name of the experiment in moe_lab.experiments (its NAME)."""
    moe: MoEConfig
    cut: int = 90
    kind: str = "case"
    """An experiment's kinds of case (notebook 04: routing | kernel | case)."""
    knobs: dict = field(default_factory=dict, hash=False)
    """Experiment-specific settings, JSON values (e.g. remedy, emulation, tile, variant, trials, detail)."""
    release: str = INSTALLED
    """The megatron-core release the engines must import ('installed' or X.Y.Z; `moe-lab versions`)."""
    deterministic_env: bool = False
    """Engines started with NCCL_ALGO=Ring and CUBLAS_WORKSPACE_CONFIG=:4096:8 (read at process start on GPUs)."""
    engine_env: tuple[tuple[str, str], ...] = ()
    """More environment variables the engines must start with (e.g. CUBLAS_WORKSPACE_CONFIG, read once per process)."""
    label: str = ""
    layout: Layout = WORLD
    """How the layer is split over the world (tp, ep, etp, sequence parallel; the rest data parallel) — the one
    place a case's layout lives. The default, `WORLD`, splits the experts over every rank (EP = world)."""

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise ValueError(f"case {self.label or self.kind!r}: layout ({self.layout!r}) must be a moe_lab.layout."
                             "Layout, e.g. Layout.parse('tp2,ep2')")

    def payload(self, world: int) -> dict:
        """What the engines of a `world`-rank cluster get: plain data (pickled by value), no objects; the layout
        resolved on that world."""
        return {"moe": self.moe.asdict(), "layout": self.layout.on(world).asdict(), "cut": self.cut,
                "kind": self.kind, "knobs": dict(self.knobs)}

    def fields(self) -> dict:
        """The record fields that say which case this is (flattened for tidy DataFrames)."""
        m = self.moe
        return {"experiment": self.experiment, "kind": self.kind, "config": m.asdict(), "cut": self.cut,
                "dispatcher": m.dispatcher, "router_dtype": m.router_dtype, "deterministic": m.deterministic,
                "probs_fp32_gather": m.probs_fp32_gather, "knobs": dict(self.knobs),
                **{k: v for k, v in self.knobs.items() if v is None or isinstance(v, (str, int, float, bool))}}


def layout_fields(case: Case, world) -> dict:
    """The case's own layout on every record (not the one the cluster started with), resolved on `world`: tp, ep,
    etp, sequence parallel and the layout in words."""
    if not isinstance(world, int):
        return case.layout.fields() if case.layout.resolved else {}
    return case.layout.on(world).fields()


def check_case(cfg: MoEConfig, layout: Layout, world: int, megatron_version: str, cut: int) -> None:
    """Everything about a case that can be wrong before an engine runs it: raise ValueError naming it."""
    from .. import releases

    layout.on(world).check_layer(cfg)
    releases.check_config(cfg, megatron_version)
    check_cut(cut, cfg.seq_len)


def not_applicable_in_release(case: Case, version: str) -> str | None:
    """An experiment's `not_applicable` when a setting the release lacks (a router dtype before 0.12, an option
    before its release) should give a record that says so (shown as n/a) rather than stop the run."""
    from .. import releases

    try:
        releases.check_config(case.moe, version)
    except ValueError as e:
        return str(e)
    return None


def release_version(release: str) -> str:
    from .. import releases

    return releases.installed_version() if release == INSTALLED else releases.normalize_version(release)


def release_path(release: str) -> tuple[str, ...]:
    """sys.path entries for a release: () for the installed one, else its side-by-side folder. A release that is not
    installed is a ValueError saying how (installing is the step before a run: `tools.versions.prepare`)."""
    from .. import release_dirs, releases

    if release == INSTALLED or releases.normalize_version(release) == releases.installed_version():
        return ()
    return (str(release_dirs.path_for(release)),)


def expected_env(ccfg: ClusterConfig, release: str, deterministic_env: bool) -> dict:
    """The key's environment fields as the controller knows them before any engine starts (so a finished group of
    cases starts no cluster). Checked against what the engines report once they run."""
    from ..controller import placement

    env = {"device": ccfg.device, "world": ccfg.engines, "backend": ccfg.backend,
           "ranks_per_gpu": ccfg.ranks_per_gpu if ccfg.device == "cuda" else None,
           "gpu": placement.gpu_name() if ccfg.device == "cuda" and ccfg.launcher == "local" else None,
           "megatron_core": release_version(release)}
    return env


def case_key(case: Case, env: dict, ccfg: ClusterConfig) -> str:
    """The ONE key of a measurement (see the module docstring), as a short hash; `key_fields` has it in full."""
    blob = json.dumps(key_fields(case, env, ccfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def key_fields(case: Case, env: dict, ccfg: ClusterConfig) -> dict:
    from .. import provenance

    switches = {**dict(ccfg.env), **dict(case.engine_env)}
    if case.deterministic_env and ccfg.device == "cuda":
        switches.update(NCCL_ALGO="Ring", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return {"experiment": case.experiment, "kind": case.kind, "config": case.moe.asdict(),
            "layout": case.layout.on(ccfg.engines).asdict(), "cut": case.cut, "knobs": case.knobs,
            **{k: env.get(k) for k in ENV_KEY}, "engine_env": sorted(switches.items()),
            "source": provenance.code_version()["source_sha"]}


def environment(cluster) -> dict:
    """What every record carries about where it was measured: rank 0's description (versions, placement, GPU name
    and UUID, CPU model / ISA / BLAS build, numerics env and switches) without per-rank fields, the UUIDs of every
    rank's GPU, and the lab's code version."""
    from .. import provenance

    i0 = cluster.info[0] if cluster.info else {}
    env = {k: v for k, v in i0.items() if k not in _PER_RANK and not k.startswith("t_")}
    uuids = sorted({i["gpu_uuid"] for i in cluster.info or [] if i.get("gpu_uuid")})
    env["gpu_uuids"] = uuids or None  # every rank's GPU (gpu_uuid: rank 0's)
    env["code"] = provenance.code_version()
    env["shared_cluster"] = bool(getattr(cluster, "attached", False))  # the run's cluster (controller.shared)
    env["notebooks_at_once"] = turns.notebooks_at_once()  # a CPU cost shared its cores with the other kernel
    return env


def _groups(cases: list[Case]) -> list[tuple[tuple, list[Case]]]:
    out: dict = {}
    for c in cases:
        out.setdefault((c.release, c.deterministic_env, tuple(c.engine_env)), []).append(c)
    return list(out.items())


def layout_major(cases: list[Case], world: int) -> list[Case]:
    """The order the engines measure `cases` in (`layout.state_major`): a change of parallel state remakes megatron's
    process groups on every rank and drops the engines' cached layers (a fifth of a second or more per switch on
    CPU). Records still come back in case order, and the first case is still measured first (a run paired with the
    first correct run finds it)."""
    return state_major(cases, lambda c: c.layout.on(world).parallel_state)


def check_all(cases: list[Case], ccfg: ClusterConfig, experiment=None) -> dict[int, str]:
    """Every case checked against the world and its release, before any engine starts. An experiment may declare
    cases its release cannot run (`experiment.not_applicable(case, version) -> reason | None`): those are returned
    (id(case) → reason) and get a `skipped` record instead of a run; any other problem raises ValueError."""
    skip = {}
    hook = getattr(experiment, "not_applicable", None)
    for c in cases:
        version = release_version(c.release)
        why = hook(c, version) if hook else None
        if why:
            skip[id(c)] = why
            continue
        check_case(c.moe, c.layout, ccfg.engines, version, c.cut)
    return skip


@dataclass
class _Group:
    """One group of cases that share engines: its cluster config, release, expected environment, keys, and the
    cases still to measure."""

    ccfg: ClusterConfig
    release: str
    env: dict
    keys: dict
    todo: list


def run(experiment, config=None, *, cluster=None, cases: list[Case] | None = None,
        results: str | os.PathLike | None = None, notebook: str | None = None, progress: Callable | None = None,
        on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Run an experiment's cases (default `experiment.cases(config)`, a `run_config.RunConfig`) and return their
    records, in case order.

    cluster: a running Cluster to use (its engines are restarted for another release or deterministic
             environment and left running), or None: one is started from `config`'s cluster settings (its
             ClusterConfig built, and the GPUs probed, now) and stopped at the end.
    results: a results.json to stream every finished case into (atomic, locked) and to resume from: a case
             whose key is already there is not measured again, its records are returned as they were.
    progress: progress(iterable, description) → iterable (a tqdm); on_record: called with each new record.
    """
    from ..controller.placement import from_settings

    cases = list(cases if cases is not None else experiment.cases(config))
    ccfg0 = cluster.config if cluster is not None else from_settings(config.cluster)
    ccfg0 = ccfg0.replace(extra_path=()) if cluster is None else ccfg0
    notebook = notebook if notebook is not None else getattr(experiment, "NOTEBOOK", "")
    # planned before the engines' turn: it reads results.json and writes only the records of cases not applicable
    plan, by_case, n_reused = _plan(experiment, cases, ccfg0, results, notebook)
    sets = EngineSets(cluster)  # the one owner of engine sets: which serve each group, what starts early, stops
    try:
        if plan:  # a first group on engines of its own gets them going while another notebook's cases run
            sets.launch_ahead(_target(plan[0].ccfg, plan[0].release))
        # notebooks run two at a time under `moe-lab run`: one kernel's cases at a time on the engines
        with turns.engines_turn(f"notebook {notebook} {experiment.NAME}" if notebook else experiment.NAME,
                                waiting=sets.tick):
            _run_groups(experiment, plan, by_case, sets, results, notebook, progress, on_record)
    except BaseException as e:
        sets.close(e)  # what was launched ahead, if the wait for the turn was interrupted (else: done already)
        raise
    out = [r for c in cases for r in by_case.get(id(c), [])]
    n_measured = sum(len(g.todo) for g in plan)
    if results is not None and notebook:
        note_run(results, notebook, [r["case_key"] for r in out if r.get("case_key")], measured=n_measured,
                 reused=n_reused)
    if progress is not None:  # a notebook's run: the resume said where the reader sees it
        print(resume_line(experiment.NAME, n_measured, n_reused, len(cases) - n_measured - n_reused))
    return out


def _run_groups(experiment, plan: list["_Group"], by_case: dict, sets: EngineSets, results, notebook: str,
                progress: Callable | None, on_record: Callable[[dict], None] | None) -> None:
    """Every planned group on the engines `sets` gives it, in order; each finished case into `by_case` (and
    streamed to `results`); the engine sets closed, still inside the engines' turn."""
    try:
        for i, g in enumerate(plan):
            cluster = sets.ensure(_target(g.ccfg, g.release))
            env, keys = _checked_env(cluster, g)
            if i + 1 < len(plan):
                sets.prefetch(_target(plan[i + 1].ccfg, plan[i + 1].release))
            items = progress(g.todo, f"{experiment.NAME} ({g.env['megatron_core']})") if progress else g.todo
            for c in items:
                recs = measure(cluster, experiment, c, env, keys[id(c)], notebook)
                if results is not None:
                    results_file.append(results, recs)  # streamed: an interrupted run keeps finished cases
                for r in recs:
                    if on_record:
                        on_record(r)
                by_case[id(c)] = recs
                sets.tick()  # the next group's engines import while this group's cases run
    except BaseException as e:
        sets.close(e)
        raise
    sets.close()


def _plan(experiment, cases: list[Case], ccfg0: ClusterConfig, results, notebook: str):
    """Everything decided before an engine runs: every case checked (one line, before anything starts), the records
    of cases already measured (same key in `results`) reused, a record written for each case its release cannot
    take, and the groups still to measure — each of whose releases is installed. Returns (groups, records so far
    by case, cases reused)."""
    skipped = check_all(cases, ccfg0, experiment)
    done: dict[str, list[dict]] = {}
    if results is not None:
        for r in results_file.load(results):  # raises ResultsFileError on a bad file, before anything is measured
            if r.get("case_key"):
                done.setdefault(r["case_key"], []).append(r)
    by_case: dict[int, list[dict]] = {}
    plan: list[_Group] = []
    n_reused = 0
    for (release, det_env, engine_env), group in _groups(cases):
        cfg_g = ccfg0.replace(env=tuple(sorted({**dict(ccfg0.env), **dict(engine_env)}.items())))
        if ccfg0.device == "cuda":
            cfg_g = cfg_g.replace(deterministic=det_env or ccfg0.deterministic)
        env0 = expected_env(cfg_g, release, det_env)
        keys = {id(c): case_key(c, env0, cfg_g) for c in group}
        for c in group:
            if keys[id(c)] in done:
                by_case[id(c)] = done[keys[id(c)]]
                n_reused += 1
            elif id(c) in skipped:  # not applicable to its release: a record that says why, no engine call
                rec = compose({"notebook": notebook}, env0, c.fields(), {"label": c.label, "case_key": keys[id(c)],
                                                                         "skipped": skipped[id(c)]})
                if results is not None:
                    results_file.append(results, [rec])
                by_case[id(c)] = [rec]
        todo = layout_major([c for c in group if id(c) not in by_case], cfg_g.engines)
        logger.info("%s, megatron-core %s: %d case(s) to run, %d already measured, %d not applicable",
                    experiment.NAME, env0["megatron_core"], len(todo),
                    sum(keys[id(c)] in done for c in group), sum(id(c) in skipped for c in group))
        if todo:
            release_path(release)  # installed side by side? one line saying how if not, before any engine starts
            plan.append(_Group(cfg_g, release, env0, keys, todo))
    return plan, by_case, n_reused


def _checked_env(cluster, g: _Group) -> tuple[dict, dict]:
    """The environment the group's engines report, checked against what the keys assumed: the wrong release is an
    error; any other difference (e.g. a GPU the controller could not name) re-keys the group's cases."""
    env = environment(cluster)
    actual = {k: env.get(k) for k in ENV_KEY}
    if actual["megatron_core"] != g.env["megatron_core"]:
        raise RuntimeError(f"engines imported megatron-core {actual['megatron_core']}, expected "
                           f"{g.env['megatron_core']}: check `moe-lab versions list`")
    keys = g.keys
    if actual != {k: g.env.get(k) for k in ENV_KEY}:
        keys = {id(c): case_key(c, actual, g.ccfg) for c in g.todo}
    return env, keys


def resume_line(name: str, measured: int, reused: int, skipped: int = 0) -> str:
    """What a run did with its cases: measured now, reused from results.json (the same key), not applicable."""
    tail = f", {skipped} not applicable to their release" if skipped else ""
    return (f"{name}: {measured} case(s) measured now, {reused} reused from results.json (same key: code, layer, "
            f"environment){tail}")


RUN_ID = os.environ.get("MOE_LAB_RUN_ID") or f"{os.getpid()}"


def note_run(results: str | os.PathLike, notebook: str, keys: list[str], *, measured: int = 0, reused: int = 0) -> None:
    """Which records a notebook's latest run shows (`cases-NN.json` beside results.json): the report's index reads
    only those, never a stale record of an earlier run with other parameters or other code. Several runs of the
    protocol inside one notebook run (one run id) add up, and so do their counts of cases `measured` now and
    `reused` from results.json (the runner shows them: a resume is visible)."""
    p = results_file.cases_path(Path(results).parent, notebook)
    try:
        prev = results_file.read_cases(p) or {}
    except results_file.ResultsFileError as e:  # the lab's own file: this run's list replaces it
        logger.warning("%s; this run's list replaces it", e)
        prev = {}
    same = prev.get("run_id") == RUN_ID
    old = prev.get("keys", []) if same else []
    counts = {k: (prev.get(k, 0) if same else 0) + v for k, v in (("measured", measured), ("reused", reused))}
    # written like results.json (fsio.write_atomic): a full disk is an OSError naming this file, the old list kept
    fsio.write_atomic(p, json.dumps({"run_id": RUN_ID, "keys": old + [k for k in keys if k not in old], **counts}))



def measure(cluster, experiment, case: Case, env: dict, key: str, notebook: str) -> list[dict]:
    """One case on every rank → its records, stamped with the case, the environment, the key and `case_wall_s`
    (the case's wall time seen from the controller: payload out, every rank's work, results back): a `records.Header`
    composed with each record the experiment built (`records.compose`: a key stated twice with two values is an
    error unless `records.HEADER_OVERLAPS` declares it)."""
    t0 = time.perf_counter()
    per_rank = cluster.run(experiment.on_engine, case.payload(cluster.config.engines),
                           what=f"{experiment.NAME} {case.label or case.kind}")
    wall = round(time.perf_counter() - t0, 3)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = []
    layout = layout_fields(case, env.get("world"))
    layout["grad_enabled"] = bool(getattr(experiment, "FORWARD_GRAD", False))  # how the compared forwards ran
    head = Header(notebook=notebook, environment=env, time=stamp, case=case.fields(), layout=layout, label=case.label,
                  case_key=key, case_wall_s=wall)
    for r in experiment.records(case, per_rank):
        out.append(schema_stamp(compose(*head.parts(), as_json(r), allowed_overlaps=HEADER_OVERLAPS)))
    return out


def _target(ccfg: ClusterConfig, release: str) -> ClusterConfig:
    """The cluster a group needs: its config with its release first on the engines' path."""
    return ccfg.replace(extra_path=release_path(release))


def shared_config(config) -> ClusterConfig:
    """The cluster a notebook's cases begin on when they need nothing of their own (the installed release, no engine
    environment, no deterministic start): what `moe-lab run` starts once for all its notebooks."""
    from ..controller.placement import from_settings

    c = from_settings(config.cluster)
    return c.replace(env=tuple(sorted(dict(c.env).items())), extra_path=())


HEADLESS_ENV = "MOE_LAB_HEADLESS"
"""Set (to "1") by `moe-lab run` for the kernels it starts: nobody watches them, their notebooks become the reports."""


def in_jupyter_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (JupyterLab, papermill, VS Code), not in a terminal's Python or
    IPython: tqdm.auto's test. IPython is looked up, not imported: a process that never imported it is no kernel."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in shell.config


def progress_bar(items: Iterable, desc: str):
    """The cases' progress where a person watches: a widget bar in a Jupyter kernel (JupyterLab draws it in place),
    a text bar in a terminal. None under the headless runner: a bar there is saved into the executed notebook that
    becomes the report — a text bar as one stream output per update (each its own line in nbconvert's HTML), a
    widget as state a static page cannot draw — and the runner shows its own progress in the terminal.
    Without ipywidgets (an install that skipped it) a kernel gets the text bar, not tqdm's "IProgress not found"."""
    if os.environ.get(HEADLESS_ENV):
        return items
    import importlib.util

    if in_jupyter_kernel() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(items, desc=desc)


__all__ = ["Case", "run", "measure", "latest", "note_run", "resume_line", "check_case", "check_all", "case_key",
           "key_fields", "environment", "release_path", "release_version", "progress_bar", "in_jupyter_kernel",
           "HEADLESS_ENV", "INSTALLED"]
