"""Studies: validation before anything runs, a real Tune run, results and report, ``ray job submit``."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from raydp.control.store import shipped_policy_dir
from raydp.errors import ConfigError
from raydp.study.config import load_study
from raydp.study.grid import trial_grid

REPO = Path(__file__).resolve().parents[1]

TINY_STUDY = {
    "name": "tiny",
    "models": ["embedded-tiny"],
    "epsilons": [2.0],
    "seeds": [0],
    "strategies": ["static", "rldp"],
    "sac_grid": {"t_rl": [4], "b_sac": [4], "k": [2]},
    "resources": {"cpus_per_trial": 1},
    "base": {"data": {"n_records": 400}, "max_steps": 24, "eval_every": 8, "eval_max_records": 16,
             "warmup_steps": 4},
    "strategy_settings": {"rldp": {"t_warm": 4, "n_max": 8, "hidden": 32}},
}


def write_study(tmp_path, **changes):
    values = json.loads(json.dumps(TINY_STUDY))
    for key, value in changes.items():
        values[key] = value
    path = tmp_path / f"{values.get('name', 'study')}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"epsilon": [2.0]}, "epsilon: unknown field"),
    ({"epsilons": [-1.0]}, "epsilons must be > 0"),
    ({"strategies": ["static", "magic"]}, "strategies.1"),
    ({"sac_grid": {"t_rl": [0]}}, "sac_grid.t_rl values must be > 0"),
    ({"base": {"strategy": "static"}}, "base.strategy is set by the study's grid"),
    ({"base": {"batch_size": -3}}, "batch_size"),
    ({"base": {"data": {"n_records": 400}, "delta": 0.01}}, "trial static_embedded-tiny_eps2_seed0: delta=0.01"),
    ({"strategy_settings": {"rldp": {"frozen": True}}}, "frozen policy needs"),
    ({"name": "bad name!"}, "name"),
    ({"evaluate": {}}, "evaluate.audit needs audit canaries in the data"),
    ({"attack_strategies": ["static"]}, "attack_strategies names arms attacked beside the released trials"),
    ({"evaluate": {"audit": False}, "attack_strategies": ["nonprivate"]}, "'nonprivate' is not one of this study's"),
    ({"evaluate": {"audit": False}, "selection": "private"}, "selection: private marks no trial for release"),
    ({"policy": "shared", "sac_grid": {"t_rl": [4], "b_sac": [4, 8], "k": [2]}}, "a shared policy has one B_SAC"),
    ({"settings_grid": {"quantile": {"clip": [0.1]}}}, "settings_grid.quantile: not a DP strategy of this study"),
    ({"settings_grid": {"static": {"clip": []}}}, "settings_grid.static: give each setting a non-empty list"),
    ({"save_policy": "x"}, "save_policy saves a study's shared policy"),
    ({"policy": "shared", "settings_grid": {"rldp": {"t_warm": [2, 4]}}}, "one shared policy cannot act"),
    ({"settings_grid": {"rldp": {"policy": ["a", "b"]}}}, "settings_grid.rldp cannot vary policy"),
    ({"policy": "shared", "save_policy": "x"}, "save_policy pre-trains on public data only"),
    ({"policy": "shared", "save_policy": "x", "strategy_settings": {"rldp": {"frozen": True, "policy": "p"}}},
     "a frozen policy learns nothing"),
    ({"private_data": False}, "private_data: false is for public data only"),
    ({"settings_grid": {"static": {"clip": [0.1, 0.1]}}}, "two trials would both be named"),
    ({"resources": {"cpus_per_trial": 64}}, "exceeds the cluster's"),
])
def test_invalid_study_files_fail_before_any_trial(tmp_path, changes, message, capsys, request):
    from raydp.cli import main

    if "cpus_per_trial" in str(changes):  # refused once Ray is up: the session's one Ray, never a study's own
        request.getfixturevalue("local_ray")
    path = write_study(tmp_path, **changes)
    assert main(["study", str(path), "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    if "cpus_per_trial" in str(changes):  # found once Ray is up (a cluster may have more CPUs than this machine)
        err = err.strip().splitlines()[-1] + "\n"
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "tiny").exists()  # nothing written: no PRIVACY.txt, study.json or dataset


def test_missing_and_broken_study_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read study"):
        load_study(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_study(broken)


#: the shipped studies: what the README and the user docs tell a user to run (one line each in docs/studies.md), and
#: the cluster's example; a campaign's study files are records under experiments/<campaign>/ (slow tier, below)
SHIPPED_STUDIES = [*sorted((REPO / "trials").glob("*.yaml")), REPO / "cluster" / "paper_grid.yaml"]
CAMPAIGN_STUDIES = sorted((REPO / "experiments").rglob("*.yaml"))
MAX_SHIPPED = 10  # study files at the top of trials/


def _validates_and_expands(path):
    """Load a study file and expand its trials; a deciding study whose public search has not run (tuned_from names
    a study directory, relative to the working directory, that is not there) must say so. Returns the study."""
    study = load_study(path)
    tuned = Path(study.tuned_from) if study.tuned_from is not None else None
    if tuned is not None and not tuned.is_file() and not (tuned / "study_summary.json").exists():
        # the deciding half of a pre-registered pair: it expands once its public search has run
        with pytest.raises(ConfigError, match="is not a finished study"):
            trial_grid(study)
        return study
    trials = trial_grid(study)
    assert trials or study.search_space, path.name  # a search's trials are Optuna's (search_cells)
    assert {t.strategy for t in trials} <= set(study.strategies) | {"pbt"}, path.name
    return study


def _named_policies(study):
    """(policy, policy_dir, frozen) of every saved policy the study's strategy settings start from."""
    return [(s["policy"], s.get("policy_dir", "policies"), bool(s.get("frozen")))
            for s in study.strategy_settings.values() if isinstance(s, dict) and s.get("policy")]


def test_shipped_study_files_validate_and_expand(tmp_path, monkeypatch):
    """Every shipped study file validates and expands to trials (no trial count is pinned here), and every policy
    one starts from is a shipped one: found from any working directory (so from a wheel too)."""
    from raydp.control.store import resolve_policy

    assert len(SHIPPED_STUDIES) - 1 <= MAX_SHIPPED, "trials/ holds the shipped studies only: a campaign's study " \
                                                    "files go to experiments/<campaign>/"
    monkeypatch.chdir(tmp_path)  # no policies/ here: only the shipped ones count
    studies = {path.stem: _validates_and_expands(path) for path in SHIPPED_STUDIES}
    for name, study in studies.items():
        for policy, policy_dir, _ in _named_policies(study):
            assert resolve_policy(policy, policy_dir).parent == shipped_policy_dir().resolve(), (name, policy)
    assert "rldp" in {t.strategy for t in trial_grid(studies["quickstart"])}
    headroom = studies["headroom"]
    assert headroom.epsilons == [0.5, 2.0, 8.0] and "nonprivate" in headroom.strategies  # the DP gap (issue 27)


# Slow tier by choice, not for time (about a second): a campaign's files are records of what ran, at the commit its
# README names, so a schema change is not held back by the fast tier; this tier checks that they still load and that
# the files they name (tuning records, policies) resolve where they moved to. One that a later schema change breaks
# is amended in its file (as pre-registered studies are), saying so.
@pytest.mark.slow
def test_campaign_study_files_validate_and_their_paths_resolve(tmp_path, monkeypatch):
    """Every study file under experiments/ validates and expands from another directory (its relative paths are read
    beside it), its tuning record exists, a policy it names is its campaign's or a shipped one, and a policy it
    continues training (not frozen) is a full copy, replay buffer included."""
    from raydp.control.store import REPLAY_FILE, resolve_policy

    monkeypatch.chdir(tmp_path)
    assert CAMPAIGN_STUDIES
    for path in CAMPAIGN_STUDIES:
        study = _validates_and_expands(path)
        if study.tuned_from is not None:
            assert Path(study.tuned_from).exists(), path
        for policy, policy_dir, frozen in _named_policies(study):
            found = resolve_policy(policy, policy_dir)
            assert found.parent in (path.parent / "policies", shipped_policy_dir().resolve()), (path, policy)
            assert frozen or (found / REPLAY_FILE).is_file(), (path, policy)


def test_settings_grid_expands_into_named_trials_with_their_settings(tmp_path):
    from raydp.study.grid import trial_config

    study = load_study(write_study(tmp_path, strategies=["static", "static-pairwise", "rldp"], settings_grid={
        "static-pairwise": {"clip": [0.01, 0.1]}, "rldp": {"action_decoding": ["paper", "relative"]}}))
    trials = trial_grid(study)
    assert [(t.strategy, t.grid) for t in trials] == [
        ("static", None), ("static-pairwise", {"clip": 0.01}), ("static-pairwise", {"clip": 0.1}),
        ("rldp", {"action_decoding": "paper"}), ("rldp", {"action_decoding": "relative"})]
    names = [t.name for t in trials]
    assert len(set(names)) == 5 and names[1].endswith("_clip0.01")
    assert trial_config(study, trials[1]).settings == {"clip": 0.01}
    assert trial_config(study, trials[3]).strategy_settings().action_decoding == "paper"
    assert trial_config(study, trials[4]).strategy_settings().action_decoding == "relative"


@pytest.fixture(scope="module")
def tiny_study(local_ray, tmp_path_factory):
    from raydp.study.runner import run_study

    root = tmp_path_factory.mktemp("study")
    base = {**TINY_STUDY["base"], "data": {"n_records": 400, "n_audit": 20}}  # audit canaries for `evaluate`
    path = write_study(root, base=base, evaluate={"generations": 20, "exposure_candidates": 50,
                                                  "membership_records": 16}, attack="all")
    study_dir = run_study(path, root / "out", progress=False)
    yield study_dir


def test_study_results_table(tiny_study):
    table = pd.read_parquet(tiny_study / "results.parquet")
    assert sorted(table["strategy"]) == ["rldp", "static"]
    assert (table["status"] == "TERMINATED").all() and table["within_budget"].all()
    assert (table["epsilon_pld"] <= 2.0).all() and (table["steps"] == 24).all()
    assert {"steps_to_target", "epsilon_prv", "epsilon_gdp", "trial_seconds", "privacy_mode", "config"} <= set(table)
    # steps_to_target recomputed here from the runs' evaluations: RLDP's target is the static trial's
    # final figure (the only baseline), not its own, on the study's selection split and metric (the
    # value-token NLL here; perplexity can cross the target at another evaluation)
    static, rldp = (table[table["strategy"] == s].iloc[0] for s in ("static", "rldp"))
    assert static["selection_split"] == "public" and static["selection_metric"] == "value_nll"
    metric = "value_nll"
    for row in (static, rldp):
        evals = pd.read_parquet(Path(row["run_dir"]) / "eval_metrics.parquet")
        hit = evals[(evals["step"] > 0) & (evals[f"public_{metric}"] <= static[f"final_public_{metric}"])]
        expected = hit["step"].iloc[0] / row["planned_steps"] if len(hit) else float("nan")
        assert row["steps_to_target"] == pytest.approx(expected, nan_ok=True), row["strategy"]
    for run_dir in table["run_dir"]:
        assert (Path(run_dir) / "privacy_ledger.parquet").exists()
    assert (Path(table[table["strategy"] == "rldp"].iloc[0]["run_dir"]) / "control_trace.parquet").exists()
    summary = json.loads((tiny_study / "study_summary.json").read_text())
    sha = json.loads((tiny_study / "dataset" / "manifest.json").read_text())["dataset_id"]
    tuning = summary["tuning_aware_epsilon"][sha]  # one figure per dataset (E7/E14)
    assert tuning["trials"] == 2 and tuning["unknown_spend"] == []
    assert tuning["tuning_aware_epsilon"] == tuning["composition_epsilon_rdp"] > tuning["max_single_trial_epsilon_rdp"]
    assert tuning["repeat_and_select_epsilon_rdp"] > tuning["max_single_trial_epsilon_rdp"]
    assert summary["selection"]["requested"] == "public"  # E15 (falls back, labelled, where runs lack it)
    assert {"final_public_perplexity", "privacy_labels", "selection_split"} <= set(table)


def test_evaluations_reach_tune_only_with_their_checkpoint(tiny_study):
    """E: every Tune result that carries a perplexity is a checkpoint's report (or the final one)."""
    for result_file in (tiny_study / "tune" / "tiny").glob("*/result.json"):
        results = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
        assert results
        for r in results:
            if r.get("eval_perplexity") is not None:
                assert r.get("checkpoint") or r.get("done"), r
            assert "selection_score" in r and r["selection_split"] in ("public", "private")
        assert "privacy_label" in results[-1] and results[-1]["done"]


def test_report_prints_the_paper_tables(tiny_study, capsys):
    from raydp.cli import main

    assert main(["report", str(tiny_study)]) == 0
    out = capsys.readouterr().out
    assert "Table 2 analogue" in out and "Table 3 analogue" in out and "Tuning-aware epsilon" in out
    assert "T_RL=4 B_SAC=4 K=2" in out
    page = (tiny_study / "report.html").read_text()  # the HTML report, with every trial's evaluation
    for section in ("fig-utility", "table2", "table-privacy", "table-membership", "table-extraction", "table-audit"):
        assert f'id="{section}"' in page, section
    assert "have no evaluation" not in page


def test_the_study_attacks_and_audits_every_trial(tiny_study):
    """The study file's `evaluate:` runs the attacks and the audit in each trial; results carry them (they
    are not a DP release and never drive selection: Tune's metric stays the selection perplexity)."""
    table = pd.read_parquet(tiny_study / "results.parquet")
    for _, row in table.iterrows():
        result = json.loads((Path(row["run_dir"]) / "evaluation.json").read_text())
        assert result["audit"]["m"] == 20 and result["extraction"]["generations"] == 20
        assert row["mia_auc"] == result["membership"]["loss"]["auc"]
        assert row["audit_epsilon_one_run"] == result["audit"]["epsilon_one_run"] <= row["epsilon"]
        assert bool(row["audit_consistent"]) is True
    assert {"mia_cal_auc", "mia_tpr_at_fpr_0.01", "canary_jaccard_1", "exposure_mean", "eval_seconds"} <= set(table)


def test_wandb_is_offline_and_logs_no_text(tiny_study):
    runs = list((tiny_study / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one offline run per trial, nothing sent anywhere
    import hashlib

    # each run's id is a digest of the study directory, the study's name and the trial (a retried or restored
    # trial resumes it)
    table = pd.read_parquet(tiny_study / "results.parquet")
    base = hashlib.sha256(f"{tiny_study.resolve()}|tiny".encode()).hexdigest()
    ids = {hashlib.sha256(f"{base}|{name}".encode()).hexdigest()[:24] for name in table["trial"]}
    assert {run.name.rsplit("-", 1)[-1] for run in runs} == ids
    from raydp.data import load_canaries, load_texts

    secrets = list(load_canaries(tiny_study / "dataset")["secret"])
    texts = [t[:40].encode() for t in load_texts(tiny_study / "dataset", "train")[:50]]
    for run in runs:
        for f in run.rglob("*"):
            if f.is_file():
                blob = f.read_bytes()
                assert not any(secret.encode() in blob for secret in secrets)
                assert b"secret_id=" not in blob and not any(t in blob for t in texts)


def test_wandb_logs_curves_tables_and_the_dp_runs_artifact(tiny_study):
    """Issue 31: each trial's wandb run holds the evaluations (both splits), the dials and the privacy spent over
    steps (train/*), tables of both, the summary, and for a DP run its releasable files as an artifact; no
    attack result without the opt-in, no console capture. Read from wandb's own offline file, not from what raydp meant to send."""
    from releasable import unclassified_wandb
    from wandb_records import history, records

    table = pd.read_parquet(tiny_study / "results.parquet").set_index("trial")
    assert len(list((tiny_study / "wandb").glob("offline-run-*/run-*.wandb"))) == len(table) == 2
    for run_file in (tiny_study / "wandb").glob("offline-run-*/run-*.wandb"):
        rows = history(run_file)
        trial = next(name for name in table.index if any(r.run.display_name == name for r in records(run_file)
                                                         if r.WhichOneof("record_type") == "run"))
        run_dir = tiny_study / "trials" / trial
        evals = pd.read_parquet(run_dir / "eval_metrics.parquet")
        logged = [r for r in rows if "eval/step" in r]
        assert [r["eval/step"] for r in logged] == list(evals["step"])
        assert [r["eval/perplexity"] for r in logged] == pytest.approx(list(evals["perplexity"]))
        assert logged == sorted(logged, key=lambda r: r["eval/step"])
        assert [r["public/value_nll"] for r in logged] == pytest.approx(list(evals["public_value_nll"]))
        train = [r for r in rows if "train/step" in r]
        ledger = pd.read_parquet(run_dir / "privacy_ledger.parquet").sort_values("step")
        assert [r["train/step"] for r in train] == list(ledger["step"] + 1)
        assert [r["train/sigma_eff"] for r in train] == pytest.approx(list(ledger["sigma_eff"]))
        assert [r["train/clip_0"] for r in train] == pytest.approx([np.atleast_1d(c)[0] for c in ledger["clip"]])
        spent = [r["train/epsilon_spent"] for r in train if "train/epsilon_spent" in r]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert len(spent) >= 2 and np.all(np.diff(spent) >= 0) and "train/epsilon_spent" in train[-1]
        # the RDP bound of the ledger's steps, as dp_accounting composes them (independently of raydp's code)
        import dp_accounting
        from raydp.privacy.accounting.rdp import DEFAULT_ORDERS

        accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
        for q, sigma in zip(ledger["q"], ledger["sigma_eff"]):
            accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
        assert spent[-1] == pytest.approx(accountant.get_epsilon(summary["privacy"]["delta"]), rel=1e-4)
        tables = {k.split("/")[1]: r[k.rsplit("/", 1)[0] + "/nrows"] for r in rows for k in r
                  if k.startswith("tables/") and k.endswith("/_type")}
        assert tables == {"dials": len(ledger), "evaluations": len(evals)}
        summaries = {item.key: json.loads(item.value_json) for r in records(run_file)
                     if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
        assert summaries["epsilon"] == pytest.approx(table.loc[trial, "epsilon"])
        assert not any(key.startswith("unprotected/") for key in summaries)  # attacks only on opt-in
        artifacts = [r.artifact for r in records(run_file)
                     if r.WhichOneof("record_type") == "artifact" and r.artifact.type != "run_table"]
        assert len(artifacts) == 1 and artifacts[0].type == "model"  # every tiny-study trial is DP
        paths = {entry.path for entry in artifacts[0].manifest.contents}
        assert {"summary.json", "PRIVACY.txt", "privacy_ledger.parquet", "adapter/adapter_model.safetensors"} <= paths
        assert not any(p.startswith("private/") or p == "evaluation.json" for p in paths)
        assert not (run_file.parent / "files" / "output.log").exists()
        # and nothing else: every record, key, column and file classified (tests/releasable.py)
        assert unclassified_wandb(run_file) == []


# ~80 s: Optuna over the SAC grid; the same study runner, trial grid and results table with grid
# search are test_study.py::test_study_results_table (tiny_study)
@pytest.mark.slow
def test_optuna_chooses_the_sac_cells(tiny_study, tmp_path):
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="tuned", search="optuna", optuna={"num_samples": 2},
                       sac_grid={"t_rl": [4, 8], "b_sac": [4], "k": [1, 2]}, wandb={"mode": "disabled"})
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert sorted(table["strategy"]) == ["rldp", "rldp", "static"]
    rldp = table[table["strategy"] == "rldp"]
    assert rldp["trial"].str.contains("optuna-").all() and (rldp["status"] == "TERMINATED").all()
    assert set(rldp["t_rl"]) <= {4, 8} and set(rldp["k"]) <= {1, 2}


def test_rldp_trials_can_share_one_policy(tiny_study, tmp_path, monkeypatch):
    """Pre-training on public data: two episodes on the public population feed one policy, saved with
    its training record."""
    from raydp.cli import main
    from raydp.study.runner import run_study

    base = {**TINY_STUDY["base"], "data": {"source": "public", "n_records": 400}}
    path = write_study(tmp_path, name="shared", strategies=["rldp"], seeds=[0, 1], policy="shared",
                       wandb={"mode": "disabled"}, base=base, private_data=False, save_policy="pre",
                       policy_dir=str(tmp_path / "policies"))
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert len(table) == 2 and (table["status"] == "TERMINATED").all()
    transitions = [json.loads((Path(d) / "summary.json").read_text())["controller"]["transitions"]
                   for d in table["run_dir"]]
    shared = json.loads((study_dir / "study_summary.json").read_text())["shared_policy"]
    assert shared["transitions_trained"] == sum(transitions) > 0  # one service trained on both trials
    manifest = json.loads((tmp_path / "policies" / "pre" / "manifest.json").read_text())
    record = manifest["trained_on"]["pretraining"]
    assert record["public_data"] and record["data_source"] == "public" and record["episodes"] == 2
    assert record["transitions"] == sum(transitions) and record["cpu_seconds"] > 0
    # K SAC updates per transition (one train() call each), and the record agrees with the manifest
    k = TINY_STUDY["sac_grid"]["k"][0]
    assert record["sac_updates"] == manifest["sac_updates"] == k * sum(transitions)
    assert all(e["public_data"] for e in manifest["provenance"]) and len(manifest["provenance"]) == 2
    assert manifest["lifetime"] == {"runs": 2, "transitions": record["transitions"],
                                    "sac_updates": record["sac_updates"]}
    # the study refuses to overwrite the saved policy, before running anything
    assert main(["study", str(path), "--results-dir", str(tmp_path / "again")]) == 2
    assert not (tmp_path / "again").exists()
    # a later study names the saved policy relative to where it runs: the driver hands each trial the
    # absolute path (Tune starts a trial in its own directory, and the policy service elsewhere again)
    from raydp.study.grid import trial_config
    from raydp.study.prepare import prepare_study

    monkeypatch.chdir(tmp_path)
    rldp = {**TINY_STUDY["strategy_settings"]["rldp"], "policy": "pre", "policy_dir": "policies"}
    study = load_study(write_study(tmp_path, name="reuse", strategies=["rldp"], strategy_settings={"rldp": rldp}))
    dataset, (trial,) = prepare_study(study, tmp_path / "reuse")
    assert trial.policy_path == str((tmp_path / "policies" / "pre").resolve())
    monkeypatch.chdir(tmp_path / "reuse")  # as in a Tune trial
    assert trial_config(study, trial, dataset, trial.policy_path).strategy_settings().policy == trial.policy_path


# slow (~35 s on CI): continuing a saved policy runs a second study; the first study, its record and the policy
# service's lifetime counts are test_rldp_trials_can_share_one_policy's, and a snapshot's counts are
# tests/test_policy_provenance.py's
@pytest.mark.slow
def test_a_shared_study_continues_a_saved_policy_and_inherits_its_provenance(local_ray, tmp_path):
    from raydp.study.runner import run_study

    base = {**TINY_STUDY["base"], "data": {"source": "public", "n_records": 400}}
    path = write_study(tmp_path, name="shared", strategies=["rldp"], seeds=[0, 1], policy="shared",
                       wandb={"mode": "disabled"}, base=base, private_data=False, save_policy="pre",
                       policy_dir=str(tmp_path / "policies"))
    run_study(path, tmp_path / "out", progress=False)
    manifest = json.loads((tmp_path / "policies" / "pre" / "manifest.json").read_text())
    record = manifest["trained_on"]["pretraining"]
    # a shared study whose controller settings name a policy continues it: its provenance is inherited (a shared
    # session used to start a fresh policy and ignore the setting)
    rldp = {**TINY_STUDY["strategy_settings"]["rldp"], "policy": "pre", "policy_dir": str(tmp_path / "policies")}
    more = write_study(tmp_path, name="more", strategies=["rldp"], seeds=[2], policy="shared",
                       wandb={"mode": "disabled"}, base=base, private_data=False, save_policy="pre2",
                       policy_dir=str(tmp_path / "policies"), strategy_settings={"rldp": rldp})
    run_study(more, tmp_path / "out", progress=False)
    continued = json.loads((tmp_path / "policies" / "pre2" / "manifest.json").read_text())
    assert len(continued["provenance"]) == 3 and continued["provenance"][:2] == manifest["provenance"]
    # its training record sums both studies (the continued policy's own counts are this study's only)
    later = continued["trained_on"]["pretraining"]
    assert later["continued_from"]["policy"] == "pre" and later["continued_from"]["episodes"] == 2
    assert later["continued_from"]["transitions"] == record["transitions"]
    assert later["totals"]["episodes"] == 3 and later["totals"]["transitions"] == record["transitions"] + \
        continued["transitions"] and later["totals"]["sac_updates"] == record["sac_updates"] + continued["sac_updates"]
    assert later["totals"]["cpu_seconds"] == pytest.approx(record["cpu_seconds"] + later["cpu_seconds"], abs=0.11)
    # the manifest's lifetime (every save writes it) agrees with the record's totals: nothing counted twice
    assert continued["lifetime"] == {k: later["totals"][k] for k in ("transitions", "sac_updates")} | {"runs": 3}


def _trial_footprint(study_dir: Path) -> tuple[dict, dict, list]:
    """What a trial that runs (again) changes: its outputs (a run replaces them whole), its pid file
    (written when the trainable starts), and its Tune result rows and checkpoints."""
    files = {str(p.relative_to(study_dir)): p.stat().st_mtime_ns
             for d in ("trials", "work") for p in (study_dir / d).rglob("*") if p.is_file()}
    tune_dir = study_dir / "tune" / study_dir.name
    rows = {p.parent.name: len(p.read_text().splitlines()) for p in tune_dir.glob("*/result.json")}
    checkpoints = sorted(str(p.relative_to(tune_dir)) for p in tune_dir.glob("*/checkpoint_*"))
    return files, rows, checkpoints


def test_every_field_of_the_studys_releasable_files_is_allowlisted(tiny_study):
    """Issue 26: results.parquet (but its private attack columns), study_summary.json and every DP trial's files
    hold only fields that are public, charged, the keyed dataset id, or labelled unprotected (tests/releasable.py);
    no plain digest of the records (the dataset manifest's content hashes) appears anywhere in them."""
    from releasable import unclassified_study

    assert unclassified_study(tiny_study) == []
    for f in (tiny_study / "trials").rglob("adapter/*"):  # PEFT writes the base model's path: not this machine's
        assert os.environ["RAYDP_CACHE"].encode() not in f.read_bytes() and b"/tmp/" not in f.read_bytes(), f
    manifest = json.loads((tiny_study / "dataset" / "manifest.json").read_text())
    digests = {manifest["content_sha256"], *manifest["split_sha256"].values()}
    released = [tiny_study / "results.parquet", tiny_study / "study_summary.json",
                *(f for f in (tiny_study / "trials").rglob("*") if f.is_file() and "private" not in f.parts)]
    for f in released:
        blob = f.read_bytes()
        assert not any(d.encode() in blob or d[:12].encode() in blob for d in digests), f


def test_resume_restores_a_finished_study_without_rerunning(tiny_study):
    from raydp.study.runner import run_study

    before = pd.read_parquet(tiny_study / "results.parquet")
    footprint = _trial_footprint(tiny_study)
    assert len(footprint[1]) == 2 and footprint[2] and any(k.endswith("/pid") for k in footprint[0])
    run_study(tiny_study / ".." / ".." / "tiny.yaml", tiny_study.parent, progress=False, resume=True)
    after = pd.read_parquet(tiny_study / "results.parquet")
    assert list(after["final_eval_perplexity"]) == list(before["final_eval_perplexity"])
    assert _trial_footprint(tiny_study) == footprint  # Tuner.restore found both trials finished: none re-ran


def test_a_changed_study_file_is_not_resumed(tiny_study, tmp_path):
    """Issue 32 review: the trials were charged and are restored under their names; a plan changed under the same
    names would run trials no charge covers. Only fields that change nothing a trial runs or spends may differ."""
    import yaml

    from raydp.study.runner import run_study

    original = yaml.safe_load((tiny_study / ".." / ".." / "tiny.yaml").read_text())
    changed = tmp_path / "changed" / "tiny.yaml"
    changed.parent.mkdir()
    changed.write_text(yaml.safe_dump({**original, "epsilons": [4.0]}))
    before = {p: p.stat().st_mtime_ns for p in tiny_study.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="study file changed since .* \\(epsilons\\)"):
        run_study(changed, tiny_study.parent, progress=False, resume=True)
    assert {p: p.stat().st_mtime_ns for p in tiny_study.rglob("*") if p.is_file()} == before


def test_a_stopped_tuner_counts_its_unfinished_and_unsampled_trials():
    """Found running trials/schedule-search.yaml: a Ctrl-C stopped one search cell's Tuner, and the study went on to
    the next cell (and wrote a tuning record from the partial search). The runner stops at the first Tuner with
    unfinished trials; a search cell's samples never drawn count as unfinished."""
    from types import SimpleNamespace

    from raydp.study.searches import unfinished_in

    done = SimpleNamespace(error=None, metrics={"done": True, "step": 9})
    failed = SimpleNamespace(error=RuntimeError("x"), metrics={"step": 3})
    cut = SimpleNamespace(error=None, metrics={"step": 3})  # reported, then stopped
    never = SimpleNamespace(error=None, metrics={})  # created, never started
    assert unfinished_in([done, failed]) == 0
    assert unfinished_in([done, cut, never]) == 2
    assert unfinished_in([done, done], planned=10) == 8  # the searcher was stopped after two samples
    assert unfinished_in([done] * 10, planned=10) == 0


def test_a_second_driver_in_the_same_study_directory_is_refused(tmp_path):
    """Issue 32 review: two drivers in one directory would both run its unfinished trials under one lifetime charge."""
    from raydp.study.prepare import lock_study_dir
    from raydp.study.runner import run_study

    path = write_study(tmp_path)
    held = lock_study_dir(tmp_path / "out" / "tiny")  # the first driver
    try:
        with pytest.raises(ConfigError, match="another raydp study is running"):
            run_study(path, tmp_path / "out", progress=False)
    finally:
        held.close()
    assert not (tmp_path / "out" / "tiny" / "trials").exists()


def test_resume_without_tune_state_is_refused_and_writes_nothing(tmp_path):
    """--resume on a directory whose Tune state is gone must not build a fresh Tuner over its trials: their spend
    would drop out of the tuning-aware epsilon (E7/E14)."""
    from raydp.study.runner import run_study

    path = write_study(tmp_path)
    trial = tmp_path / "out" / "tiny" / "trials" / "static_embedded-tiny_eps2_seed0"
    trial.mkdir(parents=True)
    (trial / "summary.json").write_text("{}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="nothing to resume.*no Tune state"):
        run_study(path, tmp_path / "out", progress=False, resume=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    with pytest.raises(ConfigError, match="nothing to resume"):  # nor a directory that never ran
        run_study(path, tmp_path / "elsewhere", progress=False, resume=True)
    assert not (tmp_path / "elsewhere").exists()


def test_steps_to_target_measures_against_the_best_baseline(tmp_path):
    """Sec. 4.2 on hand-made runs: the target is the best final perplexity among the baselines of the
    same (model, epsilon, seed), RLDP and non-private runs excluded; step 0 never counts; the step is
    divided by the planned steps."""
    from raydp.study.results import steps_to_target

    def run(name, strategy, evals, final, planned, seed=0):
        run_dir = tmp_path / name
        run_dir.mkdir()
        pd.DataFrame({"step": [0, 8, 16, 24][:len(evals)], "public_perplexity": evals}).to_parquet(
            run_dir / "eval_metrics.parquet")
        return {"model": "m", "epsilon_target": 2.0, "seed": seed, "strategy": strategy, "run_dir": str(run_dir),
                "final_public_perplexity": final, "steps": 8 * (len(evals) - 1), "planned_steps": planned}

    table = pd.DataFrame([
        run("static", "static", [30.0, 12.0, 10.5, 10.0], 10.0, 24),  # the best baseline: target 10.0
        run("dplora", "dp-lora", [30.0, 11.5, 11.2, 11.0], 11.0, 24),  # never reaches 10.0
        run("rldp", "rldp", [9.0, 10.5, 9.9, 9.5], 9.5, 32),  # step 0 below target does not count
        run("nonprivate", "nonprivate", [30.0, 5.0], 5.0, 8),  # not a baseline: its 5.0 is no target
        run("rldp_other_seed", "rldp", [9.0, 1.0], 1.0, 8, seed=1),  # no baseline of its own
    ])
    got = steps_to_target(table, "public")
    assert list(got[[0, 2, 3]]) == [24 / 24, 16 / 32, 8 / 8]
    assert got[[1, 4]].isna().all()


# slow (~2 min): a finished study restored by Tuner.restore is test_resume_restores_a_finished_study_without_rerunning
# (fast); a trial resuming from its latest checkpoint with exactly its planned ledger is
# test_a_killed_trial_resumes_with_exactly_the_planned_ledger (slow too); this one adds Ctrl-C and
# `raydp study --resume`
@pytest.mark.slow
def test_a_stopped_study_resumes_with_tuner_restore(tmp_path, raydp_cache):
    """Stop the study's driver (Ctrl-C) after a checkpoint, then `raydp study --resume` finishes it."""
    import signal

    from raydp.privacy.ledger import PrivacyLedger

    path = write_study(tmp_path, name="stopped", strategies=["static"], wandb={"mode": "disabled"},
                       base={**TINY_STUDY["base"], "max_steps": 48, "epochs": 6})  # ~150 patients: 6 epochs > 48 steps
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "raydp", "study", str(path), "--results-dir", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not list((out / "stopped" / "tune" / "stopped").glob("*/checkpoint_000001")):
        assert proc.poll() is None and time.time() < deadline, "the study ended before it could be stopped"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    run_dir = out / "stopped" / "trials" / "static_embedded-tiny_eps2_seed0"
    assert not (run_dir / "summary.json").exists()  # the trial did not finish
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["steps"] == 48
    assert list(PrivacyLedger.load(run_dir / "privacy_ledger.parquet").steps) == list(range(48))
    table = pd.read_parquet(out / "stopped" / "results.parquet")
    assert list(table["status"]) == ["TERMINATED"] and table["within_budget"].all()


# ~85 s on CI's 2 cores (two trial starts, each with its policy): the slow tier. The fast tier has parts of it only:
# a run resumed from a checkpoint's state continues its ledger and settings exactly (test_pbt.py's
# test_an_exploit_resumes_the_donors_state_with_the_new_settings, the strategies' resume tests), checkpoints come
# before the evaluations and decisions they cover (test_privacy_guarantee.py), and they reach Tune
# (test_evaluations_reach_tune_only_with_their_checkpoint). No fast test resumes a trial from Tune's checkpoint
# (the trial's _restore_point, its policy snapshot): this one and the stopped-study test below, both slow.
@pytest.mark.slow
def test_a_killed_trial_resumes_with_exactly_the_planned_ledger(tiny_study, tmp_path):
    """Kill a trial's run (its actor process) mid-training: Tune retries it from its checkpoint, the
    study finishes, and the trial's ledger has every planned step exactly once."""
    import signal
    import threading

    from raydp.privacy.ledger import PrivacyLedger
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="killed", strategies=["rldp"], max_failures=2,
                       base={**TINY_STUDY["base"], "max_steps": 48, "epochs": 6})  # ~150 patients: 6 epochs > 48 steps
    study_dir = tmp_path / "out" / "killed"
    killed = {}

    def killer():
        deadline, seen = time.time() + 600, set()
        while time.time() < deadline:
            # Tune keeps two checkpoints (CHECKPOINTS_KEPT) and deletes older ones as it goes: count every one
            # seen, so the kill lands after the third checkpoint however fast the older ones disappear
            seen |= {p.name for p in (study_dir / "tune" / "killed").glob("*/checkpoint_*")}
            pids = list((study_dir / "work").glob("*/pid"))
            if len(seen) >= 3 and pids:
                killed["pid"] = int(pids[0].read_text())
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    run_study(path, tmp_path / "out", progress=False)
    thread.join(timeout=5)
    assert "pid" in killed, "the trial finished before it could be killed"
    table = pd.read_parquet(study_dir / "results.parquet")
    assert list(table["status"]) == ["TERMINATED"]
    run_dir = Path(table["run_dir"].iloc[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and 0 < summary["resumed_from_step"] < 48
    ledger = PrivacyLedger.load(run_dir / "privacy_ledger.parquet")
    assert list(ledger.steps) == list(range(48))  # every planned step, none lost, none repeated
    # every decision of Alg. 1 happened once, including the one the checkpoint was taken before
    decisions = pd.read_parquet(run_dir / "controller_decisions.parquet")
    assert list(decisions["step"]) == list(range(8, 49, 4))
    assert summary["privacy"]["within_budget"] and summary["steps"] == 48
    assert int((study_dir / "work" / table["trial"].iloc[0] / "pid").read_text()) != killed["pid"]


def test_a_failed_evaluation_is_a_column_not_a_failed_trial(tmp_path):
    from raydp.study.trial_rows import _trial_row
    from raydp.study.trial import Trial

    trial = Trial(model="embedded", strategy="static", epsilon=2.0, seed=0)
    row = _trial_row(trial, tmp_path, "TERMINATED", {"evaluation_error": "ConfigError: no adapter"})
    assert row["status"] == "TERMINATED" and row["evaluation_error"] == "ConfigError: no adapter"
    assert "evaluation_error" not in _trial_row(trial, tmp_path, "TERMINATED", {})


def test_verdicts_compare_rldp_with_the_best_baseline_by_welch_t_test():
    from scipy import stats

    from raydp.study.statistics import verdicts

    rows = []
    cells = {  # epsilon: (rldp, static, static-pairwise [clip=0.01], quantile)
        0.5: ([1.30, 1.31, 1.32], [1.40, 1.41, 1.42], [1.35, 1.36, 1.37], [1.50, 1.50, 1.51]),  # wins
        2.0: ([1.30, 1.32, 1.34], [1.31, 1.33, 1.35], [1.40, 1.40, 1.41], [1.45, 1.46, 1.47]),  # ties
        8.0: ([1.40, 1.41, 1.42], [1.30, 1.31, 1.32], [1.33, 1.33, 1.34], [1.31, 1.30, 1.31]),  # loses
    }
    for eps, arms in cells.items():
        for (strategy, variant), values in zip((("rldp", None), ("static", None), ("static-pairwise", "clip=0.01"),
                                                ("quantile", None)), arms):
            rows += [{"model": "m", "epsilon_target": eps, "seed": i, "strategy": strategy, "variant": variant,
                      "t_rl": 16.0 if strategy == "rldp" else None, "b_sac": 4.0 if strategy == "rldp" else None,
                      "k": 2.0 if strategy == "rldp" else None, "frozen_policy": False, "final_ppl": v}
                     for i, v in enumerate(values)]
    v = verdicts(pd.DataFrame(rows), "final_ppl").set_index("epsilon")
    assert list(v["verdict"]) == ["wins", "ties", "loses"]
    assert v.loc[0.5, "best_baseline"] == "static-pairwise [clip=0.01]" and v.loc[8.0, "best_baseline"] == "quantile"
    # Welch's t by hand (t statistic, Welch-Satterthwaite degrees of freedom)
    r, b = np.array(cells[2.0][0]), np.array(cells[2.0][1])
    se2 = r.var(ddof=1) / 3 + b.var(ddof=1) / 3
    t = (r.mean() - b.mean()) / np.sqrt(se2)
    df = se2**2 / ((r.var(ddof=1) / 3) ** 2 / 2 + (b.var(ddof=1) / 3) ** 2 / 2)
    assert v.loc[2.0, "p_value"] == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert v.loc[2.0, "change_pct"] == pytest.approx(100 * (r.mean() - b.mean()) / b.mean())
    assert v.loc[0.5, "rldp_sd"] == pytest.approx(0.01)


def _fake_study(root, name, arms, sha="rdi1:" + "a" * 32, selection="public", epsilon=1.0, figure_extra=None,
                summary=True):
    """A finished study's directory as the study runner leaves it (results table and summary), for the
    report alone: ``arms`` maps (strategy, epsilon) to the final public perplexities of seeds 0..n-1."""
    d = root / name
    (d / "trials").mkdir(parents=True)
    rows = []
    for (strategy, eps), values in arms.items():
        for seed, v in enumerate(values):
            rl = strategy == "rldp"
            rows.append({"trial": f"{strategy}_m_eps{eps:g}_seed{seed}", "status": "TERMINATED", "model": "m",
                         "strategy": strategy, "epsilon_target": eps, "seed": seed, "variant": None,
                         "t_rl": 16.0 if rl else None, "b_sac": 4.0 if rl else None, "k": 2.0 if rl else None,
                         "frozen_policy": False, "run_dir": str(d / "trials" / f"{strategy}{seed}"),
                         "final_public_perplexity": v, "final_eval_perplexity": v - 0.1, "steps": 10,
                         "planned_steps": 10, "dataset_id": sha, "within_budget": True, "steps_to_target": None,
                         "selection_split": selection})
    pd.DataFrame(rows).to_parquet(d / "results.parquet")
    figure = {"runs": len(rows), "trials": len(rows), "target_epsilons": sorted({e for _, e in arms}),
              "tuning_aware_epsilon": epsilon, "delta": 1e-5, "max_single_trial_epsilon_rdp": 0.5,
              "repeat_and_select_epsilon_rdp": 0.9, "privacy_units": ["patient"], **(figure_extra or {})}
    if summary:
        (d / "study_summary.json").write_text(json.dumps({"study": name, "selection": {"split": selection},
                                                          "tuning_aware_epsilon": {sha or "rdi1:" + "b" * 32: figure}}))
    return d


def test_report_over_two_studies_replaces_a_rerun_arm_and_composes_their_spend(tmp_path, capsys):
    """An arm rerun in a later study (after a fix) replaces the same arm of the earlier study in the tables
    and verdicts; both studies' spend on the dataset adds up (basic composition)."""
    from raydp.cli import main
    from raydp.study.statistics import combine_studies
    from raydp.study.tables import format_report

    first = _fake_study(tmp_path, "frontier", {("static", 2.0): [1.40, 1.41, 1.42],
                                               ("static-pairwise", 2.0): [1.35, 1.36, 1.37],
                                               ("rldp", 2.0): [1.45, 1.46, 1.47]}, epsilon=1.5)
    rerun = _fake_study(tmp_path, "frontier-rldp", {("rldp", 2.0): [1.30, 1.31, 1.32]}, epsilon=0.75)
    assert "m eps 2: RLDP LOSES" in format_report(first)
    results, _, notes = combine_studies([first, rerun])
    assert len(results) == 9 and set(results[results["strategy"] == "rldp"]["study"]) == {"frontier-rldp"}
    assert notes == ["1 arm(s) of the earlier study replaced by frontier-rldp's: m | eps 2 | rldp T_RL=16 B_SAC=4 K=2"]
    assert main(["report", str(first), str(rerun)]) == 0
    out = capsys.readouterr().out
    assert "studies frontier, frontier-rldp combined: 9 trials (9 finished)" in out
    assert "m eps 2: RLDP WINS (rldp T_RL=16 B_SAC=4 K=2 1.3100 ± 0.0100 vs static-pairwise 1.3600 ± 0.0100" in out
    assert f"dataset {('rdi1:' + 'a' * 32)[:16]} over 2 of 2 studies (every run, replaced arms included): <= 2.250 at delta 2e-05" in out
    assert "study frontier:" in out and "per-trial budgets: 9/9 within" in out  # each study's own, replaced arm too
    assert main(["report", str(first), str(rerun), "--html", str(tmp_path / "x.html")]) == 2
    assert not (tmp_path / "x.html").exists()


def test_report_over_studies_never_hides_spend_or_its_caveats(tmp_path):
    """A study's unknown spend, warnings and other privacy units stay visible, and a study without a figure
    makes the total unknown rather than smaller."""
    from raydp.study.tables import format_report

    arms = {("static", 2.0): [1.4, 1.5], ("rldp", 2.0): [1.3, 1.4]}
    first = _fake_study(tmp_path, "a", arms, epsilon=1.5, figure_extra={
        "unknown_spend": [{"trial": "static_lost"}], "warnings": ["unknown spend: 1 trial(s) ... static_lost"]})
    record_level = _fake_study(tmp_path, "b", {("rldp", 2.0): [1.3, 1.4]}, figure_extra={"privacy_units": ["record"]})
    out = format_report(first, record_level)
    assert "WARNING: unknown spend: 1 trial(s) ... static_lost" in out
    assert "over 2 of 2 studies (every run, replaced arms included): unknown: a has unknown spend" in out
    assert "studies of different privacy units (patient, record)" in out
    no_figure = _fake_study(tmp_path, "c", {("rldp", 2.0): [1.3, 1.4]}, summary=False)
    plain = _fake_study(tmp_path, "d", arms)
    out = format_report(plain, no_figure)
    assert "c: no tuning-aware figure recorded" in out and "unknown: c has no figure" in out


def test_report_over_studies_refuses_other_datasets_or_splits(tmp_path):
    from raydp.study.tables import format_report

    first = _fake_study(tmp_path, "a", {("static", 2.0): [1.4, 1.5], ("rldp", 2.0): [1.3, 1.4]})
    other_data = _fake_study(tmp_path, "b", {("rldp", 2.0): [1.3, 1.4]}, sha="rdi1:" + "b" * 32)
    other_split = _fake_study(tmp_path, "c", {("rldp", 2.0): [1.3, 1.4]}, selection="private")
    with pytest.raises(ConfigError, match="ran on different datasets"):
        format_report(first, other_data)
    with pytest.raises(ConfigError, match="select on different splits"):
        format_report(first, other_split)
    # trials without a dataset hash: the studies' own figures still name their datasets
    unhashed = _fake_study(tmp_path, "e", {("rldp", 2.0): [1.3, 1.4]}, sha=None)
    with pytest.raises(ConfigError, match="ran on different datasets"):
        format_report(first, unhashed)


def test_a_trial_config_holds_its_own_spec_whatever_the_study_size():
    from ray.tune.search.variant_generator import generate_variants

    from raydp.study.searches import _param_space
    from raydp.study.trial import Trial

    def first_config_size(n_trials):
        trials = [Trial(model="m", epsilon=2.0, seed=i, strategy="static") for i in range(n_trials)]
        _, config = next(generate_variants(_param_space(None, trials, {"study": {"name": "x"}})))
        return len(json.dumps(config))

    assert first_config_size(10) == first_config_size(5000)


def test_tunes_best_result_ranks_dp_runs_only():
    """What ResultGrid.get_best_result() ranks (the study's Tune metric): a DP run's selection score, NaN (which
    Tune skips) for a non-private run. The whole study is test_tune_keeps_two_checkpoints_and_ranks_dp_trials_only
    (slow)."""
    from raydp.study.trainable import evaluation_metrics

    row = {"value_nll": 66.0, "public_value_nll": 67.0, "perplexity": 9.0, "public_perplexity": 9.5}
    dp, plain = evaluation_metrics(row, "public"), evaluation_metrics(row, "public", private_run=False)
    assert dp["dp_selection_score"] == dp["selection_score"] == 67.0
    assert math.isnan(plain["dp_selection_score"]) and plain["selection_score"] == 67.0


# slow (~30 s on CI): a study of its own; the fast tier checks a study's checkpoints with its evaluations
# (test_evaluations_reach_tune_only_with_their_checkpoint) and what Tune ranks (test_tunes_best_result_ranks_dp_runs_only)
@pytest.mark.slow
def test_tune_keeps_two_checkpoints_and_ranks_dp_trials_only(local_ray, tmp_path):
    from ray import tune

    from raydp.study.runner import run_study
    from raydp.study.searches import CHECKPOINTS_KEPT
    from raydp.study.trainable import run_trial

    path = write_study(tmp_path, name="ranked", strategies=["nonprivate", "static"], wandb={"mode": "disabled"})
    study_dir = run_study(path, tmp_path / "out", progress=False)
    experiment = study_dir / "tune" / "ranked"
    for trial_dir in (d for d in experiment.iterdir() if d.is_dir()):
        kept = list(trial_dir.glob("checkpoint_*"))
        assert 1 <= len(kept) <= CHECKPOINTS_KEPT  # 4 evaluations each made one
    grid = tune.Tuner.restore(str(experiment), trainable=run_trial).get_results()
    best = grid.get_best_result()  # the study's metric and mode: the best DP trial
    assert best.config["trial"]["strategy"] == "static"
    static = pd.read_parquet(study_dir / "results.parquet").set_index("strategy").loc["static"]
    assert best.metrics["dp_selection_score"] == pytest.approx(static["final_public_value_nll"])
    nonprivate = next(r for r in grid if r.config["trial"]["strategy"] == "nonprivate")
    assert math.isnan(nonprivate.metrics["dp_selection_score"]) and nonprivate.metrics["selection_score"] > 0


def test_wandb_settings_honour_wandb_environment_variables(monkeypatch):
    from raydp.study.config import WandbSettings

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    assert WandbSettings().resolved() == ("offline", "raydp", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_PROJECT", "clinic")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    assert WandbSettings().resolved() == ("disabled", "clinic", "team")
    assert WandbSettings(mode="offline", project="mine").resolved() == ("offline", "mine", "team")  # the file wins
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="WANDB_MODE='sometimes'"):
        WandbSettings().resolved()


@pytest.mark.parametrize("opt_in", [False, True])
def test_wandb_sends_attack_results_only_on_opt_in_labelled_unprotected(tmp_path, opt_in, monkeypatch, capfd):
    """Attack and audit results are measured on the private records: wandb (a third party) gets them only when the
    study says ``wandb: {attacks: true}``, under ``unprotected/``. The same trial run again resumes its wandb run."""
    from wandb_records import records

    from raydp.config import TrainConfig
    from raydp.study.config import load_study
    from raydp.study.trainable import _Reporter
    from raydp.study.trial import Trial

    monkeypatch.delenv("WANDB_SILENT", raising=False)  # raydp silences wandb itself (a study's log stays clean)
    study = load_study(write_study(tmp_path, wandb={"mode": "offline", "attacks": opt_in}))
    for _ in range(2):  # a retried trial: the same wandb run, resumed
        reporter = _Reporter(study, Trial(model="x", epsilon=2.0, seed=0, strategy="static"),
                             TrainConfig(strategy="static", epsilon=2.0), tmp_path)
        reporter.evaluation(8, {"perplexity": 3.5, "value_nll": 40.0})
        reporter.close({"mia_auc": 0.52, "evaluation_error": "text is never sent"})
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len({f.name for f in files}) == 1  # one run id for both attempts
    assert "wandb:" not in "".join(capfd.readouterr())
    summary = {item.key: json.loads(item.value_json) for f in files for r in records(f)
               if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert ("unprotected/mia_auc" in summary) is opt_in and "mia_auc" not in summary
    assert not any("evaluation_error" in key for key in summary)
    if opt_in:
        assert summary["unprotected/mia_auc"] == pytest.approx(0.52)
    from releasable import unclassified_wandb

    assert [unclassified_wandb(f) for f in files] == [[] for _ in files]


def test_wandb_gets_nothing_from_a_nonprivate_trial_and_a_wandb_failure_fails_no_trial(tmp_path, monkeypatch):
    """Nothing of a non-private trial is releasable (its step count alone gives the record count): no wandb run.
    A wandb error while logging turns the reporter off with a warning; the trial goes on."""
    import wandb

    from raydp.config import TrainConfig
    from raydp.study.config import load_study
    from raydp.study.trainable import _Reporter
    from raydp.study.trial import Trial

    study = load_study(write_study(tmp_path, wandb={"mode": "offline"}))
    reporter = _Reporter(study, Trial(model="x", seed=0, strategy="nonprivate"), TrainConfig(strategy="nonprivate"),
                         tmp_path)
    reporter.evaluation(8, {"perplexity": 3.5})
    reporter.finish({"privacy": None, "steps": 993}, tmp_path)
    reporter.close({"mia_auc": 0.5})
    assert reporter.run is None and not (tmp_path / "wandb").exists()

    def broken(*args, **kwargs):
        raise ConnectionError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken)  # wandb itself failing, as a network error would
    reporter = _Reporter(study, Trial(model="x", epsilon=2.0, seed=0, strategy="static"),
                         TrainConfig(strategy="static", epsilon=2.0), tmp_path)
    reporter.evaluation(8, {"perplexity": 3.5})
    reporter.finish({"privacy": {}}, tmp_path)
    reporter.close({})
    assert reporter.run is None


@pytest.mark.slow
def test_ctrl_c_during_a_study_leaves_a_reportable_directory_and_a_resume_hint(tmp_path):
    import signal

    path = write_study(tmp_path, name="stopped-by-user", strategies=["static"], seeds=[0, 1, 2, 3],
                       wandb={"mode": "disabled"}, base={**TINY_STUDY["base"], "max_steps": 400, "eval_every": 8})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "raydp", "study", str(path), "--results-dir", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and not list((out / "stopped-by-user" / "tune").rglob("checkpoint_*")):
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("raydp: study stopped with") and "--resume" in last and "Traceback" not in stderr
    table = pd.read_parquet(out / "stopped-by-user" / "results.parquet")
    assert (table["status"] != "TERMINATED").any()
    report = subprocess.run([sys.executable, "-m", "raydp", "report", str(out / "stopped-by-user")],
                            capture_output=True, text=True, cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]


def test_a_study_started_before_attack_resumes_attacking_every_trial(tmp_path):
    """A study.json from before `attack` (its trials attacked as they finished) resumes under attack: all when its
    file names no attack, so its finished and remaining trials are attacked alike; the resume check accepts it."""
    from raydp.study.prepare import check_resumed_study, resumed_attack_rule, study_record

    study = load_study(write_study(tmp_path, base={**TINY_STUDY["base"], "data": {"n_records": 400, "n_audit": 20}},
                                   evaluate={"generations": 4}))
    assert study.attack == "released"
    saved = json.loads(study_record(study))
    del saved["attack"], saved["attack_strategies"]
    (tmp_path / "study.json").write_text(json.dumps(saved))
    resumed = resumed_attack_rule(study, tmp_path, resume=True)
    assert resumed.attack == "all" and resumed_attack_rule(study, tmp_path, resume=False).attack == "released"
    check_resumed_study(resumed, tmp_path)
    with pytest.raises(ConfigError, match="the study file changed .*attack"):
        check_resumed_study(study, tmp_path)
