"""``search: bandit``: the episode-level contextual bandit (:mod:`raydp.study.schedule_bandit`) as a Ray Tune searcher.

A bandit study learns on PUBLIC episodes only (``private_data: false``): one Tune experiment whose trials cycle
through the study's epsilons (the contexts) ``bandit.num_samples`` times, each trial's values chosen by Thompson
sampling given every episode finished so far (random for a context's first ``bandit.startup_trials``). When the
study ends, the bandit's decision for each epsilon (its posterior-mean best values) becomes that cell's
``search_best``: a deciding study runs them with ``tuned_from``, as it runs an Optuna search's best. The study
directory keeps the fitted bandit's data (``bandit.json``), from which :meth:`ScheduleBandit.decide` gives the
values for any epsilon in the range it learned on.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pandas as pd
from ray.tune.search import Searcher

from raydp.study.schedule_bandit import Dimension, ScheduleBandit
from raydp.study.config import StudyConfig
from raydp.study.grid import search_cells
from raydp.study.results import METRIC_COLUMNS

#: where a bandit study keeps its fitted bandit
BANDIT_FILE = "bandit.json"


def study_bandit(study: StudyConfig) -> ScheduleBandit:
    """An empty bandit over the study's one searched strategy's ``search_space``, its contexts the study's
    epsilons."""
    (strategy, space), = study.search_space.items()
    dims = {name: Dimension(low=d.low, high=d.high, log=d.log, choices=tuple(d.choices) if d.choices else None)
            for name, d in space.items()}
    return ScheduleBandit(space=dims, epsilon_range=(min(study.epsilons), max(study.epsilons)),
                          seed=study.bandit.seed, candidates=study.bandit.candidates)


class BanditSearch(Searcher):
    """Tune's side of the bandit: :meth:`suggest` gives the next trial its context (cycling through the search
    cells, one per epsilon) and values; :meth:`on_trial_complete` adds the finished episode's public loss. Trials
    still running when another is suggested are not modelled: Thompson sampling's own randomness spreads them."""

    def __init__(self, study: StudyConfig, metric: str = "selection_score"):
        super().__init__(metric=metric, mode="min")
        cells = search_cells(study)
        self.plan = [cell.to_dict() for _ in range(study.bandit.num_samples) for cell in cells]
        self.startup = study.bandit.startup_trials * len(cells)  # the first rounds: random values
        self.bandit = study_bandit(study)
        self.issued = 0
        self.pending: dict[str, tuple[float, dict]] = {}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the space is the study's (set in __init__); Tune's param_space holds only fixed values

    def suggest(self, trial_id: str):
        if self.issued >= len(self.plan):
            return Searcher.FINISHED
        cell, draw = self.plan[self.issued], self.issued
        self.issued += 1
        epsilon = float(cell["epsilon"])
        values = self.bandit.random_draw(draw) if draw < self.startup else self.bandit.suggest(epsilon, draw)
        self.pending[trial_id] = (epsilon, values)
        return {"search_cell": cell, "search": values}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        epsilon, values = self.pending.pop(trial_id, (None, None))
        if epsilon is None or error or not result or result.get(self.metric) is None:
            return  # a failed episode teaches nothing (its values may be tried again)
        self.bandit.observe(epsilon, values, float(result[self.metric]))

    def get_state(self) -> dict:
        return {"plan": self.plan, "startup": self.startup, "issued": self.issued, "pending": self.pending,
                "bandit": self.bandit.to_dict()}

    def set_state(self, state: dict) -> None:
        self.plan, self.startup, self.issued = state["plan"], state["startup"], state["issued"]
        self.pending = state["pending"]
        self.bandit = ScheduleBandit.from_dict(state["bandit"])

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_bytes(pickle.dumps(self.get_state()))

    def restore(self, checkpoint_path: str) -> None:
        self.set_state(pickle.loads(Path(checkpoint_path).read_bytes()))


def bandit_best(study: StudyConfig, table: pd.DataFrame, split: str, metric: str, study_dir: Path) -> list[dict]:
    """The bandit fitted on every finished episode of the study (from its results, so a resumed study's too),
    saved as ``bandit.json``, and its decision per search cell in ``search_best``'s form."""
    column = METRIC_COLUMNS[metric][split][0]
    bandit = study_bandit(study)
    done = table[table["search"].notna() & (table["status"] == "TERMINATED")] if "search" in table else table[:0]
    done = done[done[column].notna()] if column in done else done[:0]
    for _, row in done.sort_values("trial").iterrows():
        bandit.observe(float(row["epsilon_target"]), json.loads(row["search"]), float(row[column]))
    if not bandit.observations:
        return []
    bandit.save(Path(study_dir) / BANDIT_FILE)
    out = []
    for cell in search_cells(study):
        best = bandit.decide(cell.epsilon)
        mean, low, high = bandit.predict(cell.epsilon, best)
        out.append({"strategy": cell.strategy, "model": cell.model, "epsilon": float(cell.epsilon),
                    "trials": int((done["epsilon_target"] == cell.epsilon).sum()), "best": best,
                    "decided_by": "bandit: lowest posterior mean", "predicted": round(mean, 4),
                    "predicted_range": [round(low, 4), round(high, 4)], "length_scales": bandit.length_scales()})
    return out
