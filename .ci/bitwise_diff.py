"""Compare the bitwise results of two results.json files (e.g. a cpu report before and after a refactor).

For every case of notebooks 01-05: the mismatch counts (n_mismatch) of cross_rank, rerun, truncation, a stage
comparison or a kernel probe, keyed by what identifies the case. Prints the differences; exit 1 if any.
Usage: python .ci/bitwise_diff.py BEFORE/results.json AFTER/results.json
"""

import json
import sys

ID = ("notebook", "kind", "record", "megatron_core", "dispatcher", "router_dtype", "probs_fp32_gather", "deterministic",
      "variant", "remedy", "emulation", "tile", "stage", "unit", "linear", "M", "op", "seq")
COUNTS = ("cross_rank", "rerun", "truncation", "kernel", "probs")


def counts(path: str) -> dict:
    out = {}
    for r in json.load(open(path)):
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
        if "dtype" in r and r.get("record") == "collective":
            val["dtype"] = r["dtype"]
        for k in ("first_divergent_stage", "routing_map_equal"):
            if k in r:
                val[k] = r[k]
        if val:
            out.setdefault(key, []).append(val)
    return out


def main(a: str, b: str) -> int:
    ca, cb = counts(a), counts(b)
    bad = 0
    for k in sorted(set(ca) | set(cb), key=str):
        if ca.get(k) != cb.get(k):
            bad += 1
            print("DIFF", dict(k), "\n  before:", ca.get(k), "\n  after: ", cb.get(k))
    print(f"{len(ca)} case keys before, {len(cb)} after, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
