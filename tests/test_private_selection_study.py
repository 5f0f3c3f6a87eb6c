"""``selection: private-dp`` (issue 32): the study mode around the repeat-and-select accountant
(tests/test_private_selection.py tests the accountant against the theorems and a randomized-response mechanism).

Checked here against independent computations: the score release against a naive per-patient loop, the per-record
value NLL against the split's aggregate evaluation, each cell's plan against the accountant and the run's own
calibration; and, on real Ray Tune runs, what a finished study releases (one trial per cell, the same files and keys
whatever K was, every field classified), that a resume reads K back instead of redrawing it, and that Tune's
tables (which count the trials) never reach the terminal."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml

import raydp.study.private_selection as ps
from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon
from raydp.privacy.accounting.selection import SelectionDistribution, selection_epsilon
from raydp.settings import validate_config
from raydp.study.config import StudyConfig, load_study
from raydp.study.trial import Trial

from releasable import unclassified_private_selection

SPACE = {"static-pairwise": {"clip": {"low": 0.01, "high": 1.0, "log": True},
                             "lr": {"low": 1e-4, "high": 1e-2, "log": True},
                             "lr_decay": {"choices": ["constant", "cosine"]}}}
STUDY = {
    "name": "ps", "models": ["embedded-tiny"], "epsilons": [4.0], "seeds": [0], "strategies": ["static-pairwise"],
    "search": "random", "selection": "private-dp", "search_space": SPACE, "wandb": {"mode": "disabled"},
    "private_selection": {"distribution": "poisson", "mean": 2.0, "score_noise": 6.0},
    "resources": {"cpus_per_trial": 1},
    "base": {"data": {"n_records": 600}, "max_steps": 4, "eval_max_records": 16, "public_eval_records": 16,
             "warmup_steps": 1},
}


def study_of(**changes) -> StudyConfig:
    values = json.loads(json.dumps(STUDY))
    values.update(changes)
    return validate_config(StudyConfig, values)


@pytest.mark.parametrize("changes, message", [
    ({"search": "grid"}, "selection: private-dp with search: random"),
    ({"selection": "public"}, "selection: private-dp with search: random"),
    ({"strategies": ["static-pairwise", "static"]}, "one strategy and its search_space"),
    ({"strategies": ["rldp"], "search_space": {"rldp": {"t_rl": {"low": 2, "high": 8}}}}, "planned before it runs"),
    ({"private_data": False}, "on public data select publicly"),
    ({"base": {"data": {"source": "public"}}}, "on public data select publicly"),
    ({"base": {"data": {"fractions": {"validation": 0.0}}}}, "fractions.validation must be > 0"),
    ({"evaluate": {"audit": False}}, "attack the released run with raydp eval"),
    ({"tuned_from": "x"}, "does not take tuned_from"),
    ({"settings_grid": {"static-pairwise": {"clip": [0.1]}}}, "does not take settings_grid"),
    ({"wandb": {"mode": "offline"}}, "wandb would log every trial"),
    ({"base": {"unsafe_fixed_randomness": True}}, "needs secret randomness"),
    ({"base": {"task": {"kind": "classification"}}}, "base.task.kind must be lm"),
    ({"base": {"common_random_numbers": True}}, "needs secret randomness"),
    ({"private_selection": {"distribution": "poisson", "shape": 1.0}}, "shape is the eta"),
    ({"private_selection": {"distribution": "geometric", "mean": 1.0}}, "needs mean > 1"),
    ({"private_selection": {"score_range": [5, 5]}}, "score_range needs low < high"),
])
def test_refusals(changes, message):
    with pytest.raises(ConfigError, match=message):
        study_of(**changes)


def test_private_selection_block_alone_is_refused():
    values = {k: v for k, v in STUDY.items() if k not in ("search", "selection", "search_space")}
    with pytest.raises(ConfigError, match="selection: private-dp with search: random"):
        validate_config(StudyConfig, values)


def test_score_release_matches_a_naive_per_patient_loop():
    rng = np.random.default_rng(3)
    values = rng.normal(60, 30, size=200)  # some below low and above high
    values[[5, 9]] = [np.nan, np.inf]  # a non-finite record counts as the range's high end
    units = rng.integers(0, 70, size=200)
    low, high, noise = 30.0, 110.0, 6.0
    got = ps.score_release(values, units, (low, high), noise, np.random.default_rng(11))
    per_patient = {}
    for v, u in zip(values.tolist(), units.tolist()):
        v = high if not math.isfinite(v) else v
        per_patient.setdefault(u, []).append(min(max(v, low), high) - low)
    total = sum(sum(vs) / len(vs) for vs in per_patient.values())
    want_noise = np.random.default_rng(11).normal(0.0, noise * (high - low) * (1 + ps.SCORE_ROUNDING_MARGIN))
    assert got == pytest.approx(total + want_noise, rel=1e-12)
    # one patient removed moves the noiseless sum by at most high - low (the sensitivity the noise is scaled to),
    # whatever its records: no division by the split's patient count, which moves with the patient too
    for patient in np.unique(units):
        keep = units != patient
        without = ps.score_release(values[keep], units[keep], (low, high), 0.0, np.random.default_rng(0))
        full = ps.score_release(values, units, (low, high), 0.0, np.random.default_rng(0))
        assert 0.0 <= full - without <= (high - low) + 1e-9


def exact_score(values, units, low, high) -> Fraction:
    """The noiseless score in exact rational arithmetic, one unit at a time: each record clipped to [low, high] (a
    non-finite one at high, -inf at low), minus low, averaged over the unit's records, summed over units."""
    low_q, high_q = Fraction(low), Fraction(high)
    per_unit = {}
    for v, u in zip(np.asarray(values, dtype=float).tolist(), np.asarray(units).tolist()):
        q = low_q if v == -math.inf else high_q if not math.isfinite(v) else min(max(Fraction(v), low_q), high_q)
        per_unit.setdefault(u, []).append(q - low_q)
    return sum((sum(vs, Fraction(0)) / len(vs) for vs in per_unit.values()), Fraction(0))


def random_split(rng, low, high, n_units, first_unit=0):
    """Values at the clip edges, beyond them, inside, and non-finite; 1 to 4 records per unit."""
    counts = rng.integers(1, 5, size=n_units)
    units = np.repeat(np.arange(first_unit, first_unit + n_units), counts)
    span = high - low
    pool = np.array([low, high, low - span, high + span, np.nan, np.inf, -np.inf])
    values = np.where(rng.random(len(units)) < 0.5, rng.uniform(low, high, len(units)),
                      rng.choice(pool, len(units)))
    return values, units


SCORE_RANGES = [(30.0, 110.0), (0.1, 0.4), (0.0, 0.1), (1e-3, 7.3)]


@pytest.mark.parametrize("score_range", SCORE_RANGES)
def test_score_release_noiseless_equals_an_exact_rational_per_unit_loop(score_range):
    low, high = score_range
    rng = np.random.default_rng(5)
    for n_units in (1, 2, 7, 300, 2000):
        values, units = random_split(rng, low, high, n_units)
        perm = rng.permutation(len(units))  # records in any order
        got = ps.score_release(values[perm], units[perm], score_range, 0.0, np.random.default_rng(0))
        want = exact_score(values, units, low, high)
        # each record's subtraction, each unit's division and the total round once (relative 2^-53 each); the
        # clamp to [0, fl(high - low)] moves a unit by at most fl(high - low)'s own rounding
        assert abs(Fraction(got) - want) <= Fraction(4, 2 ** 53) * n_units * Fraction(high - low)


def test_score_release_clamps_a_unit_mean_one_ulp_above_the_range():
    # 0.1 + 0.1 + 0.1 rounds to 0.30000000000000004, and / 3 to 0.10000000000000002 > high - low = 0.1
    assert (0.1 + 0.1 + 0.1) / 3 > 0.1
    assert ps.score_release(np.full(3, 0.1), np.zeros(3), (0.0, 0.1), 0.0, np.random.default_rng(0)) == 0.1
    values, units = np.full(30, 0.25), np.repeat(np.arange(10), 3)
    assert ps.score_release(values, units, (0.0, 0.1), 0.0, np.random.default_rng(0)) <= 10 * 0.1 * (1 + 2 ** -52)


@pytest.mark.parametrize("score_range", SCORE_RANGES)
def test_score_release_one_unit_added_moves_the_noiseless_sum_by_at_most_the_noise_sensitivity(score_range):
    """Neighbouring pairs: a random split and the same split with one more unit (its records at the clip edges or
    anywhere, its id first, last or in between: the units' order changes), noise 0. The move is at most
    (high - low) (1 + SCORE_ROUNDING_MARGIN), the sensitivity the noise is scaled to, and within one rounding of the
    total (math.fsum): a numpy sum's pairwise tree, which changes shape with the unit, exceeded it."""
    low, high = score_range
    span = high - low
    rng = np.random.default_rng(17)
    worst = 0.0
    for trial in range(600):
        n_units = int(rng.integers(1, 400))
        values, units = random_split(rng, low, high, n_units, first_unit=1)
        units = 2 * units  # room for an id in between
        n_new = int(rng.integers(1, 4))
        new_values = rng.choice(np.array([high, high, low, high + span, np.nan, (low + high) / 2]), n_new)
        new_id = int(rng.choice([0, 2 * n_units + 5, 2 * int(rng.integers(1, n_units + 1)) + 1]))
        where = int(rng.integers(0, len(units) + 1))  # the new records anywhere among the others
        both_values = np.insert(values, where, new_values)
        both_units = np.insert(units, where, np.full(n_new, new_id))
        s = ps.score_release(values, units, score_range, 0.0, np.random.default_rng(0))
        t = ps.score_release(both_values, both_units, score_range, 0.0, np.random.default_rng(0))
        assert 0.0 <= t - s <= span * (1 + ps.SCORE_ROUNDING_MARGIN)
        assert t - s <= span + 2 ** -53 * (s + t) * (1 + 1e-9)  # one rounding of each total, nothing more
        worst = max(worst, (t - s) / span - 1)
    assert worst < 3.8e-9  # the derivation's bound (score_release), well inside the margin


def test_score_release_total_is_clamped_at_the_public_unit_bound(monkeypatch):
    # the bound that keeps the margin independent of the (private) unit count: the total saturates beyond it (a
    # smaller bound here than the module's 2^24, which the same code applies)
    monkeypatch.setattr(ps, "SCORE_MAX_UNITS", 64)
    low, high = 0.1, 0.4
    span = high - low
    rng = np.random.default_rng(2)
    for n_units in range(55, 75):  # across the bound, one unit added at a time
        values, units = random_split(rng, low, high, n_units)
        s = ps.score_release(values, units, (low, high), 0.0, np.random.default_rng(0))
        t = ps.score_release(np.append(values, high), np.append(units, n_units), (low, high), 0.0,
                             np.random.default_rng(0))
        assert s <= 64 * span and t <= 64 * span
        assert 0.0 <= t - s <= span * (1 + ps.SCORE_ROUNDING_MARGIN)
    full = ps.score_release(np.full(80, high), np.arange(80), (low, high), 0.0, np.random.default_rng(0))
    assert full == 64 * span
    with pytest.raises(ValueError, match="finite"):
        ps.score_release(np.zeros(3), np.arange(3), (-1e308, 1e308), 0.0, np.random.default_rng(0))


def test_value_nll_per_sequence_sums_to_the_split_evaluation(tmp_path):
    from raydp.data import load_texts, resolve_dataset
    from raydp.data.splits import load_value_spans
    from raydp.evaluation.perplexity import evaluate_perplexity, value_nll_per_sequence
    from raydp.model import load_model
    from raydp.config import DataConfig

    dataset = resolve_dataset(DataConfig(n_records=300), tmp_path / "d", progress=False)
    loaded = load_model("embedded-tiny", device="cpu", progress=False)
    from raydp.model.batches import TokenizedSplit
    split = TokenizedSplit(load_texts(dataset, "validation"), loaded.tokenizer, 128,
                           spans=load_value_spans(dataset, "validation"))
    per = value_nll_per_sequence(loaded.model, split, loaded.device, batch_size=5)
    whole = evaluate_perplexity(loaded.model, split, loaded.device, batch_size=7)
    assert len(per) == len(split) > 0
    assert per.sum() / len(per) == pytest.approx(whole.value_nll_per_record, rel=1e-5)
    assert (per > 0).all()


def test_a_records_score_value_depends_on_that_record_alone(tiny_dataset):
    """The private score bounds each unit's contribution, so a record's value may depend on nothing but that record
    (and the model): the value the score uses equals the value of the record scored alone, for every record. Batched
    scoring fails this (padding and kernel shapes follow the batch: up to 7.6e-6 nats apart on this data)."""
    from raydp.data import load_texts
    from raydp.data.splits import load_value_spans
    from raydp.model import load_model
    from raydp.model.batches import TokenizedSplit

    loaded = load_model("embedded", device="cpu", progress=False)
    texts, spans = load_texts(tiny_dataset, "train")[:120], load_value_spans(tiny_dataset, "train")[:120]
    values = ps.record_values(loaded.model, TokenizedSplit(texts, loaded.tokenizer, 128, spans=spans), loaded.device)
    alone = [ps.record_values(loaded.model, TokenizedSplit([t], loaded.tokenizer, 128, spans=[s]), loaded.device)[0]
             for t, s in zip(texts, spans)]
    assert values.tolist() == alone


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    from raydp.config import DataConfig
    from raydp.data import resolve_dataset

    return str(resolve_dataset(DataConfig(n_records=600), tmp_path_factory.mktemp("ds") / "d", progress=False))


def test_cell_plan_meets_its_end_to_end_epsilon_and_is_tight(tiny_dataset):
    from raydp.runner.privacy_setup import build_strategy, plan_private_run, planned_rdp_curve, training_units
    from raydp.data import load_texts
    from raydp.study.grid import trial_config

    study = study_of()
    plan = ps.plan_cell(study, tiny_dataset, "embedded-tiny", 4.0, 0)
    dist = SelectionDistribution.poisson(2.0)
    score = np.asarray(DEFAULT_ORDERS) / (2 * 6.0 ** 2)
    assert plan.end_to_end_epsilon <= 4.0
    assert plan.trial_epsilon < 4.0

    def curve_at(eps):  # the run's own plan at that epsilon (what the trial calibrates when it starts)
        config = trial_config(study, Trial(model="embedded-tiny", epsilon=eps, seed=0, strategy="static-pairwise",
                                           search={"clip": 0.1, "lr": 1e-3}), tiny_dataset)
        units = training_units(config, tiny_dataset, len(load_texts(tiny_dataset, "train")))
        return planned_rdp_curve(plan_private_run(config, units.public_count, build_strategy(config)), config.delta)

    np.testing.assert_allclose(plan.training_curve, curve_at(plan.trial_epsilon), rtol=1e-9)
    np.testing.assert_allclose(plan.trial_curve, plan.training_curve + score, rtol=1e-12)
    assert selection_epsilon(plan.trial_curve, DEFAULT_ORDERS, dist, 1e-5) == pytest.approx(plan.end_to_end_epsilon)
    # tight: a trial 1% richer would break the end-to-end target
    assert selection_epsilon(curve_at(plan.trial_epsilon * 1.01) + score, DEFAULT_ORDERS, dist, 1e-5) > 4.0
    # the figures beside it, from E[K] (never the realised K): composing 2 trials costs more
    described = plan.describe(study.selection_settings)
    assert described["for_comparison"]["trials"] == 2
    assert described["for_comparison"]["basic_composition_epsilon"] == pytest.approx(2 * plan.trial_epsilon)


def _cell_event(study, dataset, trial_epsilon: float):
    """One cell's mechanism as dp_accounting's events: repeat-and-select (Poisson K, mean 2) of a trial that runs
    its DP-SGD steps, planned at ``trial_epsilon`` as the trial plans them, and then releases its score (a Gaussian
    of noise multiplier score_noise)."""
    from dp_accounting import dp_event
    from raydp.data import load_texts
    from raydp.runner.privacy_setup import build_strategy, plan_private_run, training_units
    from raydp.study.grid import trial_config

    config = trial_config(study, Trial(model="embedded-tiny", epsilon=trial_epsilon, seed=0,
                                       strategy="static-pairwise", search={"clip": 0.1, "lr": 1e-3}), dataset)
    units = training_units(config, dataset, len(load_texts(dataset, "train")))
    run = plan_private_run(config, units.public_count, build_strategy(config))
    steps = [dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
        run.q, dp_event.GaussianDpEvent(run.sigma_map(run.sigma_0 * multiplier))), count)
        for multiplier, count in run.schedule.segments(run.planned_steps, run.q)]
    trial = dp_event.ComposedDpEvent(steps + [dp_event.GaussianDpEvent(study.selection_settings.score_noise)])
    return dp_event.RepeatAndSelectDpEvent(trial, study.selection_settings.mean, math.inf)


@pytest.fixture(scope="module")
def six_cells(tiny_dataset):
    """A study of seeds [0, 1, 2] x epsilons [4, 8] and its six cells' plans (no trial runs)."""
    study = study_of(epsilons=[4.0, 8.0], seeds=[0, 1, 2])
    return study, ps.plan_cells(study, tiny_dataset)


def test_releasing_every_cell_costs_the_composition_of_their_end_to_end_curves(tiny_dataset, six_cells):
    """A study of seeds [0, 1, 2] x epsilons [4, 8] releases six cells: together they cost the RDP composition of the
    six end-to-end curves, far more than any one cell. Checked against dp_accounting's RDP accountant composing each
    cell's RepeatAndSelectDpEvent of its trial's events (its own subsampled-Gaussian RDP, composition and
    conversion), every cell counted whatever its K (a K = 0 cell's guarantee includes releasing nothing)."""
    from dp_accounting.rdp import RdpAccountant

    study, plans = six_cells
    assert list(plans) == [f"embedded-tiny_eps{e}_seed{s}" for e in (4, 8) for s in (0, 1, 2)]
    events = {eps: _cell_event(study, tiny_dataset, next(p for p in plans.values() if p.epsilon == eps).trial_epsilon)
              for eps in (4.0, 8.0)}

    def independent(keys) -> float:
        accountant = RdpAccountant(list(DEFAULT_ORDERS))
        for key in keys:
            accountant.compose(events[plans[key].epsilon])
        return accountant.get_epsilon(1e-5)

    total = ps.compose_cells(plans)
    assert total["cells"] == 6 and total["delta"] == 1e-5
    assert total["epsilon"] == pytest.approx(independent(plans), rel=1e-3)
    assert total["epsilon"] == pytest.approx(14.16, abs=0.01)  # the figure PRIVACY.txt and the terminal give
    fours = {k: p for k, p in plans.items() if p.epsilon == 4.0}
    assert ps.compose_cells(fours)["epsilon"] == pytest.approx(independent(fours), rel=1e-3)
    assert ps.compose_cells(fours)["epsilon"] == pytest.approx(5.91, abs=0.01)
    for key, plan in plans.items():  # one cell alone: its own end-to-end epsilon, at most its target
        assert ps.compose_cells({key: plan})["epsilon"] == pytest.approx(plan.end_to_end_epsilon, rel=1e-12)
        assert plan.end_to_end_epsilon == pytest.approx(independent([key]), rel=1e-3)
        assert plan.end_to_end_epsilon <= plan.epsilon
    assert total["largest_cell_epsilon"] == max(p.end_to_end_epsilon for p in plans.values()) <= 8.0
    assert total["smallest_cell_epsilon"] == min(p.end_to_end_epsilon for p in plans.values()) <= 4.0
    line = ps.all_cells_line(total)
    assert f"releasing all of released/ costs (epsilon, delta) = ({total['epsilon']:.4g}, 1e-05)" in line
    assert "6 cell(s), those that released nothing (K = 0) counted too" in line
    # the figure raydp report composes across studies: the same total, each cell a run, no count of trials
    figure = ps.study_figure(plans, "rdi1:" + "a" * 32)
    assert figure["tuning_aware_epsilon"] == total["epsilon"] and figure["delta"] == 1e-5
    assert [c["name"] for c in figure["composed"]] == list(plans) and "trials" not in figure


def _fake_grid_study(root: Path, name: str, dataset_id: str, epsilon: float) -> Path:
    """A finished grid study's directory as the study runner leaves it, for the report alone: a results table of
    two trials and its tuning-aware figure on ``dataset_id``."""
    import pandas as pd

    d = root / name
    (d / "trials").mkdir(parents=True)
    rows = [{"trial": f"static_m_eps2_seed{seed}", "status": "TERMINATED", "model": "m", "strategy": "static",
             "epsilon_target": 2.0, "seed": seed, "variant": None, "frozen_policy": False,
             "run_dir": str(d / "trials" / f"static{seed}"), "final_public_perplexity": 1.4 + seed / 100,
             "final_eval_perplexity": 1.3, "steps": 10, "planned_steps": 10, "dataset_id": dataset_id,
             "within_budget": True, "steps_to_target": None, "selection_split": "public"} for seed in (0, 1)]
    pd.DataFrame(rows).to_parquet(d / "results.parquet")
    figure = {"runs": 2, "trials": 2, "target_epsilons": [2.0], "tuning_aware_epsilon": epsilon, "delta": 1e-5,
              "max_single_trial_epsilon_rdp": epsilon / 2, "repeat_and_select_epsilon_rdp": epsilon,
              "privacy_units": ["patient"], "neighbouring_relations": ["add_remove_one"]}
    (d / "study_summary.json").write_text(json.dumps({"study": name, "selection": {"split": "public"},
                                                      "tuning_aware_epsilon": {dataset_id: figure}}))
    return d


def _fake_selection_study(root: Path, name: str, study, plans, dataset_id: str) -> Path:
    """A finished private-dp study's summary as the study writes it (:func:`ps.selection_summary`), every cell
    without a release (K = 0), for the report alone."""
    d = root / name
    d.mkdir(parents=True)
    released = [{**plan.describe(study.selection_settings), "released": False} for plan in plans.values()]
    (d / "study_summary.json").write_text(json.dumps(ps.selection_summary(name, released, plans, dataset_id)))
    return d


def test_report_composes_a_private_selection_with_other_studies_on_its_dataset(tmp_path, six_cells, capsys):
    """raydp report over a grid study and a private-dp study on one dataset: the grid's table, the private-dp
    study's released cells, and their spend composed (basic composition of the two studies' figures, the private-dp
    one the RDP composition of its six cells: 14.16 at delta 1e-5). It refused the private-dp study ('has no
    results.parquet'). Another dataset's private-dp study is refused, as a grid study's is."""
    from raydp.cli import main
    from raydp.study.tables import format_report

    study, plans = six_cells
    dataset_id = "rdi1:" + "a" * 32
    grid = _fake_grid_study(tmp_path, "grid", dataset_id, epsilon=1.5)
    selection = _fake_selection_study(tmp_path, "selection", study, plans, dataset_id)
    total = ps.compose_cells(plans)
    out = format_report(grid, selection)
    assert "studies grid combined: 2 trials (2 finished)" in out  # the grid's own table
    assert "embedded-tiny_eps8_seed2" in out and "nothing released (K = 0)" in out  # the selection's cells
    assert f"private selection (selection: private-dp): {ps.all_cells_line(total)}" in out
    assert (f"dataset {dataset_id[:16]} over 2 of 2 studies (every run, replaced arms included): "
            f"<= {1.5 + total['epsilon']:.3f} at delta 2e-05") in out
    assert f"{1.5 + total['epsilon']:.3f}" == "15.657"
    assert main(["report", str(selection), str(grid)]) == 0
    assert f"<= {1.5 + total['epsilon']:.3f} at delta 2e-05" in capsys.readouterr().out
    # alone, the study's released cells and their total, as raydp study printed them
    assert format_report(selection) == ps.format_selection(selection)
    # two private selections on the dataset compose too
    again = _fake_selection_study(tmp_path, "again", study, plans, dataset_id)
    assert f"<= {2 * total['epsilon']:.3f} at delta 2e-05" in format_report(selection, again)
    other = _fake_selection_study(tmp_path, "other", study, plans, "rdi1:" + "b" * 32)
    with pytest.raises(ConfigError, match="ran on different datasets"):
        format_report(grid, other)


def test_a_search_space_that_changes_the_plan_is_refused(tiny_dataset):
    # ewpba's step distance shapes its sigma schedule over the epochs, so its corners plan different curves
    # (every choice is checked, not only the first two: [1, 1, 3] was accepted by the first version)
    study = study_of(strategies=["ewpba"], search_space={"ewpba": {"step_distance": {"choices": [1, 1, 3]}}},
                     base={"data": {"n_records": 600}, "epochs": 2})
    with pytest.raises(ConfigError, match="corners plan different privacy curves"):
        ps.plan_cell(study, tiny_dataset, "embedded-tiny", 4.0, 0)
    # a strategy with a phase before DP-SGD (DualTune's phase 1, redacted or public) is refused (review 2, finding A)
    study = study_of(strategies=["dualtune"], search_space={"dualtune": {"clip": {"low": 0.1, "high": 1.0}}})
    with pytest.raises(ConfigError, match="warm_start"):
        ps.plan_cell(study, tiny_dataset, "embedded-tiny", 4.0, 0)
    # a choice that is not a valid run is refused before anything is charged, not when its trial fails
    study = study_of(search_space={"static-pairwise": {"lr": {"choices": [1e-3, 1e-3, -1.0]}}})
    with pytest.raises(ConfigError, match="lr"):
        ps.plan_cell(study, tiny_dataset, "embedded-tiny", 4.0, 0)


def test_secret_state_is_drawn_once_private_and_read_back(tmp_path):
    study = study_of(seeds=[0, 1, 2])
    state = ps.draw_or_read_state(study, tmp_path, resume=False)
    path = tmp_path / ps.SECRET_STATE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert set(state["cells"]) == {f"embedded-tiny_eps4_seed{s}" for s in (0, 1, 2)}
    for trials in state["cells"].values():
        for t in trials:
            assert 0.01 <= t["settings"]["clip"] <= 1.0 and 1e-4 <= t["settings"]["lr"] <= 1e-2
            assert t["settings"]["lr_decay"] in ("constant", "cosine")
    assert ps.draw_or_read_state(study, tmp_path, resume=True) == state  # never redrawn
    with pytest.raises(ConfigError, match="already holds a private selection"):
        ps.draw_or_read_state(study, tmp_path, resume=False)
    with pytest.raises(ConfigError, match="nothing to resume"):
        ps.draw_or_read_state(study, tmp_path / "other", resume=True)


def test_k_and_settings_are_drawn_from_their_laws():
    dist = SelectionDistribution.poisson(3.0)
    ks = np.array([ps.draw_count(dist) for _ in range(4000)])
    assert abs(ks.mean() - 3.0) < 4 * math.sqrt(3.0 / 4000)  # 4 standard errors
    rng = __import__("secrets").SystemRandom()
    clips = np.array([ps.draw_settings(study_of().search_space["static-pairwise"], rng)["clip"] for _ in range(4000)])
    logs = (np.log(clips) - np.log(0.01)) / (np.log(1.0) - np.log(0.01))  # log-uniform: uniform on [0, 1]
    assert abs(logs.mean() - 0.5) < 4 * math.sqrt(1 / 12 / 4000)


def _run(tmp_path, monkeypatch, k, name: str, resume: bool = False, **changes):
    """A real private-dp study with K fixed to ``k`` (the only randomness replaced: K's draw), or with ``k`` a list,
    to its values in the study's cell order; ``changes``: the study file's fields changed."""
    from raydp.study.runner import run_study

    draws = iter(k) if isinstance(k, list) else None
    monkeypatch.setattr(ps, "draw_count", lambda distribution: next(draws) if draws is not None else k)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**json.loads(json.dumps(STUDY)), "name": name, **changes}))
    return run_study(path, tmp_path / "runs", progress=True, resume=resume)


def _released_shape(study_dir: Path) -> dict:
    """Every released file and, for JSON, its nested keys (values aside)."""
    def keys(value, prefix=""):
        if isinstance(value, dict):
            return {p for k, v in value.items() for p in keys(v, f"{prefix}.{k}") | {f"{prefix}.{k}"}}
        if isinstance(value, list):
            return {p for v in value for p in keys(v, f"{prefix}[]")}
        return set()

    out = {}
    for f in sorted(study_dir.rglob("*")):
        rel = f.relative_to(study_dir).as_posix()
        if f.is_file() and not rel.startswith(("work/", "dataset/")):
            out[rel] = sorted(keys(json.loads(f.read_text()))) if f.suffix == ".json" and "adapter" not in rel else None
    return out


def test_a_study_releases_one_trial_whatever_k(local_ray, tmp_path, monkeypatch, capfd):
    # two cells (seeds 0 and 1), the second with K = 0 (it runs nothing: no trial's cost), which still counts in
    # what releasing both costs
    one = _run(tmp_path, monkeypatch, [1, 0], "ps-one", seeds=[0, 1])
    many = _run(tmp_path, monkeypatch, [2, 0], "ps-many", seeds=[0, 1])  # K = 2: two trials, the fewest above one
    printed = capfd.readouterr()
    assert "Number of trials" not in printed.out + printed.err  # Tune's table stayed in work/
    assert "Number of trials" in (many / "work" / "tune.log").read_text()
    assert len(json.loads((many / ps.SECRET_STATE).read_text())["cells"]["embedded-tiny_eps4_seed0"]) == 2
    assert len(list((many / "work" / "trials").iterdir())) == 2
    shape_one, shape_many = _released_shape(one), _released_shape(many)
    assert shape_one == shape_many  # same files, same keys: nothing released says how many trials ran
    assert "released/embedded-tiny_eps4_seed0/adapter/adapter_model.safetensors" in shape_many
    assert unclassified_private_selection(many) == []
    start = (many / "study.json").stat().st_mtime  # no file's time tells how long the trials took
    stamped = [p for p in (many / "released").rglob("*")] + [many / "study_summary.json", many / "released",
                                                               many]
    assert {p.stat().st_mtime for p in stamped} == {start}
    _check_times_named(many, start)
    entry = json.loads((many / "study_summary.json").read_text())["released"][0]
    kept = json.loads((many / ps.SECRET_STATE).read_text())
    state, scores = kept["cells"]["embedded-tiny_eps4_seed0"], kept["scores"]
    assert kept["released"] and set(scores) == {t["id"] for t in state}
    assert stat.S_IMODE(os.stat(many / "work").st_mode) == 0o700  # its entries count the trials
    best = min(state, key=lambda t: scores[t["id"]])
    assert entry["settings"] == best["settings"] and entry["score"] == scores[best["id"]]  # the lowest DP score
    assert "final_eval_value_nll" not in json.dumps(entry)  # the private eval split's figures stay in work/
    with pytest.raises(ConfigError, match="already holds a private selection"):  # refused before any charge
        run_study_again = __import__("raydp.study.runner", fromlist=["run_study"]).run_study
        run_study_again(tmp_path / "ps-many.yaml", tmp_path / "runs", progress=False)
    owner = json.loads((many / ps.OWNER_REPORT).read_text())["cells"]["embedded-tiny_eps4_seed0"]
    assert math.isfinite(owner["final_eval_value_nll"])
    summary = json.loads((many / "released/embedded-tiny_eps4_seed0/summary.json").read_text())
    assert set(summary) <= set(ps.RELEASED_SUMMARY_KEYS)  # an allowlist: no timing, no eval_*, no phase_one
    assert not {"wall_seconds", "train_loop_seconds", "final_eval_value_nll"} & set(summary)
    assert summary["privacy"]["end_to_end"]["epsilon"] == entry["end_to_end_epsilon"] <= 4.0
    assert summary["privacy"]["epsilon"] <= entry["trial_epsilon"] * (1 + 1e-6)
    _check_all_cells_stated(many, entry, capfd)


def _check_times_named(study_dir: Path, start: float) -> None:
    """The released files' change and birth times are the release's, after every trial (they grow with K and
    cannot be set back): the study's PRIVACY.txt names both. Birth time as `stat` reads it, where the filesystem
    keeps one (statx; Python 3.11 has no st_birthtime on Linux)."""
    import subprocess

    released = study_dir / "released" / "embedded-tiny_eps4_seed0" / "selection.json"
    assert released.stat().st_ctime > start
    born = subprocess.run(["stat", "-c", "%W", str(released)], capture_output=True, text=True).stdout.strip()
    if born.isdigit() and int(born) > 0:
        assert int(born) >= int(start) and int(born) >= int((study_dir / "work" / "trials").stat().st_mtime) - 1
    text = (study_dir / "PRIVACY.txt").read_text()
    assert "change times (ctime) and birth times (btime" in " ".join(text.split())


def test_privacy_note_names_every_file_time_that_follows_the_number_of_trials():
    """A released file's modification and access times are set to the study's start, but its change time and its
    birth time are the release's (after every trial: they grow with K). The study's PRIVACY.txt named ctime only."""
    note = " ".join(ps.PRIVATE_SELECTION_NOTE.split())
    assert "change times (ctime) and birth times (btime" in note
    assert "modification and access times are set to the study's start" in note
    assert "not with tar --format=posix, which keeps ctime" in note


def _check_all_cells_stated(study_dir: Path, entry: dict, capfd) -> None:
    """What releasing both cells costs is stated in study_summary.json, every selection.json, every PRIVACY.txt and
    on the terminal (raydp study prints format_selection; raydp report too), and equals dp_accounting's RDP
    composition of the two cells' repeat-and-select events (the K = 0 cell counted)."""
    from dp_accounting.rdp import RdpAccountant

    from raydp.cli import main

    written = json.loads((study_dir / "study_summary.json").read_text())
    total = written["all_cells"]
    event = _cell_event(study_of(seeds=[0, 1]), str(study_dir / "dataset"), entry["trial_epsilon"])
    accountant = RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(event, 2)  # two cells, the same plan
    assert total["cells"] == 2 and total["delta"] == 1e-5
    assert total["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert total["epsilon"] > 1.2 * entry["end_to_end_epsilon"]  # more than one cell: 5.1 against 3.99
    cells = sorted((study_dir / "released").iterdir())
    assert [c.name for c in cells] == ["embedded-tiny_eps4_seed0", "embedded-tiny_eps4_seed1"]
    empty = json.loads((cells[1] / "selection.json").read_text())
    assert empty["released"] is False  # K = 0: nothing released, counted all the same
    line = (f"releasing all of released/ costs (epsilon, delta) = ({total['epsilon']:.4g}, 1e-05), the RDP "
            "composition of the study's 2 cell(s), those that released nothing (K = 0) counted too; one cell alone "
            f"costs its own end-to-end epsilon ({entry['end_to_end_epsilon']:.4g} at delta 1e-05)")
    assert line in ps.all_cells_line(total)
    assert line in (study_dir / "PRIVACY.txt").read_text()
    for cell in cells:
        assert json.loads((cell / "selection.json").read_text())["all_cells"] == total
        text = (cell / "PRIVACY.txt").read_text()
        assert f"This cell alone costs (epsilon, delta) = ({entry['end_to_end_epsilon']:.4g}, 1e-05)" in text
        assert (f"Releasing all of released/ (the study's 2 cell(s), this one included) costs (epsilon, delta) = "
                f"({total['epsilon']:.4g}, 1e-05)") in text
    capfd.readouterr()
    assert main(["report", str(study_dir)]) == 0
    assert f"all cells: {line}" in capfd.readouterr().out
    figure = next(iter(written["tuning_aware_epsilon"].values()))  # what raydp report composes across studies
    assert figure["tuning_aware_epsilon"] == total["epsilon"] and figure["cells"] == 2


@pytest.mark.slow
def test_resume_reads_k_back_and_reruns_only_unfinished_trials(local_ray, tmp_path, monkeypatch):
    from raydp.study.runner import run_study

    study_dir = _run(tmp_path, monkeypatch, 2, "ps-resume")
    path = study_dir / ps.SECRET_STATE
    state = json.loads(path.read_text())
    first, second = state["cells"]["embedded-tiny_eps4_seed0"]
    stopped = {**state, "released": False, "scores": {second["id"]: state["scores"][second["id"]]}}
    path.write_text(json.dumps(stopped))  # as if stopped while the first trial ran
    monkeypatch.setattr(ps, "draw_count", lambda distribution: pytest.fail("K was redrawn"))
    run_study(tmp_path / "ps-resume.yaml", tmp_path / "runs", progress=False, resume=True)
    after = json.loads(path.read_text())
    assert after["cells"] == state["cells"] and after["charge_tag"] == state["charge_tag"] and after["released"]
    assert after["scores"][second["id"]] == state["scores"][second["id"]]  # not run again
    assert after["scores"][first["id"]] != state["scores"][first["id"]]  # run again, fresh noise
    # a released selection whose trial outputs were removed is not run again (review 2, finding C)
    shutil.rmtree(study_dir / "work" / "trials")
    with pytest.raises(ConfigError, match="a selection is run once"):
        run_study(tmp_path / "ps-resume.yaml", tmp_path / "runs", progress=False, resume=True)
    # nor is one whose scores were kept but whose state says it never released (the trials are not redone)
    path.write_text(json.dumps({**after, "released": False}))
    with pytest.raises(ConfigError, match="kept outputs are gone"):
        run_study(tmp_path / "ps-resume.yaml", tmp_path / "runs", progress=False, resume=True)


def test_check_and_report_commands(tmp_path, tiny_dataset, capsys):
    from raydp.cli import main

    path = tmp_path / "ps.yaml"
    path.write_text(yaml.safe_dump(STUDY))
    assert load_study(path).selection == "private-dp"
    assert main(["study", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "private selection over 1 cell(s)" in out and "embedded-tiny_eps4_seed0" in out


def test_lifetime_budget_is_charged_the_end_to_end_curve(tmp_path, monkeypatch):
    """The cell's end-to-end curve (which does not depend on K) is charged before any trial; past the budget the
    study is refused with nothing left behind; a resume is not charged twice."""
    from raydp.data import load_manifest, manifest_id
    from raydp.data.splits import build_dataset
    from raydp.privacy.lifetime import read_budget, set_budget, spent_epsilon
    from raydp.study.runner import run_study

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    data = tmp_path / "data"
    build_dataset(data, n_records=600, progress=False)
    manifest = load_manifest(data)
    dataset_id = manifest_id(manifest)
    set_budget(dataset_id, 10.0, 1e-5, source_sha256=manifest.get("source_sha256"))
    values = {**json.loads(json.dumps(STUDY)), "name": "ps-budget"}
    values["base"]["data"] = {"source": str(data)}
    path, too_much = tmp_path / "ps-budget.yaml", tmp_path / "ps-too-much.yaml"
    path.write_text(yaml.safe_dump(values))
    too_much.write_text(yaml.safe_dump({**values, "name": "ps-too-much", "epsilons": [12.0]}))
    with pytest.raises(ConfigError, match="lifetime"):
        run_study(too_much, tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs" / "ps-too-much").exists()  # the draw went with the refused charge
    assert spent_epsilon(read_budget(dataset_id, manifest.get("source_sha256"))) == 0.0

    study = load_study(path)
    _, plans = ps.plan_study(study, tmp_path / "s", progress=False)
    plan = plans["embedded-tiny_eps4_seed0"]
    for _ in range(2):  # one study run's tag twice (a resume): one charge
        ps._charge(str(data), plans, "run-1")
        spent = spent_epsilon(read_budget(dataset_id, manifest.get("source_sha256")))
        assert spent == pytest.approx(plan.end_to_end_epsilon, rel=1e-9)
    assert spent == pytest.approx(selection_epsilon(plan.trial_curve, DEFAULT_ORDERS,
                                                    SelectionDistribution.poisson(2.0), 1e-5), rel=1e-9)
    # a trial of the cell runs under the receipt of its cell's charge (run_training(_charged_by=...)), which the
    # register must hold: another study run's tag is refused
    from raydp.privacy.lifetime import LifetimeReceipt, check_receipt

    check_receipt(LifetimeReceipt(dataset_id, ps.charge_label("run-1", plan.key)), dataset_id,
                  manifest.get("source_sha256"))
    with pytest.raises(ConfigError, match="holds no charge"):
        check_receipt(LifetimeReceipt(dataset_id, ps.charge_label("run-9", plan.key)), dataset_id,
                      manifest.get("source_sha256"))
    ps._charge(str(data), plans, "run-2")  # the study run again (e.g. into its removed directory): charged again
    twice = spent_epsilon(read_budget(dataset_id, manifest.get("source_sha256")))
    assert twice == pytest.approx(rdp_epsilon(2 * plan.end_to_end_curve, DEFAULT_ORDERS, 1e-5), rel=1e-9)
    # a study protecting records is not charged to a budget per patient
    record = validate_config(StudyConfig, {**values, "base": {**values["base"], "privacy_unit": "record"}})
    _, record_plans = ps.plan_study(record, tmp_path / "r", progress=False)
    assert record_plans["embedded-tiny_eps4_seed0"].privacy_unit == "record"
    with pytest.raises(ConfigError, match="per patient"):
        ps._charge(str(data), record_plans, "run-3")
