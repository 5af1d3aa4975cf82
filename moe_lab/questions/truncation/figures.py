"""Notebook 04's records → seaborn figures. No numerics here: every number comes from the records of
moe_lab.questions.truncation.experiment; no torch either."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter
import pandas as pd
import seaborn as sns

from ...findings.labels import label
from ... import stats
from ...reporting.plots import FAIL, NEUTRAL, PASS, TEXT_PT, ZERO_WORDS, colours, count_words, describe, \
    heatmap_words, message, zero_aware_heatmap


def _kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("kind") == kind]


def _emu(r: dict) -> str:
    return f"EMULATED {r['emulation']}" if r.get("emulated") else "real"


def tolerance(table: list[dict], records: list[dict] | None = None, ax=None):
    """One bf16 ULP vs the seed report's allclose tolerance atol + rtol·|x|, over |x| (from truncation.tolerance_table);
    the measured |output| of the first cut tokens (median, p99) marked when records are given."""
    df = pd.DataFrame(table)
    ax = ax or plt.subplots(figsize=(8.5, 4.2))[1]
    ulp_colour, tol_colour = colours(2)
    ax.step(df.abs_x, df.one_ulp, where="post", color=ulp_colour, label="one bf16 ULP at |x|")
    ax.plot(df.abs_x, df.tolerance, color=tol_colour, ls="--", label="atol + rtol·|x|  (1e-3, 1e-3)")
    ax.fill_between(df.abs_x, df.tolerance, df.one_ulp, where=df.one_ulp > df.tolerance, step="post",
                    color=FAIL, alpha=0.15, label="a one-ULP difference fails allclose")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("|x| (output value)")
    ax.set_ylabel("absolute difference")
    plain = [r for r in _kind(records or [], "case") if r.get("available") and r["remedy"] == "none"
             and not r["emulated"]]
    if plain:
        q = plain[0]["abs_quantiles"]
        for name, v, ls in (("median |out|", q["p50"], ":"), ("p99 |out|", q["p99"], "--")):
            ax.axvline(v, color=NEUTRAL, ls=ls, lw=1)
            ax.text(v, ax.get_ylim()[1], f" {name}\n {v:.3g}", va="top", ha="left", fontsize=TEXT_PT, color=NEUTRAL)
    ax.legend(loc="lower right", fontsize=TEXT_PT)
    fails = df[df.one_ulp > df.tolerance]
    since = f"{fails.abs_x.min():.3g}" if len(fails) else None
    ax.set_title("One bf16 ULP vs allclose(atol=rtol=1e-3): " + (f"a one-ULP difference fails from |x| = {since}"
                                                                 if since else "a one-ULP difference always passes"),
                 fontsize=10)
    describe(ax, f"Line chart, log-log: one bf16 ULP and the allclose tolerance 1e-3 + 1e-3·|x| against |x| "
                 f"({df.abs_x.min():g} to {df.abs_x.max():g}); "
                 + (f"one ULP exceeds the tolerance from |x| = {since} (shaded)" if since else
                    "one ULP stays within the tolerance everywhere")
                 + (f"; measured |output| median {q['p50']:.3g}, p99 {q['p99']:.3g}" if plain else ""))
    return ax


def expert_rows(records: list[dict]):
    """Rows each expert GEMM receives (all ranks' tokens), with and without tokens[cut:] zeroed, per dispatcher;
    shaded: the experts every zeroed token is routed to."""
    rts = _kind(records, "routing")
    if not rts:
        return message("no routing record: rows per expert not measured").figure
    n = _n_experts(rts)
    wide = n > 16  # many experts: one panel per row
    shape = (len(rts), 1) if wide else (1, len(rts))
    size = (min(14, max(8, 0.2 * n)), 3.3 * len(rts)) if wide else (5.2 * len(rts), 4.3)
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False, sharey=True)
    for ax, r in zip(axes.flat, rts):
        rows = []
        for run, counts in r["rows_per_expert"].items():
            rows += [{"expert": e, "rows": c, "input": run.replace("truncated", f"tokens {r['cut']}+ zeroed")}
                     for e, c in enumerate(counts)]
        df = pd.DataFrame(rows)
        for e in {e for s in r["zero_tokens"]["expert_sets"] for e in s}:
            ax.axvspan(e - 0.5, e + 0.5, color=NEUTRAL, alpha=0.15, lw=0)
        sns.barplot(df, x="expert", y="rows", hue="input", ax=ax, palette=colours(df.input.nunique()),
                    saturation=1)
        if wide:
            ax.set_xticks(range(0, n, 4))
            ax.set_xticklabels(range(0, n, 4))
        ax.set_title(f"{r['dispatcher']}, EP={r['world']}: rows M per expert GEMM" + (" " if wide else "\n")
                     + "(shaded: where every zeroed token goes)", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
    # one legend for the figure, below it: the inputs are the same in every panel
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, fontsize=TEXT_PT)
    fig.tight_layout(rect=(0, 0.07 if not wide else 0.03, 1, 1))
    describe(fig, f"Bar charts, one per dispatcher ({', '.join(r['dispatcher'] for r in rts)}): rows each of "
                  f"{n} expert GEMMs receives, for the full input and with tokens[cut:] zeroed; shaded: the experts "
                  f"every zeroed token goes to (" + "; ".join(
                      f"{r['dispatcher']}: experts {sorted({e for s in r['zero_tokens']['expert_sets'] for e in s})}"
                      for r in rts) + ")")
    return fig


def _n_experts(rts) -> int:
    return max((len(next(iter(r["rows_per_expert"].values()))) for r in rts), default=8)


def _state(r: dict) -> str:
    rem = r["remedy"]
    what = f"tiled T={r['tile']}" if r.get("tile") else "no split-K" if rem == "no_splitk" else "plain GEMM"
    return f"{_emu(r)} / {what}"


def kernel_variance(records: list[dict], axes=None):
    """Bits of the first m rows of each expert GEMM (fc1, fc2) that change when it gets M rows instead of m, per
    state (plain, tiled, split-K forbidden; EMULATED ones say so). One panel per linear."""
    ks = _kind(records, "kernel")
    ks = [r for r in ks if r["world"] == min(x["world"] for x in ks)]  # the same GEMM shapes at every world
    linears = list(dict.fromkeys(r.get("linear", "fc1") for r in ks)) or ["fc1"]
    if axes is None:
        axes = plt.subplots(1, len(linears), figsize=(5.2 * len(linears) + 2.2, 3.6), sharey=True,
                            squeeze=False)[1][0]
    states = list(dict.fromkeys(_state(r) for r in ks))
    top = max([r["kernel"]["n_mismatch"] for r in ks] + [1])
    for ax, lin in zip(axes, linears):
        sub = [r for r in ks if r.get("linear", "fc1") == lin]
        df = pd.DataFrame([{"M": r["M"], "differing elements": r["kernel"]["n_mismatch"], "state": _state(r)}
                           for r in sub])
        # Lines that coincide (all zero) are drawn side by side: each state's points shifted by a few % of M.
        df["M (rows in the GEMM)"] = [m * 2 ** (0.04 * (states.index(s) - (len(states) - 1) / 2))
                                      for m, s in zip(df.M, df.state)]
        sns.lineplot(df, x="M (rows in the GEMM)", y="differing elements", hue="state", style="state", markers=True,
                     dashes=False, ax=ax, hue_order=states, style_order=states, legend=ax is axes[-1],
                     palette=dict(zip(states, colours(len(states)))))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(df.M)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.tick_params(axis="x", labelsize=7, rotation=45)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(-0.3, max(2.0, top * 2))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        r0 = sub[0]
        ax.set_title(f"linear_{lin} (K={r0.get('K', '?')}, N={r0.get('N', '?')}): first {r0['m']} rows inside M vs "
                     f"alone\n({r0['kernel']['numel']:,} elements compared)", fontsize=9)
    axes[-1].legend(fontsize=TEXT_PT, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    differ = [f"linear_{r.get('linear', 'fc1')} {_state(r)} at M={r['M']:,}: {r['kernel']['n_mismatch']:,}" for r in ks
              if r["kernel"]["n_mismatch"]]
    describe(axes, f"Line charts, one per expert linear ({', '.join('linear_' + x for x in linears)}): elements of "
                   f"the first rows of a GEMM whose bits change when it gets M rows instead of those rows alone, "
                   f"against M ({len({r['M'] for r in ks})} sizes, log axis), per state ({', '.join(states)}); "
                   + count_words(len(ks) - len(differ), len(ks), "GEMMs bitwise equal")
                   + (f"; differing: {'; '.join(differ)}" if differ else ""))
    return axes


def token_mismatch_map(records: list[dict], ax=None):
    """Per case (row) and token (column) of the first `cut`: fraction of hidden elements whose bits change."""
    cs = [r for r in _kind(records, "case") if r.get("available")]
    if not cs:
        return message("no truncation case ran here", ax)
    mat = pd.DataFrame([r["token_mismatch_frac"] for r in cs], index=[_row(r, cs) for r in cs])
    ax = ax or plt.subplots(figsize=(10, 0.32 * len(cs) + 1.6))[1]
    zero_aware_heatmap(mat, ax, annot=False, label="fraction of hidden elements differing")
    ax.set_xticks(range(0, mat.shape[1], 10), range(0, mat.shape[1], 10))
    ax.set_xlabel(f"token (first {cs[0]['cut'] if cs else '?'}, truncated vs full input)")
    ax.set_ylabel("")
    ax.set_title("Where the first tokens change (EMULATED rows are CPU emulations of GPU behaviour)", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    equal = int((mat.fillna(0) == 0).all(axis=1).sum())
    describe(ax, f"Heatmap: fraction of hidden elements whose bits change, per case ({mat.shape[0]} rows) and token "
                 f"(the first {mat.shape[1]}), truncated against full input ({ZERO_WORDS}); "
                 f"{count_words(equal, mat.shape[0], 'cases bitwise equal at every token')}; "
                 f"{heatmap_words(mat, '.1%')}")
    return ax


def _row(r: dict, cs: list[dict]) -> str:
    """A case's row name: dispatcher / setting, with EP and workspace when the records hold several."""
    extra = []
    if len({x["world"] for x in cs}) > 1:
        extra.append(f"EP={r['world']}")
    if len({x.get("workspace") or "unset" for x in cs}) > 1:
        extra.append(f"ws {r.get('workspace') or 'unset'}")
    return f"{r['dispatcher']} / {label(r)}" + (f" [{', '.join(extra)}]" if extra else "")


def remedy_effect_cost(records: list[dict], ax=None):
    """Grid: remedy (rows) x dispatcher/emulation (columns); PASS (blue, ✓) = first tokens bitwise equal and rerun
    equal, FAIL (vermillion, ✗) = not; text = what differs and the forward time relative to the same setting without
    remedy."""
    cs = [r for r in _kind(records, "case") if r.get("available")]
    if not cs:
        return message("no remedy case ran here", ax)
    rows = []
    for r in cs:
        ok = r["truncation"]["bitwise_equal"] and r["rerun"]["bitwise_equal"]
        what = ("✓ " if ok else "✗ ") + ("bitwise equal" if r["truncation"]["bitwise_equal"]
                                         else f"{r['truncation']['n_mismatch']:,} differ")
        if not r["rerun"]["bitwise_equal"]:
            what += "\nrerun differs"
        c = r.get("cost") or {}
        cost = (f"{c['ratio']:.2f}× [{c['ci'][0]:.2f}–{c['ci'][1]:.2f}]" if c.get("ratio") else "n/a")
        ep = f"\nEP={r['world']}" if len({x["world"] for x in cs}) > 1 else ""
        ws = f"\nws {r.get('workspace') or 'unset'}" if len({x.get("workspace") or "unset" for x in cs}) > 1 else ""
        rows.append({"remedy": r["remedy"] + (f" T={r['tile']}" if r.get("tile") else ""),
                     "setting": f"{r['dispatcher']}\n{_emu(r)}{ep}{ws}", "ok": 0.0 if ok else 1.0,
                     "text": f"{what}\n{cost}"})
    df = pd.DataFrame(rows)
    order, cols = list(dict.fromkeys(df.remedy)), list(dict.fromkeys(df.setting))  # the run's order: real first
    val = df.pivot(index="remedy", columns="setting", values="ok").reindex(index=order, columns=cols)
    txt = df.pivot(index="remedy", columns="setting", values="text").reindex(index=order, columns=cols)
    ax = ax or plt.subplots(figsize=(2.3 * val.shape[1] + 3, 0.62 * val.shape[0] + 1.8))[1]
    cmap = sns.color_palette([PASS, FAIL], as_cmap=True)
    sns.heatmap(val, annot=txt.fillna("").values, fmt="", cmap=cmap, vmin=0, vmax=1, cbar=False, linewidths=1,
                linecolor="white", ax=ax, annot_kws={"fontsize": 8, "color": "white"}, mask=val.isna())
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title("Remedies: effect (blue ✓ = first tokens and rerun bitwise equal in every trial, vermillion ✗ = not) "
                 f"and cost\n(× plain forward, {stats.interval_name((r.get('cost') or {}).get('rounds') for r in cs)}; "
                 "remedy none = A/A noise floor)",
                 fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ok = df[df["ok"] == 0.0]
    where = "; ".join(f"{a} on {' '.join(b.split())}" for a, b in zip(ok.remedy, ok.setting))
    describe(ax, f"Grid: remedy ({len(order)} rows) by dispatcher and emulation ({len(cols)} columns); "
                 f"{count_words(len(ok), len(df), 'cells')} keep the first tokens and the rerun bitwise equal in every "
                 f"trial" + (f" ({where})" if where else "") + "; each cell gives what differs and the forward time "
                 "against the same setting without remedy")
    return ax

