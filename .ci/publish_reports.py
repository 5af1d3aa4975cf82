"""Build reports/published/ (the curated GPU evidence the repository keeps) from full report folders.

    python .ci/publish_reports.py SRC DST FOLDER [FOLDER ...]

SRC holds the full report folders (e.g. a checkout's reports/ at 34e396c, where every dated folder was committed),
DST the published tree. Per folder it keeps:
- one page per notebook: `NN_*.html` (not the `.shared.html` or the executed `.ipynb`), its style sheet moved to one
  `page.css` at DST's top (the same 260 KB in every page) and its figures re-encoded as 256-colour PNGs;
- the records its notebooks' latest runs showed (`results.latest`, per `cases-NN.json`), lzma-compressed as
  `results.json.xz`; notebook 06's routing margins only where a finding reads them (a flipped top-k slot against
  any run of the same stack, setting and mode; NaN elsewhere);
- `cases-NN.json`, `compare-with-*.txt` and the measurement files named in KEEP; no session logs or diaries.
It then checks that `moe-lab findings --json` says the same of the published folder as of the source folder.
"""

from __future__ import annotations

import array
import base64
import io
import json
import lzma
import math
import re
import shutil
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_lab import results  # noqa: E402
from moe_lab import questions  # noqa: E402

KEEP = {"bench_gpu.txt", "bench_gpu.json", "capture_gpu.txt", "capture_gpu.json", "measured.json", "measured.md",
        "presets-findings.txt"}
CSS = "page.css"
STYLE = re.compile(r"<style[^>]*>.*?</style>\s*", re.S)
PNG = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")


def _pack(values: list, code: str) -> str:
    return base64.b64encode(zlib.compress(array.array(code, values).tobytes(), 9)).decode()


def _unpack(text: str, code: str) -> list:
    a = array.array(code)
    a.frombytes(zlib.decompress(base64.b64decode(text)))
    return a.tolist()


def trim_margins(records: list[dict]) -> None:
    """Notebook 06: a token's top-k boundary margin is read only where its top-k set differs from another run's at
    the same step (findings.training.flips); keep those, NaN the rest (they zlib to almost nothing)."""
    runs = [r for r in records if r.get("notebook") == "06" and r.get("kind") == "train" and r.get("routing")]
    group: dict = {}
    for r in runs:
        group.setdefault((r["layers"], r["setting"], bool(r["deterministic"])), []).append(r)
    for rs in group.values():
        for r in rs:
            k = int(r["topk"])
            for li, layer in enumerate(r["routing"]):
                for si, step in enumerate(layer):
                    mine = _unpack(step["topk"], "B")
                    used = set()
                    for o in rs:
                        if o is r or li >= len(o["routing"]) or si >= len(o["routing"][li]):
                            continue
                        if o["routing"][li][si]["topk"] == step["topk"]:
                            continue
                        theirs = _unpack(o["routing"][li][si]["topk"], "B")
                        used |= {t for t in range(len(mine) // k)
                                 if set(mine[t * k:(t + 1) * k]) != set(theirs[t * k:(t + 1) * k])}
                    m = _unpack(step["margin"], "f")
                    step["margin"] = _pack([x if t in used else math.nan for t, x in enumerate(m)], "f")


def page(src: Path, dst: Path, css_href: str, css: Path) -> None:
    """Copy one notebook page: its large style blocks (the same in every page) replaced by a link to the shared sheet
    `css`, written from the first page; its figures as 256-colour PNGs where that is smaller."""
    from PIL import Image

    text = src.read_text()
    head = text.find("</head>")
    big = [m.group(0) for m in STYLE.finditer(text[:head]) if len(m.group(0)) > 4000]
    sheet = "".join(re.sub(r"</?style[^>]*>", "", b) for b in big)
    if not css.exists():
        css.write_text(sheet)
    assert css.read_text() == sheet, f"{src}: another style sheet than {css}'s"
    start = text.index(big[0])
    for b in big:
        text = text.replace(b, "", 1)
    text = text[:start] + f'<link rel="stylesheet" href="{css_href}">\n' + text[start:]

    def small(m: re.Match) -> str:
        im = Image.open(io.BytesIO(base64.b64decode(m.group(1))))
        out = io.BytesIO()
        im.convert("RGBA").quantize(256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
        raw = out.getvalue()
        return "data:image/png;base64," + base64.b64encode(raw).decode() if len(raw) < len(m.group(1)) * 3 // 4 \
            else m.group(0)

    dst.write_text(PNG.sub(small, text))


def findings_json(folder: Path, records: list[dict]) -> str:
    by_nb = questions.findings(results.latest(records, folder))
    return json.dumps({nb: [f.to_dict() for f in fs] for nb, fs in by_nb.items()}, default=str, sort_keys=True)


def publish(src: Path, dst: Path, name: str, top: Path) -> None:
    s, d = src / name, dst / name
    d.mkdir(parents=True, exist_ok=True)
    href = "/".join([".."] * len(Path(name).parts)) + "/" + CSS
    for p in sorted(s.iterdir()):
        if p.is_dir():
            continue
        if re.match(r"\d\d_.*\.html$", p.name) and not p.name.endswith(".shared.html"):
            page(p, d / p.name, href, top / CSS)
        elif re.match(r"cases-\d\d\.json$", p.name) or p.name.startswith("compare-with-") or p.name in KEEP:
            shutil.copy2(p, d / p.name)
    if (s / "results.json").is_file():
        recs = results.load(s / "results.json")
        kept = results.latest(recs, s)
        trim_margins(kept)
        (d / "results.json.xz").write_bytes(lzma.compress(json.dumps(kept, separators=(",", ":")).encode(),
                                                          preset=9 | lzma.PRESET_EXTREME))
        back = results.load(d / "results.json.xz")
        assert findings_json(d, back) == findings_json(s, recs), f"{name}: the findings changed"


def main(argv: list[str]) -> int:
    src, dst, names = Path(argv[0]), Path(argv[1]), argv[2:]
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        publish(src, dst, name, dst)
        print(name, sum(p.stat().st_size for p in (dst / name).iterdir() if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
