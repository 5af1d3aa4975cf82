"""An executed notebook's pages: what the index reads from it (title, verdict, first error), the failure banner
that makes a stopped run visible in it, and its HTML (full, and the shared page without code)."""

from __future__ import annotations

import html
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: scrubbed from shared pages as '<moe_lab>'
NB_PATTERN = re.compile(r"^(\d\d)_[\w-]+\.ipynb$")  # a numbered notebook: NN_name.ipynb


def title_of(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "(untitled)"


def verdict_of(nb) -> str:
    """The text output of the cell tagged `verdict` (first lines), or '' if it did not run."""
    for cell in nb.cells:
        if "verdict" in cell.get("metadata", {}).get("tags", []):
            texts = []
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    texts.append(out.get("text", ""))
                elif "data" in out:
                    texts.append(out["data"].get("text/markdown") or out["data"].get("text/plain", ""))
            return "".join(texts).strip()
    return ""


def error_of(nb) -> str:
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return f"{out.get('ename')}: {out.get('evalue')}"[:500]
    return ""


LONG_OUTPUT = 40
"""Text outputs longer than this many lines are folded on the pages (a table, a settings dump): the figures and the
answer stay on the first screens, the numbers a click away."""
EVIDENCE_TAGS = ("verdict", "recommendations")
"""Cells whose output is the findings in full: folded at the page's end under 'evidence' (the answer block on top
says it in a few words)."""


def page_records(nb_path: Path) -> list[dict] | None:
    """The records of the notebook's question in its report folder (the latest run's); None where no question is
    registered for it or the records cannot be read."""
    from .. import questions, results

    q = questions.BY_NUMBER.get(nb_path.name[:2])
    if q is None:
        return None
    try:
        return questions.of_question(results.latest(results.load(nb_path.parent / "results.json"), nb_path.parent), q)
    except results.ResultsFileError:
        return None


def answer_block(nb_path: Path, records: list[dict] | None) -> str | None:
    """The page's answer, first: this question's rows of the answer table (`moe_lab.findings.answers`) from its
    records, with its headline; None where there are no readable records."""
    from .. import questions
    from ..findings import answers, render
    from . import summary

    if records is None:
        return None
    q = questions.BY_NUMBER[nb_path.name[:2]]
    fs = q.findings_of(records)
    status, text = render.headline(fs)
    rows = answers.table({q.number: fs}, {q.number: q.answers}, {q.number: q.fallback_answers})
    table = render.answer_table(rows, shared=summary.shared(rows), evidence_href=lambda i: "#evidence") if any(
        r.cells for r in rows) else ""
    return (f"<h2 id='answer'>Answer</h2>\n\n<p>{summary.status_badge(status)} {html.escape(text)}</p>\n\n"
            f"{table}")


def _text_of(out) -> str:
    if out.get("output_type") == "stream":
        return out.get("text", "")
    return str((out.get("data") or {}).get("text/plain", ""))


def _folded(summary_: str, out, *, anchor: str = "") -> dict:
    """An output replaced by the same content inside a collapsed <details> (its HTML where it has one)."""
    import nbformat

    data = out.get("data") or {}
    inner = data.get("text/html") or f"<pre>{html.escape(_text_of(out))}</pre>"
    return nbformat.v4.new_output("display_data", data={
        "text/html": f"<details{f' id={anchor!r}' if anchor else ''}><summary>{html.escape(summary_)}</summary>"
                     f"{inner}</details>", "text/plain": _text_of(out)})


def shape_page(nb, nb_path: Path, records: list[dict] | None) -> None:
    """The page's order (question → answer → figures → evidence): the answer block after the question's own cell, a
    table of contents of the sections, the settings dump and long tables folded, and the full findings folded at the
    end under 'evidence' (their one line to copy shown once, in the answer)."""
    import nbformat

    heads = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## "):
            heads.append((i, cell.source.lstrip()[3:].splitlines()[0].strip()))
            cell.source = f"<a id='sec-{i}'></a>\n\n" + cell.source.lstrip()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        outs = cell.get("outputs", [])
        if any(t in tags for t in EVIDENCE_TAGS):
            cell.outputs = [_folded("Evidence: every finding in full (the answer above says it in a few words)", o,
                                    anchor="evidence" if "verdict" in tags else "") if _text_of(o) else o
                            for o in outs]
            continue
        folded = []
        for o in outs:
            n = _text_of(o).count("\n") + 1
            if o.get("output_type") in ("execute_result", "stream") and n > LONG_OUTPUT:
                what = "the run's settings" if cell.source.rstrip().endswith(".public()") else "table"
                folded.append(_folded(f"{what} ({n} lines)", o))
            else:
                folded.append(o)
        cell.outputs = folded
    answer = answer_block(nb_path, records)
    toc = " · ".join(f"[{html.escape(h)}](#sec-{i})" for i, h in heads)
    cells = ([nbformat.v4.new_markdown_cell(answer)] if answer else []) + (
        [nbformat.v4.new_markdown_cell("**On this page:** " + ("[answer](#answer) · " if answer else "") + toc
                                       + " · [evidence](#evidence)")] if heads else [])
    first_md = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1)
    nb.cells[first_md + 1:first_md + 1] = cells


def render_html(nb_path: Path, *, exclude_input: bool = False) -> Path:
    """The executed notebook as HTML (full, or `exclude_input`: the shared page without code). Each page stands alone
   : its title, links to the index, the other notebooks and the public issue; the answer first, a table of contents,
    long outputs and the findings in full folded; local paths scrubbed; wide tables scroll instead of overflowing."""
    import nbformat
    from nbconvert import HTMLExporter

    from .summary import ANSWER_CSS, ISSUE

    from .summary import day_and_machine

    nb = nbformat.read(nb_path, as_version=4)
    records = page_records(nb_path)
    title = " · ".join([title_of(nb)] + (day_and_machine(records) if records else []))
    suffix = ".shared.html" if exclude_input else ".html"
    others = [p for p in sorted(nb_path.parent.glob("[0-9][0-9]_*.ipynb")) if NB_PATTERN.match(p.name)]
    nav = " · ".join(f"[{p.name[:2]}]({p.stem}{suffix})" if p != nb_path else f"**{p.name[:2]}**" for p in others)
    shape_page(nb, nb_path, records)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(
        f"[← report index](index.html) · notebooks: {nav} · [Megatron-LM #1421]({ISSUE})"
        + (" · [this page with code](" + nb_path.stem + ".html)" if exclude_input else "")))
    exporter = HTMLExporter(exclude_input=exclude_input, exclude_input_prompt=exclude_input,
                            exclude_output_prompt=exclude_input)
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r"<title>.*?</title>", f"<title>{html.escape(title)}</title>", body, count=1, flags=re.S)
    body = body.replace("</head>", "<style>.jp-OutputArea-output{overflow-x:auto}table.dataframe{font-size:11px}"
                                   f"{ANSWER_CSS}</style></head>", 1)
    out = nb_path.with_name(nb_path.stem + suffix)
    out.write_text(scrub_paths(body, nb_path.parent))
    return out


def scrub_paths(text: str, out_dir: Path) -> str:
    """Local paths out of a shared page: the report directory becomes '.', the checkout '<moe_lab>', home '~'."""
    for path, name in ((str(out_dir.resolve()), "."), (str(ROOT), "<moe_lab>"), (str(Path.home()), "~")):
        if path and path != "/":
            text = text.replace(path, name)
    return text


def mark_failure(nb_path: Path, message: str, *, replace: bool = False) -> bool:
    """Make a failure visible in the executed notebook: a banner on top saying why it stopped and, where the failure
    left no error output (dead kernel, timeout, SIGTERM), one on the cell that was running. False if already done,
    unless `replace`: then the banner says `message` instead (a run interrupted while the notebook was failing of it —
    its engines stopped under it — names the interrupt, as its index row does)."""
    import nbformat

    nb = nbformat.read(nb_path, as_version=4)
    marked = ["moe_lab-failure" in c.get("metadata", {}).get("tags", []) for c in nb.cells]
    if any(marked):
        if not replace:
            return False
        nb.cells = [c for c, m in zip(nb.cells, marked) if not m]
    started = [c for c in nb.cells
               if c.cell_type == "code" and c.get("metadata", {}).get("papermill", {}).get("start_time")]
    ename, _, evalue = message.partition(": ")
    if started and not error_of(nb):
        cell = started[-1]
        cell.setdefault("outputs", []).append(nbformat.v4.new_output(
            "error", ename=ename or "Error", evalue=evalue or message, traceback=[message]))
        cell.metadata.papermill["status"] = "failed"
    where = f"cell In [{started[-1].get('execution_count') or len(started)}]" if started else "kernel start"
    banner = nbformat.v4.new_markdown_cell(
        f'<span style="color:red; font-family:Helvetica Neue, Helvetica, Arial, sans-serif; font-size:2em;">'
        f"Execution stopped at {where}: {html.escape(message)}</span>", metadata={"tags": ["moe_lab-failure"]})
    nb.cells.insert(0, banner)
    nbformat.write(nb, nb_path)
    return True
