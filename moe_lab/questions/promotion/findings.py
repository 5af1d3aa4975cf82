"""Notebook 03's findings: per release x dispatcher, do the plain bf16 ranks agree, and which setting of the grid
(router dtype, the reporter's fp32 cast, deterministic mode) makes ranks and reruns bitwise equal in every trial, at
what cost — named by `common.choose`, which never ranks settings whose intervals overlap."""

from __future__ import annotations

from ...findings.common import (choice_text, choose, cost, describe, env_clause, fix_words, groups, guarded,
                                trial_words, trials)
from ...findings.model import FAIL, NA, NOT_MEASURED, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "promotion"
QUESTION = "fix: ranks diverge"
PLAIN_RANKS = "plain ranks agree"
"""The plain bf16 cell's own answer (not a card's: notebook 01 asks it; the answer table reads it where 01 did not
run)."""


def is_plain(r: dict) -> bool:
    return r["router_dtype"] == "none" and not r["probs_fp32_gather"] and not r["deterministic"]


def remedy_name(r: dict) -> str:
    parts = [f"router {r['router_dtype']}"]
    if r["probs_fp32_gather"]:
        parts.append("probs fp32 gather")
    if r["deterministic"]:
        parts.append("deterministic")
    return " + ".join(parts)


def agrees(r: dict) -> bool:
    """Bitwise-equal ranks and reruns in every trial."""
    return bool(r["cross_rank"].get("bitwise_equal", False)) and bool(r["rerun"]["bitwise_equal"])


def simplicity(name: str) -> tuple:
    """Fewer changes first: no deterministic mode, no lab cast, then the narrower router dtype."""
    return ("deterministic" in name, "probs fp32 gather" in name,
            {"none": 0, "fp32": 1, "fp64": 2}.get(name.split(" + ")[0].removeprefix("router "), 3))


def _group(cells: list[dict]) -> list[Finding]:
    plain = next((r for r in cells if is_plain(r)), None)
    subj = subject_of(cells[0])
    commits = commits_of(cells)
    who = f"megatron-core {subj['release']}, {subj['dispatcher']}"
    if plain is None:
        return [Finding(EXPERIMENT, QUESTION, subj, NOT_MEASURED, f"{who}: the plain bf16 cell was not "
                        "measured, so nothing is said about a fix", Evidence(records=case_keys(cells)), card=True,
                        commits=commits, short="plain cell not measured")]
    c = plain["cross_rank"]
    if not c.get("applicable", True):
        return [Finding(EXPERIMENT, QUESTION, subj, NA, f"{who}: one rank — there are no ranks to make "
                        "agree", Evidence(records=case_keys([plain])), card=True, commits=commits,
                        short="one rank: nothing to fix")]
    if agrees(plain):
        return [Finding(EXPERIMENT, QUESTION, subj, PASS, f"{who}: plain bf16 ranks and reruns already "
                        f"agree bit for bit {describe(c).removeprefix('bitwise equal ')} — nothing to set",
                        Evidence(records=case_keys([plain]), trials=trials(c)), card=True, commits=commits,
                        short="nothing to fix: ranks already agree"),
                Finding(EXPERIMENT, PLAIN_RANKS, subj, PASS, f"{who}: plain bf16 ranks and reruns bitwise equal "
                        f"{describe(c).removeprefix('bitwise equal ')}", Evidence(records=case_keys([plain]),
                                                                                   trials=trials(c)),
                        commits=commits, short="no: plain bf16 ranks and reruns equal" + trial_words(trials(c)))]
    plain_ranks = Finding(EXPERIMENT, PLAIN_RANKS, subj, FAIL, f"{who}: plain bf16 ranks {describe(c)}; a rerun: "
                          f"{describe(plain['rerun'])}", Evidence(records=case_keys([plain]), trials=trials(c)),
                          commits=commits_of([plain]),
                          short="yes: plain bf16 ranks differ" + trial_words(trials(c)) if trials(c)[0] else
                          "yes: plain bf16 reruns differ (ranks equal)")
    good = [r for r in cells if agrees(r) and not is_plain(r)]
    costs = {remedy_name(r): cost(r, plain, r) for r in good}
    ch = choose(list(costs.items()), simplicity)
    head = (f"{who}: plain bf16 ranks {describe(c)}; a rerun: {describe(plain['rerun'])}. "
            + (f"{len(good)} of {len(cells) - 1} other settings give bitwise-equal ranks and reruns in every trial"
               if len(cells) > 1 else "no other setting was measured"))
    if ch["name"] is None:
        return [Finding(EXPERIMENT, QUESTION, subj, FAIL, head + "; no setting of the grid does",
                        Evidence(records=case_keys(cells), trials=trials(c)), card=True, commits=commits,
                        short=fix_words(None, len(cells) - 1)), plain_ranks]
    best = next(r for r in good if remedy_name(r) == ch["name"])
    from ...findings.jobs import job_lines

    return [Finding(EXPERIMENT, QUESTION, subj, PASS, head + "; " + choice_text(ch, costs) + env_clause(best, plain),
                    Evidence(records=case_keys([plain, best]), trials=trials(best["cross_rank"]), cost=ch["cost"]),
                    remedy=ch["name"], lines=job_lines(ch["name"]), card=True, commits=commits,
                    short=fix_words(ch["name"], len(cells) - 1)), plain_ranks]


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict)]
    ran = [r for r in recs if "skipped" not in r]
    out: list[Finding] = []
    for _key, cells in groups(ran).items():
        out += guarded(EXPERIMENT, QUESTION, cells, lambda cells=cells: _group(cells))
    skipped = [r for r in recs if "skipped" in r]
    for why in dict.fromkeys((r.get("megatron_core"), r["skipped"]) for r in skipped):
        sub = [r for r in skipped if (r.get("megatron_core"), r["skipped"]) == why]
        out.append(Finding(EXPERIMENT, "not applicable", {**subject_of(sub[0]), "dispatcher": "any"}, NA,
                           f"megatron-core {why[0]}: {len(sub)} cell(s) not applicable ({why[1]})",
                           Evidence(records=case_keys(sub)), commits=commits_of(sub)))
    if skipped and not ran:
        out.append(Finding(EXPERIMENT, QUESTION, subject_of(skipped[0]), NOT_MEASURED, f"no cell ran ({len(skipped)} not "
                           "applicable in their release): nothing is said about the ranks or a fix",
                           Evidence(records=case_keys(skipped)), card=True, commits=commits_of(skipped),
                           short="no cell ran"))
    return out


__all__ = ["findings", "is_plain", "remedy_name", "agrees", "simplicity", "EXPERIMENT"]
