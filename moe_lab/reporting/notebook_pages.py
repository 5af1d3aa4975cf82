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


def render_html(nb_path: Path, *, exclude_input: bool = False) -> Path:
    """The executed notebook as HTML (full, or `exclude_input`: the shared page without code). Each page stands alone
   : its title, links to the index, the other notebooks and the public issue; local paths scrubbed; wide tables
    scroll instead of overflowing."""
    import nbformat
    from nbconvert import HTMLExporter

    from .summary import ISSUE

    nb = nbformat.read(nb_path, as_version=4)
    title = title_of(nb)
    suffix = ".shared.html" if exclude_input else ".html"
    others = [p for p in sorted(nb_path.parent.glob("[0-9][0-9]_*.ipynb")) if NB_PATTERN.match(p.name)]
    nav = " · ".join(f"[{p.name[:2]}]({p.stem}{suffix})" if p != nb_path else f"**{p.name[:2]}**" for p in others)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(
        f"[← report index](index.html) · notebooks: {nav} · [Megatron-LM #1421]({ISSUE})"
        + (" · [this page with code](" + nb_path.stem + ".html)" if exclude_input else "")))
    exporter = HTMLExporter(exclude_input=exclude_input, exclude_input_prompt=exclude_input,
                            exclude_output_prompt=exclude_input)
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r"<title>.*?</title>", f"<title>{html.escape(title)}</title>", body, count=1, flags=re.S)
    body = body.replace("</head>", "<style>.jp-OutputArea-output{overflow-x:auto}"
                                   "table.dataframe{font-size:11px}</style></head>", 1)
    out = nb_path.with_name(nb_path.stem + suffix)
    out.write_text(scrub_paths(body, nb_path.parent))
    return out


def scrub_paths(text: str, out_dir: Path) -> str:
    """Local paths out of a shared page: the report directory becomes '.', the checkout '<moe_lab>', home '~'."""
    for path, name in ((str(out_dir.resolve()), "."), (str(ROOT), "<moe_lab>"), (str(Path.home()), "~")):
        if path and path != "/":
            text = text.replace(path, name)
    return text


def mark_failure(nb_path: Path, message: str) -> bool:
    """Make a failure visible in the executed notebook: a banner on top saying why it stopped and, where the failure
    left no error output (dead kernel, timeout, SIGTERM), one on the cell that was running. False if already done."""
    import nbformat

    nb = nbformat.read(nb_path, as_version=4)
    if any("moe_lab-failure" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        return False
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
