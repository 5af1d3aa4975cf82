"""Every question's cases' keys for a few profiles and overrides, with a fixed fake environment and no engines: run
against a checkout (PYTHONPATH) it prints them as JSON. tests/unit/data/case_keys.json holds them: the gpu runs' as
the code gave them before a case's layout had one home (9b00aa3, where the layer's config held tp / ep / etp /
sequence parallel), except where a profile's cases changed since (a profile change is a change of cases: that
profile's keys are written again — the cpu profile's when it was sized for minutes on two cores, the gpu profile's
when it was sized for ten minutes on one H200); the tests compute them again and compare (test_run_config.py).

On that code a key is brought to today's form first (`today`): the layout fields leave the layer's config and the
layout, resolved on the world, is a field of its own (the layer's over the world where the case had none); the
layouts question's reference is its spec alone (the reference layer was the case's layer at that layout). Today's
keys pass through unchanged, so what is compared is the key the runner computes.

    PYTHONPATH=<checkout> python tests/unit/data/case_keys_gen.py > tests/unit/data/case_keys.json
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from unittest import mock

GPU = {"releases": ["installed", "0.12.3"]}  # a second release, as a user adds one (a release of this Python)
RUNS = [("cpu", {}), ("gpu", GPU),
        ("cpu", {"seq_len": 256, "cut": 64, "trials": 2, "dispatchers": "alltoall"}),
        ("cpu", {"training": {"steps": 5, "eps": [1, 2]}, "router_dtypes": ["none"]}),
        ("gpu", {**GPU, "engines": 8, "cost_rounds": 3}),
        ("cpu", {"model": "qwen3-30b-a3b", "scale": 0.125})]
GPUS = 8  # the fake machine's visible GPUs


def keys(profile: str, overrides: dict) -> dict:
    from moe_lab import profiles
    from moe_lab.experiments import protocol
    from moe_lab.questions import QUESTIONS

    env = {k: f"fake-{k}" for k in protocol.ENV_KEY}
    P = profiles.load(profile, json.loads(json.dumps(overrides)))

    def key(case, ccfg):
        f = today(case, protocol.key_fields(case, env, ccfg), ccfg.engines)
        f.pop("source")  # the code's own version: changes with every commit
        return hashlib.sha256(json.dumps(f, sort_keys=True, default=str).encode()).hexdigest()[:20]

    out = {}
    if hasattr(profiles, "cluster_config"):  # the code before the run config was typed
        ccfg, worlds = profiles.cluster_config(P), profiles.truncation_engines(P)
    else:
        from moe_lab.controller.placement import from_settings
        from moe_lab.questions.truncation.experiment import worlds as truncation_worlds

        ccfg, worlds = from_settings(P.cluster), truncation_worlds(P)
    for q in QUESTIONS:
        for run in q.runs:
            mod = importlib.import_module(f"{q.package}.{run}")
            if q.name == "truncation":
                for engines in worlds:
                    cs = mod.cases(P, engines=engines)
                    at = ccfg.replace(engines=engines) if engines else ccfg  # the cluster those cases run on
                    out[f"{q.name}.{run}@{engines}"] = [key(c, at) for c in cs]
            else:
                out[f"{q.name}.{run}"] = [key(c, ccfg) for c in mod.cases(P)]
    return out


def today(case, fields: dict, world: int) -> dict:
    """A key's fields in today's form (see the module docstring); today's own are returned as they are."""
    cfg = dict(fields["config"])
    if not any(k in cfg for k in ("tp", "ep", "etp", "sequence_parallel")):
        return fields
    for k in ("tp", "ep", "etp", "sequence_parallel"):
        cfg.pop(k)
    out = dict(fields, config=cfg)
    if "layout" not in out:
        out["layout"] = case.moe.layout(world).asdict()
    out["knobs"] = {k: v for k, v in out["knobs"].items() if k != "reference_moe"}
    return out


def main() -> dict:
    with mock.patch("moe_lab.controller.placement.visible_gpus", return_value=GPUS), \
            mock.patch("moe_lab.controller.launchers.launcher_settings", return_value=None):
        return {f"{p} {json.dumps(o, sort_keys=True)}": keys(p, o) for p, o in RUNS}


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1, sort_keys=True)
    print()
