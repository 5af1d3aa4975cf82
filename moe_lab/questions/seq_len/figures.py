"""Notebook 09's figure: the fraction of output elements that differ across EP ranks (worst trial, worst rank pair)
and on a rerun, against the sequence length, one panel per dispatcher. Records → seaborn; no numerics here."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...reporting.plots import not_applicable

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
    palette = dict(zip(COMPARED.values(), sns.color_palette("colorblind", 2)))
    for ax, d in zip(axes[0], disp):
        sub = df[df["dispatcher"] == d]
        order = sorted(sub["tokens"].unique())
        hues = list(COMPARED.values())
        sns.barplot(sub, x="tokens", y="fraction differing", hue="comparison", order=order, hue_order=hues,
                    palette=palette, ax=ax)
        for _, row in sub[sub["equal"]].iterrows():  # a zero bar is invisible: say that it was measured
            x = order.index(row["tokens"]) - 0.2 + 0.4 * hues.index(row["comparison"])
            ax.annotate("equal", (x, 0), ha="center", va="bottom", fontsize=8, rotation=90)
        ax.set_title(d)
        ax.set_xlabel("tokens per forward")
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
    axes[0][0].set_ylabel("fraction of output elements differing")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
