"""The one-screen answer: the index's banner and answer table, each notebook's headline and the provenance header — all
rendered from the typed findings (moe_lab.findings), which every verdict, `moe-lab findings` and the README also
render. No measurement here and no clause of its own: every word comes from a finding or a record field."""

from __future__ import annotations

import datetime
import html

from .. import questions
from ..findings import answers as answer_table
from ..findings import render
from ..findings.common import vt
from ..findings.model import placement_label
from ..findings.jobs import JOB_LINES, job_lines  # noqa: F401 - re-exported: the job lines of a remedy

ISSUE = "https://github.com/NVIDIA/Megatron-LM/issues/1421"


def answers(records: list[dict]) -> list[answer_table.Row]:
    """The answer table's rows: one per release x dispatcher x placement x layer, from every registered question's
    card findings, each placed in the column its question names (`Question.answers`)."""
    return answer_table.table(questions.findings(records), {q.number: q.answers for q in questions.QUESTIONS},
                              {q.number: q.fallback_answers for q in questions.QUESTIONS})


def shared(rows: list[answer_table.Row]) -> dict[str, str]:
    """What every row has in common (release, dispatcher, placement), said once above the table."""
    out = {}
    for k in ("release", "dispatcher", "placement"):
        vals = {getattr(r, k) for r in rows}
        if len(vals) == 1 and len(rows) > 1:
            out[k] = vals.pop()
    return out


def answers_json(rows: list[answer_table.Row]) -> list[dict]:
    """The rows for index.json: the subject, each cell's status and words, and the findings in full."""
    return [{"release": r.release, "dispatcher": r.dispatcher, "placement": r.placement, "layer": r.layer,
             "layouts": r.layouts, "diverges": r.diverges, "fix": r.fix,
             "cells": {k: [{"status": c.status, "text": c.text} for c in v] for k, v in r.cells.items()},
             "findings": [f.to_dict() for f in r.findings]} for r in rows]


def render_answers(rows: list[answer_table.Row]) -> str:
    """Banner (counts), the answer table and, below it, the evidence of each row (collapsed)."""
    if not rows:
        return "<p class='banner'>no records yet: nothing is answered</p>"
    counts = answer_table.banner(rows)
    b = "".join(f"<span class='b {k.replace(' ', '_')}'>{v} {html.escape(k)}</span>" for k, v in counts.items()
                if v or k == "subjects")
    return f"<p class='banner'>{b}</p>" + render.answer_table(rows, shared=shared(rows))


def headline(nb: str, records: list[dict]) -> tuple[str, str]:
    """A notebook's finding status (PASS / FAIL / MIXED / NOT MEASURED / N/A) and one line, from its findings."""
    q = questions.BY_NUMBER.get(nb)
    if q is None:
        return "N/A", f"no question is registered for notebook {nb}"
    return render.headline(q.findings_of(questions.of_question(records, q)))


def _times(records: list[dict]) -> list[str]:
    return sorted(str(r["time"]) for r in records if isinstance(r, dict) and r.get("time"))


def _cpu(r: dict) -> str:
    cpu = r.get("cpu") or {}
    if not cpu:
        return "not recorded (records older than the CPU provenance)"
    isa = cpu.get("isa") or []
    amx = [f for f in isa if f.startswith("amx")]
    return (f"{cpu.get('model')}; AMX: {', '.join(amx) if amx else 'none'}; AVX-512: "
            f"{'yes' if any(f.startswith('avx512') for f in isa) else 'no'}; torch CPU capability "
            f"{cpu.get('capability')}; oneDNN {cpu.get('onednn')}, BLAS {cpu.get('blas')}"
            + (f"; {', '.join(f'{k}={v}' for k, v in cpu['env'].items())}" if cpu.get("env") else ""))


def provenance(records: list[dict]) -> dict:
    """Where the report's numbers came from: the commit of each notebook's records, the GPUs by name and UUID, the
    CPU by model and ISA, the libraries, the numerics env, and the span of the records' times."""
    recs = [x for x in records if isinstance(x, dict) and "code" in x]
    if not recs:
        return {}
    r = recs[0]
    out: dict = {}
    for q in questions.QUESTIONS:
        mine = questions.of_question(recs, q)
        if mine:
            commits = sorted({f"{(x.get('code') or {}).get('commit') or '?'}" + (", dirty tree" if (x.get("code") or {})
                              .get("dirty") else "") for x in mine})
            out[f"moe_lab, notebook {q.number}"] = f"{(mine[0].get('code') or {}).get('moe_lab')} (commit " \
                                                       f"{' / '.join(commits)}, {len(mine)} record(s))"
    releases = sorted({str(x["megatron_core"]) for x in recs if x.get("megatron_core")}, key=vt)
    gpus = sorted({str(x.get("gpu")) for x in recs if x.get("gpu")})
    uuids = sorted({u for x in recs for u in (x.get("gpu_uuids") or ([x["gpu_uuid"]] if x.get("gpu_uuid") else []))})
    placements = sorted({placement_label(x) for x in recs})
    ts = _times(recs)
    out.update({"megatron-core": ", ".join(releases), "torch": r.get("torch"), "CUDA": r.get("cuda"),
                "cuBLAS": r.get("cublas"), "NCCL": r.get("nccl"), "driver": r.get("driver"),
                "GPU": ", ".join(gpus) or None,
                "GPU UUID(s)": ", ".join(uuids) or ("not recorded (records older than the GPU UUID)" if gpus else None),
                "CPU": "; ".join(sorted({_cpu(x) for x in recs})),
                "placement(s)": "; ".join(placements), "python": r.get("python"),
                "numerics env": "; ".join(sorted({", ".join(f"{k}={v}" for k, v in (x.get("env") or {}).items())
                                                 or "(none set)" for x in recs})),
                "records measured": f"{ts[0]} … {ts[-1]}" if ts else "times not recorded"})
    return out


def day_and_machine(records: list[dict]) -> list[str]:
    """['2026-12-02', 'NVIDIA H200']: the day(s) the records were measured and the machine (GPU, else CPU model) —
    a span of days, several GPUs or CPUs as they are."""
    recs = [r for r in records if isinstance(r, dict)]
    days = sorted({t[:10] for t in _times(recs)})
    gpus = sorted({str(r["gpu"]) for r in recs if r.get("gpu")})
    cpus = sorted({str((r.get("cpu") or {}).get("model")) for r in recs if (r.get("cpu") or {}).get("model")})
    parts = [days[0] if len(days) == 1 else f"{days[0]} … {days[-1]}" if days else "not measured yet"]
    if gpus or cpus:
        parts.append(", ".join(gpus) if gpus else ", ".join(cpus))
    return parts


def title(profile: str, records: list[dict]) -> str:
    """A report's title: the profile, the day its records were measured and the machine — 'moe_lab report — gpu ·
    2026-12-02 · NVIDIA H200' / '... cpu · 2026-12-04 · AMD EPYC'."""
    return "moe_lab report — " + " · ".join([profile or "report"] + day_and_machine(records))


def generated_after(records: list[dict]) -> str:
    """The index's 'generated' time: now, which follows every record it renders (checked, not assumed)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ts = _times(records)
    return now if not ts or ts[-1] <= now else f"{now} (a record is stamped later: {ts[-1]} — clocks differ)"


ANSWER_CSS = """.banner{margin:.4em 0}.banner .b{display:inline-block;margin-right:.6em;padding:.15em .6em;border-radius:4px;
background:#eee}.banner .diverge{background:#fde2e2}.banner .agree{background:#d9f2dd}.banner .mixed{background:#fff1c2}
.banner .no_fix_found{background:#fde2e2;font-weight:600}.banner .fix_found{background:#dbe9f7}
table.answers{border-collapse:collapse;font-size:.86em}table.answers td,table.answers th{border:1px solid #ccc;
padding:.35em .6em;vertical-align:top;text-align:left}table.answers td div+div{margin-top:.25em}td.subj{min-width:11em}
td.empty{color:#888}.mk{font-weight:700}.mk.FAIL{color:#a4161a}.mk.PASS{color:#176b1b}.mk.MIXED{color:#7a5a00}
ul.shared{margin:.2em 0 .5em;padding-left:1.2em;color:#444;font-size:.9em}details>summary{cursor:pointer}
.st{font-weight:700;padding:0 .4em;border-radius:4px}.st.PASS{background:#d9f2dd;color:#176b1b}
.st.MIXED{background:#fff1c2;color:#7a5a00}.st.FAIL{background:#fde2e2;color:#a4161a}.st.na{background:#eee;color:#555}"""
"""The answer table's and the status badges' style: the index's, and each notebook page's answer block."""

CSS = """body{font-family:system-ui,sans-serif;margin:1.2em 2em;max-width:110em;color:#222}h1{font-size:1.4em;margin:.2em 0}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.35em .6em;vertical-align:top;text-align:left}
code,pre{font-size:.85em;background:#f3f3f3}pre{padding:.4em;white-space:pre-wrap}details{margin-top:.3em}
.where{color:#444;margin:.2em 0 .6em}.caveat{color:#555;border-top:1px dashed #ccc;padding-top:.3em}
.prov td:first-child{font-weight:600;white-space:nowrap}.run-failed{background:#fde2e2}""" + ANSWER_CSS


def status_badge(status: str) -> str:
    cls = {"PASS": "PASS", "FAIL": "FAIL", "MIXED": "MIXED"}.get(status, "na")
    return f"<span class='st {cls}'>{html.escape(status)}</span>"


def render_provenance(p: dict) -> str:
    if not p:
        return ""
    return "<table class='prov'>" + "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                                            for k, v in p.items() if v not in (None, "", "None")) + "</table>"


__all__ = ["answers", "answers_json", "render_answers", "shared", "headline", "provenance", "generated_after",
           "render_provenance",
           "job_lines", "ISSUE"]
