"""Headless runner: numbered notebooks → papermill → executed .ipynb + HTML (full and code-hidden) + index + results.json."""

from __future__ import annotations

import datetime
import html
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from . import profiles

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
REPORTS = ROOT / "reports"
NB_PATTERN = re.compile(r"^(\d\d)_[\w-]+\.ipynb$")


def numbered_notebooks(nb_dir: Path = NOTEBOOKS) -> dict[str, Path]:
    return {m.group(1): p for p in sorted(nb_dir.glob("*.ipynb")) if (m := NB_PATTERN.match(p.name))}


def select(only: str | None, nb_dir: Path = NOTEBOOKS) -> list[tuple[str, Path]]:
    nbs = numbered_notebooks(nb_dir)
    if not nbs:
        raise ValueError(f"no numbered notebooks (NN_name.ipynb) in {nb_dir}")
    if not only:
        return list(nbs.items())
    want = [w.strip().zfill(2) for w in only.split(",") if w.strip()]
    bad = [w for w in want if w not in nbs]
    if bad:
        raise ValueError(f"--only {only!r}: no notebook {bad}; available: {', '.join(nbs)}")
    return [(w, nbs[w]) for w in want]


def default_profile() -> str:
    from .cluster import visible_gpus

    return "gpu" if visible_gpus() else "cpu"


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "(untitled)"


def _verdict(nb) -> str:
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


def _error(nb) -> str:
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return f"{out.get('ename')}: {out.get('evalue')}"[:500]
    return ""


def render_html(nb_path: Path, *, exclude_input: bool = False) -> Path:
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(nb_path, as_version=4)
    exporter = HTMLExporter(exclude_input=exclude_input, exclude_input_prompt=exclude_input,
                            exclude_output_prompt=exclude_input)
    body, _ = exporter.from_notebook_node(nb)
    out = nb_path.with_name(nb_path.stem + (".shared.html" if exclude_input else ".html"))
    out.write_text(body)
    return out


def run_one(num: str, src: Path, out_dir: Path, params: dict, profile: str, timeout: float) -> dict:
    import nbformat
    import papermill as pm

    dst = out_dir / src.name
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        pm.execute_notebook(str(src), str(dst), parameters=dict(profile=profile, params=params, out_dir=str(out_dir)),
                            cwd=str(src.parent), kernel_name="python3", progress_bar=sys.stderr.isatty(),
                            execution_timeout=timeout, log_output=False, request_save_on_cell_execute=True)
    except Exception as e:  # noqa: BLE001 - a failing notebook still gets its HTML and an index row
        status, error = "failed", f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        logger.error("notebook %s failed: %s", src.name, error)
    elapsed = time.perf_counter() - t0
    row = {"notebook": num, "file": src.name, "status": status, "error": error, "seconds": round(elapsed, 1),
           "title": "", "verdict": ""}
    if dst.exists():
        nb = nbformat.read(dst, as_version=4)
        row["title"], row["verdict"] = _title(nb), _verdict(nb)
        row["error"] = row["error"] or (_error(nb) if status != "ok" else "")
        try:
            row["html"] = render_html(dst).name
            row["shared_html"] = render_html(dst, exclude_input=True).name
        except Exception as e:  # noqa: BLE001 - report it in the index rather than lose the run
            row["error"] += f" (HTML rendering failed: {e})"
            logger.error("rendering %s failed: %s", dst.name, e)
    return row


def write_index(out_dir: Path, rows: list[dict], meta: dict) -> Path:
    trs = []
    for r in rows:
        ok = r["status"] == "ok"
        links = " · ".join(f'<a href="{html.escape(r[k])}">{label}</a>' for k, label in
                           (("html", "full"), ("shared_html", "shared")) if r.get(k))
        verdict = html.escape(r["verdict"] or r["error"] or "").replace("\n", "<br>")
        trs.append(f"<tr class='{'ok' if ok else 'fail'}'><td>{r['notebook']}</td><td>{html.escape(r['title'])}</td>"
                   f"<td>{'✔ ok' if ok else '✘ FAILED'}</td><td>{verdict}</td><td>{r['seconds']:.0f} s</td><td>{links}</td></tr>")
    meta_html = "".join(f"<li><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</li>" for k, v in meta.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>moe_lab report</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:80em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.4em .6em;vertical-align:top}}tr.fail{{background:#fde2e2}}tr.ok td:nth-child(3){{color:#176b1b}}</style>
</head><body><h1>moe_lab report</h1><ul>{meta_html}</ul>
<table><tr><th>#</th><th>notebook</th><th>status</th><th>verdict</th><th>run time</th><th>HTML</th></tr>
{''.join(trs)}</table><p>Tidy records of every measured case: <a href="results.json">results.json</a>.</p></body></html>"""
    p = out_dir / "index.html"
    p.write_text(page)
    (out_dir / "index.json").write_text(json.dumps({"meta": meta, "notebooks": rows}, indent=1))
    return p


def run_all(*, profile: str | None = None, only: str | None = None, overrides: dict | None = None,
            out: str | None = None, timeout: float | None = None, nb_dir: Path = NOTEBOOKS) -> int:
    """Execute the selected notebooks in order; returns 0 if all ran, 1 if any failed. Input is checked first."""
    profile = profile or default_profile()
    params = profiles.load(profile, overrides)  # raises ValueError before anything starts
    if params["device"] == "cuda":
        profiles.cluster_config(params)  # GPU count vs engines
    chosen = select(only, nb_dir)
    name = Path(profile).stem if profile not in profiles.PROFILES else profile
    out_dir = Path(out) if out else REPORTS / f"{name}-{datetime.date.today().isoformat()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ["MOE_LAB_HEADLESS"] = "1"  # kernels inherit it: no widget progress bars inside the reports
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    it = tqdm(chosen, desc="notebooks", unit="nb") if tqdm else chosen
    for num, src in it:
        if tqdm:
            it.set_postfix_str(src.name)
        logger.info("running %s (profile %s) → %s", src.name, profile, out_dir)
        rows.append(run_one(num, src, out_dir, overrides or {}, profile, timeout or 1800))
        write_index(out_dir, rows, _meta(profile, params))
    failed = [r["file"] for r in rows if r["status"] != "ok"]
    logger.info("report: %s (%d notebooks, %d failed)", out_dir / "index.html", len(rows), len(failed))
    return 1 if failed else 0


def _meta(profile: str, params: dict) -> dict:
    import platform

    import torch

    from . import compat

    return {"profile": profile, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "megatron-core (controller)": compat.installed_version(),
            "parameters": json.dumps(params)}


def lab(port: int | None = None, open_browser: bool = True, extra_args: list[str] | None = None) -> int:
    """JupyterLab on notebooks/, with this Python (which has moe_lab installed) as the kernel."""
    import subprocess

    cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={NOTEBOOKS}"]
    if port:
        cmd.append(f"--port={port}")
    if not open_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; jupyter refuses it otherwise
    cmd += list(extra_args or [])
    return subprocess.call(cmd)
