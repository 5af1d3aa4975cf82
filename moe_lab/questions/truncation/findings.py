"""Notebook 04's findings: per release x dispatcher x placement x layer x router dtype and setting
(CUBLAS_WORKSPACE_CONFIG, emulation), does the truncation test hold bitwise on the real layer (in k of N trials), which
remedy holds in every trial at what cost (never ranked inside the noise), and the evidence for why: the first tokens'
routing, and whether this device's own expert GEMMs are batch variant (the kernel probe, with the GPU or the CPU model
and ISA that measured it). Evidence is never pooled across subjects: a failing case's "why" rests only on records of
its own release, layer, device and dispatcher (`_same`)."""

from __future__ import annotations

from ...findings.labels import rem_label
from ...findings.common import choice_text, choose, cost, describe, fix_words, groups, guarded, trial_words, trials
from ...findings.model import FAIL, NOT_MEASURED, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "truncation"
QUESTION = "truncation"
FIX = "fix: truncation"
ALONE = ("deterministic", "ordered_combine", "tiled_experts", "no_splitk", "padding_mask")


def ws(r: dict) -> str:
    return r.get("workspace") or "unset"


def setting_label(r: dict) -> str:
    s = f"EP={r['world']}, CUBLAS_WORKSPACE_CONFIG={ws(r)}" if r.get("device") == "cuda" else f"EP={r['world']}"
    return s + (f", EMULATED {r['emulation']}" if r.get("emulated") else ", real layer")


def holds(r: dict) -> bool:
    return bool(r["truncation"]["bitwise_equal"]) and bool(r["rerun"]["bitwise_equal"])


def simplicity(name: str) -> tuple:
    """Fewer parts first, no tiles before tiles, smaller tiles last."""
    return (name.count("+"), "T=" in name, name)


def device_label(r: dict) -> str:
    """The device whose kernels ran: the GPU by name, or the CPU by model and the ISA flags that pick its GEMM."""
    if r.get("device") == "cuda":
        return str(r.get("gpu") or "a GPU (name not recorded)")
    cpu = r.get("cpu") or {}
    if not cpu:
        return "this CPU (model and ISA not recorded)"
    flags = cpu.get("isa") or cpu.get("flags") or []
    amx = [f for f in flags if f.startswith("amx")]
    avx = [f for f in flags if f.startswith("avx512")]
    isa = ("AMX " + "/".join(amx) if amx else "no AMX") + (", AVX-512" if avx else ", no AVX-512")
    cap = cpu.get("capability")
    return f"CPU {cpu.get('model', '?')} ({isa}" + (f"; torch CPU capability {cap}" if cap else "") + ")"


def device_key(r: dict) -> tuple:
    """What a kernel's behaviour depends on: the release, the device that ran it (the GPU, or the CPU model and ISA)
    and the layer (its GEMM shapes) — not the world or the dispatcher."""
    s = subject_of(r)
    return (s["release"], device_label(r), s["layer"])


def _same(r: dict, other: dict, *, dispatcher: bool = True) -> bool:
    """`other` may stand as evidence for `r`: the same release, device and layer, and (unless not asked: a kernel
    probe's rows) the same dispatcher and router dtype where both state one."""
    if device_key(r) != device_key(other):
        return False
    if not dispatcher:
        return True
    rd, ord_ = r.get("router_dtype"), other.get("router_dtype")
    return r.get("dispatcher") == other.get("dispatcher") and (rd is None or ord_ is None or rd == ord_)


def _kernels(records: list[dict], remedy: str) -> dict[tuple, list[dict]]:
    """Real-kernel probe rows of one remedy state, by (release, device, layer, linear, workspace), each of the first
    world probed on that device: a CPU's rows never join a GPU's, nor one release's another's."""
    ks = [r for r in records if r.get("kind") == "kernel" and not r.get("emulated") and r.get("remedy") == remedy]
    first_world: dict = {}
    for r in ks:
        w = r.get("world")
        if isinstance(w, int):
            first_world[device_key(r)] = min(first_world.get(device_key(r), w), w)
    out: dict = {}
    for r in ks:
        if r.get("world") == first_world.get(device_key(r), r.get("world")):
            out.setdefault(device_key(r) + (r.get("linear", "fc1"), ws(r)), []).append(r)
    return out


def kernel_findings(records: list[dict]) -> list[Finding]:
    out = []
    fixed_by = {rem: _kernels(records, rem) for rem in ("no_splitk", "tiled_experts")}
    for key, rows in _kernels(records, "none").items():
        lin, w = key[-2:]
        rows = sorted(rows, key=lambda r: r["M"])
        bad = [r["M"] for r in rows if not r["kernel"]["bitwise_equal"]]
        dev = device_label(rows[0])
        fixes = {rem: all(x["kernel"]["bitwise_equal"] for x in ks.get(key, []))
                 for rem, ks in fixed_by.items() if ks.get(key)}
        subj = {**subject_of(rows[0]), "dispatcher": "any", "linear": lin, "workspace": w, "device": dev}
        k0 = rows[0]
        shape = f"K={k0.get('K')}, N={k0.get('N')}" if k0.get("K") else ""
        if bad:
            claim = (f"expert {lin} GEMM ({shape}) on {dev}: batch variant — the first {k0['m']} rows change when "
                     f"computed inside M = {bad} rows (first at M = {bad[0]}; invariant at "
                     f"{[r['M'] for r in rows if r['kernel']['bitwise_equal']]})")
            if fixes:
                claim += "; " + ", ".join(f"{k}: {'invariant' if v else 'still variant'}" for k, v in fixes.items())
        else:
            claim = (f"expert {lin} GEMM ({shape}) on {dev}: batch invariant — the first {k0['m']} rows are "
                     f"bit-identical for every M in {[r['M'] for r in rows]}")
        out.append(Finding(EXPERIMENT, "expert GEMM batch invariance", subj, FAIL if bad else PASS, claim,
                           Evidence(records=case_keys(rows)), commits=commits_of(rows)))
    return out


def routing_findings(records: list[dict]) -> list[Finding]:
    out = []
    for rt in (r for r in records if r.get("kind") == "routing"):
        same = rt["routing"]["routing_map_equal"] and rt["routing"]["probs"]["bitwise_equal"]
        rows = rt["rows_per_expert"]
        delta = [t - f for f, t in zip(rows["full"], rows["truncated"])]
        z = rt["zero_tokens"]
        claim = (f"{rt['dispatcher']}: the first {rt['cut']} tokens' routing is "
                 + (f"identical (routing map and {rt['routing']['probs_dtype']} probs bitwise)" if same else "CHANGED")
                 + f"; zeroed tokens have logits {z['max_abs_logit']:g} and go to experts "
                 + " / ".join("{" + ", ".join(map(str, e)) + "}" for e in z["expert_sets"])
                 + (f", so the rows per expert GEMM change by {min(delta):+d} … {max(delta):+d}" if delta else ""))
        notes = []
        if "truncated+padding_mask" in rows:
            keep = rows["truncated+padding_mask"] == rows["truncated"]
            notes.append("padding_mask: rows per expert " + ("unchanged — this release still dispatches and computes "
                                                              "padded tokens" if keep else "changed: padded tokens "
                                                                                           "leave the experts"))
        out.append(Finding(EXPERIMENT, "first tokens' routing", subject_of(rt), PASS if same else FAIL, claim,
                           Evidence(records=case_keys([rt]), notes=notes), commits=commits_of([rt])))
    return out


def _setting(cases: list[dict], na: list[dict]) -> list[Finding]:
    """One dispatcher x placement x (workspace, emulation): the plain case's truncation and, if it fails, the fix."""
    plain = next((r for r in cases if r["remedy"] == "none"), None)
    r0 = plain or cases[0]
    label = setting_label(r0)
    subj = subject_of(r0, router_dtype=str(r0.get("router_dtype")), setting=label, workspace=ws(r0),
                      emulation=r0.get("emulation", "none"))
    real = not r0.get("emulated")
    commits = commits_of(cases)
    if plain is None:
        return [Finding(EXPERIMENT, QUESTION, subj, NOT_MEASURED, f"{r0['dispatcher']}, {label}: the no-remedy case "
                        "was not measured", Evidence(records=case_keys(cases)), card=real, commits=commits,
                        short="no-remedy case not measured")]
    t, rr = plain["truncation"], plain["rerun"]
    cut = plain.get("cut")
    ok = holds(plain)
    claim = (f"{plain['dispatcher']}, {label}: the first {cut} tokens "
             + ("are bitwise equal under truncation and on a rerun " + describe(t).removeprefix("bitwise equal ")
                if ok else f"{describe(t, 'first-token elements')}; a rerun: {describe(rr, 'output elements')}"))
    out = [Finding(EXPERIMENT, QUESTION, subj, PASS if ok else FAIL, claim,
                   Evidence(records=case_keys([plain]), trials=trials(t)), card=real, commits=commits,
                   short=f"router {r0.get('router_dtype')}: " + ("holds" if ok else "fails") + trial_words(trials(t)))]
    if ok:
        return out
    rems = [r for r in cases if r["remedy"] != "none"]
    good = [r for r in rems if holds(r)]
    costs = {rem_label(r["remedy"], r.get("tile")): cost(r, plain, r) for r in good}
    ch = choose(list(costs.items()), simplicity)
    alone = []
    for m in ALONE:
        for r in (x for x in rems if x["remedy"] == m):
            alone.append(f"{rem_label(m, r.get('tile'))}: first tokens "
                         + ("equal" if r["truncation"]["bitwise_equal"] else "still differ")
                         + ", rerun " + ("equal" if r["rerun"]["bitwise_equal"] else "differs"))
    notes = (["alone — " + "; ".join(alone)] if alone else []) + \
            (["not run here: " + "; ".join(f"{rem_label(r['remedy'], r.get('tile'))} ({r.get('reason')})" for r in na)]
             if na else [])
    if plain.get("device") == "cpu" and ch["name"]:
        notes.append("CPU time, not a GPU cost")
    if ch["name"] is None:
        out.append(Finding(EXPERIMENT, FIX, subj, FAIL, f"{plain['dispatcher']}, {label}: no remedy tried keeps the "
                           f"first tokens and a rerun bitwise equal in every trial ({len(rems)} tried)",
                           Evidence(records=case_keys(cases), notes=notes), card=real, commits=commits,
                           short=fix_words(None, len(rems))))
        return out
    best = next(r for r in good if rem_label(r["remedy"], r.get("tile")) == ch["name"])
    from ...findings.jobs import job_lines

    out.append(Finding(EXPERIMENT, FIX, subj, PASS, f"{plain['dispatcher']}, {label}: " + choice_text(ch, costs),
                       Evidence(records=case_keys([plain, best]), trials=trials(best["truncation"]), cost=ch["cost"],
                                notes=notes),
                       remedy=ch["name"], lines=job_lines(best["remedy"], best.get("router_dtype")) + (
                           ["export CUBLAS_WORKSPACE_CONFIG=" + ws(best)] if ws(best) != "unset" else []),
                       card=real, commits=commits, short=fix_words(ch["name"], len(rems))))
    return out


def _why(records: list[dict], cases: list[dict], kern: list[Finding]) -> list[Finding]:
    """Why the real layer fails, each cause with its evidence; no cause is assumed. One finding per failing
    release x device x layer x dispatcher, each resting only on that subject's records (`_same`): one dispatcher's
    routing never explains another's failure, a CPU's kernel probe never an H200's."""
    real = [r for r in cases if not r.get("emulated")]
    failing = [r for r in real if r["remedy"] == "none" and not holds(r)]
    by_subject: dict = {}
    for r in failing:
        by_subject.setdefault(device_key(r) + (r.get("dispatcher"), r.get("router_dtype")), []).append(r)
    kernel_rows = {id(f): [r for r in records if r.get("case_key") in set(f.evidence.records)] for f in kern}
    out = []
    for fs in by_subject.values():
        mine = [f for f in kern if any(_same(fs[0], k, dispatcher=False) for k in kernel_rows[id(f)])]
        out.append(_why_one(fs, [r for r in records if r.get("kind") == "routing" and _same(fs[0], r)],
                            [r for r in real if _same(fs[0], r)], [f for f in mine if f.status == FAIL], bool(mine)))
    return out


def _why_one(failing: list[dict], rts: list[dict], real: list[dict], variant: list[Finding],
             probed: bool) -> Finding:
    causes = []
    if any(not (r["routing"]["routing_map_equal"] and r["routing"]["probs"]["bitwise_equal"]) for r in rts):
        causes.append("the routing of the first tokens itself changes")
    gemm_fix = list(dict.fromkeys(rem_label(r["remedy"], r.get("tile")) for r in real
                                  if ("tiled_experts" in r["remedy"] or "no_splitk" in r["remedy"])
                                  and r["truncation"]["bitwise_equal"]))
    if variant or gemm_fix:
        ev = [f.claim for f in variant] + ([f"the first tokens are bitwise equal again with {', '.join(gemm_fix[:3])}"]
                                           if gemm_fix else [])
        if probed and not variant:
            ev.append("the kernel probe saw no variance at its M values, so it is at the layer's own, uneven row "
                      "counts per expert")
        causes.append("the expert GEMMs are batch variant (" + "; ".join(ev) + ")")
    if any(not r["rerun"]["bitwise_equal"] for r in failing):
        fixed = [x for x in ("deterministic", "ordered_combine")
                 if any(r["remedy"] == x and r["rerun"]["bitwise_equal"] for r in real)]
        causes.append("the combine's accumulation order changes from run to run (a rerun differs"
                      + (f"; {' and '.join(fixed)} make the rerun equal" if fixed else "") + ")")
    if not causes:
        causes.append("no cause isolated by these experiments")
    names = sorted({f"{r['dispatcher']} ({setting_label(r)}, router {r.get('router_dtype')})" for r in failing})
    return Finding(EXPERIMENT, "why truncation fails", subject_of(failing[0]), FAIL,
                   f"the truncation test fails on the real layer for {', '.join(names)} on {device_label(failing[0])}: "
                   + "; ".join(causes), Evidence(records=case_keys(failing)), commits=commits_of(failing))


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict)]
    cases = [r for r in recs if r.get("kind") == "case" and r.get("available")]
    na = [r for r in recs if r.get("kind") == "case" and r.get("available") is False]
    out: list[Finding] = guarded(EXPERIMENT, "first tokens' routing", recs, lambda: routing_findings(recs))
    kern = guarded(EXPERIMENT, "expert GEMM batch invariance", recs, lambda: kernel_findings(recs))
    out += kern
    for _key, sub in groups(cases, "router_dtype", "workspace", "emulation").items():
        miss = [r for r in na if (r.get("dispatcher"), r.get("router_dtype"), r.get("world"), ws(r), r.get("emulation"))
                == (sub[0].get("dispatcher"), sub[0].get("router_dtype"), sub[0].get("world"), ws(sub[0]),
                    sub[0].get("emulation"))]
        out += guarded(EXPERIMENT, QUESTION, sub, lambda sub=sub, miss=miss: _setting(sub, miss))
    # a subject measured only under EMULATION: the real layer's truncation is not measured, and says so
    real_keys = {k[:4] for k in groups([r for r in cases if not r.get("emulated")])}
    for key, sub in groups([r for r in cases if r.get("emulated")]).items():
        if key[:4] not in real_keys:
            out.append(Finding(EXPERIMENT, QUESTION, subject_of(sub[0], setting="real layer"), NOT_MEASURED,
                               f"{sub[0].get('dispatcher')}: only EMULATED cases ran — the real layer's truncation test "
                               "was not measured", Evidence(records=case_keys(sub)), card=True,
                               commits=commits_of(sub), short="only emulated cases ran"))
    out += guarded(EXPERIMENT, "why truncation fails", cases, lambda: _why(recs, cases, kern))
    return out


__all__ = ["findings", "kernel_findings", "routing_findings", "device_label", "setting_label", "EXPERIMENT"]
