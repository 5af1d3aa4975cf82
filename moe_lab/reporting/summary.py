"""The one-screen answer (#14): from a report's records, one card per megatron-core release x dispatcher — do the
ranks diverge (k/N trials; EP order or nondeterminism), where first (stage, collective), does the truncation test
pass, the cheapest remedy that is bitwise in every trial with its cost, and the lines to put in a training job —
plus each notebook's finding status (PASS / FAIL / n/a, apart from whether it ran) and the provenance header.
No measurement here: every word comes from the records."""

from __future__ import annotations

import html

from .. import stats

ISSUE = "https://github.com/NVIDIA/Megatron-LM/issues/1421"

# What a remedy is in a training job: config fields, environment, code (megatron options where they exist).
JOB_LINES = {
    "router fp32": ["TransformerConfig(moe_router_dtype=\"fp32\")  # Megatron-LM: --moe-router-dtype fp32"],
    "router fp64": ["TransformerConfig(moe_router_dtype=\"fp64\")  # Megatron-LM: --moe-router-dtype fp64"],
    "probs fp32 gather": ["# cast routing probs to fp32 before the token dispatcher (the reporter's patch; no megatron "
                          "option: prefer moe_router_dtype)"],
    "deterministic": ["torch.use_deterministic_algorithms(True)  # megatron's unpermute: scatter_add_ → index_add_",
                      "export NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8  # Megatron-LM: --deterministic-mode"],
    "no_splitk": ["torch.backends.cuda.preferred_blas_library(\"cublaslt\")",
                  "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)  # torch >= 2.10"],
    "ordered_combine": ["# replace megatron's token_dispatcher.unpermute by an ordered fp32 sum "
                        "(moe_lab.experiments.remedies.ordered_combine; no megatron option)"],
    "tiled_experts": ["# run every expert GEMM on fixed-size row tiles (moe_lab.experiments.remedies.tiled_experts)"],
    "padding_mask": ["moe_layer(hidden_states, padding_mask=mask)  # megatron's MoE padding mask"],
    "batch_invariant_mode": ["from megatron.core.transformer.custom_layers.batch_invariant_kernels import "
                             "set_batch_invariant_mode",
                             "with set_batch_invariant_mode(True): ...  # Triton kernels for aten::mm/addmm (GPU)"],
}


def _nb(records: list[dict], nb: str) -> list[dict]:
    return [r for r in records if r.get("notebook") == nb]


def _vt(v: str):
    try:
        return tuple(int(x) for x in str(v).split(".")[:3])
    except ValueError:
        return (0, 0, 0)


def _attr(cross: dict, rerun: dict) -> str:
    from ..experiments.labels import attribution

    a = attribution(cross, rerun)
    return {"equal": "no", "ep": "EP order", "ep+nondeterminism": "EP order (+ run-to-run nondeterminism)"}.get(a, a)


def _trials(c: dict) -> str:
    n = c.get("trials", 1)
    return f"{c.get('n_differ', 0)}/{n} trials"


def job_lines(setting: str) -> list[str]:
    """'router fp32 + deterministic' / 'ordered_combine+no_splitk' → the lines a training job needs."""
    out = []
    for part in [p.strip() for p in setting.replace("+", " + ").split(" + ") if p.strip()]:
        if part == "router none":
            continue
        out += JOB_LINES.get(part, [f"# {part}"])
    return out


def cards(records: list[dict]) -> list[dict]:
    """One card per release x dispatcher that the records cover (01/03 give divergence, 02/03 where, 04 truncation)."""
    r01, r02, r03, r04, r05 = (_nb(records, n) for n in ("01", "02", "03", "04", "05"))
    keys = {(r["megatron_core"], r["dispatcher"]) for r in r01 + r02 + r03 + r04 + r05 if "skipped" not in r}
    out = []
    for v, d in sorted(keys, key=lambda k: (_vt(k[0]), k[1])):
        card: dict = {"release": v, "dispatcher": d}
        plain01 = next((r for r in r01 if (r["megatron_core"], r["dispatcher"], r["router_dtype"]) == (v, d, "none")),
                       None)
        plain03 = next((r for r in r03 if "skipped" not in r and (r["megatron_core"], r["dispatcher"]) == (v, d)
                        and r["router_dtype"] == "none" and not r["probs_fp32_gather"] and not r["deterministic"]),
                       None)
        src = plain01 or plain03
        if src:
            a = _attr(src["cross_rank"], src["rerun"])
            c = src["cross_rank"]
            card["diverge"] = {"status": {"no": "PASS", "n/a": "n/a"}.get(a, "FAIL"), "kind": a,
                               "text": ("ranks agree bit for bit" if a == "no" else
                                        "one rank: not applicable" if a == "n/a" else
                                        f"ranks differ in {_trials(c)} (up to {c['mismatch_frac']:.3g} of elements, "
                                        f"max {c['max_ulp']:.0f} ULP): {a}"),
                               "where": src.get("world"), "placement": src.get("placement")}
        case02 = next((r for r in r02 if r.get("record") == "case" and (r["megatron_core"], r["dispatcher"]) == (v, d)
                       and r.get("variant") == "bf16 (nothing)"), None)
        if case02 or plain03:
            s = case02 or plain03
            card["first"] = {"stage": s.get("first_divergent_stage"), "op": s.get("combine_op"),
                             "dtype": s.get("combine_dtype")}
        t04 = [r for r in r04 if r.get("kind") == "case" and r.get("available") and not r.get("emulated")
               and (r["megatron_core"], r["dispatcher"]) == (v, d) and r["remedy"] == "none"]
        if t04:
            t = max(t04, key=lambda r: (r["world"], (r.get("workspace") or "unset") == "unset"))["truncation"]
        elif src:
            t = src["truncation"]
        else:
            t = None
        if t:
            card["truncation"] = {"status": "PASS" if t["bitwise_equal"] else "FAIL",
                                  "text": "bitwise equal" + (f" in {t.get('trials', 1)} trials" if t.get("trials", 1) > 1
                                                             else "") if t["bitwise_equal"] else
                                  f"{t['n_mismatch']:,} of {t['numel']:,} first-token elements differ in {_trials(t)}"}
        back = [r for r in _nb(records, "05") if r.get("kind") == "backward" and r.get("available")
                and (r["megatron_core"], r["dispatcher"]) == (v, d)]
        plain05 = next((r for r in back if r["setting"] == "plain"), None)
        if plain05:
            from ..experiments import compound

            ok = compound.grads_agree(plain05)
            fix = [r["setting"] for r in back if r["setting"] != "plain" and compound.grads_agree(r)]
            card["gradients"] = {"status": "PASS" if ok else "FAIL",
                                 "text": "gradients agree (ranks, reruns, truncation)" if ok else
                                 "gradients differ: " + ", ".join(compound._fails(plain05, compound.GRAD_CMPS))
                                 + (f"; all agree with {', '.join(fix)}" if fix else "")}
        card["remedies"] = _remedies(records, v, d)
        out.append(card)
    return out


def _remedies(records: list[dict], v: str, d: str) -> list[dict]:
    """The cheapest fix the records support for each failure of this release x dispatcher."""
    from ..experiments import promotion, truncation_verdict

    out = []
    r03 = [r for r in _nb(records, "03") if r.get("megatron_core") == v and r.get("dispatcher") == d]
    ran = [r for r in r03 if "skipped" not in r]
    plain = next((r for r in ran if promotion.is_plain(r)), None)
    if plain and not promotion.agrees(plain):
        chosen = promotion.best_setting(ran)
        if chosen:
            best, floor = chosen
            name = promotion.remedy_name(best)
            out.append({"for": "ranks diverge", "remedy": name, "cost": stats.describe(best.get("cost"), floor),
                        "lines": job_lines(name)})
        else:
            out.append({"for": "ranks diverge", "remedy": None, "cost": None, "lines": [],
                        "note": "no setting of notebook 03's grid makes ranks and reruns agree in every trial"})
    r04 = [r for r in _nb(records, "04") if r.get("megatron_core") == v]
    if r04:
        best = truncation_verdict.cheapest(r04)
        plain = [r for r in r04 if r.get("kind") == "case" and r.get("available") and r["remedy"] == "none"
                 and r["dispatcher"] == d]
        real_fails = any(not r["truncation"]["bitwise_equal"] for r in plain if not r.get("emulated"))
        fails = real_fails or any(not r["truncation"]["bitwise_equal"] for r in plain)
        what = "truncation" if real_fails else "truncation under the EMULATED GPU mechanisms"
        if best and best["setting"][2] != "none" and real_fails:
            best = None  # the real layer fails: an emulated fix is no answer for it
        if fails and best:
            out.append({"for": what, "remedy": best["remedy"] + (f" T={best['tile']}" if best.get("tile") else ""),
                        "cost": ("no measurable cost" if best["free"] else stats.describe(best["cost"], best["floor"])),
                        "setting": f"EP={best['setting'][0]}, CUBLAS_WORKSPACE_CONFIG={best['setting'][1]}"
                                   + (f", EMULATED {best['setting'][2]}" if best["setting"][2] != "none" else ""),
                        "lines": job_lines(best["remedy"])})
        elif fails:
            out.append({"for": what, "remedy": None, "cost": None, "lines": [],
                        "note": "no remedy tried holds in every trial"})
    return out


def headline(nb: str, records: list[dict]) -> tuple[str, str]:
    """A notebook's finding status (PASS / FAIL / n/a) and one line, from its records."""
    recs = _nb(records, nb)
    if not recs:
        return "n/a", "no records"
    if nb == "01":
        kinds = {r["dispatcher"] + "/" + r["router_dtype"]: _attr(r["cross_rank"], r["rerun"]) for r in recs}
        bad = {k: a for k, a in kinds.items() if a not in ("no", "n/a")}
        if all(a == "n/a" for a in kinds.values()):
            return "n/a", "one rank: cross-rank not applicable"
        return ("FAIL", "ranks differ: " + ", ".join(f"{k} ({a})" for k, a in bad.items())) if bad else \
            ("PASS", "ranks agree bit for bit in every case and trial")
    if nb == "02":
        cases = [r for r in recs if r.get("record") == "case"]
        firsts = sorted({c["first_divergent_stage"] for c in cases if c["first_divergent_stage"]})
        return ("FAIL", "first divergent stage(s): " + ", ".join(firsts)) if firsts else \
            ("PASS", "every stage agrees in every case")
    if nb == "03":
        from ..experiments import promotion

        recs_ = promotion.recommendations(recs)
        stuck = [x for x in recs_ if "no setting" in x]
        return ("FAIL" if stuck else "PASS", f"{len(recs_) - len(stuck)} of {len(recs_)} release x dispatcher have a "
                                              "setting that makes ranks and reruns agree in every trial")
    if nb == "04":
        plain = [r for r in recs if r.get("kind") == "case" and r.get("available") and r["remedy"] == "none"
                 and not r.get("emulated")]
        fails = sorted({r["dispatcher"] for r in plain if not r["truncation"]["bitwise_equal"]})
        return ("FAIL", f"truncation test fails for {', '.join(fails)} (real layer)") if fails else \
            ("PASS", "truncation test passes bitwise on the real layer")
    if nb == "05":
        from ..experiments import compound

        back = [r for r in recs if r.get("kind") == "backward" and r.get("available")]
        plain = [r for r in back if r["setting"] == "plain"]
        bad = sorted({r["dispatcher"] for r in plain if not compound.grads_agree(r)})
        if not bad:
            return "PASS", "gradients bitwise equal across ranks, reruns and truncation (plain)"
        fixes = []
        for d in bad:
            ok = [r["setting"] for r in back if r["dispatcher"] == d and compound.grads_agree(r)]
            fixes.append(f"{d}: " + (f"every gradient agrees with {', '.join(ok)}" if ok else "no setting makes all agree"))
        return "FAIL", f"gradients differ for {', '.join(bad)} (plain); " + "; ".join(fixes)
    return "n/a", f"{len(recs)} records"


def provenance(records: list[dict]) -> dict:
    """Where the report's numbers came from (the first measured record's environment and code version)."""
    r = next((x for x in records if "code" in x), None)
    if r is None:
        return {}
    code = r["code"]
    releases = sorted({x["megatron_core"] for x in records if x.get("megatron_core")}, key=_vt)
    return {"moe_lab": f"{code.get('moe_lab')} (commit {code.get('commit') or '?'}"
                       + (", dirty tree" if code.get("dirty") else "") + f", source {code.get('source_sha')})",
            "megatron-core": ", ".join(releases), "torch": r.get("torch"), "CUDA": r.get("cuda"),
            "cuBLAS": r.get("cublas"), "NCCL": r.get("nccl"), "driver": r.get("driver"),
            "device": r.get("gpu") or r.get("device"), "placement": f"{r.get('world')} rank(s), {r.get('placement')}, "
                                                                  f"backend {r.get('backend')}",
            "python": r.get("python"), "numerics env": ", ".join(f"{k}={v}" for k, v in (r.get("env") or {}).items())
            or "(none set)"}


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:84em;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.35em .6em;vertical-align:top;text-align:left}
.cards{display:flex;flex-wrap:wrap;gap:1em;margin:1em 0 2em}.card{border:1px solid #bbb;border-radius:8px;padding:.8em 1em;
width:25em;background:#fcfcfc}.card h3{margin:.1em 0 .5em;font-size:1.05em}.st{font-weight:700;padding:0 .4em;border-radius:4px}
.PASS{background:#d9f2dd;color:#176b1b}.FAIL{background:#fde2e2;color:#a4161a}.na{background:#eee;color:#555}
code,pre{font-size:.85em;background:#f3f3f3}pre{padding:.4em;white-space:pre-wrap}details{margin-top:.3em}
.prov td:first-child{font-weight:600;white-space:nowrap}.run-failed{background:#fde2e2}"""


def _st(status: str) -> str:
    cls = status if status in ("PASS", "FAIL") else "na"
    return f"<span class='st {cls}'>{html.escape(status)}</span>"


def render_cards(cs: list[dict]) -> str:
    parts = []
    for c in cs:
        rows = []
        if "diverge" in c:
            rows.append(f"<p>{_st(c['diverge']['status'])} ranks: {html.escape(c['diverge']['text'])}</p>")
        if "first" in c:
            f = c["first"]
            rows.append("<p>first divergent stage: <code>" + html.escape(str(f["stage"] or "none")) + "</code>"
                        + (f"; combine {html.escape(str(f['op']))} in {html.escape(str(f['dtype']))}" if f["op"] else "")
                        + "</p>")
        if "truncation" in c:
            rows.append(f"<p>{_st(c['truncation']['status'])} truncation: {html.escape(c['truncation']['text'])}</p>")
        if "gradients" in c:
            rows.append(f"<p>{_st(c['gradients']['status'])} {html.escape(c['gradients']['text'])}</p>")
        for r in c["remedies"]:
            if r["remedy"]:
                rows.append(f"<p>fix for {html.escape(r['for'])}: <b>{html.escape(r['remedy'])}</b>, "
                            f"{html.escape(r['cost'] or 'n/a')}"
                            + (f" <small>({html.escape(r['setting'])})</small>" if r.get("setting") else "") + "</p>"
                            + ("<pre>" + html.escape("\n".join(r["lines"])) + "</pre>" if r["lines"] else ""))
            else:
                rows.append(f"<p>fix for {html.escape(r['for'])}: {html.escape(r.get('note', 'none found'))}</p>")
        parts.append(f"<div class='card'><h3>megatron-core {html.escape(c['release'])} · "
                     f"{html.escape(c['dispatcher'])}</h3>{''.join(rows)}</div>")
    return "<div class='cards'>" + "".join(parts) + "</div>"


def render_provenance(p: dict) -> str:
    if not p:
        return ""
    return "<table class='prov'>" + "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                                            for k, v in p.items() if v not in (None, "", "None")) + "</table>"


__all__ = ["cards", "headline", "provenance", "render_cards", "render_provenance", "job_lines", "ISSUE"]
