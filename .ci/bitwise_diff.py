"""Compare the bitwise results of two results.json files (e.g. a cpu report before and after a refactor).

For every case of notebooks 01-05: the mismatch counts (n_mismatch) of cross_rank, rerun, truncation, a stage
comparison, a kernel probe, and 05's outputs and gradients (per backward case and per depth layer), keyed by what
identifies the case (records of any schema, read through `moe_lab.records.upgrade`). Prints the differences; exit 1 if
any. Keys measured nondeterministically (rerun counts > 0, or repeated records that disagree) are listed apart, not
compared.
Usage: python .ci/bitwise_diff.py BEFORE/results.json AFTER/results.json
"""

import json
import sys

from moe_lab.records import upgrade

ID = ("notebook", "kind", "stage_kind", "megatron_core", "dispatcher", "router_dtype", "probs_fp32_gather", "deterministic",
      "variant", "remedy", "emulation", "tile", "stage", "unit", "linear", "M", "op", "seq", "setting", "stack", "layer",
      "layout")
COUNTS = ("cross_rank", "rerun", "truncation", "kernel", "probs",
          # notebook 05: outputs, input gradients, router and expert weight gradients, per backward case or depth layer
          "rerun_out", "truncation_out", "cross_out", "rerun_dx", "truncation_dx", "cross_dx", "rerun_router_grad",
          "truncation_router_grad", "cross_router_grad", "experts_rerun", "experts_truncation", "rerun_grad",
          "truncation_grad", "cross_grad")


def counts(path: str) -> dict:
    out = {}
    for r in map(upgrade, json.load(open(path))):  # any committed schema, read as the current one
        if r.get("notebook") not in ("01", "02", "03", "04", "05"):
            continue
        r = {"probs_fp32_gather": False, "deterministic": False, "kind": "case", **r}  # older records left defaults out
        key = tuple((k, json.dumps(r.get(k))) for k in ID if r.get(k) is not None)
        val = {}
        for c in COUNTS:
            v = r.get(c) if c != "probs" else (r.get("routing") or {}).get("probs")
            if isinstance(v, dict) and "n_mismatch" in v:
                val[c] = v["n_mismatch"]
        if "n_mismatch" in r:
            val["stage"] = r["n_mismatch"]
        if "dtype" in r and r.get("kind") == "collective":
            val["dtype"] = r["dtype"]
        for k in ("first_divergent_stage", "routing_map_equal", "backward_first_divergent"):
            if k in r:
                val[k] = r[k]
        if val:
            out.setdefault(key, []).append(val)
    return out


def nondeterministic(vals: list) -> bool:
    """The records of one case key say the case is nondeterministic where they were measured: its own rerun counts
    are not 0, or two records of it (e.g. two device calls) disagree."""
    reruns = [v for val in vals for k, v in val.items() if k.startswith("rerun") or k == "experts_rerun"]
    return any(reruns) or any(val != vals[0] for val in vals)


def main(a: str, b: str) -> int:
    """A key whose records are nondeterministic on either side (GPU atomics: rerun counts > 0, or repeated records
    that disagree) is listed as VARIES, not as a difference: its counts are not expected to repeat."""
    ca, cb = counts(a), counts(b)
    bad = varies = 0
    for k in sorted(set(ca) | set(cb), key=str):
        va, vb = ca.get(k), cb.get(k)
        if va and vb and (nondeterministic(va) or nondeterministic(vb)):
            varies += 1
            print("VARIES", dict(k), "\n  before:", va, "\n  after: ", vb)
        elif (va and va[0]) != (vb and vb[0]):
            bad += 1
            print("DIFF", dict(k), "\n  before:", va, "\n  after: ", vb)
    print(f"{len(ca)} case keys before, {len(cb)} after, {bad} differ, {varies} nondeterministic (not compared)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
