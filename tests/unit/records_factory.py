"""Record builders for the findings tests, one place for the unit and property tests alike. Each record is built the
way the experiments build theirs: its own fields through the experiment's record type (`experiments/*_record.py`),
comparisons through `records.Comparison`, composed with the header fields by `records.compose` (which refuses a key
stated twice with two values), in the current schema."""

from moe_lab.questions.compound.record import BackwardRecord
from moe_lab.questions.reproduce.layouts_record import LayoutRecord
from moe_lab.questions.localise.record import LocaliseCase
from moe_lab.questions.presets.record import PresetRecord
from moe_lab.experiments.probe_record import ProbeRecord
from moe_lab.questions.promotion.record import PromotionRecord
from moe_lab.questions.training.record import TrainingRecord
from moe_lab.questions.truncation.record import KernelRecord, TruncationCase
from moe_lab.records import SCHEMA, Comparison, compose


def _record(header: dict, body, **kw) -> dict:
    """header + the record type's fields + the test's own extras (`kw` may restate a field: it wins, as a test's
    variation of the record)."""
    return {"schema": SCHEMA, **compose({**ENV, **header}, body.asdict()), **kw}

ENV = dict(megatron_core="0.16.1", world=4, device="cuda", gpu="NVIDIA H200", backend="gloo", ranks_per_gpu=4,
           placement="4 ranks share each GPU (virtual EP)", config={"hidden": 64, "num_experts": 8, "topk": 2,
                                                                  "ffn_hidden": 128, "seq_len": 1024, "dtype": "bf16"},
           cut=90, code={"commit": "abc123"})


def cmp(n=0, trials=5, n_differ=None, numel=1000):
    n_differ = (trials if n else 0) if n_differ is None else n_differ
    c = Comparison.counted(numel, n, max_ulp=3.0 if n else 0.0, max_abs=0.01 if n else 0.0, allclose_1e3=n == 0,
                           assert_close=True, trials=trials, n_differ=n_differ,
                           per_trial=[n if i < n_differ else 0 for i in range(trials)])
    d = c.asdict()
    d["bitwise_equal"] = n == 0 and n_differ == 0  # a worst trial without mismatch can still have differed
    return d


def rec01(d, r, cross, rerun, **kw):
    return _record(dict(notebook="01", kind="case", case_key=f"01/{d}/{r}", dispatcher=d, router_dtype=r,
                        deterministic=False),
                   ProbeRecord(cross_rank=_c(cross), rerun=_c(rerun), truncation=_c(cmp()), t_forward_s=0.01), **kw)


def case02(d, variant, first, kind="replicated", **kw):
    return _record(dict(notebook="02", kind="case", case_key=f"{d}/{variant}", dispatcher=d, variant=variant),
                   LocaliseCase(first_divergent_stage=first, trials=3, first_divergent_per_trial=[first] * 3,
                                first_divergent_kind=kind if first else None, first_divergent_by_pair={},
                                out_mismatch_frac=0.3 if first else 0.0, out_max_ulp=4.0 if first else 0.0,
                                cross_rank_applicable=True, probs_gather_dtype="bfloat16", combine_dtype="bfloat16",
                                combine_op="reduce_scatter_tensor", out_dtype="bfloat16", bytes_compared=0), **kw)


def _cell_body(record_type, cross, rerun, cross_differ, ratio, ci, first=None):
    return record_type(cross_rank=_c(cmp(cross, n_differ=cross_differ)), rerun=_c(cmp(rerun)), truncation=_c(cmp()),
                       t_forward_s=0.01 * ratio, probs_dtype="bfloat16", combine_op="reduce_scatter_tensor",
                       combine_dtype="bfloat16", out_dtype="bfloat16", first_divergent_stage=first,
                       first_divergent_kind="replicated" if first else None,
                       cost={"ratio": ratio, "ci": list(ci), "t_with_s": 0.01 * ratio})


def cell(d="allgather", r="none", pf32=False, det=False, cross=0, rerun=0, ratio=1.0, ci=(0.95, 1.05),
         cross_differ=None, **kw):
    return _record(dict(notebook="03", kind="case", case_key=f"03/{d}/{r}/{pf32}/{det}", dispatcher=d,
                        router_dtype=r, probs_fp32_gather=pf32, deterministic=det),
                   _cell_body(PromotionRecord, cross, rerun, cross_differ, ratio, ci), **kw)


def preset07(model, d="allgather", r="none", det=False, cross=0, rerun=0, first=None, ratio=1.0, ci=(0.95, 1.05),
             **kw):
    """A notebook-07 cell (questions.presets.experiment: 03's cell on a model preset's layer)."""
    return _record(dict(notebook="07", kind="case", experiment="presets", case_key=f"07/{model}/{d}/{r}/{det}",
                        dispatcher=d, router_dtype=r, probs_fp32_gather=False, deterministic=det,
                        config=dict(ENV["config"], model=model)),
                   _cell_body(PresetRecord, cross, rerun, None, ratio, ci, first), **kw)


def case04(d, remedy, trunc, rerun=None, ratio=1.0, ci=(0.97, 1.03), world=4, ws="unset", emu="none", tile=None,
           **kw):
    return _record(dict(notebook="04", kind="case", case_key=f"04/{d}/{remedy}/{world}/{ws}/{emu}/{tile}",
                        world=world, workspace=ws, dispatcher=d, router_dtype="fp64"),
                   TruncationCase(remedy=remedy, emulation=emu, emulated=emu != "none", tile=tile, available=True,
                                  truncation=_c(trunc), rerun=_c(rerun or cmp()), one_ulp_fails_frac=0.5,
                                  cost={"ratio": ratio, "ci": list(ci), "t_with_s": 0.01}), **kw)


def kernel04(linear, M, equal, device="cpu", **kw):
    return _record(dict(notebook="04", kind="kernel", case_key=f"k/{linear}/{M}", device=device, world=4,
                        workspace="unset"),
                   KernelRecord.of_row(dict(emulation="none", remedy="none", linear=linear, K=256, N=512, M=M, m=128,
                                            kernel=_c(cmp(0 if equal else 3, trials=1)))), **kw)


def back05(d, setting, bad=(), available=True, **kw):
    from moe_lab.findings.labels import FWD_CMPS, GRAD_CMPS
    from moe_lab.records import Unavailable

    head = dict(notebook="05", kind="backward", case_key=f"05/{d}/{setting}", dispatcher=d, setting=setting, trials=3)
    if not available:
        return _record(head, Unavailable("ValueError: needs TransformerEngine"), **kw)
    cmps = {k: _c(cmp(7, trials=3, numel=1024 * 64) if k in bad else cmp(trials=3, numel=1024 * 64))
            for k in FWD_CMPS + GRAD_CMPS}
    return _record(head, BackwardRecord(**cmps, backward_first_divergent=None, backward_ledger=[]), **kw)


def _c(d):
    """A comparison dict → its type (what the record types hold)."""
    from moe_lab.records import parse_comparison

    return parse_comparison(d)


def lay01(d, layout, vs_ref, rerun=None, *, r="none", ref="tp 1 × ep 1", routing=0, **kw):
    """A notebook-01 layout record (questions.reproduce.layouts): `layout` against `ref` (n differing output elements)."""
    stages = {"router.logits": cmp(), "router.probs": cmp(), "router.routing_map": cmp(routing), "out": vs_ref}
    first = next((k for k in ("router.logits", "router.probs", "router.routing_map", "out")
                  if stages[k].get("n_differ")), None)
    return _record(dict(notebook="01", experiment="layouts", kind="layout", case_key=f"01/{d}/{r}/{layout}",
                        dispatcher=d, router_dtype=r, deterministic=False),
                   LayoutRecord(layout=layout, reference_layout=ref, is_reference=layout == ref, etp=1,
                                sequence_parallel=False, vs_reference=_c(vs_ref), rerun=_c(rerun or cmp()),
                                cross_rank=_c(cmp()), stages_vs_reference={k: _c(v) for k, v in stages.items()},
                                first_divergent_stage=first), **kw)


def pack(values, code: str) -> str:
    """The engine's packing of a routing tensor (zlib + base64 of array bytes), in pure Python."""
    import array
    import base64
    import zlib

    return base64.b64encode(zlib.compress(array.array(code, values).tobytes())).decode()


def train06(ep, run=0, *, setting="plain", det=True, layers=1, part_at=None, how_far=1e-3, steps=6, tokens=4, k=2,
            flip_at=None, tag=None, tp=1, sp=False, loss_part_at="same", **kw):
    """A notebook-06 run record at layout (tp, ep, sp) on 4 ranks: equal to the reference trajectory until step
    `part_at` (None: never), then its weights (after that step) and its loss (from step `loss_part_at`, by default the
    same) off by `how_far` (relative), its weights named `tag` (default the layout's spec: a rerun parting like its
    run 0 has the same weights); a routing flip of token 0 from step `flip_at` on (margin 1e-3)."""
    import math

    from moe_lab.layout import Layout

    lay = Layout(tp=tp, ep=ep, sequence_parallel=sp)

    base_loss = [1.0 - 0.01 * t for t in range(steps)]
    lp = part_at if loss_part_at == "same" else loss_part_at
    loss = [x * (1 + how_far) if lp is not None and t + 1 >= lp else x for t, x in enumerate(base_loss)]
    fps, sketch = [], []
    for t in range(steps + 1):
        off = part_at is not None and t >= part_at
        fps.append(f"w{t}" + (f"-{tag or lay.spec()}-{how_far}" if off else ""))
        sketch.append([1.0 + (how_far * (j % 3 + 1) if off else 0.0) for j in range(16)])
    routing = []
    for _ in range(layers):
        per = []
        for t in range(steps):
            idx = [(i % 8) for i in range(tokens * k)]
            if flip_at is not None and t + 1 >= flip_at:
                idx[0] = 7
            per.append({"topk": pack(idx, "B"), "margin": pack([1e-3] * tokens, "f")})
        routing.append(per)
    head = dict(notebook="06", kind="train", experiment="training", **lay.fields(), run=run, setting=setting,
                deterministic=det, layers=layers, reference_layout="ep1", dispatcher="allgather",
                case_key=f"06/{setting}/{layers}/{det}/{lay.spec()}/{run}")
    return _record(head, TrainingRecord(dp=lay.dp(4), expert_dp=lay.expert_dp(4), loss=loss,
                                        loss_hex=[float(x).hex() for x in loss], grad_norm=[0.1] * steps,
                                        weights_fp=fps, weights_norm=[math.sqrt(16.0)] * (steps + 1),
                                        weights_sketch=sketch, weights_tensors=17, routing=routing, topk=k, shares=4),
                   **kw)


def rec08(d="allgather", *, layout_bias: float = 0.0, swap_ulps: float = 40.0, seed: int = 0, **kw):
    """A notebook-08 record from constructed outputs: three layouts (two runs each) as bf16 roundings of a truth with
    their own rounding noise, one layout shifted by `layout_bias` ULP on a quarter of its elements, and a planted
    swap_experts `swap_ulps` ULP off on the same quarter; statistics and gaps by the rule itself."""
    import numpy as np

    from moe_lab.questions.oracle import rule
    from moe_lab.questions.oracle.record import OracleRecord

    rng = np.random.default_rng(seed)
    truth = rng.uniform(0.5, 1.9, 4096)
    ulp = rule.bf16_ulp(truth)
    quarter = np.arange(truth.size) < truth.size // 4

    def run(noise_seed, shift=0.0):
        r = np.random.default_rng(noise_seed)
        return rule.round_bf16(truth + (r.normal(0, 0.4, truth.size) + shift * quarter) * ulp)

    outs = {}
    for i, lay in enumerate(("ep1", "ep4", "tp2,ep2")):
        out = run(i, layout_bias if lay == "tp2,ep2" else 0.0)
        outs[(lay, None, 1)], outs[(lay, None, 2)] = out, out
    outs[("ep4", "swap_experts", 1)] = run(1, swap_ulps)
    label = {k: f"{d} {k[0]} + {k[1]}" if k[1] else f"{d} {k[0]} run {k[2]}" for k in outs}
    runs = [{"label": label[k], "dispatcher": d, "layout": k[0], "fault": k[1], "trial": k[2],
             "stats": {**rule.error_stats(rule.round_bf16(truth[:64]), truth[:64], prefix="router.logits/"),
                       **rule.error_stats(v, truth, prefix="out/")},
             "flips": {"tokens": 32, "flipped": 0, "flipped_margin_ulp": [], "flipped_topk": {},
                       "margin_ulp_quantiles": {"min": 0.5, "p1": 1.0, "median": 90.0}, "margin_ulp_below": {}}}
            for k, v in outs.items()]
    ref = label[("ep1", None, 1)]
    pairs = [{"a": ref, "b": label[k], **rule.pair_gap(outs[("ep1", None, 1)], v).asdict()}
             for k, v in outs.items() if label[k] != ref]
    return _record(dict(notebook="08", kind="oracle", experiment="oracle", case_key=f"08/{d}", dispatcher=d),
                   OracleRecord(reference="ep1", layouts=["ep1", "ep4", "tp2,ep2"], dispatchers=[d],
                                faults=["swap_experts"], trials=2, runs=runs, pairs=pairs,
                                fp64_layouts={"ep1": {"max_abs": 0.0, "max_rel": 0.0, "routing_equal": True}},
                                truth={"layout": "ep1", "elements": 4096}), **kw)
