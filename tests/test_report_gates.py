"""The benchmark's gates in `raydp report` (issue 27): the headroom and epsilon gates computed by hand here, and a study
with one seed per arm, whose sd-based gates cannot be judged (N/A: 1 seed, no test; not FAIL)."""

from __future__ import annotations

import math

import pandas as pd

from raydp.study.statistics import gates


def _table(seeds):
    rows = []
    values = {("nonprivate", None): (63.0, 65.0), ("static-pairwise", 0.5): (66.0, 68.0),
              ("static-pairwise", 8.0): (65.0, 67.0)}
    for (strategy, eps), (private, public) in values.items():
        for seed in seeds:
            jitter = 0.01 * seed
            rows.append({"trial": f"{strategy}-{eps}-{seed}", "status": "TERMINATED", "model": "embedded",
                         "strategy": strategy, "epsilon_target": eps if eps is not None else math.nan, "seed": seed,
                         "final_eval_value_nll": private + jitter, "final_public_value_nll": public + jitter})
    return pd.DataFrame(rows)


def test_the_gates_by_hand_and_with_one_seed():
    lines = gates(_table([0, 1, 2]), "final_public_value_nll")
    # non-private vs static-pairwise at 0.5: 3.0 apart, 3/66.01 = 4.5%; both arms' sd is 0.01, so 300 pooled sd
    assert lines[0].startswith("PASS") and "3.000 nats/record apart, 4.5% and 300.0 pooled sd" in lines[0]
    assert lines[1].startswith("PASS") and "1.000 nats/record apart, 100.0 pooled sd" in lines[1]
    one = gates(_table([0]), "final_public_value_nll")
    assert one[0].startswith("N/A (1 seed: no test)") and one[1].startswith("N/A")
    assert not any("nan" in line for line in one)  # no NaN pooled sd where there is none
    assert one[2].startswith(("PASS", "FAIL")) and one[3].startswith("PASS")  # the rank and public gates need no sd


def test_a_spearman_of_exactly_the_threshold_passes():
    """Four cells with one adjacent pair swapped between the splits: rho = 1 - 6*2/(4*15) = 0.8 exactly (scipy returns
    0.7999999999999999)."""
    table = _table([0, 1])  # private: non-private 63 < static@2 64 < sp@8 65 < sp@0.5 66
    extra = table[table["strategy"] == "nonprivate"].copy()
    extra["strategy"], extra["epsilon_target"] = "static", 2.0
    extra["final_eval_value_nll"], extra["final_public_value_nll"] = 64.0, 67.5  # public: sp@8 67 < static@2 67.5
    lines = gates(pd.concat([table, extra], ignore_index=True), "final_public_value_nll")
    rank = next(line for line in lines if "Spearman" in line)
    assert "Spearman 0.800" in rank and rank.startswith("PASS")
