"""Findings in words: a notebook's verdict (text), the index cards (HTML), markdown for the README and the terminal.
Every sentence here is a finding's claim or built from a finding's fields; nothing is typed in about the numbers."""

from __future__ import annotations

import html

from .model import FAIL, MIXED, NA, NOT_MEASURED, PASS, Finding


def headline(fs: list[Finding]) -> tuple[str, str]:
    """One status and line over an experiment's card findings (all of them where none is a card's): no PASS without
    a measured finding — nothing measured is NOT MEASURED (or N/A where everything was not applicable)."""
    top = [f for f in fs if f.card] or list(fs)
    if not top:
        return NOT_MEASURED, "no records: nothing was measured"
    st = {f.status for f in top}
    measured = [f for f in top if f.status in (PASS, FAIL, MIXED)]
    if not measured:
        status = NOT_MEASURED if NOT_MEASURED in st else NA
    else:
        status = FAIL if FAIL in st else MIXED if MIXED in st else PASS
    pick = [f for f in top if f.status == status] or top
    n = {s: sum(f.status == s for f in top) for s in (PASS, FAIL, MIXED, NOT_MEASURED, NA) if any(f.status == s for f in top)}
    counts = ", ".join(f"{k} {v}" for k, v in n.items())
    return status, f"{counts} of {len(top)} finding(s): " + "; ".join(f.claim.split(" — ")[0] for f in pick[:3])


def verdict(fs: list[Finding], *, title: str = "") -> str:
    """A notebook's verdict cell: each finding on its own line, then the headline over its card findings."""
    if not fs:
        return (title + "\n" if title else "") + "[NOT MEASURED] no case ran: nothing is claimed."
    lines = [title] if title else []
    lines += ["- " + f.text() for f in fs]
    st, text = headline(fs)
    lines.append(f"Verdict: [{st}] {text}")
    return "\n".join(lines)


def caveat(card: dict) -> str | None:
    """Where a card's divergence rests on a collective's reduction order: that collective and what another transport
    may do — from the card's own findings (02's first divergent collective, the records' backend)."""
    rs = [f for f in card["findings"] if f.question == "ranks agree" and f.subject.get("attribution", "").startswith("ep")]
    if not rs:
        return None
    loc = next((f for f in card["findings"] if f.question == "first divergent stage" and f.subject.get("collective")),
               None)
    backend = "nccl" if "nccl" in card["placement"].lower() else "gloo"
    what = (f"the combine's collective {loc.subject['collective']} (first divergent stage {loc.subject['first_stage']})"
            if loc else "the dispatcher's collectives (first divergent stage not localised on this card)")
    other = ("NCCL with one rank per GPU may order it otherwise" if backend == "gloo"
             else "another NCCL algorithm or topology may order it otherwise")
    return f"EP order here rests on the order in which {backend} sums in {what}; {other}."


def cards(by_nb: dict[str, list[Finding]]) -> list[dict]:
    """One card per release x dispatcher x placement x layer: the card findings of every experiment for it, in the
    order of `by_nb` (the registry's: `moe_lab.questions.findings`). Findings about different subjects never share a
    card."""
    out: dict[tuple, dict] = {}
    for fs in by_nb.values():
        for f in fs:
            if not f.card:
                continue
            k = f.card_key()
            c = out.setdefault(k, {"release": k[0], "dispatcher": k[1], "placement": k[2], "layer": k[3],
                                   "findings": []})
            c["findings"].append(f)
    res = []
    for c in out.values():
        c["caveat"] = caveat(c)
        res.append(c)
    return res


def card_dict(c: dict) -> dict:
    return {**{k: v for k, v in c.items() if k != "findings"}, "findings": [f.to_dict() for f in c["findings"]]}


MARKS = {PASS: "✓", FAIL: "✗", MIXED: "≈", NOT_MEASURED: "–", NA: "·"}
"""A status by glyph as well as colour (read without colour, e.g. under colour-blindness or in print)."""
UNMARKED = ("where", "fix", "cost")
"""Columns whose cells are not tests: a location, a remedy, a ratio — shown without a status mark."""


def _st(status: str) -> str:
    cls = {"PASS": "PASS", "FAIL": "FAIL", "MIXED": "MIXED"}.get(status, "na")
    return f"<span class='st {cls}'>{MARKS.get(status, '')} {html.escape(status)}</span>"


def subject_title(row) -> str:
    """'megatron-core 0.16.1 · allgather · qwen3-30b-a3b · tp 1 × ep 4': what a row is about, in its own words."""
    return " · ".join([f"megatron-core {row.release}", row.dispatcher, row.model] + ([", ".join(row.layouts)]
                                                                                     if row.layouts else []))


SHOWN = 3
"""Lines a cell shows; the rest are counted and linked to the row's evidence."""
_ORDER = {FAIL: 0, MIXED: 1, NOT_MEASURED: 2, PASS: 3, NA: 4}


def _cell(col: str, cells: list, anchor: str) -> str:
    if not cells:
        return "<td class='empty'>not measured</td>"
    # a fix first (what to do), then what failed before what held
    ranked = list(cells) if col in UNMARKED else sorted(cells, key=lambda c: (not (c.finding is not None and c.finding.question.startswith("fix")),
                                          _ORDER.get(c.status, 5)))
    parts = []
    for c in ranked[:SHOWN]:
        mark = "" if col in UNMARKED else f"<span class='mk {c.status.replace(' ', '_')}'>{MARKS.get(c.status, '')}</span> "
        line = f"{mark}{html.escape(c.text)}"
        f = c.finding
        if col == "fix" and f is not None and f.lines:
            line += ("<details><summary>the job line(s)</summary><pre>" + html.escape("\n".join(f.lines))
                     + "</pre></details>")
        parts.append(f"<div>{line}</div>")
    if len(ranked) > SHOWN:
        parts.append(f"<div><a href='{anchor}'>+{len(ranked) - SHOWN} more</a></div>")
    return f"<td>{''.join(parts)}</td>"


def answer_table(rows: list, *, shared: dict[str, str], evidence_href=lambda i: f"#ev-{i}") -> str:
    """The answer table: one row per subject, each cell a few words with a mark where it is a test; the subject
    links to its evidence below. `shared`: what every row has in common (e.g. the placement), said once above."""
    from .answers import COLUMNS, HEADERS

    cols = [c for c in COLUMNS if any(r.cells.get(c) for r in rows)]
    head = "<tr><th>subject</th>" + "".join(f"<th>{html.escape(HEADERS[c])}</th>" for c in cols) + "</tr>"
    trs = []
    for i, r in enumerate(rows):
        own = [r.model] + ([f"megatron-core {r.release}"] if "release" not in shared else []) + \
              ([r.dispatcher] if "dispatcher" not in shared else []) + ([r.placement] if "placement" not in shared
                                                                        else [])
        subj = (f"<td class='subj'><b>{html.escape(own[0])}</b>" + "".join(f"<br>{html.escape(x)}" for x in own[1:])
                + (f"<br><small>{html.escape(', '.join(r.layouts))}</small>" if r.layouts else "")
                + f"<br><a href='{evidence_href(i)}'>evidence</a></td>")
        trs.append("<tr>" + subj + "".join(_cell(c, r.cells.get(c, []), evidence_href(i)) for c in cols) + "</tr>")
    said = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in shared.items())
    return (f"<ul class='shared'>{said}</ul>" if said else "") + f"<table class='answers'>{head}{''.join(trs)}</table>"


def answers_text(rows: list) -> str:
    """The answer table for a terminal: per subject, each column's words (a mark where the column is a test)."""
    from .answers import COLUMNS, HEADERS

    out = []
    for r in rows:
        out.append(f"* {subject_title(r)} — {r.placement}")
        for col in COLUMNS:
            cells = r.cells.get(col, [])
            if cells:
                said = "; ".join(("" if col in UNMARKED else MARKS.get(c.status, "") + " ") + c.text for c in cells)
                out.append(f"    {HEADERS[col]}: {said}")
    return "\n".join(out)


def evidence(rows: list) -> str:
    """Per row, collapsed: every card finding of its subject in full (status, question, claim, notes, job lines)
    and the caveat its findings carry."""
    out = []
    for i, r in enumerate(rows):
        items = []
        col_of = {id(c.finding): col for col, cells in r.cells.items() for c in cells if c.finding is not None}
        for f in r.findings:
            # a location or a remedy is not a test: its few words stand where a badge would
            label = (f"<span class='st na'>{html.escape(f.short)}</span>" if col_of.get(id(f)) in UNMARKED and f.short
                     else _st(f.status))
            items.append(f"<li>{label} <b>{html.escape(f.question)}</b>: {html.escape(f.claim)}"
                         + (f" <small>({html.escape('; '.join(f.evidence.notes))})</small>" if f.evidence.notes else "")
                         + ("<pre>" + html.escape("\n".join(f.lines)) + "</pre>" if f.lines else "") + "</li>")
        cav = caveat({"findings": r.findings, "placement": r.placement})
        out.append(f"<details id='ev-{i}'><summary>{html.escape(subject_title(r))}</summary>"
                   f"<p class='where'>{html.escape(r.placement)}<br><small>{html.escape(r.layer)}</small></p>"
                   f"<ul>{''.join(items)}</ul>"
                   + (f"<p class='caveat'><small>{html.escape(cav)}</small></p>" if cav else "") + "</details>")
    return "".join(out)


def markdown(name: str, by_nb: dict[str, list[Finding]], *, short: bool = False) -> str:
    """A report's findings for the README: its placement(s), then each card finding, one bullet each (`short`: the
    claim up to its first ' — ', the explanation left to the report)."""
    cs = cards(by_nb)
    lines = [f"**`{name}`**"]
    for c in cs:
        lines.append(f"- megatron-core {c['release']}, {c['dispatcher']} — {c['placement']}; {c['layer']}:")
        for f in c["findings"]:
            claim = f.claim.split(" — ")[0] if short else f.claim
            lines.append(f"  - [{f.status}] {f.question}: {claim}" + (f" → `{f.remedy}`" if f.remedy and short else ""))
        if c.get("caveat"):
            lines.append(f"  - caveat: {c['caveat']}")
    return "\n".join(lines)


def terminal(by_nb: dict[str, list[Finding]], names: dict[str, str]) -> str:
    """Each question's headline and card findings; `names`: notebook number → the question's name."""
    out = []
    for nb, fs in by_nb.items():
        st, text = headline(fs)
        out.append(f"{nb} {names.get(nb, '?')}: [{st}] {text}")
        out += ["   " + f.text() for f in fs if f.card]
    return "\n".join(out)


__all__ = ["headline", "verdict", "cards", "card_dict", "answer_table", "answers_text", "evidence", "subject_title", "markdown", "terminal", "caveat", "PASS", "FAIL"]
