"""Notebook 09's figure: the fraction of output elements that differ across EP ranks (worst trial, worst rank pair)
and on a rerun, against the sequence length, one panel per dispatcher. Records → seaborn; no numerics here."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...reporting.plots import TEXT_PT, colours, describe, not_applicable

COMPARED = {"cross_rank": "across EP ranks", "rerun": "rerun on one rank"}


def frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        for key, words in COMPARED.items():
            c = r.get(key) or {}
            if c.get("applicable", True) and "mismatch_frac" in c:
                rows.append({"dispatcher": r["dispatcher"], "tokens": (r.get("config") or {}).get("seq_len"),
                             "comparison": words, "fraction differing": c["mismatch_frac"],
                             "equal": bool(c.get("bitwise_equal"))})
    return pd.DataFrame(rows)


def mismatch_by_length(records: list[dict]):
    df = frame(records)
    if df.empty:
        return not_applicable(records, None, "cross-rank comparison by length").figure
    disp = sorted(df["dispatcher"].unique())
    fig, axes = plt.subplots(1, len(disp), figsize=(5.5 * len(disp), 3.8), squeeze=False, sharey=True)
    palette = dict(zip(COMPARED.values(), colours(len(COMPARED))))
    for ax, d in zip(axes[0], disp):
        sub = df[df["dispatcher"] == d]
        order = sorted(sub["tokens"].unique())
        hues = list(COMPARED.values())
        sns.barplot(sub, x="tokens", y="fraction differing", hue="comparison", order=order, hue_order=hues,
                    palette=palette, saturation=1, ax=ax)
        for _, row in sub[sub["equal"]].iterrows():  # a zero bar is invisible: say that it was measured
            x = order.index(row["tokens"]) - 0.2 + 0.4 * hues.index(row["comparison"])
            ax.annotate("0: equal", (x, 0), ha="center", va="bottom", fontsize=TEXT_PT, rotation=90)
        ax.set_title(d)
        ax.set_xlabel("tokens per forward")
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
    axes[0][0].set_ylabel("fraction of output elements differing")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, fontsize=TEXT_PT + 1)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    worst = df.loc[df["fraction differing"].idxmax()]
    describe(fig, f"Bar charts, one per dispatcher ({', '.join(disp)}): fraction of output elements that differ "
                  f"{' and '.join(COMPARED.values())} against tokens per forward "
                  f"({', '.join(str(t) for t in sorted(df['tokens'].unique()))}); {int(df['equal'].sum())} of "
                  f"{len(df)} bars bitwise equal (marked 'equal'); largest {worst['fraction differing']:.2%} "
                  f"({worst['dispatcher']}, {worst['comparison']}, {worst['tokens']} tokens)")
    return fig
