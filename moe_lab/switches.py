"""The lab's on/off environment switches. Each is unset (its default), `0` (off) or `1` (on); any other value is
refused by name, with what the switch does, before a command launches anything (`check`), and wherever one is read.
Torch-free and import-free: read by the CLI, the controller and the engines alike."""

from __future__ import annotations

import os

SWITCHES = {
    "MOE_LAB_PRELOAD": "fork local engines from a preload server that imported torch and megatron-core once "
                       "(default: on, on Linux)",
    "MOE_LAB_PRESTART": "launch a cluster's next engines while the current ones work (default: on a GPU node, or a "
                        "CPU machine with a core for every engine of both sets)",
    "MOE_LAB_KEEP_ENGINES": "keep a run's own cluster, its cached layers dropped, for the same process's next run "
                            "for up to 120 s (default: in a notebook kernel, where launching early is on)",
    "MOE_LAB_SHARE_CLUSTER": "one cluster for a run's notebooks (default: on)",
    "MOE_LAB_OVERLAP": "run the next notebook while the current one draws its figures and pages, their cases "
                       "taking turns on the engines (default: on)",
    "MOE_LAB_SHARE_CORES": "GPU engines split their node's cores between them for torch's threads (default: on; 0: "
                           "torch's default, every core in each engine)",
    "MOE_LAB_NO_CPU_BF16": "CPU engines take torch's own bf16 GEMM loop, as a CPU without bf16 instructions does "
                           "(default: off)",
    "MOE_LAB_IPC_COLLECTIVES": "all-to-alls between ranks that share a GPU through CUDA IPC buffers instead of "
                               "gloo's sockets, gloo's bytes (default: on there; 1: on CPU engines too, through "
                               "shared memory)",
    "MOE_LAB_BYTECODE_CACHE": "give the processes the lab starts a bytecode cache of its own where the environment "
                              "sets PYTHONDONTWRITEBYTECODE (default: where torch also holds no bytecode; 1: wherever "
                              "it is set)",
}


def forced(name: str) -> bool | None:
    """The switch `name` as set: True (1), False (0) or None (unset or empty: the default). Another value raises
    ValueError naming the switch, what it does and the values it takes."""
    value = os.environ.get(name, "").strip()
    if value in ("", "0", "1"):
        return None if value == "" else value == "1"
    raise ValueError(f"{name}={os.environ[name]!r}: give 0 (off) or 1 (on), or leave it unset; it switches: "
                     f"{SWITCHES.get(name, 'see moe_lab/switches.py')}")


def check() -> None:
    """Every switch's value checked (ValueError at the first that is neither unset, 0 nor 1)."""
    for name in SWITCHES:
        forced(name)


__all__ = ["SWITCHES", "forced", "check"]
