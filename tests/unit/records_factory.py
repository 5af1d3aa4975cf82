"""Record builders for the findings tests (the layouts the experiments write), one place for the unit and property
tests alike."""

ENV = dict(megatron_core="0.16.1", world=4, device="cuda", gpu="NVIDIA H200", backend="gloo", ranks_per_gpu=4,
           placement="4 ranks share each GPU (virtual EP)", config={"hidden": 64, "num_experts": 8, "topk": 2,
                                                                  "ffn_hidden": 128, "seq_len": 1024, "dtype": "bf16"},
           cut=90, code={"commit": "abc123"})


def cmp(n=0, trials=5, n_differ=None, numel=1000):
    n_differ = (trials if n else 0) if n_differ is None else n_differ
    return {"numel": numel, "n_mismatch": n, "mismatch_frac": n / numel, "bitwise_equal": n == 0 and n_differ == 0,
            "max_ulp": 3.0 if n else 0.0, "max_abs": 0.01 if n else 0.0, "allclose_1e3": n == 0, "assert_close": True,
            "trials": trials, "n_differ": n_differ, "per_trial": [n if i < n_differ else 0 for i in range(trials)]}


def rec01(d, r, cross, rerun, **kw):
    return dict(ENV, notebook="01", kind="case", case_key=f"01/{d}/{r}", dispatcher=d, router_dtype=r,
                cross_rank=cross, rerun=rerun, truncation=cmp(), deterministic=False, **kw)


def case02(d, variant, first, kind="replicated", **kw):
    return dict(ENV, notebook="02", record="case", case_key=f"{d}/{variant}", dispatcher=d, variant=variant,
                first_divergent_stage=first, first_divergent_kind=kind if first else None, trials=3,
                out_mismatch_frac=0.3 if first else 0.0, out_max_ulp=4.0 if first else 0.0,
                probs_gather_dtype="bfloat16", combine_op="reduce_scatter_tensor", combine_dtype="bfloat16",
                cross_rank_applicable=True, **kw)


def cell(d="allgather", r="none", pf32=False, det=False, cross=0, rerun=0, ratio=1.0, ci=(0.95, 1.05),
         cross_differ=None, **kw):
    return dict(ENV, notebook="03", kind="case", case_key=f"03/{d}/{r}/{pf32}/{det}", dispatcher=d, router_dtype=r,
                probs_fp32_gather=pf32, deterministic=det, cross_rank=cmp(cross, n_differ=cross_differ),
                rerun=cmp(rerun), truncation=cmp(), cost={"ratio": ratio, "ci": list(ci), "t_with_s": 0.01 * ratio},
                **kw)


def preset07(model, d="allgather", r="none", det=False, cross=0, rerun=0, first=None, ratio=1.0, ci=(0.95, 1.05),
             **kw):
    """A notebook-07 cell (experiments.presets: 03's cell on a model preset's layer)."""
    c = cell(d, r, det=det, cross=cross, rerun=rerun, ratio=ratio, ci=ci, **kw)
    c.update(notebook="07", experiment="presets", case_key=f"07/{model}/{d}/{r}/{det}",
             config=dict(ENV["config"], model=model), first_divergent_stage=first,
             first_divergent_kind="replicated" if first else None, probs_dtype="bfloat16",
             combine_op="reduce_scatter_tensor", combine_dtype="bfloat16")
    return c


def case04(d, remedy, trunc, rerun=None, ratio=1.0, ci=(0.97, 1.03), world=4, ws="unset", emu="none", tile=None,
           **kw):
    return dict(ENV, notebook="04", kind="case", case_key=f"04/{d}/{remedy}/{world}/{ws}/{emu}/{tile}", available=True,
                world=world, workspace=ws, dispatcher=d, remedy=remedy, tile=tile, emulation=emu,
                emulated=emu != "none", router_dtype="fp64", truncation=trunc, rerun=rerun or cmp(),
                one_ulp_fails_frac=0.5, cost={"ratio": ratio, "ci": list(ci), "t_with_s": 0.01}, **kw)


def kernel04(linear, M, equal, device="cpu", **kw):
    return dict(ENV, notebook="04", kind="kernel", case_key=f"k/{linear}/{M}", device=device, linear=linear, M=M,
                m=128, K=256, N=512, remedy="none", emulation="none", emulated=False, world=4, workspace="unset",
                kernel=cmp(0 if equal else 3, trials=1), **kw)


def back05(d, setting, bad=(), available=True, **kw):
    from moe_lab.findings.labels import FWD_CMPS, GRAD_CMPS

    r = dict(ENV, notebook="05", kind="backward", case_key=f"05/{d}/{setting}", dispatcher=d, setting=setting,
             available=available, trials=3, backward_first_divergent=None, backward_ledger=[], **kw)
    if not available:
        return dict(r, reason="ValueError: needs TransformerEngine")
    for k in FWD_CMPS + GRAD_CMPS:
        r[k] = cmp(7, trials=3, numel=1024 * 64) if k in bad else cmp(trials=3, numel=1024 * 64)
    return r


def lay01(d, layout, vs_ref, rerun=None, *, r="none", ref="tp 1 × ep 1", routing=0, **kw):
    """A notebook-01 layout record (experiments.layouts): `layout` against `ref` (n differing output elements)."""
    stages = {"router.logits": cmp(), "router.probs": cmp(), "router.routing_map": cmp(routing), "out": vs_ref}
    first = next((k for k in ("router.logits", "router.probs", "router.routing_map", "out")
                  if stages[k].get("n_differ")), None)
    return dict(ENV, notebook="01", experiment="layouts", kind="layout", case_key=f"01/{d}/{r}/{layout}",
                dispatcher=d, router_dtype=r, layout=layout, reference_layout=ref, is_reference=layout == ref,
                vs_reference=vs_ref, rerun=rerun or cmp(), cross_rank=cmp(), stages_vs_reference=stages,
                first_divergent_stage=first, deterministic=False, **kw)
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
    return dict(ENV, notebook="06", kind="train", experiment="training", available=True, **lay.fields(), run=run,
                setting=setting, deterministic=det, layers=layers, reference_layout="ep1", dispatcher="allgather",
                dp=lay.dp(4), expert_dp=lay.expert_dp(4), case_key=f"06/{setting}/{layers}/{det}/{lay.spec()}/{run}",
                loss=loss, loss_hex=[float(x).hex() for x in loss],
                grad_norm=[0.1] * steps, weights_fp=fps, weights_norm=[math.sqrt(16.0)] * (steps + 1),
                weights_sketch=sketch, weights_tensors=17, routing=routing, topk=k, shares=4, **kw)
