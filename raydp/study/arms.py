"""What an arm is: the strategy variant a result row belongs to, the unit every comparison, table and figure groups
by. One model, :class:`Arm`, and one label, built here only: the strategy, its ``settings_grid`` variant in
brackets, and for a controller's trial its SAC cell and ``(frozen policy)`` when its policy was frozen, e.g. ``rldp
[action_decoding=paper] T_RL=16 B_SAC=4 K=1 (frozen policy)``. ``cell=False`` leaves the SAC cell and frozen mark
out (one arm per strategy variant). A planned trial's arm is :attr:`raydp.study.trial.Trial.arm`; a results row's
is :meth:`Arm.from_row` (any results table: a study's, several studies' combined, a lone run's).

The strategy groups a study compares (challengers, controllers, the non-private reference) are defined here too,
from the registry's capabilities, so that the label and the tables agree on them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from raydp.strategies.registry import STRATEGY_CHOICES, is_private, with_capability

#: the learned controllers a study compares with the baselines (never a baseline themselves): the
#: registry's ``challenger`` capability
CHALLENGERS = tuple(with_capability(STRATEGY_CHOICES, "challenger"))
#: the strategies whose dials a live policy sets (RLDP): their SAC cells are arms of their own
CONTROLLERS = tuple(with_capability(STRATEGY_CHOICES, "controller"))
#: the non-private reference arm(s)
NONPRIVATE_ARMS = tuple(name for name in STRATEGY_CHOICES if not is_private(name))
BASELINE_EXCLUDED = (*CHALLENGERS, *NONPRIVATE_ARMS)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


@dataclass(frozen=True)
class Arm:
    """One arm: ``strategy``, its ``variant`` (a settings_grid, search or tuned_from trial's settings as
    ``clip=0.03``), a controller trial's SAC cell (``t_rl``, ``b_sac``, ``k``; a missing one prints as ``?``) and
    whether its policy was ``frozen``."""

    strategy: str
    variant: str | None = None
    t_rl: int | None = None
    b_sac: int | None = None
    k: int | None = None
    frozen: bool = False

    def label(self, cell: bool = True) -> str:
        label = str(self.strategy)
        if isinstance(self.variant, str) and self.variant:
            label += f" [{self.variant}]"
        if cell and str(self.strategy) in CONTROLLERS:
            if not _missing(self.t_rl):
                label += " " + " ".join(f"{name}={'?' if _missing(v) else int(v)}"
                                        for name, v in (("T_RL", self.t_rl), ("B_SAC", self.b_sac), ("K", self.k)))
            if self.frozen:
                label += " (frozen policy)"
        return label

    def __str__(self) -> str:
        return self.label()

    @classmethod
    def from_row(cls, row: Mapping) -> Arm:
        """The arm of a results row (``strategy``, and where present ``variant``, ``t_rl``, ``b_sac``, ``k``,
        ``frozen_policy``; missing values, NaN included, are None)."""
        def get(name):
            value = row.get(name)
            return None if _missing(value) else value

        frozen = get("frozen_policy")
        return cls(strategy=row["strategy"], variant=get("variant"), t_rl=get("t_rl"), b_sac=get("b_sac"),
                   k=get("k"), frozen=frozen is True or (frozen is not None and frozen == 1))


def arm_label(strategy, variant=None, t_rl=None, b_sac=None, k=None, frozen=False, cell: bool = True) -> str:
    """:meth:`Arm.label` of the arm given by its parts (a missing or NaN ``frozen`` is not frozen)."""
    frozen = not _missing(frozen) and (frozen is True or frozen == 1)
    return Arm(strategy, variant, t_rl, b_sac, k, frozen).label(cell)


def arms(results: pd.DataFrame, cell: bool = True) -> pd.Series:
    """The arm label (:meth:`Arm.label`) of every row of a results table."""
    return pd.Series([Arm.from_row(row).label(cell) for row in results.to_dict("records")], index=results.index,
                     dtype=object)
