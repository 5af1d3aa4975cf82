"""`moe-lab compare A B`: the same cases in two reports, side by side — e.g. one rank per GPU over NCCL against the
same EP as virtual EP on one GPU, or the same profile on two machines or two days.

A case is a finding of a question that has a compare module (its folder's `compare`): its verdict is the finding's
status, the verdict details its subject carries (the question's `DETAILS`, e.g. the attribution or the first
divergent stage) and the remedy it names — what `moe-lab findings` says, built by the same findings code from each
report's latest records (`results.latest`). The two sides' cases are matched by their full subject: experiment,
question, dispatcher, the layout the finding rests on and the case's own axes (router dtype, variant, setting,
stack, mode, ...), then release, layer, environment, placement, machine and trials. Cases whose subjects differ only
in some of these are still matched where each side holds exactly one such case, the looser match tried only after
the exact one:

- a case matched across another release, layer or numerics environment is refused (`UnlikeReports`, one line)
  unless the caller allows it (`allow_unlike`): those are other measurements, not the same one elsewhere;
- placement, machine (the GPU by name and UUID, the CPU by model), trials and the question's `MARKED` subject
  fields (a kernel's device, the lengths of a sweep) are what a comparison is for: allowed, and every row names
  those that differ, the values listed once above the rows with their counts.

Every case held by one side only is listed, and every count says of how many. Nothing here states a cause: a row
that disagrees gives the two verdicts, the two magnitudes and what differs between the sides. Reads records,
measures nothing, imports no torch."""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..findings.model import MIXED, FAIL, PASS, Count, Finding, case_keys, env_label, layout_label

FACTOR = 2.0
REFUSED = ("release", "layer", "environment")
"""Side fields that make two cases other measurements: refused unless the caller allows unlike sides."""
MARKED = ("placement", "machine", "trials", "layouts")
"""Side fields a comparison is made across: allowed, named on every row where they differ."""
STAGES = (None, REFUSED, ("release", "environment"), ("release",), ())
"""The side fields two cases must share, from the exact match (None: every side field) to the loosest (the case's
identity alone); each looser stage matches only cases the stricter ones left, and only one case to one."""
WORDS = {"release": "releases", "layer": "layers", "environment": "numerics environments", "placement": "placements",
         "machine": "machines", "trials": "trial counts", "layouts": "layouts measured"}
MEASURED = (PASS, FAIL, MIXED)


class UnlikeReports(ValueError):
    """The two sides hold cases that match only across another release, layer or numerics environment."""


def check_factor(factor) -> float:
    """`--factor`: a finite number above 1 (two magnitudes 'agree' within it); a ValueError naming it otherwise."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"--factor {factor!r}: must be a finite number above 1 (two magnitudes agree when the larger "
                         "is at most this many times the smaller), e.g. --factor 2")
    return float(factor)


# ---------------------------------------------------------------------------------------------- reading a report


def load(path: str | Path) -> tuple[Path, list[dict]]:
    """A report folder (or its results.json, or results.json.xz) → (folder, the records its notebooks' latest runs
    showed). Anything that is not a readable report — no results.json, malformed JSON, a record whose `notebook`,
    `case_key`, `experiment`, `kind` or `config` has a shape no moe-lab record has, a cases-NN.json that is not
    {"keys": [...]} — is one ValueError naming the file and what to do."""
    from .. import results

    p = Path(path)
    file = p / "results.json" if p.is_dir() else p
    if file.name.endswith(".xz"):
        file = file.with_name(file.name[: -len(".xz")])
    if not file.is_file() and not file.with_name(file.name + ".xz").is_file():
        raise ValueError(f"{path}: no results.json there (give a report folder, e.g. "
                         "reports/published/gpu-h200x1-2026-12-01)")
    try:
        records = results.load(file)
    except results.ResultsFileError as e:
        raise ValueError(str(e)) from None
    folder = file.parent
    for i, r in enumerate(records):
        _check_record(file, i, r)
    for nb in sorted({r["notebook"] for r in records if r.get("notebook")}):
        _check_cases_file(folder / f"cases-{nb}.json")
    return folder, results.latest(records, folder)


_SCALARS = (str, type(None))


def _check_record(file: Path, i: int, r: dict) -> None:
    for k in ("notebook", "case_key", "experiment", "kind"):
        if not isinstance(r.get(k), _SCALARS):
            raise ValueError(f"{file}: record {i} has {k} {r.get(k)!r} ({type(r.get(k)).__name__}); a moe-lab record's "
                             f"{k} is a string — this file is not a report's results.json, or was edited by hand")
    for k in ("config", "env"):
        if not isinstance(r.get(k), (dict, type(None))):
            raise ValueError(f"{file}: record {i} has {k} of type {type(r.get(k)).__name__}; a moe-lab record's {k} "
                             "is a JSON object — this file is not a report's results.json, or was edited by hand")


def _check_cases_file(p: Path) -> None:
    if not p.exists():
        return
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} cannot be read as JSON ({e}); it says which records the notebook's latest run "
                         "showed — restore it, or delete it to compare every record of that notebook") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{p} must be a JSON object whose 'keys' is a list of case keys, found "
                         f"{type(data).__name__}" + (f" with keys {type(keys).__name__}" if isinstance(data, dict)
                                                     else "")
                         + "; restore it, or delete it to compare every record of that notebook")


# ---------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One finding of one report, as a case to match: who it is about (`identity`), where and how it was measured
    (`sides`), what it says (`verdict`), and the records it rests on."""

    number: str
    finding: Finding
    records: list[dict]
    identity: tuple
    sides: dict
    verdict: tuple

    @property
    def name(self) -> str:
        f = self.finding
        axes = [v if k in ("dispatcher", "layout") else f"{k.replace('_', ' ')} {v}" for k, v in self.identity[2:]]
        return f"{self.number} {f.question}" + (" — " + ", ".join(axes) if axes else "")

    def key(self, kept) -> tuple:
        fields = sorted(self.sides) if kept is None else kept
        return self.identity + tuple((k, self.sides.get(k)) for k in fields)

    def verdict_text(self) -> str:
        status, *rest = self.verdict
        return status + (f" ({'; '.join(rest)})" if rest else "")


def _machine(records: list[dict]) -> str:
    """The GPUs by name and UUID (first 8 characters), else the CPU by model."""
    out = set()
    for r in records:
        if r.get("device") == "cuda" or r.get("gpu"):
            uuids = r.get("gpu_uuids") if isinstance(r.get("gpu_uuids"), list) else [r.get("gpu_uuid")]
            names = {f"{r.get('gpu')} {str(u)[:8]}" for u in uuids if u}
            out |= names or {str(r.get("gpu") or "a GPU (name not recorded)")}
        elif isinstance(r.get("cpu"), dict):
            out.add(f"CPU {r['cpu'].get('model') or '(model not recorded)'}")
    return ", ".join(sorted(out)) or "not recorded"


def _trials(f: Finding, records: list[dict]) -> str:
    """The trials the finding's comparisons ran (its evidence's, else its records' comparisons')."""
    t = f.evidence.trials
    if isinstance(t, (list, tuple)) and len(t) == 2:
        return str(t[1])
    seen = set()
    for r in records:
        for v in [r, *(x for x in r.values() if isinstance(x, dict))]:
            n = v.get("trials")
            if isinstance(n, int) and not isinstance(n, bool):
                seen.add(n)
    return ", ".join(map(str, sorted(seen))) or "not recorded"


def cases_of(q, records: list[dict]) -> list[Case]:
    """Question `q`'s cases in one report: each of its findings with the records it rests on."""
    from ..questions import of_question

    mod = q.module(q.compare)
    mine = of_question(records, q)
    by_key: dict[str, list[dict]] = {}
    for r, k in zip(mine, case_keys(mine)):
        by_key.setdefault(k, []).append(r)
    details, marked = getattr(mod, "DETAILS", ()), getattr(mod, "MARKED", ())
    out = []
    for f in q.findings_of(mine):
        behind = [r for k in dict.fromkeys(f.evidence.records) for r in by_key.get(k, [])]
        s = {k: str(v) for k, v in f.subject.items()}
        layouts = sorted({layout_label(r) for r in behind}) or [s.get("layout", "?")]
        axes = {k: v for k, v in s.items() if k not in REFUSED + ("placement", "layout") + tuple(details)
                + tuple(marked)}
        if len(layouts) == 1:  # a finding about one layout; a group's is about the layouts it spans (a side)
            axes["layout"] = layouts[0]
        if hasattr(mod, "axes"):
            axes.update({k: str(v) for k, v in mod.axes(f, behind).items()})
        envs = sorted({env_label(r) for r in behind}) or [s.get("environment", "?")]
        sides = {"release": s.get("release", "?"), "layer": s.get("layer", "?"), "environment": "; ".join(envs),
                 "placement": s.get("placement", "?"), "machine": _machine(behind), "trials": _trials(f, behind),
                 "layouts": ", ".join(layouts)}
        sides.update({k: s[k] for k in marked if k in s})
        head = ("dispatcher", "layout")
        ident = (f.experiment, f.question) + tuple((k, axes[k]) for k in head if k in axes) \
            + tuple(sorted((k, v) for k, v in axes.items() if k not in head))
        verdict = (f.status, *(f"{k.replace('_', ' ')} {s[k]}" for k in details if s.get(k) not in (None, "None")),
                   *([f"remedy {f.remedy}"] if f.remedy else []))
        out.append(Case(q.number, f, behind, ident, sides, verdict))
    return out


def match(ca: list[Case], cb: list[Case]) -> tuple[list[tuple[Case, Case]], list[Case], list[Case]]:
    """(pairs, only in A, only in B): stage by stage (`STAGES`), the cases left on each side whose key at that stage
    is held by exactly one case on each side are a pair."""
    left_a, left_b, pairs = list(ca), list(cb), []
    for kept in STAGES:
        ga: dict = {}
        gb: dict = {}
        for c in left_a:
            ga.setdefault(c.key(kept), []).append(c)
        for c in left_b:
            gb.setdefault(c.key(kept), []).append(c)
        now = [(ga[k][0], gb[k][0]) for k in ga if k in gb and len(ga[k]) == 1 and len(gb[k]) == 1]
        pairs += now
        used = {id(c) for p in now for c in p}
        left_a = [c for c in left_a if id(c) not in used]
        left_b = [c for c in left_b if id(c) not in used]
    order = {id(c): i for i, c in enumerate(ca)}
    return sorted(pairs, key=lambda p: order[id(p[0])]), left_a, left_b


# ---------------------------------------------------------------------------------------------- magnitudes


def valid(m) -> bool:
    """A magnitude that can be compared: a count n of `of` with 0 <= n <= of and of > 0, or a finite number >= 0."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
    if isinstance(m, Count):
        return num(m.n) and num(m.of) and m.of > 0 and 0 <= m.n <= m.of
    return num(m) and m >= 0


def magnitude_text(m) -> str:
    if m is None:
        return "—"
    if isinstance(m, Count):  # its measure is the row's; the count keeps its denominator
        return f"{m.n:,} of {m.of:,} ({m.frac:.3g})" if valid(m) else f"invalid ({m.n!r} of {m.of!r})"
    return f"{m:.3g}" if valid(m) else f"invalid ({m!r})"


def _value(m) -> float:
    return m.frac if isinstance(m, Count) else float(m)


def _what(m) -> str | None:
    return m.what if isinstance(m, Count) else None


def within(ma, mb, factor: float) -> bool | None:
    """Two magnitudes of the same measure within `factor` of each other (two zeros agree, a zero and a non-zero never
    do); None where either is missing or invalid, or they measure different things."""
    if ma is None or mb is None or not valid(ma) or not valid(mb) or _what(ma) != _what(mb):
        return None
    a, b = _value(ma), _value(mb)
    if a == 0 or b == 0:
        return a == b
    return max(a, b) / min(a, b) <= factor


# ---------------------------------------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    a: str
    b: str
    factor: float
    rows: list[dict]
    only_a: list[Case]
    only_b: list[Case]
    per_question: dict
    not_compared: dict
    lines: list[str] = field(default_factory=list)
    """Lines a question's compare module adds over its rows (its `summary`)."""
    sides: dict = field(default_factory=dict)

    @property
    def agree(self) -> int:
        return sum(r["agree"] for r in self.rows)


def _row(q, x: Case, y: Case, extra: dict, factor: float) -> dict:
    """One matched pair as a row: both verdicts, the question's magnitudes (`extra`: its `rows` entry — 'what', 'a',
    'b', optionally its own 'within_factor', and fields of its own), what differs between the sides."""
    differs = [k for k in sorted(set(x.sides) | set(y.sides), key=_field_order) if x.sides.get(k) != y.sides.get(k)]
    extra = dict(extra)
    what, ma, mb = extra.pop("what", ""), extra.pop("a", None), extra.pop("b", None)
    wf = extra.pop("within_factor", None) if "within_factor" in extra else within(ma, mb, factor)
    return {"notebook": q.number, "case": x.name, "question": x.finding.question, "a": x.verdict_text(),
            "b": y.verdict_text(), "agree": x.verdict == y.verdict,
            "measured": x.finding.status in MEASURED and y.finding.status in MEASURED,
            "magnitude": what if ma is not None or mb is not None else "", "magnitude_a": magnitude_text(ma),
            "magnitude_b": magnitude_text(mb), "within_factor": wf, "differs": differs, "sides_a": dict(x.sides),
            "sides_b": dict(y.sides), "claim_a": x.finding.claim, "claim_b": y.finding.claim, **extra}


def _field_order(k: str) -> tuple:
    order = REFUSED + MARKED
    return (order.index(k) if k in order else len(order), k)


def compare(a: list[dict], b: list[dict], *, factor: float = FACTOR, allow_unlike: bool = False,
            where: tuple[str, str] = ("", "")) -> Comparison:
    """Every case of every question with a compare module, matched across the two record sets (`match`); rows for
    the pairs (each question's `rows` gives the magnitudes), the cases held by one side only. Raises UnlikeReports
    when a pair differs in a REFUSED field and `allow_unlike` is not set."""
    from ..questions import QUESTIONS, of_question

    factor = check_factor(factor)
    rows, only_a, only_b, per_q, not_cmp, lines, unlike = [], [], [], {}, {}, [], []
    for q in QUESTIONS:
        if q.compare is None:
            na, nb = (len(q.findings_of(of_question(x, q))) for x in (a, b))
            if na or nb:
                not_cmp[q.number] = (na, nb)
            continue
        ca, cb = cases_of(q, a), cases_of(q, b)
        pairs, la, lb = match(ca, cb)
        extras = q.compare_rows()([_as_dict(x) for x, _ in pairs], [_as_dict(y) for _, y in pairs], factor)
        mine = [_row(q, x, y, e, factor) for (x, y), e in zip(pairs, extras)]
        unlike += [r for r in mine if any(k in REFUSED for k in r["differs"])]
        rows += mine
        only_a += la
        only_b += lb
        if ca or cb:
            per_q[q.number] = {"a": len(ca), "b": len(cb), "both": len(pairs), "only_a": len(la), "only_b": len(lb)}
        summary_of = getattr(q.module(q.compare), "summary", None)
        like = [r for r in mine if not set(r["differs"]) & set(REFUSED)]  # a line over cases of one kind only
        if summary_of is not None and like:
            lines += summary_of(like)
    if unlike and not allow_unlike:
        raise UnlikeReports(_unlike_message(unlike, len(rows)))
    return Comparison("A", "B", factor, rows, only_a, only_b, per_q, not_cmp, lines,
                      {"a": _describe(a, where[0]), "b": _describe(b, where[1])})


def _as_dict(c: Case) -> dict:
    return {"finding": c.finding, "records": c.records}


def _unlike_message(unlike: list[dict], n: int) -> str:
    parts = []
    for k in REFUSED:
        diff = Counter((r["sides_a"][k], r["sides_b"][k]) for r in unlike if k in r["differs"])
        if diff:
            (va, vb), m = diff.most_common(1)[0]
            more = f"; {len(diff) - 1} other pair(s) of {WORDS[k]}" if len(diff) > 1 else ""
            parts.append(f"different {WORDS[k]} ({va} vs {vb}) in {sum(diff.values())} of the {n} cases they both "
                         f"hold{more}")
    return ("A and B hold " + "; ".join(parts)
            + " — pass --allow-unlike to compare them anyway, each row marked")


def _describe(records: list[dict], where: str) -> dict:
    """What a report's records span: releases, placements, machines, layers (of subjects `subject_of` names)."""
    from ..findings.model import subject_of

    subs = []
    for r in records:
        try:
            subs.append(subject_of(r))
        except (KeyError, TypeError, ValueError, AttributeError):  # a record findings cannot read: its finding says so
            continue
    return {"where": where, "records": len(records), "release": sorted({s["release"] for s in subs}),
            "placement": sorted({s["placement"] for s in subs}), "machine": _machine(records),
            "layer": sorted({s["layer"] for s in subs})}


# ---------------------------------------------------------------------------------------------- words


def _count(n: int, of: int, what: str) -> str:
    return f"{n} of {of} {what}"


def answer(c: Comparison) -> list[str]:
    """The short answer: how many cases agree, disagree and are held by one side only, each with its denominator."""
    n = len(c.rows)
    measured = sum(r["measured"] for r in c.rows)
    judged = [r for r in c.rows if r["within_factor"] is not None]
    out = [f"Cases held by both: {n}. Verdicts agree in {_count(c.agree, n, 'cases held by both')}"
           + (f" ({n - measured} of them not measured or not applicable on at least one side)" if n > measured else "")
           + f"; they disagree in {n - c.agree}."]
    if judged:
        out.append(f"Magnitudes within {c.factor:g}x in {sum(r['within_factor'] for r in judged)} of {len(judged)} "
                   f"cases where both sides carry a valid magnitude of the same measure ({n - len(judged)} of the "
                   f"{n} carry none, or not a comparable one).")
    out.append(f"Only in {c.a}: {len(c.only_a)} case(s){_by_question(c.only_a)}; only in {c.b}: {len(c.only_b)} "
               f"case(s){_by_question(c.only_b)}.")
    if c.per_question:
        out.append(f"Per question, cases in {c.a} / in {c.b} / held by both: "
                   + "; ".join(f"{nb} {x['a']} / {x['b']} / {x['both']}" for nb, x in c.per_question.items()) + ".")
    for nb, (na, nb_) in c.not_compared.items():
        out.append(f"{nb}: not compared — the question has no compare module ({na} finding(s) in {c.a}, {nb_} in "
                   f"{c.b}).")
    return out


def _by_question(cs: list[Case]) -> str:
    if not cs:
        return ""
    per = Counter(x.number for x in cs)
    return " (" + ", ".join(f"{k}: {v}" for k, v in sorted(per.items())) + ")"


def differences(c: Comparison) -> list[str]:
    """Per side field that differs in some pair: the value pairs with how many of the pairs hold each."""
    out = []
    n = len(c.rows)
    for k in REFUSED + MARKED + tuple(sorted({d for r in c.rows for d in r["differs"]} - set(REFUSED + MARKED))):
        diff = Counter((r["sides_a"].get(k), r["sides_b"].get(k)) for r in c.rows if k in r["differs"])
        if not diff:
            continue
        shown = [f"{c.a} {va} vs {c.b} {vb} in {m} of {n}" for (va, vb), m in diff.most_common(3)]
        more = f"; {len(diff) - 3} other pair(s)" if len(diff) > 3 else ""
        out.append(f"{k.replace('_', ' ')}: " + "; ".join(shown) + more)
    return out


def _sides_line(name: str, d: dict) -> str:
    where = f"{d['where']}, " if d["where"] else ""
    return (f"{name}: {where}{d['records']} record(s); megatron-core {', '.join(d['release']) or '?'}; "
            f"{'; '.join(d['placement']) or 'placement not recorded'}; {d['machine']}")


def text(c: Comparison) -> str:
    """The comparison for a terminal: the sides, the short answer, what differs between the sides, then every case
    held by both (those that disagree first) and every case held by one side only."""
    lines = [_sides_line(c.a, c.sides["a"]), _sides_line(c.b, c.sides["b"])] + answer(c)
    diffs = differences(c)
    if diffs:
        lines.append("Differs between the sides (named on each row): " + " | ".join(diffs))
    lines += c.lines
    if c.rows:
        lines.append("")
        lines.append(f"Held by both ({len(c.rows)}; ≠ the verdicts differ, = they agree):")
        for r in sorted(c.rows, key=lambda r: r["agree"]):
            mag = (f"; {r['magnitude']}: {c.a} {r['magnitude_a']}, {c.b} {r['magnitude_b']}"
                   + ("" if r["within_factor"] is None else
                      f" ({'within' if r['within_factor'] else 'not within'} {c.factor:g}x)")
                   if r["magnitude"] else "")
            extra = f"; {r['bits']}" if r.get("bits") else ""
            differs = f"; differs: {', '.join(r['differs'])}" if r["differs"] else ""
            lines.append(f"{'=' if r['agree'] else '≠'} {r['case']}: {c.a} {r['a']}, {c.b} {r['b']}{mag}{extra}"
                         f"{differs}")
    for name, cs in ((c.a, c.only_a), (c.b, c.only_b)):
        if cs:
            lines.append("")
            lines.append(f"Only in {name} ({len(cs)}):")
            side = c.sides["a" if cs is c.only_a else "b"]
            spans = [k for k in ("release", "placement", "layer") if len(side[k]) > 1]
            lines += [f"- {x.name}: {x.verdict_text()}" + (f" ({'; '.join(_side_words(x, k) for k in spans)})"
                                                             if spans else "") for x in cs]
    return "\n".join(lines)


def _side_words(x: Case, k: str) -> str:
    return f"megatron-core {x.sides[k]}" if k == "release" else x.sides[k]


def summary(a: list[dict], b: list[dict], *, factor: float = FACTOR, allow_unlike: bool = False,
            where: tuple[str, str] = ("", "")) -> str:
    return text(compare(a, b, factor=factor, allow_unlike=allow_unlike, where=where))


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:110em;color:black}"
        "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid silver;padding:.3em .5em;"
        "vertical-align:top;text-align:left}tr.differ{background:mistyrose}tr.agree{background:honeydew}"
        ".answer{font-size:110%}details{max-width:40em}code{font-size:95%}")


def page(c: Comparison, *, title: str = "") -> str:
    """The comparison as a self-contained HTML page: the short answer first, then the table of cases held by both,
    then the cases held by one side only. Every value is escaped."""
    e = lambda x: html.escape(str(x), quote=True)  # noqa: E731
    title = title or "moe-lab compare: " + " vs ".join(c.sides[s]["where"] or n for n, s in ((c.a, "a"), (c.b, "b")))
    out = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
           f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>",
           "<div class='answer'>" + "".join(f"<p>{e(x)}</p>" for x in answer(c)) + "</div>",
           "<ul>" + "".join(f"<li>{e(_sides_line(n, c.sides[s]))}</li>" for n, s in ((c.a, "a"), (c.b, "b"))) + "</ul>"]
    diffs = differences(c)
    if diffs:
        out.append("<h2>What differs between the sides</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in diffs)
                   + "</ul>")
    if c.lines:
        out.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in c.lines) + "</ul>")
    if c.rows:
        head = ["", "case", f"verdict {c.a}", f"verdict {c.b}", "magnitude", c.a, c.b, f"within {c.factor:g}x",
                "differs", "claims"]
        out.append(f"<h2>Held by both ({len(c.rows)})</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head)
                   + "</tr>")
        for r in sorted(c.rows, key=lambda r: r["agree"]):
            wf = "—" if r["within_factor"] is None else "yes" if r["within_factor"] else "no"
            diff = "; ".join(f"{k}: {c.a} {r['sides_a'].get(k)} / {c.b} {r['sides_b'].get(k)}" for k in r["differs"])
            claims = (f"<details><summary>findings</summary><p>{e(c.a)}: {e(r['claim_a'])}</p>"
                      f"<p>{e(c.b)}: {e(r['claim_b'])}</p></details>")
            cells = ["=" if r["agree"] else "≠", r["case"], r["a"], r["b"], r["magnitude"], r["magnitude_a"],
                     r["magnitude_b"], wf, diff + (f" {r['bits']}" if r.get("bits") else "")]
            out.append(f"<tr class='{'agree' if r['agree'] else 'differ'}'>"
                       + "".join(f"<td>{e(x)}</td>" for x in cells) + f"<td>{claims}</td></tr>")
        out.append("</table>")
    for name, cs in ((c.a, c.only_a), (c.b, c.only_b)):
        out.append(f"<h2>Only in {e(name)} ({len(cs)})</h2>")
        if cs:
            out.append("<table><tr><th>case</th><th>verdict</th><th>release</th><th>placement</th><th>layer</th></tr>"
                       + "".join(f"<tr><td>{e(x.name)}</td><td>{e(x.verdict_text())}</td>"
                                 f"<td>{e(x.sides['release'])}</td><td>{e(x.sides['placement'])}</td>"
                                 f"<td>{e(x.sides['layer'])}</td></tr>" for x in cs) + "</table>")
    out.append("</body></html>")
    return "\n".join(out)


__all__ = ["compare", "summary", "text", "page", "load", "check_factor", "match", "cases_of", "within", "valid",
           "Case", "Comparison", "UnlikeReports", "FACTOR", "REFUSED", "MARKED", "WORDS"]
