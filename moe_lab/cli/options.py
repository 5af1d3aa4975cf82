"""Options that more than one subcommand takes: key=value values (`run -p`, `--launcher-option`) and the launcher's
(`--launcher`, `--launcher-option`: `probe` and `run`), with the ClusterConfig fields they give."""

from __future__ import annotations

import argparse
import json


def kv(s: str, flag: str = "-p", example: str = "-p seq_len=256") -> tuple[str, object]:
    """key=value, the value as JSON where it is JSON (a number, a list, an object, true/null) and as text otherwise.
    An empty key or value is refused: leaving the key out is how to keep the profile's value."""
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"{flag} {s!r}: expected key=value, e.g. {example}")
    k, v = s.split("=", 1)
    if not k.strip():
        raise argparse.ArgumentTypeError(f"{flag} {s!r}: the key is empty; expected key=value, e.g. {example}")
    if not v.strip():
        raise argparse.ArgumentTypeError(f"{flag} {s!r}: the value of {k.strip()!r} is empty; give a value, or leave "
                                         f"{flag} {k.strip()}=... out for the profile's")
    try:
        val = json.loads(v)
    except json.JSONDecodeError:
        val = v
    return k.strip(), val


def launcher_option(s: str) -> tuple[str, object]:
    return kv(s, "--launcher-option", "--launcher-option 'mpi_args=[\"--oversubscribe\"]'")


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
