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


def _st(status: str) -> str:
    cls = {"PASS": "PASS", "FAIL": "FAIL", "MIXED": "MIXED"}.get(status, "na")
    return f"<span class='st {cls}'>{html.escape(status)}</span>"


def render_cards(cs: list[dict]) -> str:
    parts = []
    for c in cs:
        rows = [f"<p class='where'>{html.escape(c['placement'])}<br><small>{html.escape(c['layer'])}</small></p>"]
        for f in c["findings"]:
            rows.append(f"<p>{_st(f.status)} <b>{html.escape(f.question)}</b>: {html.escape(f.claim)}"
                        + (f" <small>({html.escape('; '.join(f.evidence.notes))})</small>" if f.evidence.notes else "")
                        + "</p>"
                        + ("<pre>" + html.escape("\n".join(f.lines)) + "</pre>" if f.lines else ""))
        if c.get("caveat"):
            rows.append(f"<p class='caveat'><small>{html.escape(c['caveat'])}</small></p>")
        parts.append(f"<div class='card'><h3>megatron-core {html.escape(c['release'])} · "
                     f"{html.escape(c['dispatcher'])}</h3>{''.join(rows)}</div>")
    return "<div class='cards'>" + "".join(parts) + "</div>"


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


__all__ = ["headline", "verdict", "cards", "card_dict", "render_cards", "markdown", "terminal", "caveat", "PASS", "FAIL"]
