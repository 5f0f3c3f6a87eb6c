"""The allowlist of every field of every releasable file, each with why it may be released (issue 26).

A field is releasable only if it is one of:

* PUBLIC: configuration, code and model descriptions, public data, or the run's plan (public inputs);
* DP: a DP release charged in the ledger, or post-processing of charged releases (the adapters, the ledger, the
  noisy statistics, the epsilon the ledger gives, the controller's decisions from them);
* COUNT: the number of units and records in train and what follows from it (q = B/N, steps per epoch), which
  the summary says are released and treated as public, with the replace-one guarantee that covers them;
* ID: the dataset's owner-keyed id (raydp.data.identity), which nobody without the key can compute;
* UNPROTECTED: computed from private records without a DP release, and labelled so in the file or in the
  directory's PRIVACY.txt (perplexities on the private eval split, E15; timings, which depend on private batch
  sizes).

:func:`unclassified` walks a run or study directory's releasable files and returns every field path that is not
in the allowlist: a new field must be classified here before it can be written, or the test fails. Paths are
dotted JSON paths with ``[]`` for list items and ``<id>`` for a dataset-id key; Parquet files contribute their
columns and the keys of their schema metadata (the ledger's metadata JSON is walked like a JSON file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq

PUBLIC, DP, COUNT, ID, UNPROTECTED = "public", "dp", "count", "id", "unprotected"

_PRIVACY_BLOCK = {
    **{f"privacy.{k}": PUBLIC for k in (
        "mechanism", "neighbouring_relation", "privacy_unit", "unit_note", "epsilon_target", "delta", "sigma_0",
        "releases_per_step[]", "schedule.kind", "schedule.per_epoch[]", "guarantee", "guarantee_note",
        "calibration_accountant", "enforcing_accountant", "gdp_note", "edgeworth_note", "privacy_mode", "randomness",
        "epsilon_void", "labels[]", "privacy_label", "public_counts", "replace_one_note", "epsilon_by_accountant_note",
        "planned_steps", "sigma_eff_0", "batch_width", "records_alone", "record_slots[]", "filter", "filter.name", "filter.theorem", "filter.orders[]",
        "filter.budget_rdp[]", "filter.delta", "filter.epsilon")},
    # the strategy's description: its settings (public configuration) and declared releases
    **{f"privacy.strategy.{k}": PUBLIC for k in (
        "name", "clip_mode", "allocation", "gradient_source", "privacy_mode", "releases[]", "releases[].name",
        "releases[].noise.relative", "schedule.kind", "schedule.per_epoch[]", "settings.clip", "action_decoding",
        "architecture", "b_sac", "frozen", "k", "noise_control", "policy", "r_max", "reward", "t_rl", "t_warm",
        "strict_releases[].name", "strict_releases[].noise_multiplier", "settings.*", "privacy_label",
        # clip-schedule's r_i: median per-sample norms on the PUBLIC probe under the initial model
        "public_reference_norms[]",
        # dualtune: the sigma the paper's Edgeworth calibration would give the plan and what it would spend by
        # PLD, from the plan's epsilon, delta, q and planned steps, like sigma_0
        "paper_calibration.accountant", "paper_calibration.sigma", "paper_calibration.epsilon_pld_at_that_sigma",
        "paper_calibration.note")},
    # from the ledger: charged releases and their accounting
    **{f"privacy.{k}": DP for k in (
        "epsilon", "epsilon_by_accountant.pld", "epsilon_by_accountant.prv", "epsilon_by_accountant.rdp",
        "epsilon_by_accountant.gdp", "epsilon_by_accountant.edgeworth", "epsilon_member_filter", "within_budget",
        "verdict", "steps_charged", "guard_clamps", "epsilon_replace_one", "delta_replace_one")},
    **{f"privacy.{k}": COUNT for k in ("n_units", "q")},
}

SUMMARY = {
    **_PRIVACY_BLOCK,
    **{k: PUBLIC for k in (
        "model", "model_source", "model_type", "device", "n_adapter_pairs", "adapter_pairs[].index",
        "adapter_pairs[].layer", "adapter_pairs[].module_name", "adapter_pairs[].relative_depth",
        "adapter_pairs[].shape_a[]", "adapter_pairs[].shape_b[]", "strategy", "dropout", "data_source", "data_note",
        "eval_note", "public_eval_records", "max_length", "task.kind", "task.metric", "raydp_version", "saved_policy",
        "public_validation", "public_validation_note", "initial_public_value_nll", "final_public_value_nll",
        "best_public_value_nll", "final_public_nll_per_record",
        "phase_one",  # null: no phase 1 (its fields: PHASE_ONE below)
        "recipe", "recipe.*",  # the recipe entry the run took (raydp.recipe): from public config values and the table
        "controller",
        # public validation split: public records
        "initial_public_perplexity", "final_public_perplexity", "best_public_perplexity")},
    "dataset_id": ID,
    "steps_per_epoch": COUNT,  # (a DP run's record count is not released: issue 26)
    **{k: DP for k in ("steps", "stopped_early")},  # the guard stops on the ledger
    # the private eval split (E15: labelled by eval_note) and timings (labelled in PRIVACY.txt)
    **{k: UNPROTECTED for k in ("initial_eval_perplexity", "final_eval_perplexity", "best_eval_perplexity",
                                "eval_records", "wall_seconds", "train_loop_seconds", "initial_eval_value_nll",
                                "resumed_from_step",  # when a failure happened: timing (issue 26 review)
                                "final_eval_value_nll", "best_eval_value_nll", "final_eval_nll_per_record")},
    # RLDP's controller: post-processing of charged releases and public randomness (strict mode)
    **{f"controller.{k}": DP for k in (
        "decisions", "transitions", "mean_reward", "final_sigma", "final_clip[]")},
    **{f"controller.{k}": PUBLIC for k in (
        "histogram_log10_range[]", "loss_clip", "action_decoding", "pair_reference[]")},  # placed on public records
    # an RLDP `raydp train`: the policy service's counters (post-processing of the transitions, which are
    # post-processing of charged releases in strict mode), where the policy went, the transport
    **{f"policy_service.{k}": DP for k in ("train_calls", "transitions_trained", "module_steps_trained",
                                           "env_steps_sampled", "replay_size", "alpha", "errors[]")},
    **{f"controller_transport.{k}": PUBLIC for k in ("kind", "address", "note")},
}

#: DualTune's non-private phase 1 (raydp.runner.phases), by its data. A public phase touches nothing private, not even
#: the private record count (its size is a public constant or setting), so all it reports is public. A redacted phase
#: trained a model non-privately on the private records: what it reports of that model or of its work is unprotected,
#: labelled by phase_one.note and the run's privacy label (ERRATA E16); its record and step counts are not reported.
_PHASE_ONE_SHARED = {f"phase_one.{k}": PUBLIC for k in (
    "data", "note", "epochs", "lr", "batch_size",
    "public_perplexity_before", "public_accuracy_before")}  # the initial model on public validation
PHASE_ONE = {
    "public": {**_PHASE_ONE_SHARED, **{f"phase_one.{k}": PUBLIC for k in (
        "records", "public_seed", "steps", "trained_records", "public_perplexity_after", "public_accuracy_after",
        "seconds")}},  # public records trained on public work: nothing here depends on a private record
    "redacted": {
        **_PHASE_ONE_SHARED,
        # the detector: its configuration, and its recall on PUBLIC records of the schema
        **{f"phase_one.{k}": PUBLIC for k in ("detector.*", "field_recall_public.*")},
        **{f"phase_one.{k}": UNPROTECTED for k in (
            "public_perplexity_after", "public_accuracy_after",  # a model trained non-privately on private records
            "seconds",  # its time grows with the private record count (timing, PRIVACY.txt)
            "canary_recall_private",  # null: the dataset has no canaries
            # counts of the run's canaries the detector found among the private records, labelled in its note
            "canary_recall_private.found", "canary_recall_private.total", "canary_recall_private.recall")},
        "phase_one.canary_recall_private.note": PUBLIC},
}
#: a checkpoint from before phase 1's report was kept: the run resumed after phase 1 (when: timing, as
#: resumed_from_step)
PHASE_ONE_RESUMED = {"phase_one.resumed": UNPROTECTED}

LEDGER_METADATA = {
    **{k: PUBLIC for k in ("accountant", "delta", "epsilon_target", "format_version", "guarantee", "guarantee_note",
                           "labels[]", "neighbouring_relation", "privacy_unit", "randomness", "unit_note",
                           "filter", "filter.name", "filter.theorem", "filter.orders[]", "filter.budget_rdp[]",
                           "filter.delta", "filter.epsilon", "sigma_eff")},
    "n_units": COUNT,
    "num_steps": DP,
}

POLICY_MANIFEST = {
    **{k: PUBLIC for k in (
        "architecture", "format", "name", "raydp_version", "layout.architecture", "layout.f_adapter",
        "layout.g_global", "layout.n_slots", "layout.version", "sac.actor_lr", "sac.alpha", "sac.b_sac",
        "sac.critic_lr", "sac.gamma", "sac.hidden", "sac.k", "sac.replay_capacity", "sac.seed", "sac.tau",
        "sac.squashed", "sac.initial_log_std",
        "trained_on.action_decoding", "trained_on.epsilon", "trained_on.model", "trained_on.n_adapter_pairs",
        "trained_on.privacy_mode", "provenance[].privacy_mode", "provenance[].privacy_unit", "provenance[].delta",
        "provenance[].guarantee", "provenance[].labels[]", "provenance[].public_data", "provenance[].rdp_orders[]",
        "provenance[].entry_id", "results.best_public_perplexity", "results.final_public_perplexity",
        "results.labels[]")},
    **{k: DP for k in ("transitions", "sac_updates", "trained_on.decisions", "trained_on.steps", "results.epsilon",
                       "provenance[].epsilon", "provenance[].rdp_curve[]",
                       # the policy's lifetime counts: its transitions and updates as above, summed with the restored
                       # policy's
                       "lifetime.transitions", "lifetime.sac_updates")},
    "lifetime.runs": PUBLIC,  # the provenance entries' count
    "provenance[].dataset_id": ID,
    "created": UNPROTECTED,  # a wall-clock time: when the run that saved it ended (timing, labelled in PRIVACY.txt)
}

RESULTS = {
    **{k: PUBLIC for k in (
        "trial", "status", "model", "strategy", "epsilon_target", "seed", "t_rl", "b_sac", "k", "frozen_policy",
        "variant", "grid", "run_dir", "config", "initial_public_perplexity", "final_public_perplexity",
        "best_public_perplexity", "planned_steps", "enforcing_accountant", "privacy_mode", "privacy_label",
        "privacy_labels", "guarantee", "privacy_unit", "rdp_curve_source", "selection_split", "steps_to_target",
        "selection_metric", "initial_public_value_nll", "final_public_value_nll", "best_public_value_nll",
        "tuned", "public_validation")},  # tuned: a PUBLIC search's chosen values (tuned_from refuses a search on private data)
    # search: Optuna's sampled values, chosen from earlier trials' public-validation scores of DP-trained models
    # (post-processing; a search on private data runs one trial at a time, so no timing decides them)
    "search": DP,
    **{k: DP for k in ("steps", "epsilon_pld", "epsilon_prv", "epsilon_rdp", "epsilon_gdp", "epsilon_edgeworth",
                       "within_budget", "verdict", "epsilon")},
    "dataset_id": ID,
    **{k: UNPROTECTED for k in ("initial_eval_perplexity", "final_eval_perplexity", "best_eval_perplexity",
                                "trial_seconds", "wall_seconds", "initial_eval_value_nll", "final_eval_value_nll",
                                "best_eval_value_nll")},
}
#: results.parquet's attack and audit columns are private (PRIVACY.txt): never part of a release
RESULTS_PRIVATE_PREFIXES = ("mia_", "canary_", "exposure_", "audit_", "eval_seconds", "evaluation_error")

_FIGURE = "tuning_aware_epsilon.<id>."
STUDY_SUMMARY = {
    **{k: PUBLIC for k in ("study", "trials", "results", "selection.note", "selection.requested", "selection.split",
                           "selection.metric")},
    **{k: UNPROTECTED for k in ("wall_seconds", "per_trial_overhead_seconds", "first_trial_start_latency_seconds")},
    "unfinished_trials": PUBLIC,  # trials a stop (Ctrl-C) left unfinished
    # a search's winners per cell: the values and final public-validation figure of DP-trained trials
    **{f"search_best[].{k}": DP for k in ("strategy", "model", "epsilon", "trials", "best.*", "trial",
                                          "final_public_value_nll", "final_public_perplexity")},
    # search: bandit: each cell's values are the bandit's decision, with its posterior for them
    "search_best[].decided_by": PUBLIC,
    **{f"search_best[].{k}": DP for k in ("predicted", "predicted_range[]", "length_scales.*")},
    "tuning_aware_epsilon": PUBLIC,  # the 'not applicable' note of a public study
    **{_FIGURE + k: DP for k in (
        "composed[].curve", "composed[].epsilon_rdp", "composition_epsilon_rdp", "max_single_trial_epsilon_rdp",
        "repeat_and_select_epsilon_rdp", "trials_composition_epsilon_rdp", "tuning_aware_epsilon", "runs", "trials",
        "unknown_spend[]", "unknown_spend[].trial", "unknown_spend[].status", "unknown_spend[].reason",
        "unknown_spend[].labels[]")},
    **{_FIGURE + k: PUBLIC for k in (
        "composed[].epsilon_target", "composed[].kind", "composed[].name", "delta", "labels[]",
        "neighbouring_relations[]", "nonprivate_trials[]", "note", "orders", "privacy_units[]", "target_epsilons[]",
        "warnings[]")},
    _FIGURE + "dataset_id": ID,
    # what `raydp study` printed (raydp.study.outcome.outcome_record): the trial counts; per (model, epsilon) cell the
    # arms' names and trials (the plan), their public validation figures and epsilon (DP-trained runs), the private
    # eval split's figures and the shares of the non-private gain (no DP covers them, labelled in the table's note),
    # and the trial the study would release (the argmin of DP-trained runs' public figures)
    **{k: PUBLIC for k in ("finished_trials", "failed_trials", "planned_trials", "partial")},
    **{f"results_table.{k}": PUBLIC for k in (
        "column", "decimals", "note", "cells[].model", "cells[].epsilon", "cells[].would_release",
        "cells[].arms[].arm", "cells[].arms[].name", "cells[].arms[].seeds", "cells[].arms[].trials[]",
        "cells[].nonprivate.arm", "cells[].nonprivate.name", "cells[].nonprivate.seeds",
        "cells[].untrained.public", "cells[].untrained.gain_share_pct")},
    **{f"results_table.{k}": DP for k in (
        "cells[].arms[].public", "cells[].arms[].public_sd", "cells[].arms[].epsilon_spent",
        "cells[].arms[].would_release", "cells[].would_release.trial", "cells[].would_release.arm",
        "cells[].would_release.seed")},
    **{f"results_table.{k}": UNPROTECTED for k in (
        "cells[].arms[].private", "cells[].arms[].private_sd", "cells[].arms[].gain_share_pct",
        "cells[].nonprivate.public", "cells[].nonprivate.public_sd", "cells[].nonprivate.private",
        "cells[].nonprivate.private_sd", "cells[].nonprivate.gain_share_pct", "cells[].untrained.private")},
    **{f"would_release[].{k}": PUBLIC for k in ("model", "epsilon")},
    **{f"would_release[].{k}": DP for k in ("trial", "arm", "seed")},
    # a search's candidates counted as such; selection: none's fixed release (the lowest planned seed)
    **{f"results_table.{k}": PUBLIC for k in ("cells[].arms[].searched", "cells[].nonprivate.searched",
                                              "cells[].fixed_release")},
    # which trials were attacked (attack: released): the released trials (chosen on DP-trained runs' public figures)
    # and every trial of the strategies the study file names
    **{f"attacked.{k}": PUBLIC for k in ("rule", "strategies[]")},
    "attacked.trials[]": DP,
}

TRAIN_METRICS_DP = {**{k: DP for k in ("sigma", "sigma_eff", "clamped", "clip_mean", "noisy_grad_norm")},
                    **{k: PUBLIC for k in ("step", "lr", "epoch")}}
EVAL_METRICS = {**{k: PUBLIC for k in ("step", "epoch", "public_perplexity", "public_accuracy", "public_value_nll",
                                       "public_nll_per_record")},
                **{k: UNPROTECTED for k in ("perplexity", "nll_per_token", "utility", "n_tokens", "accuracy", "value_nll",
                                            "nll_per_record")}}
LEDGER = {k: DP for k in ("step", "q", "sigma_eff", "clip", "allocation", "releases")}
CONTROL_TRACE = {"step": PUBLIC, "decision": PUBLIC, **{k: DP for k in ("sigma", "sigma_eff", "clamped")}}
DECISIONS = {**{k: DP for k in ("step", "epsilon", "utility", "reward", "action", "sigma_next", "sigma_proposed",
                                "step_size", "clip_next")},
             **{k: PUBLIC for k in ("privacy_mode", "privacy_label")}}
SAFETENSORS_ADAPTER = DP  # the trained adapters: the DP release itself

#: files released as a whole for what they are (their every field is configuration)
WHOLE_FILES = {"config.json": PUBLIC, "PRIVACY.txt": PUBLIC, "adapter/adapter_config.json": PUBLIC, "adapter/README.md": PUBLIC,
               "adapter/adapter_model.safetensors": DP,
               "policy/module.safetensors": DP,  # the SAC module's weights: trained on charged releases only
               "policy/replay.npz": DP}


def field_paths(value, prefix: str = ""):
    """Dotted paths of a JSON value's leaves (list items as ``[]``, dataset-id keys as ``<id>``)."""
    if isinstance(value, dict):
        if not value and prefix:
            yield prefix
        for key, item in value.items():
            key = "<id>" if re.match(r"^(rdi1|public):", str(key)) else str(key)
            yield from field_paths(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list):
        if not value or not any(isinstance(v, (dict, list)) for v in value):
            yield prefix + "[]"
        for item in value:
            if isinstance(item, (dict, list)):
                yield from field_paths(item, prefix + "[]")
    else:
        yield prefix


def _check_json(path: Path, allowed: dict, out: list) -> None:
    """``allowed`` keys are field paths; one ending in ``.*`` covers every field under it (a search's values)."""
    prefixes = tuple(k[:-1] for k in allowed if k.endswith(".*"))
    for field in set(field_paths(json.loads(path.read_text()))):
        if field not in allowed and not field.startswith(prefixes):
            out.append(f"{path}: {field}")


def _check_columns(path: Path, allowed: dict, out: list, private_prefixes=()) -> None:
    for column in pq.read_schema(path).names:
        if column not in allowed and not column.startswith(private_prefixes):
            out.append(f"{path}: column {column}")


def unclassified_run(run_dir: Path) -> list[str]:
    """Every field of a DP run directory's releasable files (all but ``private/`` and ``evaluation.json``) that
    the allowlist does not classify; also any file it does not know."""
    run_dir = Path(run_dir)
    out: list[str] = []
    for f in sorted(run_dir.rglob("*")):
        rel = f.relative_to(run_dir).as_posix()
        if f.is_dir() or rel.startswith("private/") or rel == "evaluation.json":
            continue
        if rel in WHOLE_FILES:
            continue
        if rel == "summary.json":
            phase = json.loads(f.read_text()).get("phase_one") or {}
            _check_json(f, {**SUMMARY, **PHASE_ONE.get(phase.get("data"), PHASE_ONE_RESUMED)}, out)
        elif rel == "policy/manifest.json":
            _check_json(f, POLICY_MANIFEST, out)
        elif rel == "train_metrics.parquet":
            _check_columns(f, TRAIN_METRICS_DP, out)
        elif rel == "eval_metrics.parquet":
            _check_columns(f, EVAL_METRICS, out)
        elif rel == "privacy_ledger.parquet":
            out.extend(unclassified_ledger(f))
        elif rel == "control_trace.parquet":
            _check_columns(f, {**CONTROL_TRACE, **{c: DP for c in pq.read_schema(f).names if re.match(r"clip_\d+$", c)}},
                           out)
        elif rel == "controller_decisions.parquet":
            _check_columns(f, DECISIONS, out)
        else:
            out.append(f"{f}: a file the allowlist does not know")
    return out


#: search: bandit's bandit.json: the study's choices (PUBLIC) and every episode's values and final public-validation
#: loss (DP: figures of DP-trained runs, as search_best's)
BANDIT = {**{k: PUBLIC for k in ("format", "seed", "candidates", "epsilon_range[]", "space.*")},
          **{f"observations[].{k}": DP for k in ("epsilon", "values.*", "loss")}}


def unclassified_study(study_dir: Path, nonprivate_trials=()) -> list[str]:
    """The same for a study directory: ``results.parquet`` (but its private attack columns),
    ``study_summary.json`` and every DP trial's run directory (non-private trials are not releasable)."""
    study_dir = Path(study_dir)
    out: list[str] = []
    _check_columns(study_dir / "results.parquet", RESULTS, out, RESULTS_PRIVATE_PREFIXES)
    _check_json(study_dir / "study_summary.json", STUDY_SUMMARY, out)
    if (study_dir / "bandit.json").exists():
        _check_json(study_dir / "bandit.json", BANDIT, out)
    for trial in sorted((study_dir / "trials").iterdir()):
        if trial.name not in nonprivate_trials:
            out.extend(unclassified_run(trial))
    return out


# -- selection: private-dp (issue 32) ------------------------------------------------------------------------------
#: one released cell's selection.json: the study file's choices and the guarantee (PUBLIC: computed from the plan and
#: E[K], never the realised K), the chosen trial's drawn settings and its noisy score (DP: the argmin of charged
#: score releases, Papernot & Steinke's released output), the private eval figure (UNPROTECTED, labelled)
SELECTION = {
    **{k: PUBLIC for k in (
        "model", "epsilon", "seed", "strategy", "delta", "trial_epsilon", "end_to_end_epsilon", "theorem",
        "distribution.kind", "distribution.mean", "distribution.shape", "score_epsilon_share",
        "for_comparison.trials", "for_comparison.basic_composition_epsilon", "for_comparison.rdp_composition_epsilon",
        "for_comparison.note", "released", "note", "score_note", "directory")},
    **{k: DP for k in ("settings.*", "score", "final_public_value_nll")},
    # what releasing every cell of the study costs (PUBLIC: the composition of the cells' planned end-to-end curves,
    # which do not depend on any K)
    **{f"all_cells.{k}": PUBLIC for k in ("epsilon", "delta", "cells", "smallest_cell_epsilon", "largest_cell_epsilon",
                                          "composition", "note")},
}
_END_TO_END = {f"privacy.end_to_end.{k}": PUBLIC for k in ("epsilon", "delta", "theorem", "note")}
#: a released trial's summary: a run summary's fields without any UNPROTECTED one (no timing, no private eval figure)
RELEASED_SUMMARY = {**{k: v for k, v in SUMMARY.items() if v != UNPROTECTED}, **_END_TO_END}
PRIVATE_SELECTION_SUMMARY = {"study": PUBLIC, "selection": PUBLIC, "note": PUBLIC,
                             **{f"released[].{k}": v for k, v in SELECTION.items() if not k.startswith("all_cells.")},
                             **{k: v for k, v in SELECTION.items() if k.startswith("all_cells.")},
                             # the same total per dataset, for raydp report's composition across studies (PUBLIC:
                             # from the plans; the number of cells, never of trials)
                             **{_FIGURE + k: PUBLIC for k in (
                                 "selection", "cells", "delta", "tuning_aware_epsilon", "composition_epsilon_rdp",
                                 "largest_cell_epsilon", "target_epsilons[]", "composed[].name", "composed[].kind",
                                 "composed[].curve", "composed[].epsilon_target", "composed[].epsilon_rdp", "labels[]",
                                 "privacy_units[]", "neighbouring_relations[]", "unknown_spend[]", "warnings[]",
                                 "orders", "note")},
                             _FIGURE + "dataset_id": ID}
#: the only top-level entries of a private-dp study directory; dataset/ and work/ are private (PRIVACY.txt)
PRIVATE_SELECTION_TOP = {"PRIVACY.txt", "study.json", "study_summary.json", "released", "dataset", "work"}


def unclassified_private_selection(study_dir: Path) -> list[str]:
    """Every field of a private-dp study's releasable files that the allowlist does not classify, and any entry of
    the study directory that is neither released nor one of its private directories."""
    study_dir = Path(study_dir)
    out = [f"{study_dir}: unexpected entry {p.name}" for p in study_dir.iterdir() if p.name not in PRIVATE_SELECTION_TOP]
    _check_json(study_dir / "study_summary.json", PRIVATE_SELECTION_SUMMARY, out)
    for cell in sorted((study_dir / "released").iterdir()):
        _check_json(cell / "selection.json", SELECTION, out)
        for f in sorted(cell.rglob("*")):
            rel = f.relative_to(cell).as_posix()
            if f.is_dir() or rel in WHOLE_FILES or rel == "selection.json":
                continue
            if rel == "summary.json":
                _check_json(f, RELEASED_SUMMARY, out)
            elif rel == "privacy_ledger.parquet":
                out.extend(unclassified_ledger(f))
            else:
                out.append(f"{f}: unknown file")
    return out


def unclassified_ledger(f: Path) -> list[str]:
    """A privacy ledger's columns and metadata fields that the allowlist does not classify."""
    out: list[str] = []
    _check_columns(f, LEDGER, out)
    metadata = pq.read_schema(f).metadata or {}
    for key, raw in metadata.items():
        if key == b"raydp.privacy_ledger":
            out.extend(f"{f}: metadata {field}" for field in set(field_paths(json.loads(raw)))
                       if field not in LEDGER_METADATA)
        elif key.decode() not in LEDGER_METADATA:
            out.append(f"{f}: metadata key {key.decode()}")
    return out


# -- wandb (issue 31) --------------------------------------------------------------------------------------------
#: what one DP trial's wandb run may hold, by key; a non-private trial has no wandb run at all
_WANDB_TABLE_META = {f"tables/{t}/{k}": DP for t in ("dials", "evaluations")
                     for k in ("_type", "path", "sha256", "size", "nrows", "ncols", "artifact_path",
                               "_latest_artifact_path", "log_mode")}
WANDB_HISTORY = {
    "eval/step": PUBLIC, "train/step": PUBLIC,
    **{f"eval/{k}": UNPROTECTED for k in ("perplexity", "value_nll", "nll_per_token")},  # the private eval split
    **{f"public/{k}": PUBLIC for k in ("perplexity", "value_nll")},  # the public split, of the DP model
    **{f"train/{k}": DP for k in ("sigma", "sigma_eff", "clip_mean", "noisy_grad_norm", "epsilon_spent")},
    "train/lr": PUBLIC,
    **_WANDB_TABLE_META,
    **{k: UNPROTECTED for k in ("_step", "_runtime", "_timestamp")},  # wandb's own: timing
}
WANDB_HISTORY_PATTERNS = {r"train/clip_\d+$": DP}
WANDB_SUMMARY = {
    **WANDB_HISTORY,
    **{f"eval/{k}": UNPROTECTED for k in ("final_perplexity", "best_perplexity", "final_value_nll")},
    **{f"public/{k}": PUBLIC for k in ("final_perplexity", "best_perplexity", "final_value_nll")},
    "steps": COUNT, "epsilon": DP, "privacy_label": PUBLIC,
}
WANDB_SUMMARY_PATTERNS = {**WANDB_HISTORY_PATTERNS, r"_wandb/": UNPROTECTED, r"unprotected/": UNPROTECTED}
#: the run's config: the trial's spec (public settings) and the run's plan
WANDB_CONFIG = {k: PUBLIC for k in (
    "model", "epsilon", "seed", "strategy", "t_rl", "b_sac", "k", "name", "grid", "settings", "tuned", "search",
    "stage", "member", "frozen_from", "frozen", "optuna_id", "epochs", "batch_size", "delta", "accountant", "_wandb")}
WANDB_TABLE_COLUMNS = {**{k: v for k, v in WANDB_HISTORY.items() if not k.startswith(("tables/", "_"))}}
WANDB_ARTIFACT = {"summary.json": DP, "privacy_ledger.parquet": DP, "config.json": PUBLIC, "PRIVACY.txt": PUBLIC,
                  **{k: v for k, v in WHOLE_FILES.items() if k.startswith("adapter/")}}
#: record types a run may hold: no environment (machine, git), console output or system metrics
WANDB_RECORDS = {"header", "run", "config", "history", "summary", "metric", "telemetry", "files", "artifact", "exit",
                 "final", "footer", "preempting", "request", "use_artifact", "alert", "tbrecord", "link_artifact"}


def _known(key: str, exact: dict, patterns: dict) -> bool:
    return key in exact or any(re.match(p, key) for p in patterns)


def unclassified_wandb(run_file: Path) -> list[str]:
    """Everything in a wandb offline run file that the allowlist does not classify: record types, config keys,
    history and summary keys, table columns (read from the run's table files) and the artifact's paths."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from wandb_records import records

    out: list[str] = []
    for record in records(run_file):
        kind = record.WhichOneof("record_type")
        if kind not in WANDB_RECORDS:
            out.append(f"record {kind}")
        elif kind == "run":
            run = record.run
            out += [f"config {item.key}" for item in run.config.update if item.key not in WANDB_CONFIG]
            if run.host not in ("", "trial") or run.git.remote_url or run.git.commit:
                out.append(f"run record names its machine or checkout: host={run.host!r} git={run.git.commit!r}")
        elif kind == "config":
            out += [f"config {item.key}" for item in record.config.update if item.key not in WANDB_CONFIG]
        elif kind == "history":
            out += [f"history {k}" for item in record.history.item
                    if not _known(k := item.key or "/".join(item.nested_key), WANDB_HISTORY, WANDB_HISTORY_PATTERNS)]
        elif kind == "summary":
            out += [f"summary {k}" for item in record.summary.update
                    if not _known(k := item.key or "/".join(item.nested_key), WANDB_SUMMARY, WANDB_SUMMARY_PATTERNS)]
        elif kind == "artifact" and record.artifact.type == "model":
            out += [f"artifact {e.path}" for e in record.artifact.manifest.contents if e.path not in WANDB_ARTIFACT]
        elif kind == "artifact" and record.artifact.type != "run_table":
            out.append(f"artifact of type {record.artifact.type}")
    for table in run_file.parent.glob("files/media/table/**/*.table.json"):
        out += [f"table column {c}" for c in json.loads(table.read_text())["columns"]
                if not _known(c, WANDB_TABLE_COLUMNS, WANDB_HISTORY_PATTERNS)]
    return out
