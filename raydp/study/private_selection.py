"""``selection: private-dp``: private hyperparameter selection with one end-to-end epsilon.

The mechanism (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022,
arXiv:2110.03620v2), once per (model, epsilon, seed) cell of the study:

1. draw the number of trials K from a fixed distribution (Poisson, Thm. 6; truncated negative binomial, Thm. 2)
   with secret randomness (the OS's), and each trial's settings independently from ``search_space`` (uniform,
   log-uniform or a uniform choice), with secret randomness too: a public seed would fix the candidates'
   order, and the released best's settings would then tell which of them won, so K's lower bound;
2. run every trial: a DP-SGD run at the per-trial epsilon solved from the cell's end-to-end epsilon (below), then
   ONE Gaussian release of its score on the private validation split (:func:`score_release`);
3. release the trial with the lowest noisy score: its adapters, settings, score and run summary without timings.
   Nothing else: not K, not the other trials, not their wall times (``work/`` keeps them, private).

Accounting. Each trial's RDP curve is its planned training curve (:func:`raydp.runner.privacy_setup.
planned_rdp_curve`, the same for every draw: the search space may only vary settings that leave the plan
unchanged, checked at its corners) plus the score release's a / (2 s^2) (Mironov 2017, Prop. 7, sensitivity 1 after
dividing by the score range). The released result is RDP with :func:`raydp.privacy.accounting.selection.
selection_rdp` of that curve (dp_accounting's repeat-and-select), converted to (epsilon, delta); the per-trial
epsilon is the largest whose end-to-end epsilon meets the cell's (:func:`plan_cell`). After each trial, its ledger's
curve is checked against the planned one: a trial that spent more stops the study with nothing released. Every
cell is charged to the dataset's lifetime budget by its end-to-end curve, which does not depend on K.

Limits (docs/privacy.md): K = 0 (Poisson only) releases nothing for the cell, which is part of Thm. 6's output;
a trial that fails stops the study with nothing released (a failure is not covered by the theorem: the
study's trials are fixed-plan DP-SGD runs, which fail on bugs or resources, not on the data); the study's total
run time grows with K, so whoever watches the driver learns about K: release the result, not the run's timing;
each trial is a process every local user sees in the process table (docs/privacy.md: run it where no one else
logs in, or with /proc mounted hidepid=2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raydp.data import load_manifest, load_texts, load_units, manifest_id, resolve_dataset
from raydp.data.splits import has_split, load_value_spans
from raydp.errors import ConfigError
from raydp.files import atomic_write, tighten_umask
from raydp.evaluation.evaluate import SELECTION_FILE, load_trained_model
from raydp.evaluation.perplexity import value_nll_per_sequence
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, ledger_rdp_curve, rdp_epsilon
from raydp.privacy.accounting.selection import (POISSON, SelectionDistribution, calibrate_trial_parameter,
                                                selection_rdp)
from raydp.privacy.ledger import PrivacyLedger
from raydp.privacy.lifetime import LifetimeReceipt, charge, read_budget, record_spend
from raydp.runner.privacy_setup import (LifetimeCharge, build_strategy, plan_key, plan_private_run, planned_rdp_curve,
                                        training_units)
from raydp.strategies.base import Strategy
from raydp.strategies.registry import strategy_class
from raydp.runner.run import run_training
from raydp.runner.task import Task
from raydp.run_directory import CONFIG, LEDGER, RunDirectory
from raydp.study.config import PrivateSelectionSettings, SearchDimension, StudyConfig
from raydp.study.grid import draw_in_range, trial_config
from raydp.study.prepare import study_record
from raydp.study.selection_route import selection_route
from raydp.data.public_records import PublicRecords
from raydp.study.trial import Trial
from raydp.study.selection_release import (ALL_CELLS_NOTE, OWNER_REPORT, PRIVATE_SELECTION_NOTE,  # noqa: F401
                                          RELEASED_CELL_NOTE, RELEASED_SUMMARY_KEYS, all_cells_line, cell_key,
                                          compose_cells, format_selection, released_cell_note,
                                          released_summary, selection_summary, study_figure,
                                          study_privacy_note)

#: the mechanism's secret state (K and the drawn settings of every cell): private, never in a releasable file
SECRET_STATE = Path("work") / "private-selection.json"
SECRET_FORMAT = "raydp-private-selection-v1"
#: what a private-dp study releases, one directory per cell
RELEASED = "released"
#: a run directory's files a released trial keeps (adapter/ is copied whole; summary.json is rewritten)
RELEASED_FILES = (CONFIG, LEDGER)
#: a cell's per-trial epsilon is solved in [end-to-end / EPSILON_RANGE, end-to-end]
EPSILON_RANGE = 50.0
#: the most corner combinations of a search space that plan_cell checks
MAX_CORNERS = 256
#: interior draws whose plan key is checked beside the corners
INTERIOR_CHECKS = 8

def distribution_of(settings: PrivateSelectionSettings) -> SelectionDistribution:
    """The law of K the study file names (Papernot & Steinke Def. 1; Poisson: Sec. 3.3)."""
    if settings.distribution == "poisson":
        return SelectionDistribution.poisson(settings.mean)
    if settings.distribution == "geometric":
        return SelectionDistribution.geometric(settings.mean)
    if settings.distribution == "logarithmic":
        return SelectionDistribution.logarithmic(settings.mean)
    return SelectionDistribution.truncated_negative_binomial(settings.mean, settings.shape)


def score_rdp(noise: float, orders=DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the score release: a Gaussian mechanism of sensitivity 1 (the score divided by its range) and noise
    std ``noise``: a / (2 noise^2) at order a (Mironov 2017, Prop. 7)."""
    return np.asarray(orders, dtype=np.float64) / (2.0 * float(noise) ** 2)


def draw_settings(space: dict[str, SearchDimension], rng: random.Random) -> dict:
    """One independent draw from the search space: log-uniform, uniform, or a uniform choice per dimension."""
    values = {}
    for name, dim in space.items():
        values[name] = dim.choices[rng.randrange(len(dim.choices))] if dim.choices is not None \
            else draw_in_range(dim, rng)
    return values


def draw_count(distribution: SelectionDistribution) -> int:
    """K, from a generator seeded by 128 bits of OS entropy that no file keeps."""
    return int(distribution.sample(np.random.default_rng(secrets.randbits(128))))


@dataclass(frozen=True)
class CellPlan:
    """One cell's mechanism, fixed before any trial runs."""

    key: str
    model: str
    epsilon: float  # the end-to-end target
    seed: int
    strategy: str
    trial_epsilon: float  # each trial's DP-SGD target (its planned curve's PLD epsilon)
    training_curve: np.ndarray  # each trial's planned training curve at DEFAULT_ORDERS
    trial_curve: np.ndarray  # training + the score release
    end_to_end_curve: np.ndarray  # repeat-and-select of trial_curve
    end_to_end_epsilon: float
    delta: float
    privacy_unit: str  # what every trial protects (the lifetime charge must be for the same unit)

    def describe(self, settings: PrivateSelectionSettings) -> dict:
        """The cell's public description: what the study file fixes and the guarantee it gives (no K)."""
        distribution = distribution_of(settings)
        n = max(1, math.ceil(distribution.mean))  # the mean, never the realised K
        composed = rdp_epsilon(n * self.trial_curve, DEFAULT_ORDERS, self.delta)
        return {"model": self.model, "epsilon": self.epsilon, "seed": self.seed, "strategy": self.strategy,
                "delta": self.delta, "trial_epsilon": self.trial_epsilon,
                "end_to_end_epsilon": self.end_to_end_epsilon,
                "theorem": ("Papernot & Steinke 2022, Thm. 6 (Poisson number of trials)" if distribution.kind == POISSON
                            else "Papernot & Steinke 2022, Thm. 2 (truncated negative binomial number of trials)"),
                "distribution": {"kind": distribution.kind, "mean": distribution.mean, "shape": distribution.shape},
                "score_epsilon_share": rdp_epsilon(score_rdp(settings.score_noise), DEFAULT_ORDERS, self.delta),
                "for_comparison": {
                    "trials": n, "basic_composition_epsilon": n * self.trial_epsilon,
                    "rdp_composition_epsilon": composed,
                    "note": "what releasing every one of this many trials (E[K] rounded up, never the realised K) "
                            "would cost: basic composition, and RDP composition (the tuning-aware figure)"}}


def _cells(study: StudyConfig) -> list[tuple[str, float, int]]:
    return [(model, float(eps), int(seed)) for model in study.models for eps in study.epsilons for seed in study.seeds]


def _trial_spec(study: StudyConfig, model: str, epsilon: float, seed: int, values: dict) -> Trial:
    """One trial of a cell with its drawn ``values`` (run fields and the strategy's settings, as a search's)."""
    return Trial(model=model, epsilon=epsilon, seed=seed, strategy=study.strategies[0], search=values)


def corner_draws(space: dict[str, SearchDimension]) -> list[dict]:
    """Every combination of the space's corners: each range's two ends, each of a list's choices. A plan that is
    the same at all of them is the same at every draw for the settings a plan can depend on (it depends on a
    setting's value through the plan key, which the check compares; see :func:`plan_cell`)."""
    values = [dim.choices if dim.choices is not None else [dim.low, dim.high] for dim in space.values()]
    count = math.prod(len(v) for v in values)
    if count > MAX_CORNERS:
        raise ConfigError(f"the search space has {count} corner combinations: selection: private-dp checks every one "
                          f"before it charges anything, at most {MAX_CORNERS}; give fewer choices")
    return [dict(zip(space, combo)) for combo in itertools.product(*values)]


def plan_cell(study: StudyConfig, dataset: str, model: str, epsilon: float, seed: int) -> CellPlan:
    """Solve the cell's per-trial epsilon: the largest whose trials (training plus the score release) give an
    end-to-end epsilon at most the cell's (:func:`raydp.privacy.accounting.selection.calibrate_trial_parameter`,
    bisection on 1 / epsilon, since the repeat-and-select epsilon grows with the trial's). Every corner combination
    of the search space (:func:`corner_draws`) must be a valid trial with one privacy plan (the same plan key and, at
    the solved epsilon, the same curve): the theorem needs one curve that bounds every draw."""
    settings = study.selection_settings
    corners = corner_draws(study.search_space[study.strategies[0]])
    n_train = len(load_texts(dataset, "train"))
    score = score_rdp(settings.score_noise)

    def planned(trial_eps: float, values: dict):
        config = trial_config(study, _trial_spec(study, model, trial_eps, seed, values), dataset)
        strategy = build_strategy(config)
        units = training_units(config, dataset, n_train)
        return config, strategy, units, plan_private_run(config, units.public_count, strategy)

    if getattr(strategy_class(study.strategies[0]), "warm_start", None) is not Strategy.warm_start:
        raise ConfigError(f"strategy {study.strategies[0]!r} trains a phase before DP-SGD (warm_start): "
                          "selection: private-dp releases DP-SGD runs only")
    keys, first = set(), None
    checker = random.Random(0)  # public: a few interior draws beside the corners, for the check only
    interior = [draw_settings(study.search_space[study.strategies[0]], checker) for _ in range(INTERIOR_CHECKS)]
    for values in corners + interior:  # every corner is a valid config (a trial that fails after the charge strands the study)
        config, strategy, units, plan = planned(epsilon, values)
        caveats = LifetimeCharge.of(plan, config, strategy, units.name).caveats
        if caveats:  # an epsilon with caveats (paper mode, a redacted phase, void randomness) bounds nothing here
            raise ConfigError(f"search_space.{study.strategies[0]}: a draw's epsilon carries caveats "
                              f"({'; '.join(caveats)[:120]}): selection: private-dp refuses it")
        keys.add(plan_key(config, strategy))
        first = first or (config, units)
    if len(keys) > 1:
        raise ConfigError(f"search_space.{study.strategies[0]}: its corners plan different privacy curves; "
                          "selection: private-dp needs one plan for every draw (search clips, learning rates and "
                          "schedules, not what changes sigma, q or the steps)")
    config, units = first
    distribution, delta = distribution_of(settings), config.delta

    def trial_rdp_of(inverse_eps: float) -> np.ndarray:
        _, _, _, plan = planned(1.0 / inverse_eps, corners[0])
        return planned_rdp_curve(plan, delta) + score

    try:
        inverse = calibrate_trial_parameter(epsilon, delta, distribution, trial_rdp_of, low=1.0 / epsilon,
                                            high=EPSILON_RANGE / epsilon, rtol=1e-3)
    except ConfigError as exc:
        raise ConfigError(f"cell {cell_key(model, epsilon, seed)}: end-to-end epsilon {epsilon:g} is unreachable "
                          f"with this score noise and number of trials ({exc})") from None
    trial_eps = 1.0 / inverse
    curves = [planned_rdp_curve(planned(trial_eps, values)[3], delta) for values in corners]
    training_curve = np.max(curves, axis=0)
    if not all(np.allclose(c, training_curve, rtol=1e-9, atol=0.0) for c in curves):
        raise ConfigError(f"search_space.{study.strategies[0]}: its corners plan different privacy curves at "
                          f"epsilon {trial_eps:.4g}")
    trial_curve = training_curve + score
    end_curve = selection_rdp(trial_curve, DEFAULT_ORDERS, distribution)
    return CellPlan(cell_key(model, epsilon, seed), model, epsilon, seed, study.strategies[0], trial_eps,
                    training_curve, trial_curve, end_curve, rdp_epsilon(end_curve, DEFAULT_ORDERS, delta), delta,
                    units.name)


# ----------------------------------------------------------------------------------------------- secret state

def _write_private(path: Path, value: dict) -> None:
    """Write ``value`` as JSON readable by the owner only (0600), atomically (:func:`raydp.files.atomic_write`)."""
    atomic_write(path, json.dumps(value, indent=1))


def draw_or_read_state(study: StudyConfig, study_dir: Path, resume: bool) -> dict:
    """Each cell's K and trials (an opaque id and drawn settings each), drawn once with OS entropy and kept in
    ``work/``. A resume reads them back and never redraws: K is the mechanism's secret state, and a redraw would
    be a second, uncharged selection."""
    path = Path(study_dir) / SECRET_STATE
    if path.is_file():
        if not resume:
            raise ConfigError(f"{study_dir} already holds a private selection: finish it with --resume, or run into "
                              "another --results-dir")
        state = json.loads(path.read_text())
        if state.get("format") != SECRET_FORMAT:
            raise ConfigError(f"{path}: not a {SECRET_FORMAT} file")
        return state
    if resume:
        raise ConfigError(f"nothing to resume in {study_dir}: it has no private selection state ({SECRET_STATE})")
    rng = secrets.SystemRandom()
    distribution = distribution_of(study.selection_settings)
    space = study.search_space[study.strategies[0]]
    cells = {}
    for model, eps, seed in _cells(study):
        count = draw_count(distribution)
        cells[cell_key(model, eps, seed)] = [{"id": secrets.token_hex(6), "settings": draw_settings(space, rng)}
                                             for _ in range(count)]
    # the tag of this selection's lifetime charges: drawn with it, so that a selection drawn anew (its state
    # removed, or the study run again elsewhere) is charged anew, and a resume of this one is charged once
    state = {"format": SECRET_FORMAT, "charge_tag": secrets.token_hex(16), "cells": cells, "scores": {},
             "released": False}
    _write_private(path, state)
    return state


def _save_state(study_dir: Path, state: dict) -> None:
    _write_private(Path(study_dir) / SECRET_STATE, state)


# ------------------------------------------------------------------------------------------------ the score

#: A public bound on a validation split's privacy units: the score's total is clamped at SCORE_MAX_UNITS x (high - low)
#: (a larger split's score saturates; nothing is refused), which bounds the final rounding below.
SCORE_MAX_UNITS = 2 ** 24
#: The score's noise is for the sensitivity (high - low) x (1 + margin): one unit added or removed moves the rounded
#: sum by at most that (:func:`score_release`; Casacuberta et al. 2022, "Widespread underestimation of sensitivity in
#: differentially private libraries and how to fix it", on floating-point sensitivity).
SCORE_ROUNDING_MARGIN = 1e-8


def score_release(values: np.ndarray, units: np.ndarray, score_range: tuple[float, float], noise: float,
                  rng: np.random.Generator) -> float:
    """The DP score of one trial (lower is better): each record's value-token NLL clipped to [low, high] (a
    non-finite one counts as ``high``); each unit (patient) contributes the mean of its records' minus ``low``, in
    [0, high - low], so adding or removing a unit moves the sum by at most high - low; the released score is that
    sum plus Gaussian noise of std ``noise`` (high - low) (1 + :data:`SCORE_ROUNDING_MARGIN`). It is not divided by
    the split's unit count: the count moves with the unit added or removed, which the Gaussian's sensitivity does not
    cover (found by an adversarial review of this mechanism).

    Floating point (Casacuberta et al. 2022). With D = fl(high - low): a unit's contribution c_u is the exactly
    rounded sum (``math.fsum``, independent of the records' order) of its records' fl(clip(v) - low), each in
    [0, D] (rounding is monotone), divided by their count and clamped to [0, D] (the division can exceed D by one
    ulp: three records at 0.1 with range (0, 0.1) average to 0.10000000000000002); c_u depends on the unit's records
    alone. The total is S = min(fsum(c_u), B), B = SCORE_MAX_UNITS D (exact: a power of two), so S is the exact sum T
    rounded once to nearest (|fl(x) - x| <= u |x|, u = 2^-53), then clamped. A numpy sum's pairwise tree changes
    shape when a unit is added, which moved the sum by up to 7.3e-12 more than D (review, 20,000 random pairs at
    range (30, 110)). Adding a unit of contribution c in [0, D] (T' = T + c): S' >= S (fl and min are monotone);
    if S = B, S' = B; otherwise T < B / (1 - u) and S' - S <= fl(T') - fl(T) <= c + u (T + T') < c + u (2B / (1 - u)
    + D), so |S' - S| / D < 1 + u (2^25 / (1 - u) + 1) < 1 + 3.8e-9, which the 1e-8 margin covers with room for the
    std's own two roundings (relative 2u). The margin does not depend on the split's unit count (private): the clamp
    at the public B bounds the total whatever the count."""
    low, high = score_range
    span = high - low
    bound = SCORE_MAX_UNITS * span
    if not (span > 0 and math.isfinite(bound)):
        raise ValueError(f"score_range {score_range!r}: needs low < high and a finite {SCORE_MAX_UNITS} x (high - low)")
    values = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=high, posinf=high, neginf=low)
    clipped = np.clip(values, low, high) - low
    _, inverse = np.unique(np.asarray(units), return_inverse=True)
    inverse = inverse.reshape(-1)
    groups = (np.split(clipped[np.argsort(inverse, kind="stable")], np.cumsum(np.bincount(inverse))[:-1])
              if len(inverse) else [])
    contributions = [min(max(math.fsum(group) / len(group), 0.0), span) for group in groups]
    total = min(math.fsum(contributions), bound)
    return total + float(rng.normal(0.0, noise * span * (1.0 + SCORE_ROUNDING_MARGIN)))


def record_values(model, split, device) -> np.ndarray:
    """Each record's value-token NLL for the score (a free-text record, which has no value spans: its whole text's
    NLL, nats per text), one record per forward pass, so that a record's value depends on that record and the model
    alone; clipped to ``score_range`` either way, so a unit's bound does not depend on which. Batched, a record is
    padded to its batch's longest and the kernels' shapes follow the other records: removing one record moved other
    records' values by up to 7.6e-6 nats (1 removal in 40, embedded model, 300 validation records), beyond the
    high - low that bounds one unit's contribution."""
    return value_nll_per_sequence(model, split, device, batch_size=1, whole_text=split.value_masks is None)


def trial_score(run_dir: Path, config, dataset: str, settings: PrivateSelectionSettings) -> float:
    """Score the trained run on the private validation split (:func:`score_release`), with OS-entropy noise."""
    loaded = load_trained_model(run_dir, config, config.device)
    task = Task.build(config.task.kind, config.task.label, loaded.tokenizer, encoder=loaded.is_encoder)
    split = task.split(load_texts(dataset, "validation"), loaded.tokenizer,
                       task.length_cap(config.max_length, loaded.max_positions),
                       spans=load_value_spans(dataset, "validation"))
    values = record_values(loaded.model, split, loaded.device)
    return score_release(values, load_units(dataset, "validation"), settings.score_range, settings.score_noise,
                         np.random.default_rng(secrets.randbits(128)))


def check_trial_spend(run_dir: Path, plan_curve: np.ndarray) -> None:
    """The trial's ledger against its planned training curve: a trial that spent more than planned breaks the
    theorem's one-curve condition, so the study stops with nothing released."""
    ledger = PrivacyLedger.load(RunDirectory(run_dir).ledger)
    spent = ledger_rdp_curve(ledger, DEFAULT_ORDERS)
    if np.any(spent > np.asarray(plan_curve) * (1 + 1e-9) + 1e-12):
        raise ConfigError(f"trial {run_dir.name} spent more than its plan (order "
                          f"{DEFAULT_ORDERS[int(np.argmax(spent - plan_curve))]}): nothing is released")


def run_selection_trial(params: dict) -> None:
    """The Tune trainable: one trial of a private selection, trained into the private ``work/``, then scored."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    tighten_umask()  # this trial's process writes private files (a joined cluster's worker may have a looser mask)
    study = StudyConfig(**params["study"])
    trial = params["trial"]
    dataset = params["dataset"]
    config = trial_config(study, _trial_spec(study, trial["model"], trial["trial_epsilon"], trial["seed"],
                                             trial["settings"]), dataset)
    torch.set_num_threads(config.cpus or 1)
    out = Path(params["study_dir"]) / "work" / "trials" / trial["id"]
    # charged by its cell's end-to-end curve (_charge), which covers every trial of the cell: the receipt says so
    run_training(config, out / "run", overwrite=True, progress=False,
                 _charged_by=LifetimeReceipt(trial["dataset_id"], trial["charge_label"]))
    check_trial_spend(out / "run", np.asarray(trial["training_curve"]))
    score = trial_score(out / "run", config, dataset, study.selection_settings)
    _write_private(out / "score.json", {"id": trial["id"], "score": score})
    tune.report({"done": True})


# ------------------------------------------------------------------------------------------------ the driver

def plan_study(study: StudyConfig, study_dir: Path, progress: bool = True) -> tuple[str, dict[str, CellPlan]]:
    """Build the dataset (into ``study_dir/dataset``) and solve every cell's plan; needs no Ray."""
    probe = trial_config(study, _trial_spec(study, study.models[0], study.epsilons[0], study.seeds[0],
                                            corner_draws(study.search_space[study.strategies[0]])[0]))
    dataset = str(resolve_dataset(probe.data, Path(study_dir) / "dataset", progress=progress))
    if not has_split(dataset, "validation"):
        raise ConfigError(f"dataset {dataset} has no private validation split: set base.data.fractions.validation")
    manifest = load_manifest(dataset)
    if probe.public_validation:  # apart from the private records, before the lifetime charge (raydp.data.public_records)
        PublicRecords.of(probe.public_validation, manifest).check_apart(Path(dataset), manifest)
    if manifest.get("text_source") and "score_range" not in study.selection_settings.model_fields_set:
        raise ConfigError("private selection on free text scores each validation text's whole NLL (nats per text), "
                          "which the default score_range (30, 110), set for the value-token NLL of a record, would "
                          "clip flat: set private_selection.score_range for texts like yours, from public texts or "
                          "public knowledge, never from the private ones")
    route = selection_route(study, probe.public_validation, manifest)
    if route and progress:
        print(f"raydp: {route}", flush=True)
    return dataset, plan_cells(study, dataset)


def plan_cells(study: StudyConfig, dataset: str) -> dict[str, CellPlan]:
    """Every cell's plan (:func:`plan_cell`), by cell key, in the study's order; solved once per model and epsilon
    (a cell's plan does not depend on its seed)."""
    solved: dict[tuple[str, float], CellPlan] = {}
    plans = {}
    for model, eps, seed in _cells(study):
        if (model, eps) not in solved:
            solved[(model, eps)] = plan_cell(study, dataset, model, eps, seed)
        plans[cell_key(model, eps, seed)] = dataclasses.replace(solved[(model, eps)], key=cell_key(model, eps, seed),
                                                                seed=seed)
    return plans


def run_private_selection(study: StudyConfig, study_dir: Path, progress: bool, resume: bool) -> Path:
    """Run (or resume) a private-dp study in ``study_dir`` (locked by the caller); returns the directory."""
    import ray  # lazy: `raydp study --check` loads no Ray
    from ray import tune  # lazy: as above

    from raydp.runner.launch import ensure_ray, remove_tune_staging  # lazy: imports Ray

    log = logging.getLogger("raydp.study")
    say = (lambda text: print(f"raydp: {text}", flush=True)) if progress else (lambda text: None)
    for private in (study_dir / "work", study_dir / "dataset"):  # owner-only: work/'s entries count the trials
        private.mkdir(parents=True, exist_ok=True)
        os.chmod(private, 0o700)
    dataset, plans = plan_study(study, study_dir, progress)
    total = compose_cells(plans)  # what releasing every cell costs: fixed by the plans, before any K is drawn
    for plan in plans.values():
        say(f"cell {plan.key}: each trial at epsilon {plan.trial_epsilon:.4g} (score noise "
            f"{study.selection_settings.score_noise:g}); the released best: epsilon {plan.end_to_end_epsilon:.4g} "
            f"at delta {plan.delta:g}")
    fresh = not (study_dir / SECRET_STATE).is_file()
    state = draw_or_read_state(study, study_dir, resume)  # a rerun without --resume is refused before any charge
    try:
        _charge(dataset, plans, state["charge_tag"])
    except BaseException:
        if fresh:  # nothing ran: the draw is discarded with the refused charge
            (study_dir / SECRET_STATE).unlink(missing_ok=True)
        raise
    atomic_write(study_dir / "PRIVACY.txt", study_privacy_note(total))
    atomic_write(study_dir / "study.json", study_record(study))

    if state.get("released"):  # a finished selection is released once: its trials are never run again
        say("this selection was released already: its released files are rewritten from its kept trials")
    pending = []
    dataset_id = manifest_id(load_manifest(dataset))
    for key, trials in state["cells"].items():
        plan = plans[key]
        for trial in trials:
            if trial["id"] not in state["scores"]:
                pending.append({"id": trial["id"], "settings": trial["settings"], "model": plan.model,
                                "seed": plan.seed, "trial_epsilon": plan.trial_epsilon,
                                "training_curve": plan.training_curve.tolist(), "dataset_id": dataset_id,
                                "charge_label": charge_label(state["charge_tag"], key)})
    if pending and state.get("released"):
        raise ConfigError(f"{study_dir} was released, and some of its trials' kept outputs are gone: a selection is "
                          "run once (running them again would be a second, uncharged selection)")
    if pending:
        ensure_ray(private=True)
        cpus, gpus = study.resources.cpus_per_trial, study.resources.gpus_per_trial
        if cpus > ray.cluster_resources().get("CPU", 0):
            raise ConfigError(f"resources.cpus_per_trial={cpus} exceeds the cluster's "
                              f"{int(ray.cluster_resources().get('CPU', 0))} CPUs: no trial could ever start")
        say("training the cells' trials (how many is secret: no progress is shown)")
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        trainable = tune.with_resources(run_selection_trial, tune.PlacementGroupFactory([bundle]))
        common = {"study": study.model_dump(mode="json"), "dataset": dataset, "study_dir": str(study_dir)}
        # a fresh experiment name each time: scored trials are skipped above, an unscored one starts over (its
        # partial run released nothing); Tune's state and logs stay in the private work/
        experiment = f"selection-{secrets.token_hex(4)}"
        tuner = tune.Tuner(trainable, param_space={**common, "trial": tune.grid_search(pending)},
                           tune_config=tune.TuneConfig(trial_dirname_creator=lambda t: t.trial_id),
                           run_config=tune.RunConfig(name=experiment,
                                                     storage_path=str(study_dir / "work" / "tune"),
                                                     failure_config=tune.FailureConfig(max_failures=0),
                                                     verbose=0))
        try:
            with _output_to(study_dir / "work" / "tune.log"):  # Tune prints the number of trials: keep it private
                grid = tuner.fit()
        finally:  # Tune's staged copy in Ray's temporary folder (every trial's settings, so K)
            remove_tune_staging(experiment)
        for trial in pending:  # every score into the mechanism's state (deleting a trial's files cannot redo it)
            path = study_dir / "work" / "trials" / trial["id"] / "score.json"
            if path.is_file():
                state["scores"][trial["id"]] = json.loads(path.read_text())["score"]
        _save_state(study_dir, state)
        failed = [r for r in grid if r.error is not None]
        if failed or any(t["id"] not in state["scores"] for t in pending):
            log.error("private selection: a trial failed: %s",
                      str(failed[0].error).splitlines()[0][:300] if failed else "no score")
            raise ConfigError("a trial of the private selection failed: nothing is released (finish the study with "
                              "--resume once the cause is fixed; the number of trials is kept)")
    released = _release(study, study_dir, plans, state, total)
    state["released"] = True
    _save_state(study_dir, state)
    summary = selection_summary(study.name, released, plans, dataset_id)
    atomic_write(study_dir / "study_summary.json", json.dumps(summary, indent=2, default=str))
    _stamp_releasable(study_dir)
    return study_dir


def _stamp_releasable(study_dir: Path) -> None:
    """Give every releasable file and directory the modification and access times of ``study.json`` (written before
    any trial): the time between the study's start and its release grows with K, and copies would carry the chosen
    trial's. (Their change time, ctime, and birth time, btime, cannot be set: they are the stamping's and the
    release's, at the study's end; PRIVACY.txt names both and says how to copy the files without them.)"""
    when = (study_dir / "study.json").stat().st_mtime
    paths = [study_dir / "study_summary.json", study_dir / "PRIVACY.txt", study_dir / RELEASED, study_dir]
    paths += sorted((study_dir / RELEASED).rglob("*"), reverse=True) if (study_dir / RELEASED).is_dir() else []
    for path in paths:
        if path.exists():
            os.utime(path, (when, when))


@contextlib.contextmanager
def _output_to(path: Path):
    """Send this process's stdout and stderr (file descriptors 1 and 2: Tune's tables, Ray's forwarded trial logs)
    to ``path`` for the block: they name the trials, so how many ran."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    log = open(path, "a", buffering=1)  # where sys.stdout is not fd 1 (a notebook, a test's capture)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        log.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for handle in (*saved, fd):
            os.close(handle)


def charge_label(charge_tag: str, key: str) -> str:
    """The lifetime register's label of a cell's charge (:func:`_charge`), which its trials' receipts name."""
    return f"study:{charge_tag}/private-dp/{key}"


def _charge(dataset: str, plans: dict[str, CellPlan], charge_tag: str) -> None:
    """Charge every cell's end-to-end curve (independent of K) to the dataset's lifetime budget, before any trial,
    under labels tagged with the selection's ``charge_tag`` (drawn with K and kept with it in ``work/``: a resume is
    charged once; a selection drawn anew, its state removed or the study run again anywhere, is charged again)."""
    manifest = load_manifest(dataset)
    dataset_id, source = manifest_id(manifest), manifest.get("source_sha256")
    if read_budget(dataset_id, source) is None and not manifest.get("lifetime_budget"):  # no budget: recorded
        record_spend(dataset_id, {charge_label(charge_tag, key): plan.end_to_end_curve for key, plan in plans.items()})
        return
    units = {plan.privacy_unit for plan in plans.values()}
    if len(units) != 1:
        raise ConfigError(f"the study's cells protect different units ({sorted(units)}): charge them apart")
    charge(dataset_id, {charge_label(charge_tag, key): plan.end_to_end_curve for key, plan in plans.items()},
           DEFAULT_ORDERS, privacy_unit=units.pop(), required=bool(manifest.get("lifetime_budget")),
           source_sha256=source)


def _release(study: StudyConfig, study_dir: Path, plans: dict[str, CellPlan], state: dict,
             total: dict) -> list[dict]:
    """Per cell, copy the best trial's releasable files to ``released/CELL`` and describe it, with what releasing
    every cell costs (``total``, :func:`compose_cells`) in its ``selection.json`` and ``PRIVACY.txt``; the private
    eval split's figures of the released trials go to ``work/owner-report.json`` (private)."""
    settings = study.selection_settings
    out, owner = [], {}
    for key, trials in state["cells"].items():
        plan = plans[key]
        entry = plan.describe(settings)
        scores = {t["id"]: state["scores"][t["id"]] for t in trials}
        target = study_dir / RELEASED / key
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        if not trials:  # Poisson's K = 0: the mechanism's empty output
            entry.update(released=False, note="no trial ran (K = 0 is part of the mechanism): nothing is released")
        else:
            best = min(trials, key=lambda t: (not math.isfinite(scores[t["id"]]), scores[t["id"]]))
            run_dir = study_dir / "work" / "trials" / best["id"] / "run"
            run, cell = RunDirectory(run_dir), RunDirectory(target)
            if not run.adapter.is_dir():
                raise ConfigError(f"the selected trial's kept outputs are gone from {study_dir / 'work'}: nothing "
                                  "is released (a selection is run once)")
            shutil.copytree(run.adapter, cell.adapter, copy_function=shutil.copyfile)
            for name in RELEASED_FILES:
                if (run_dir / name).is_file():
                    shutil.copyfile(run_dir / name, target / name)
            run_summary = run.read_summary().raw
            atomic_write(cell.summary, json.dumps(released_summary(run_summary, plan, entry["theorem"]),
                                                             indent=2))
            entry.update(released=True, settings=best["settings"], score=scores[best["id"]],
                         score_note="the noisy sum over the private validation split's patients of each patient's "
                                    "mean clipped value-token NLL minus the range's low end (lower is better; a "
                                    "charged Gaussian release)",
                         final_public_value_nll=run_summary.get("final_public_value_nll"),
                         directory=str(target.relative_to(study_dir)))
            owner[key] = {k: run_summary.get(k) for k in ("final_eval_value_nll", "best_eval_value_nll",
                                                          "final_eval_perplexity")}
        atomic_write(RunDirectory(target).privacy_note, released_cell_note(plan, total))
        atomic_write(target / SELECTION_FILE, json.dumps({**entry, "all_cells": total}, indent=2))
        out.append(entry)
    _write_private(study_dir / OWNER_REPORT, {
        "note": "the released trials' figures on the private eval split: not a DP release, for the data owner "
                "(ERRATA E15); nothing was selected on them", "cells": owner})
    return out
