"""The study's reported epsilon (ERRATA E7, E12, E14, E15), from hand-made run directories: no Tune.

Every trial on the same private dataset composes (RDP, Mironov 2017), whatever its target epsilon; a
Renyi-filtered run composes with its filter's budget curve (Feldman & Zrnic 2021); a saved policy's
training runs on the same data compose too; errored trials without a checkpoint are listed as unknown
spend; labels reach results.parquet and the figure; selection uses the public split by default.
"""

import json
import math
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

from raydp.data.identity import keyed_id, public_id
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_vector
from raydp.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from raydp.study.config import StudyConfig
from raydp.study.results import collect_results, curve_on_orders, ledger_rdp_curve
from raydp.study.trial import Trial

SHA = "d" * 64  # the dataset manifest's (private) content hash
ID = keyed_id(SHA)  # what released files name it by
DELTA = 1e-5
ORDERS = list(DEFAULT_ORDERS)


def make_study(**changes):
    values = {"name": "hand", "models": ["embedded-tiny"], "epsilons": [0.5, 2.0], "strategies": ["static"],
              "base": {"delta": DELTA}, "wandb": {"mode": "disabled"}}
    values.update(changes)
    return StudyConfig(**values)


def make_ledger(q, sigma, steps, eps_target):
    ledger = PrivacyLedger(delta=DELTA, epsilon_target=eps_target, accountant="rdp")
    for _ in range(steps):
        ledger.record_gaussian(q, sigma)
    return ledger


def write_run(study_dir, name, *, ledger=None, eps_target=2.0, labels=None, filt=None, sha=SHA, public=True,
              evals=None, final=(1.5, 1.6), unit=None):
    run = study_dir / "trials" / name
    run.mkdir(parents=True)
    private_final, public_final = final
    summary = {"initial_eval_perplexity": 3.0, "final_eval_perplexity": private_final,
               "best_eval_perplexity": private_final, "steps": 10, "wall_seconds": 1.0,
               "privacy": {"epsilon": eps_target, "epsilon_target": eps_target, "planned_steps": 10,
                           "epsilon_by_accountant": {"rdp": eps_target}, "enforcing_accountant": "rdp",
                           "within_budget": True, "verdict": "ok", "privacy_mode": None, "privacy_label": None,
                           "labels": labels or [], "filter": filt}}
    if sha is not None:
        summary["dataset_id"] = keyed_id(sha)
    if unit is not None:
        summary["privacy"]["privacy_unit"] = unit
    if public:
        summary.update(initial_public_perplexity=3.1, final_public_perplexity=public_final,
                       best_public_perplexity=public_final)
    (run / "summary.json").write_text(json.dumps(summary))
    if ledger is not None:
        ledger.save(run / LEDGER_FILENAME)
    if evals is not None:
        pd.DataFrame(evals).to_parquet(run / "eval_metrics.parquet")
    return run


def study_dir_with_dataset(tmp_path):
    d = tmp_path / "hand"
    (d / "dataset").mkdir(parents=True)
    (d / "dataset" / "manifest.json").write_text(json.dumps({"content_sha256": SHA}))
    return d


def spec(name, eps, strategy="static", seed=0, study=None, **fields):
    """A trial as the study plans it (:meth:`Trial.plan`: frozen where the study's controller settings say so)."""
    values = {"name": name, "model": "embedded-tiny", "epsilon": eps, "seed": seed, "strategy": strategy, **fields}
    return Trial.plan(study, **values) if study is not None else Trial(**values)


def result(trial, error=None, checkpoint=None):
    """Tune's result of a trial, its config in the older form (every spec, ``trial_specs``, as plain dicts)."""
    return SimpleNamespace(metrics={}, config={"trial_specs": {trial.name: trial.to_dict()}, "trial_name": trial.name},
                           error=error, path=f"/tune/{trial.name}", checkpoint=checkpoint)


def independent_rdp(ledgers):
    """dp_accounting's own RDP accountant over every ledger's steps (not raydp's code)."""
    acc = dp_rdp.RdpAccountant(ORDERS)
    for ledger in ledgers:
        for q, sigma in zip(ledger.q, ledger.sigma_eff):
            acc.compose(dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(sigma))))
    return np.asarray(acc._rdp)


def test_trials_at_different_target_epsilons_compose_into_one_figure(tmp_path):
    """E7/E14: trials at eps 0.5 and 2 on the same data give ONE figure, larger than each trial's."""
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    low, high = make_ledger(0.05, 4.0, 40, 0.5), make_ledger(0.05, 1.5, 40, 2.0)
    t_low, t_high = spec("static_eps0.5", 0.5), spec("static_eps2", 2.0)
    write_run(d, t_low.name, ledger=low, eps_target=0.5)
    write_run(d, t_high.name, ledger=high, eps_target=2.0)
    table = collect_results(study, d, [t_low, t_high], [result(t_low), result(t_high)])
    tuning = table.attrs["tuning_aware_epsilon"]
    assert list(tuning) == [ID]  # one figure per dataset, not per target epsilon
    fig = tuning[ID]
    assert fig["trials"] == 2 and fig["runs"] == 2 and fig["target_epsilons"] == [0.5, 2.0]
    singles = {c["name"]: c["epsilon_rdp"] for c in fig["composed"]}
    assert fig["tuning_aware_epsilon"] > max(singles.values()) == fig["max_single_trial_epsilon_rdp"]
    expected, _ = dp_rdp.compute_epsilon(ORDERS, independent_rdp([low, high]), DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)
    assert fig["repeat_and_select_epsilon_rdp"] > fig["max_single_trial_epsilon_rdp"]
    assert fig["unknown_spend"] == [] and fig["labels"] == []


def test_filtered_run_composes_with_its_budget_curve(tmp_path):
    """A run enforced by a Renyi filter is (alpha, B(alpha))-RDP (Feldman & Zrnic 2021): its budget curve,
    not its (smaller) realized ledger curve, is what composes."""
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    realized, other = make_ledger(0.05, 1.5, 30, 2.0), make_ledger(0.05, 3.0, 30, 0.5)
    budget = 60 * rdp_vector(0.05, 1.5)  # the filter's budget curve on DEFAULT_ORDERS, above the realized sum
    t_filt, t_other = spec("rldp_filtered", 2.0, strategy="rldp", t_rl=4, b_sac=4, k=2), spec("static_other", 0.5)
    write_run(d, t_filt.name, ledger=realized, filt={"orders": ORDERS, "budget_rdp": budget.tolist()})
    write_run(d, t_other.name, ledger=other, eps_target=0.5)
    table = collect_results(study, d, [t_filt, t_other], [result(t_filt), result(t_other)])
    fig = table.attrs["tuning_aware_epsilon"][ID]
    sources = {c["name"]: c["curve"] for c in fig["composed"]}
    assert sources == {"rldp_filtered": "renyi_filter", "static_other": "ledger"}
    assert list(table["rdp_curve_source"]) == ["renyi_filter", "ledger"]
    # independent: the budget curve plus dp_accounting's RDP of the other run, by direct sums
    expected, _ = dp_rdp.compute_epsilon(ORDERS, budget + independent_rdp([other]), DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)
    realized_only, _ = dp_rdp.compute_epsilon(ORDERS, independent_rdp([realized, other]), DELTA)
    assert fig["tuning_aware_epsilon"] > realized_only


def test_curves_on_other_orders_are_mapped_conservatively():
    """RDP is non-decreasing in the order: the value at the next given order above bounds every order."""
    coarse_orders = [2.0, 8.0, 32.0]
    coarse = [0.1, 0.5, 2.0]
    mapped = curve_on_orders(coarse_orders, coarse)
    orders = np.asarray(DEFAULT_ORDERS)
    assert np.all(mapped[orders <= 2.0] == 0.1) and np.all(mapped[(orders > 2.0) & (orders <= 8.0)] == 0.5)
    assert np.all(mapped[(orders > 8.0) & (orders <= 32.0)] == 2.0) and np.all(np.isinf(mapped[orders > 32.0]))
    exact = 10 * rdp_vector(0.1, 1.0)
    assert np.array_equal(curve_on_orders(DEFAULT_ORDERS, exact), exact)  # same orders: unchanged
    ledger = make_ledger(0.1, 1.0, 10, 1.0)
    assert np.allclose(ledger_rdp_curve(ledger), exact)


@contextmanager
def _as_directory(path):
    yield str(path)


def tune_checkpoint(tmp_path, ledger):
    """A Tune checkpoint as a trial writes it (its state.pt holds the ledger so far)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"trainer": {"gradient": {"ledger": ledger.to_arrow()}}}, ckpt / "state.pt")
    return SimpleNamespace(as_directory=lambda: _as_directory(ckpt))


def test_errored_trials_compose_from_their_checkpoint_or_are_listed_as_unknown_spend(tmp_path):
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    done, partial = make_ledger(0.05, 1.5, 40, 2.0), make_ledger(0.05, 1.5, 12, 2.0)
    checkpoint = tune_checkpoint(tmp_path, partial)
    t_done, t_ckpt, t_lost = spec("static_done", 2.0), spec("static_ckpt", 0.5), spec("static_lost", 0.5, seed=1)
    write_run(d, t_done.name, ledger=done)
    table = collect_results(study, d, [t_done, t_ckpt, t_lost],
                            [result(t_done), result(t_ckpt, error=RuntimeError("x"), checkpoint=checkpoint),
                             result(t_lost, error=RuntimeError("y"))])
    fig = table.attrs["tuning_aware_epsilon"][ID]
    assert {c["name"]: c["curve"] for c in fig["composed"]} == {"static_done": "ledger",
                                                                 "static_ckpt": "checkpoint_ledger"}
    assert [u["trial"] for u in fig["unknown_spend"]] == ["static_lost"]
    assert any("unknown spend" in w and "static_lost" in w for w in fig["warnings"])
    expected, _ = dp_rdp.compute_epsilon(ORDERS, independent_rdp([done, partial]), DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_an_errored_adaptive_trial_composes_with_its_filter_budget(tmp_path):
    """The checkpoint's ledger carries the Renyi filter (metadata): its budget, not the realized sum,
    bounds the errored adaptive run (E13); its labels come along."""
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    budget = 50 * rdp_vector(0.05, 1.5)
    partial = PrivacyLedger(delta=DELTA, epsilon_target=2.0, accountant="renyi_filter",
                            metadata={"filter": {"orders": ORDERS, "budget_rdp": budget.tolist()},
                                      "labels": ["LABEL X"]})
    for _ in range(5):
        partial.record_gaussian(0.05, 1.5)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"trainer": {"gradient": {"ledger": partial.to_arrow()}}}, ckpt / "state.pt")
    t = spec("rldp_err", 2.0, strategy="rldp", t_rl=4, b_sac=4, k=2)
    checkpoint = SimpleNamespace(as_directory=lambda: _as_directory(ckpt))
    table = collect_results(study, d, [t], [result(t, error=RuntimeError("x"), checkpoint=checkpoint)])
    fig = table.attrs["tuning_aware_epsilon"][ID]
    assert [c["curve"] for c in fig["composed"]] == ["renyi_filter"] and fig["labels"] == ["LABEL X"]
    expected, _ = dp_rdp.compute_epsilon(ORDERS, budget, DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_labels_reach_results_and_the_figure(tmp_path):
    """E12/E3: a run's labels go to results.parquet ('; '-joined) and to its dataset's figure."""
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    void = "epsilon is void: sampling and noise were seeded from a recorded seed (E12)"
    t_void, t_plain = spec("static_void", 2.0), spec("static_plain", 0.5)
    write_run(d, t_void.name, ledger=make_ledger(0.05, 1.5, 10, 2.0), labels=[void, "second label"])
    write_run(d, t_plain.name, ledger=make_ledger(0.05, 3.0, 10, 0.5), eps_target=0.5)
    collect_results(study, d, [t_void, t_plain], [result(t_void), result(t_plain)])
    table = pd.read_parquet(d / "results.parquet")
    assert table["privacy_labels"].iloc[0] == f"{void}; second label" and pd.isna(table["privacy_labels"].iloc[1])
    assert "privacy_label" in table  # today's column stays
    summary_labels = collect_results(study, d, [t_void, t_plain], [result(t_void), result(t_plain)]
                                     ).attrs["tuning_aware_epsilon"][ID]["labels"]
    assert summary_labels == [void, "second label"]


def test_a_saved_policys_training_runs_on_the_same_data_compose(tmp_path, monkeypatch):
    """E14: the runs that trained the policy a trial starts from compose when they used this dataset."""
    from raydp.control.features import ObservationLayout
    from raydp.control.store import write_manifest

    policies = tmp_path / "policies"
    pol = policies / "prior"
    pol.mkdir(parents=True)
    trained = make_ledger(0.05, 1.5, 50, 2.0)
    same = {"dataset_id": ID, "privacy_mode": "strict", "privacy_unit": "record", "epsilon": 2.0,
            "delta": DELTA, "guarantee": "ledger", "rdp_orders": ORDERS,
            "rdp_curve": ledger_rdp_curve(trained).tolist()}
    elsewhere = {**same, "dataset_id": keyed_id("e" * 64)}
    public = {**same, "dataset_id": public_id("f" * 64), "public_data": True}
    write_manifest(pol, layout=ObservationLayout("shared", 8), sac={}, trained_on={"model": "embedded"}, results={},
                   transitions=1, updates=1, provenance=[same, elsewhere, public])
    study = make_study(strategies=["rldp"], base={"delta": DELTA},
                       strategy_settings={"rldp": {"policy": "prior", "policy_dir": str(policies)}})
    d = study_dir_with_dataset(tmp_path)
    trial = spec("rldp_a", 0.5, strategy="rldp", t_rl=4, b_sac=4, k=2)
    trial_b = spec("rldp_b", 2.0, strategy="rldp", t_rl=4, b_sac=4, k=2)
    own_a, own_b = make_ledger(0.05, 3.0, 20, 0.5), make_ledger(0.05, 1.5, 20, 2.0)
    write_run(d, trial.name, ledger=own_a, eps_target=0.5)
    write_run(d, trial_b.name, ledger=own_b)
    fig = collect_results(study, d, [trial, trial_b], [result(trial), result(trial_b)]
                          ).attrs["tuning_aware_epsilon"][ID]
    kinds = [c["kind"] for c in fig["composed"]]
    assert kinds.count("policy_training_run") == 1  # used by two trials, composed once; other dataset: not
    assert fig["trials"] == 2 and fig["runs"] == 3
    # another private dataset is not composed, but said (it may hold the same people); public data is not
    others = [w for w in fig["warnings"] if "another private dataset" in w]
    assert len(others) == 1 and keyed_id("e" * 64) in others[0] and not any("ffffffffffff" in w for w in fig["warnings"])
    expected, _ = dp_rdp.compute_epsilon(ORDERS, independent_rdp([own_a, own_b, trained]), DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_selection_uses_the_public_split_by_default_and_labels_the_private_one(tmp_path):
    """E15: steps-to-target on the public validation perplexity; 'private' says it is unprotected."""
    evals_base = {"step": [0, 5, 10], "perplexity": [3.0, 1.9, 1.5], "public_perplexity": [3.1, 2.5, 1.6]}
    evals_rldp = {"step": [0, 5, 10], "perplexity": [3.0, 1.4, 1.3], "public_perplexity": [3.1, 1.55, 1.5]}
    results = {}
    for selection in ("public", "private"):
        study, d = make_study(epsilons=[2.0], strategies=["static", "rldp"], selection=selection), \
            study_dir_with_dataset(tmp_path / selection)
        base = spec("static", 2.0)
        rldp = spec("rldp", 2.0, strategy="rldp", t_rl=4, b_sac=4, k=2)
        write_run(d, base.name, ledger=make_ledger(0.05, 1.5, 10, 2.0), evals=evals_base, final=(1.5, 1.6))
        write_run(d, rldp.name, ledger=make_ledger(0.05, 1.5, 10, 2.0), evals=evals_rldp, final=(1.3, 1.5))
        table = collect_results(study, d, [base, rldp], [result(base), result(rldp)])
        results[selection] = table
        saved = pd.read_parquet(d / "results.parquet")
        assert {"final_public_perplexity", "final_eval_perplexity", "selection_split"} <= set(saved)
    public, private = results["public"], results["private"]
    # public: the baseline's final public ppl is 1.6; RLDP reaches it (1.55) at step 5 -> 0.5
    assert public.attrs["selection"]["split"] == "public"
    assert public.set_index("trial")["steps_to_target"]["rldp"] == pytest.approx(0.5)
    assert private.attrs["selection"] == {"requested": "private", "split": "private", "metric": "perplexity",
                                          "note": "selection used the private eval split: unprotected (E15)"}
    assert private.set_index("trial")["steps_to_target"]["rldp"] == pytest.approx(0.5)  # 1.4 <= 1.5 at 5
    assert list(pd.read_parquet(tmp_path / "private" / "hand" / "results.parquet")["selection_split"]) == \
        ["private", "private"]


def test_old_summaries_without_public_figures_fall_back_with_a_label(tmp_path):
    study, d = make_study(epsilons=[2.0]), study_dir_with_dataset(tmp_path)
    t = spec("static_old", 2.0)
    write_run(d, t.name, ledger=make_ledger(0.05, 1.5, 10, 2.0), public=False, sha=None)
    table = collect_results(study, d, [t], [result(t)])
    assert table.attrs["selection"]["split"] == "private"
    assert "unprotected (E15)" in table.attrs["selection"]["note"]
    assert list(table.attrs["tuning_aware_epsilon"]) == [ID]  # identity from the study's dataset manifest
    assert math.isnan(table["final_public_perplexity"].iloc[0])


def test_report_prints_the_figure_labels_and_selection(tmp_path):
    from raydp.report import write_report
    from raydp.study.tables import format_report

    study, d = make_study(), study_dir_with_dataset(tmp_path)
    t1, t2 = spec("static_a", 0.5), spec("static_b", 2.0)
    write_run(d, t1.name, ledger=make_ledger(0.05, 3.0, 10, 0.5), eps_target=0.5, labels=["VOID (E12)"])
    write_run(d, t2.name, ledger=make_ledger(0.05, 1.5, 10, 2.0))
    table = collect_results(study, d, [t1, t2], [result(t1), result(t2, error=RuntimeError("x"))])
    (d / "study_summary.json").write_text(json.dumps({"study": "hand", **table.attrs}, default=str))
    out = format_report(d)  # what `raydp report` prints, beside the HTML page it writes
    assert write_report(d).is_file()
    assert f"dataset {ID[:16]}: 2 runs" in out and "LABEL: VOID (E12)" in out
    assert "selection used the public validation split (E15)" in out
    assert "final perplexity" in out and "public validation (selects)" in out  # the metric and the split it selects on


def test_a_stopped_studys_trials_are_finished_interrupted_or_not_run_and_interrupted_spend_counts(tmp_path):
    """A study stopped with Ctrl-C: Tune's grid holds finished trials, one stopped mid-run (reported and
    checkpointed, no final report), and pending ones with neither config nor metrics. The table says which
    is which (no trial invented), and the interrupted trial's checkpointed ledger is in the figure."""
    study, d = make_study(), study_dir_with_dataset(tmp_path)
    done, partial = make_ledger(0.05, 1.5, 40, 2.0), make_ledger(0.05, 1.5, 12, 2.0)
    partial.update_metadata(privacy_unit="patient")  # as a run's ledger carries it
    checkpoint = tune_checkpoint(tmp_path, partial)
    t_done, t_mid = spec("static_done", 2.0), spec("static_mid", 0.5)
    t_pending, t_pending2 = spec("static_pending", 0.5, seed=1), spec("static_pending2", 2.0, seed=1)
    write_run(d, t_done.name, ledger=done, unit="patient")
    mid = result(t_mid, checkpoint=checkpoint)
    mid.metrics = {"step": 12, "checkpoint": True}  # reported, never finished
    never = [SimpleNamespace(metrics={"trial_id": f"x_{i:05d}"}, config={}, error=None, path=f"/tune/p{i}",
                             checkpoint=None) for i in (1, 2)]  # what Tune's restored grid holds for them
    table = collect_results(study, d, [t_done, t_mid, t_pending, t_pending2], [result(t_done), mid, *never])
    assert dict(zip(table["trial"], table["status"])) == {
        "static_done": "TERMINATED", "static_mid": "INTERRUPTED", "static_pending": "NOT_RUN",
        "static_pending2": "NOT_RUN"}
    fig = table.attrs["tuning_aware_epsilon"][ID]
    assert sorted(c["kind"] for c in fig["composed"]) == ["interrupted_trial", "trial"]
    # the interrupted trial's unit comes from its checkpointed ledger, not "unknown" (the finished run's
    # summary names the patient too): no mixed-unit warning
    assert fig["privacy_units"] == ["patient"] and not any("privacy units" in w for w in fig["warnings"])
    expected, _ = dp_rdp.compute_epsilon(ORDERS, independent_rdp([done, partial]), DELTA)
    assert fig["tuning_aware_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_a_study_that_freezes_its_policy_marks_its_rldp_trials_frozen(tmp_path):
    """strategy_settings.rldp.frozen: the results table says so (the report then keys the arm "(frozen policy)"), like a
    transfer study's frozen stage; a baseline trial beside it is not frozen."""
    study = make_study(strategies=["rldp", "static"], base={"delta": DELTA},
                       strategy_settings={"rldp": {"frozen": True, "policy": "public-embedded"}})
    d = study_dir_with_dataset(tmp_path)
    t_rl, t_static = spec("rldp_frozen", 2.0, "rldp", study=study), spec("static_beside", 2.0, study=study)
    assert t_rl.frozen and not t_static.frozen and t_rl.arm.label() == "rldp (frozen policy)"
    table = collect_results(study, d, [t_rl, t_static], [])
    assert table.set_index("trial")["frozen_policy"].to_dict() == {"rldp_frozen": True, "static_beside": False}
    unfrozen = make_study(strategies=["rldp"])
    table = collect_results(unfrozen, d, [spec("rldp_frozen", 2.0, "rldp", study=unfrozen)], [])
    assert not table["frozen_policy"].any()
