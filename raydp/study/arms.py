"""What an arm is: the strategy variant a result row belongs to, the unit every comparison, table and figure groups
by. One label, built here only: the strategy, its ``settings_grid`` variant in brackets, and for a controller's
trial its SAC cell and ``(frozen policy)`` when its policy was frozen, e.g. ``rldp [action_decoding=paper] T_RL=16
B_SAC=4 K=1 (frozen policy)``. ``cell=False`` leaves the SAC cell and frozen mark out (one arm per strategy
variant)."""

from __future__ import annotations

import math

import pandas as pd

from raydp.study.results import CONTROLLERS  # strategies whose trials carry a SAC cell


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def arm_label(strategy, variant=None, t_rl=None, b_sac=None, k=None, frozen=False, cell: bool = True) -> str:
    label = str(strategy)
    if isinstance(variant, str) and variant:
        label += f" [{variant}]"
    if cell and str(strategy) in CONTROLLERS:
        if not _missing(t_rl):
            label += " " + " ".join(f"{name}={'?' if _missing(v) else int(v)}"
                                    for name, v in (("T_RL", t_rl), ("B_SAC", b_sac), ("K", k)))
        if not _missing(frozen) and (frozen is True or frozen == 1):
            label += " (frozen policy)"
    return label


def arms(results: pd.DataFrame, cell: bool = True) -> pd.Series:
    """:func:`arm_label` of every row of a results table."""
    def column(name, default=None):
        return results[name] if name in results else pd.Series(default, index=results.index, dtype=object)

    return pd.Series([arm_label(*values, cell=cell) for values in zip(
        results["strategy"], column("variant"), column("t_rl"), column("b_sac"), column("k"),
        column("frozen_policy", False))], index=results.index, dtype=object)
