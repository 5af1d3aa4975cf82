"""Typed records (moe_lab.records): every committed report reads back through `upgrade`, every comparison in it parses
as a `Comparison` (or `NotCompared`) and writes back to the same JSON; `compose` refuses an undeclared collision; the
types round-trip; `results` writes the current schema and reads every one."""

from __future__ import annotations

import glob
import json
import lzma
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from moe_lab import records, results
from moe_lab.questions.compound.record import BackwardRecord, DepthRecord
from moe_lab.questions.reproduce.layouts_record import LayoutRecord
from moe_lab.questions.localise.record import CollectiveRecord, LocaliseCase, StageRecord
from moe_lab.experiments.probe_record import ProbeRecord
from moe_lab.questions.promotion.record import PromotionRecord
from moe_lab.questions.training.record import TrainingRecord
from moe_lab.questions.truncation.record import KernelRecord, RoutingRecord, TruncationCase
from moe_lab.records import (SCHEMA, CollisionError, Comparison, Header, NotCompared, Unavailable, compose,
                             parse_comparison, upgrade)

ROOT = Path(__file__).resolve().parents[2]


def committed_reports() -> list[Path]:
    pats = ("reports/**/*results.json", "reports/published/*/results.json.xz", "reports/**/results.json.xz")
    return sorted({Path(p) for pat in pats for p in glob.glob(str(ROOT / pat), recursive=True)})


def _read(p: Path) -> list[dict]:
    text = lzma.open(p, "rt").read() if p.suffix == ".xz" else p.read_text()
    return json.loads(text)


REPORTS = committed_reports()


def _eq(a, b) -> bool:
    """JSON equality with NaN equal to NaN (integer comparisons state NaN ULPs)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return a == b


def test_there_are_committed_reports():
    assert REPORTS, "no reports/*/results.json found"


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_record_upgrades_and_every_comparison_parses(path):
    raw = _read(path)
    n_cmp = 0
    for r in raw:
        u = upgrade(r)
        assert u["schema"] == SCHEMA and "record" not in u
        assert upgrade(u) == u  # the current schema is a fixed point
        if r.get("notebook") == "02" and "record" in r:
            assert u["kind"] == r["record"]
            if r["record"] == "stage":
                assert u["stage_kind"] == r["kind"] and StageRecord.from_dict(u).stage_kind == r["kind"]
        for where, c in records.comparisons_in(u):
            t = parse_comparison(c)
            assert isinstance(t, (Comparison, NotCompared)), where
            assert _eq(t.asdict(), dict(c)), where  # the same JSON back, key for key
            n_cmp += 1
        if u.get("kind") == "stage" and "numel" in u:  # 02's flat stage comparison
            flat = {k: u[k] for k in ("numel", "n_mismatch", "mismatch_frac", "bitwise_equal", "max_ulp", "max_abs")
                    if k in u}
            assert isinstance(Comparison.from_dict(flat), Comparison)
    # 02's stages, 06's training runs and 08's error statistics against fp64 hold no Comparison of their own
    assert n_cmp or not raw or all(r.get("notebook") in ("02", "06", "08") for r in raw)


@pytest.mark.parametrize("path", REPORTS[:3], ids=lambda p: str(p.relative_to(ROOT)))
def test_results_load_upgrades_every_record(path):
    recs = results.load(path) if path.suffix != ".xz" else [upgrade(r) for r in _read(path)]
    assert recs and all(r["schema"] == SCHEMA for r in recs)


def test_experiment_record_types_read_their_committed_records():
    """Each question's type reads its records of the published reports (header fields ignored) and writes its own
    fields back as they were."""
    types = {("reproduce", "case"): ProbeRecord, ("promotion", "case"): PromotionRecord,
             ("layouts", "layout"): LayoutRecord, ("localise", "case"): LocaliseCase,
             ("truncation", "case"): TruncationCase, ("truncation", "kernel"): KernelRecord,
             ("truncation", "routing"): RoutingRecord, ("compound", "backward"): BackwardRecord,
             ("compound", "depth"): DepthRecord, ("training", "train"): TrainingRecord}
    seen = set()
    for r in (r for p in REPORTS for r in results.load(p)):
        t = types.get((r.get("experiment"), r.get("kind")))
        if t is None or r.get("available") is False or "skipped" in r:
            continue
        body = t.from_dict(r).asdict()
        assert all(_eq(v, r[k]) for k, v in body.items() if k != "kind"), t
        seen.add(t)
    assert len(seen) >= 8


# ---------------------------------------------------------------------------------------------- compose


def test_compose_refuses_an_undeclared_collision_and_accepts_a_declared_one():
    with pytest.raises(CollisionError, match="'tp'"):
        compose({"tp": 1, "world": 4}, {"tp": 2})
    assert compose({"tp": 1, "world": 4}, {"tp": 2}, allowed_overlaps={"tp"}) == {"tp": 2, "world": 4}
    assert compose({"a": 1}, {"a": 1, "b": 2}) == {"a": 1, "b": 2}  # the same value twice is no collision
    assert list(compose({"a": 1, "b": 2}, {"a": 1, "c": 3})) == ["a", "b", "c"]  # first position kept


def test_the_header_overlaps_are_declared_with_a_reason():
    env = {"device": "cpu", "world": 4, "tp": 1, "ep": 4, "placement": "4 ranks"}
    h = Header(notebook="01", environment=env, time="t", case={"experiment": "x", "kind": "case", "detail": True},
               layout={"tp": 2, "ep": 2, "layout": "tp 2 × ep 2"}, label="l", case_key="k", case_wall_s=1.0)
    with pytest.raises(CollisionError):
        compose(*h.parts())
    rec = compose(*h.parts(), {"detail": {"pairs": {}}}, allowed_overlaps=records.HEADER_OVERLAPS)
    assert rec["tp"] == 2 and rec["ep"] == 2 and rec["detail"] == {"pairs": {}} and h.placement == "4 ranks"
    assert all(isinstance(v, str) and v for v in records.HEADER_OVERLAPS.values())


# ---------------------------------------------------------------------------------------------- round trips

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
counts = st.integers(min_value=0, max_value=10**9)


@st.composite
def comparisons(draw):
    numel = draw(counts)
    n = draw(st.integers(min_value=0, max_value=numel))
    kw = {}
    for name, strat in (("max_abs", finite), ("max_rel", finite), ("max_ulp", finite), ("mean_ulp", finite),
                        ("allclose_1e3", st.booleans()), ("assert_close", st.booleans()),
                        ("trials", st.integers(1, 9)), ("worst_copy", st.integers(0, 7))):
        if draw(st.booleans()):
            kw[name] = draw(strat)
    if "trials" in kw:
        kw["n_differ"] = draw(st.integers(0, kw["trials"]))
        kw["per_trial"] = draw(st.lists(counts, min_size=kw["trials"], max_size=kw["trials"]))
    return Comparison.counted(numel, n, **kw)


@settings(max_examples=200, deadline=None)
@given(comparisons())
def test_comparison_round_trips(c):
    assert Comparison.from_dict(c.asdict()) == c
    assert Comparison.from_dict(json.loads(json.dumps(c.asdict()))) == c
    assert c.bitwise_equal == (c.n_mismatch == 0) and 0.0 <= c.mismatch_frac <= 1.0


@settings(max_examples=100, deadline=None)
@given(st.text(), st.one_of(st.none(), st.integers(1, 9)))
def test_not_compared_round_trips(reason, trials):
    x = NotCompared(reason) if trials is None else NotCompared(reason, trials)
    assert NotCompared.from_dict(x.asdict()) == x and parse_comparison(x.asdict()) == x
    assert x.asdict()["applicable"] is False
    assert Unavailable.from_dict(Unavailable(reason).asdict()) == Unavailable(reason)


def test_metrics_compare_and_the_exact_compares_build_the_same_keys():
    torch = pytest.importorskip("torch")
    from moe_lab import metrics
    from moe_lab.engine import toolkit
    from moe_lab.questions.reproduce import layouts

    a = torch.arange(6, dtype=torch.bfloat16)
    b = a.clone()
    b[2] += 1
    full = ["numel", "n_mismatch", "mismatch_frac", "bitwise_equal", "max_abs", "max_rel", "max_ulp", "mean_ulp",
            "allclose_1e3", "assert_close"]
    assert list(metrics.compare(a, b)) == full and list(metrics.compare(a, a)) == full
    ia, ib = torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3])
    assert list(toolkit.compare_any(ia, ib)) == full and toolkit.compare_any(ia, ib)["n_mismatch"] == 1
    assert layouts._cmp_exact(ia, ib) == {"numel": 3, "n_mismatch": 1, "mismatch_frac": 1 / 3, "bitwise_equal": False}
    assert layouts._cmp_exact(ia[:0], ib[:0])["mismatch_frac"] == 0.0


@settings(max_examples=50, deadline=None)
@given(comparisons(), comparisons(), st.booleans())
def test_record_types_round_trip(c1, c2, detail):
    p = ProbeRecord(cross_rank=c1, rerun=c2, truncation=NotCompared("one rank"), t_forward_s=0.5,
                    fingerprints={"0": "ab"}, bytes_compared=3, **({"detail": {"x": 1}} if detail else {}))
    assert ProbeRecord.from_dict(json.loads(json.dumps(p.asdict()))) == p
    s = StageRecord(stage="combine.comm", order=3, stage_kind="replicated", dtype="bf16", shape=[2, 3], unit="rank 0-1",
                    **{k: v for k, v in c1.asdict().items() if k in ("numel", "n_mismatch", "bitwise_equal")})
    assert StageRecord.from_dict(s.asdict()) == s and s.asdict()["kind"] == "stage"
    col = CollectiveRecord(extra={"seq": 0, "op": "all_gather", "dtype": "bf16"})
    assert col.asdict() == {"kind": "collective", "seq": 0, "op": "all_gather", "dtype": "bf16"}


# ---------------------------------------------------------------------------------------------- upgrade + results


def test_upgrade_renames_02s_discriminator_and_keeps_the_record_passed():
    old = {"notebook": "02", "kind": "replicated", "record": "stage", "stage": "combine.comm", "order": 1}
    new = upgrade(old)
    assert new == {"notebook": "02", "kind": "stage", "stage": "combine.comm", "stage_kind": "replicated", "order": 1,
                   "schema": SCHEMA}
    assert old["record"] == "stage" and "schema" not in old
    assert upgrade({"notebook": "02", "record": "case"})["kind"] == "case"
    with pytest.raises(ValueError, match="newer"):
        upgrade({"schema": SCHEMA + 1})


def test_upgrade_moves_the_layout_out_of_the_layers_config():
    """Schema 2 held the layout in the layer's config: upgraded, the config is the layer alone; a record that states
    its layout keeps its own fields, one that does not gets the config's sizes (ep 0 / etp 0 / False said nothing)."""
    layer = {"hidden": 64, "num_experts": 8, "seed": 1}
    stated = {"schema": 2, "config": {**layer, "tp": 2, "ep": 2, "etp": 0, "sequence_parallel": True},
              "tp": 2, "ep": 2, "etp": 2, "sequence_parallel": True, "layout": "tp 2 × ep 2, sequence parallel"}
    new = upgrade(stated)
    assert new["config"] == layer and (new["tp"], new["ep"], new["etp"]) == (2, 2, 2) and new["schema"] == SCHEMA
    assert stated["config"]["tp"] == 2  # the record passed is unchanged
    bare = upgrade({"schema": 2, "config": {**layer, "tp": 4, "ep": 0, "etp": 0, "sequence_parallel": False}})
    assert bare["config"] == layer and bare["tp"] == 4 and not {"ep", "etp", "sequence_parallel"} & set(bare)
    assert upgrade({"notebook": "02", "record": "case", "config": {**layer, "tp": 1}})["config"] == layer  # from 1
    for r in (upgrade(r) for path in REPORTS for r in _read(path)):  # every committed record: no layout in a layer
        assert not {"tp", "ep", "etp", "sequence_parallel"} & set(r.get("config") or {})


def test_results_append_writes_the_current_schema_and_load_upgrades(tmp_path):
    p = tmp_path / "results.json"
    p.write_text(json.dumps([{"notebook": "02", "record": "case", "kind": "case"}]))
    results.append(p, [{"kind": "layout"}], notebook="01")
    raw = json.loads(p.read_text())
    assert raw[-1] == {"schema": SCHEMA, "notebook": "01", "kind": "layout"}
    assert [r["kind"] for r in results.load(p)] == ["case", "layout"]
    assert all(r["schema"] == SCHEMA for r in results.load(p))
