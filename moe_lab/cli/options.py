"""Options that more than one subcommand takes: key=value values (`run -p`, `--launcher-option`) and the launcher's
(`--launcher`, `--launcher-option`: `probe` and `run`), with the ClusterConfig fields they give."""

from __future__ import annotations

import argparse
import json


def kv(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"-p {s!r}: expected key=value, e.g. -p seq_len=256")
    k, v = s.split("=", 1)
    try:
        val = json.loads(v)
    except json.JSONDecodeError:
        val = v
    return k.strip(), val


def launcher_option(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"--launcher-option {s!r}: expected key=value, e.g. "
                                         "--launcher-option 'mpi_args=[\"--oversubscribe\"]'")
    return kv(s)


def add_launcher_arguments(p: argparse.ArgumentParser) -> None:
    from ..config import LAUNCHERS

    p.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="how ipyparallel starts the engines (default local); mpi/slurm/ssh need --device and --engines")
    p.add_argument("--launcher-option", dest="launcher_options", type=launcher_option, action="append", default=[],
                   metavar="KEY=VALUE", help="an ipyparallel launcher setting, value as JSON, e.g. "
                   "'mpi_args=[\"--oversubscribe\"]', 'timelimit=\"01:00:00\"', 'engines={\"gpu-a\": 8}'")


def launcher_kwargs(a) -> dict:
    """--launcher / --launcher-option as ClusterConfig fields (nothing when neither is given)."""
    kw = {}
    if a.launcher:
        kw["launcher"] = a.launcher
    if a.launcher_options:
        kw["launcher_options"] = dict(a.launcher_options)
    return kw
