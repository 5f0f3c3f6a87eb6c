"""One fine-tuning run end to end: data, model, loop, outputs (``raydp train``).

Layout of a run directory (what may be released and what may not)::

    adapter/                   the trained LoRA adapter (PEFT format)            released under DP
    privacy_ledger.parquet     per-step mechanism: q, sigma_eff, clips, releases  safe (post-processing)
    summary.json, config.json  settings, guarantee, labels, perplexities          safe, except the
    train_metrics.parquet      per-step noisy-gradient figures (DP runs)          private-eval perplexity
    eval_metrics.parquet       perplexity per evaluation                          (not a DP release, E15)
                                                                                  and timings: unprotected
    control_trace.parquet, controller_decisions.parquet, policy/   (RLDP)        safe in strict mode
    private/                   PRIVATE: the dataset splits built for the run; never release

A non-private run's directory is private as a whole. The dataset is named by its owner-keyed id
(:mod:`raydp.data.identity`), never by a hash of the records; the number of units in train and q = B/N are
released as public (``privacy.public_counts``; ``epsilon_replace_one`` is the guarantee that covers them too).
tests/releasable.py lists every released field and why it may be released. The sampling and noise seeds are in
no file (ERRATA E12); resume checkpoints (Tune's, which hold the RNG states and the training split's positions)
are private too and live outside the run directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import uuid
from pathlib import Path

import torch

from raydp import __version__
from raydp.config import TrainConfig
from raydp.control.policies import trained_on
from raydp.data import load_manifest, load_texts, manifest_id, public_corpus, resolve_dataset
from raydp.data.public_records import SYNTHETIC_PUBLIC, PublicRecords
from raydp.data.splits import load_value_spans
from raydp.data.synthetic import DEFAULT_GENERATOR
from raydp.errors import ConfigError
from raydp.model import LoraSettings, disable_dropout, load_model
from raydp.model.batches import TokenizedSplit
from raydp.model.embedded import ensure_embedded_model, is_embedded_name
from raydp.model.loading import check_model_name
from raydp.run_directory import RunDirectory
from raydp.runner.allocator import keep_freed_memory
from raydp.runner.gradients import NonPrivateGradient
from raydp.runner.loop import OptimizerSettings, Trainer
from raydp.runner.output import staged_output
from raydp.runner.privacy_setup import (
    build_strategy,
    LifetimeCharge,
    charge_lifetime as charge_lifetime_budget,
    check_expected_plan,
    has_lifetime_budget,
    plan_private_run,
    privacy_summary,
    setup_private_run,
    training_units,
)
from raydp.runner.phases import run_phase_one
from raydp.runner.sampling import ShuffledBatchSampler
from raydp.runner.local_setup import (
    unit_training_set,
    is_local,
    local_privacy_summary,
    plan_local_run,
    setup_local_run,
)
from raydp.data.tasks import classification_spec
from raydp.runner.task import Task
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, ledger_rdp_curve
from raydp.privacy.clipping import isolates_records
from raydp.privacy.lifetime import LifetimeReceipt, check_receipt, spend_line

SYNTHETIC_NOTE = "synthetic records: they describe no real patient"
PUBLIC_PROBE_SEED = 7_777
PUBLIC_EVAL_SEED = 8_888
PRIVATE_DIR = "private"
RUN_PRIVACY_NOTE = """What in this run directory is private (ERRATA E11-E15; tests/releasable.py lists every released field):
- private/  the dataset splits the run built: never release.
- evaluation.json (after `raydp eval`): attacks and audit computed from private records: keep private; and
  report.html's attack and audit sections (membership ROC curves included), which are drawn from it.
- a non-private run (strategy nonprivate): nothing here is protected: keep it all private.
- a paper-mode RLDP run (settings.privacy_mode: paper): controller_decisions.parquet, control_trace.parquet and policy/
  hold unprivatized statistics of the private records (E3): keep them private.
Releasable, with their labels: summary.json, config.json, privacy_ledger.parquet, train_metrics.parquet,
eval_metrics.parquet, adapter/, and (strict mode) the controller's files. Unprotected inside them: every eval_*
figure (the private eval split, E15), every timing (wall_seconds, train_loop_seconds, resumed_from_step, a saved
policy's creation time: they follow the private batch sizes). Public by convention: the number of patients in train
and q = B/N (summary privacy.public_counts; epsilon_replace_one covers them for a swap of one training patient for
another; a patient who moves between train and another split changes N, which only the public-N convention
covers). The dataset is named by its
owner-keyed id. No file holds a sampling or noise seed, a generator state or a plain hash of the records.
"""
PRIVATE_README = ("Everything under this directory is private data (the dataset splits built for this run). "
                  "Never release it.\n")
EVAL_NOTE = ("every eval_* figure (perplexity, value-token NLL, NLL per record, token counts; a classification task's "
             "eval_accuracy) is computed on the private held-out eval split: not a DP release (unprotected, ERRATA "
             "E15); the public_* figures are on public validation records, and the public value-token NLL (else "
             "perplexity) is what studies select on")


def prepare_dataset(config: TrainConfig, workdir: Path, progress: bool = True) -> Path:
    """The run's dataset (:func:`raydp.data.resolve_dataset`); one it builds goes under ``private/``."""
    source = Path(config.data.source).expanduser()
    if config.data.source == "synthetic" or not source.is_dir():
        (workdir / PRIVATE_DIR).mkdir(exist_ok=True)
        (workdir / PRIVATE_DIR / "README").write_text(PRIVATE_README)
    return resolve_dataset(config.data, workdir / PRIVATE_DIR / "dataset", progress=progress)


def nonprivate_steps(config: TrainConfig, steps_per_epoch: float) -> int:
    """Steps derived from data size, epochs and batch size (ERRATA E10), capped by ``max_steps``."""
    steps = max(1, math.ceil(config.epochs * steps_per_epoch - 1e-9))
    return min(steps, config.max_steps) if config.max_steps else steps


def public_probe_batch(tokenizer, max_length: int, n_records: int, device, task: Task | None = None):
    """A batch of PUBLIC records (disjoint synthetic population) for strategies that calibrate on them."""
    split = (task or Task()).split(public_corpus(n_records, seed=PUBLIC_PROBE_SEED), tokenizer, max_length)
    return split.collate(list(range(len(split))), device)


def public_utility(loaded, public_eval, strategy):
    """The strategy context's ``public_utility``: minus the value-token NLL per record of the first
    ``strategy.public_utility_records`` public validation records (None for a strategy that asks for none, or a split
    without value spans)."""
    records = strategy.public_utility_records
    if not records or public_eval.value_masks is None:
        return None
    from raydp.evaluation.perplexity import evaluate_perplexity

    return lambda: -evaluate_perplexity(loaded.model, public_eval, loaded.device,
                                        max_sequences=records).value_nll_per_record


#: public validation records whose longest sets a DP run's batch width (:func:`dp_batch_width`)
DP_WIDTH_RECORDS = 2000


def dp_batch_width(configured: int | None, max_length: int, public_eval, public_split_of) -> int:
    """The fixed width (tokens) of every training batch of a DP run: ``configured`` (``dp_width``), else the longest
    of the first :data:`DP_WIDTH_RECORDS` public validation records (``public_eval``, or ``public_split_of(n)`` when
    it holds fewer), at most ``max_length``. Public either way, so it is the same for neighbouring datasets.

    Why a constant. Padded to its longest record, a batch's width follows its records, and the kernels' shapes follow
    the width: on a 2-core CPU, adding one record of 64 tokens or more to a batch of shorter ones moved the other
    records' per-sample gradients by up to 4.7e-7 relative (15 of 16 rows, the embedded model). The sensitivity of
    every release (the clipped sum, the controller's norm histogram, where a moved norm can cross a bin edge) assumes
    a record changes its own contribution only. At a fixed width no other row moved (32 to 256 records)."""
    if configured is not None:
        return min(configured, max_length)
    split = public_eval if len(public_eval) >= DP_WIDTH_RECORDS else public_split_of(DP_WIDTH_RECORDS)
    return min(max(max((len(seq) for seq in split.sequences[:DP_WIDTH_RECORDS]), default=2), 2), max_length)


def public_validation_split(tokenizer, max_length: int, n_records: int, task: Task | None = None,
                            generator: str = DEFAULT_GENERATOR, source: str | None = None,
                            manifest: dict | None = None) -> TokenizedSplit:
    """PUBLIC validation records (with their value spans where the records have fields): the first ``n_records`` of
    ``source``, the user's public records in the form of the private dataset of ``manifest``
    (:class:`raydp.data.public_records.PublicRecords`), else the public population of ``generator`` (drawn apart from
    the probe and pre-training)."""
    if source is not None:
        texts, spans = PublicRecords.of(source, manifest or {}).texts(n_records)
    else:
        texts, spans = public_corpus(n_records, seed=PUBLIC_EVAL_SEED, generator=generator, spans=True)
    return (task or Task()).split(texts, tokenizer, max_length, spans=spans)


def check_public_validation(source: str | None, dataset_dir: Path, manifest: dict) -> None:
    """Refuse a ``public_validation`` file that is not apart from the private dataset: the dataset's own source file,
    or one sharing a privacy unit with any of its splits (:meth:`PublicRecords.check_apart`). Its records steer
    selection and, with RLDP's public-validation reward, the clips (which assume public data: they are charged
    nothing). Run before anything is charged."""
    if source is not None:
        PublicRecords.of(source, manifest).check_apart(dataset_dir, manifest)


SYNTHETIC_VALIDATION_NOTE = ("the public validation records are synthetic (raydp's public population): they say "
                             "nothing about this real dataset's task, so selecting on them may choose wrongly; supply "
                             "public records of the same kind with public_validation")


def policy_provenance(private, config: TrainConfig, manifest: dict, privacy: dict) -> dict:
    """What a policy trained by this run must remember about it (ERRATA E14): which private dataset it
    touched, in which mode, and the run's RDP curve (the Renyi filter's budget for adaptive sigma)."""
    if privacy.get("filter"):
        orders, curve = privacy["filter"]["orders"], privacy["filter"]["budget_rdp"]
    else:
        orders, curve = list(DEFAULT_ORDERS), ledger_rdp_curve(private.ledger).tolist()
    return {"dataset_id": manifest_id(manifest), "public_data": bool(manifest.get("public")),
            "privacy_mode": private.strategy.privacy_mode,
            "privacy_unit": private.units.name, "epsilon": privacy["epsilon"], "delta": config.delta,
            "guarantee": privacy["guarantee"], "labels": privacy["labels"], "rdp_orders": list(orders),
            "rdp_curve": list(curve)}


def dp_steps_note(config: TrainConfig, plan, units) -> str:
    """Why a DP run's step count differs from a non-private run's at the same ``epochs``: it samples privacy units
    (patients) with probability q = batch_size / units each step (Poisson, ERRATA E10/E11), so an epoch is 1/q steps
    of about batch_size units, each with all its records; a non-private run takes batches of batch_size records.
    Only public figures: the planned q, steps and the public unit count."""
    capped = ", capped by max_steps" if config.max_steps and plan.planned_steps >= config.max_steps else ""
    return (f"DP steps: each step samples each of the {units.public_count} {units.name}s with probability "
            f"q = {plan.q:.4g} (about {config.batch_size} {units.name}s, all their records), so {config.epochs:g} "
            f"epoch(s) plan {plan.planned_steps} steps (ceil(epochs / q){capped}); a non-private run takes batches "
            f"of {config.batch_size} records, so more steps at the same epochs")


def run_training(config: TrainConfig, output: str | Path, overwrite: bool = False, progress: bool = True,
                 client=None, on_evaluation=None, on_checkpoint=None, checkpoint_every: int | None = None,
                 resume: dict | None = None, population_admit=None, charge_lifetime: bool = True,
                 _charged_by: LifetimeReceipt | None = None, expected_plan: dict | None = None) -> dict:
    """Run one fine-tuning and write everything it produces under ``output``; returns the summary.

    ``client``: the policy connection of an RLDP run (:class:`raydp.control.service.PolicyClient`, or over
    RLlink :class:`raydp.control.rllink.RLlinkPolicyClient`); RLDP runs are started by
    :func:`raydp.runner.launch.train`, which runs them as Ray actors. A client whose ``service`` is set
    gets ``save_policy`` with the run's provenance entry (ERRATA E14) when the run ends.
    ``on_checkpoint(state)`` receives the resumable state at evaluations, every ``checkpoint_every``
    steps and before every controller decision; ``resume`` is such a state: the run continues from it
    with exactly its ledger (no step lost or charged twice). ``population_admit``: a PBT member's admission by
    its population's Renyi filter (:mod:`raydp.study.population`).

    Lifetime budget (:mod:`raydp.privacy.lifetime`): a fresh DP run is charged its plan, if the owner set a budget on
    its dataset. Only a caller that charged the run itself, before it starts (a study its trials, a private
    selection its cells), skips that, by passing ``_charged_by``, the :class:`~raydp.privacy.lifetime.LifetimeReceipt`
    of its charge (checked: :func:`~raydp.privacy.lifetime.check_receipt`). ``charge_lifetime=False`` without one
    is kept for callers without a budget (where there is nothing to charge) and refused on a dataset with one.

    ``expected_plan``: the privacy plan (:func:`~raydp.runner.privacy_setup.plan_record`) a caller calibrated and
    charged for this run (a study's driver, for each trial it planned): the run calibrates its own and refuses, with
    a ConfigError naming the differing fields, before any charge or step, when the two differ (the dataset's id and
    the privacy units included: a plan charged on one dataset does not run on another of the same size). None: not
    compared (a plain run; a study's searched trial, which the driver did not plan)."""
    started = time.perf_counter()
    if is_embedded_name(config.model):  # built (once, cached) at the caller's threads, as before: the float order of
        ensure_embedded_model(config.model, progress=progress)  # the cached model's build is not the run's to change
    with run_threads(config.cpus):  # the run's CPU threads, for the run only
        return _run_training(config, output, overwrite, progress, client, on_evaluation, on_checkpoint,
                             checkpoint_every, resume, population_admit, charge_lifetime, _charged_by,
                             expected_plan, started)


@contextlib.contextmanager
def run_threads(cpus: int | None):
    """``cpus`` torch threads within the block (a run's ``cpus``; None: as they are, torch's default being every
    core), the caller's count restored after it: a run in a process that goes on (a test session, a notebook) leaves
    its thread count, and so the float order of later work, as it found them."""
    before = torch.get_num_threads()
    if cpus:
        torch.set_num_threads(cpus)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_training(config: TrainConfig, output, overwrite, progress, client, on_evaluation, on_checkpoint,
                  checkpoint_every, resume, population_admit, charge_lifetime, _charged_by, expected_plan,
                  started) -> dict:
    """:func:`run_training`'s body, under the run's threads."""
    check_model_name(config.model)  # fail on a bad model before building anything
    keep_freed_memory()  # every step reuses the last step's pages (raydp.runner.allocator; nothing computed changes)
    if config.is_controlled and client is None:
        raise ConfigError(f"a {config.strategy} run needs a policy client; start it with raydp.runner.launch.train")
    with staged_output(output, overwrite=overwrite) as staging:
        files = RunDirectory(staging)  # the run's files, named (staged, then renamed into place whole)
        dataset_dir = prepare_dataset(config, staging, progress=progress)
        manifest = load_manifest(dataset_dir)
        check_public_validation(config.public_validation, dataset_dir, manifest)  # before any charge
        train_texts = load_texts(dataset_dir, "train")
        strategy = build_strategy(config, client) if config.is_private else None
        units = training_units(config, dataset_dir, len(train_texts)) if config.is_private else None
        local = config.is_private and is_local(strategy)  # forward-pass local DP (ewft, dpforward)
        if local:  # each patient contributes exactly records_per_patient training records (ERRATA E11)
            train_texts, units = unit_training_set(train_texts, units, strategy)
            plan = plan_local_run(config, strategy, units, classification_spec(config.task.label).n_classes)
        else:
            plan = plan_private_run(config, units.public_count, strategy) if config.is_private else None
        if expected_plan is not None:  # the plan that was charged is the plan that runs (before any charge or step)
            check_expected_plan(expected_plan, plan, config, units, manifest_id(manifest))
        if plan is not None and resume is None and progress and not local:  # what earlier runs spent, never silent
            spent = spend_line(manifest_id(manifest), config.delta, manifest.get("source_sha256"))
            if spent:
                print(f"raydp: {spent}", file=sys.stderr, flush=True)
        if plan is not None and resume is None:  # refused here, before any step, when past the lifetime budget;
            # every fresh run is charged anew (a rerun into the same directory spends again), a resumed one was
            # charged when it started
            if _charged_by is not None:  # its caller charged it: the receipt must show that charge
                check_receipt(_charged_by, manifest_id(manifest), manifest.get("source_sha256"))
            elif charge_lifetime:
                label = f"run:{Path(output).resolve()}#{uuid.uuid4().hex[:12]}"
                charge_lifetime_budget(manifest, {label: LifetimeCharge.of(plan, config, strategy, units.name)})
            elif has_lifetime_budget(manifest):
                raise ConfigError(f"dataset {manifest_id(manifest)} has a lifetime budget: a run on it is charged "
                                  "its plan unless its caller charged it first and passes the receipt of that "
                                  "charge (_charged_by); charge_lifetime=False alone does not skip it; nothing "
                                  "was started")
        torch.manual_seed(config.seed)
        loaded = load_model(
            config.model,
            device=config.device,
            lora=LoraSettings(**config.lora.model_dump()),
            progress=progress,
        )
        if config.is_private:  # dropout draws from the public-seeded global generator (ERRATA E12)
            disable_dropout(loaded.model)
        task = Task.build(config.task.kind, config.task.label, loaded.tokenizer, encoder=loaded.is_encoder)
        max_length = task.length_cap(config.max_length, loaded.max_positions)
        generator = manifest.get("generator") or ("independent" if manifest.get("synthetic") else DEFAULT_GENERATOR)
        public_eval = public_validation_split(  # the public population of the dataset's generator (E15)
            loaded.tokenizer, max_length, config.public_eval_records, task, generator=generator,
            source=config.public_validation, manifest=manifest)
        width = None
        if config.is_private:  # every DP batch as wide as a public constant; longer training records cut to it
            width = dp_batch_width(config.dp_width, max_length, public_eval, lambda n: public_validation_split(
                loaded.tokenizer, max_length, n, task, generator=generator, source=config.public_validation,
                manifest=manifest))
        train = task.split(train_texts, loaded.tokenizer, width or max_length, units=units.ids if units else None,
                           require_all=True)
        evaluation = task.split(load_texts(dataset_dir, "eval"), loaded.tokenizer, max_length,
                                spans=load_value_spans(dataset_dir, "eval"))
        warm = strategy.warm_start() if config.is_private and hasattr(strategy, "warm_start") else None
        phase_one = None
        if warm is not None:  # a non-private phase before the DP phase (DualTune-GhostDP phase 1)
            phase_one = (resume.get("phase_one") or {"resumed": True}) if resume is not None else run_phase_one(
                warm, config, loaded, task, train_texts, max_length, public_eval, dataset_dir, progress=progress)
        private = local_run = None
        if local:
            local_run = setup_local_run(config, plan, strategy, loaded, train, units, task, max_length,
                                        start_step=resume["trainer"]["step_count"] if resume else 0)
            sampler, gradient = local_run.sampler, local_run.step
            total_steps = min(local_run.planned_steps, config.max_steps or local_run.planned_steps)
        elif config.is_private:
            probe = (public_probe_batch(loaded.tokenizer, max_length, strategy.public_probe_records, loaded.device,
                                        task) if strategy.needs_public_probe else None)
            private = setup_private_run(config, plan, loaded.model, loaded.pairs, units, loaded.device,
                                        strategy=strategy, public_batch=probe,
                                        start_step=resume["trainer"]["step_count"] if resume else 0,
                                        population_admit=population_admit,  # PBT population filter (or None)
                                        loss=task.loss if task.is_classification else None,
                                        public_utility=public_utility(loaded, public_eval, strategy))
            sampler, gradient, total_steps = private.sampler, private.step, private.planned_steps
            if progress and resume is None:  # why a DP run takes fewer steps than a non-private one at equal epochs
                print(f"raydp: {dp_steps_note(config, plan, units)}", file=sys.stderr, flush=True)
        else:
            sampler = ShuffledBatchSampler(len(train), config.batch_size, seed=config.seed)
            gradient = NonPrivateGradient(task.loss if task.is_classification else None)
            total_steps = nonprivate_steps(config, sampler.steps_per_epoch)
        trainer = Trainer(
            loaded.model,
            train,
            evaluation,
            sampler,
            gradient,
            loaded.device,
            optimizer=OptimizerSettings(lr=config.lr, warmup_steps=config.warmup_steps, decay=config.lr_decay,
                                        lr_end=config.lr_end, total_steps=total_steps,
                                        rescale_moments=config.rescale_moments, weight_decay=config.weight_decay),
            eval_every=config.eval_every or 0,
            eval_max_sequences=config.eval_max_records,
            progress=progress,
            on_evaluation=on_evaluation,
            on_checkpoint=(lambda t: on_checkpoint({"trainer": t.state_dict(), "phase_one": phase_one}))
            if on_checkpoint else None,
            checkpoint_every=checkpoint_every,
            public_evaluation=public_eval,
            evaluate=task.evaluate,
            batch_width=width,
        )
        if resume is not None:
            trainer.load_state_dict(resume["trainer"])
        history = trainer.run(total_steps)
        history.write(staging)
        evals = [row["perplexity"] for row in history.eval_rows]
        public = [row["public_perplexity"] for row in history.eval_rows]
        value = {split: [row.get(key) for row in history.eval_rows]
                 for split, key in (("eval", "value_nll"), ("public", "public_value_nll"))}
        controller = None
        privacy = privacy_summary(private, config) if private else {"mechanism": "none", "epsilon": None}
        if local_run is not None:
            privacy = local_privacy_summary(local_run, config)
            local_run.ledger.save(files.ledger)
        if width is not None:
            privacy["batch_width"] = width  # public (dp_batch_width)
        if private is not None:
            privacy["records_alone"] = isolates_records(loaded.device)  # public: off the CPU (ERRATA E17)
            if privacy["records_alone"]:  # rows per pass the run used ([8]: slotted; [1]: one record per pass; public)
                privacy["record_slots"] = sorted(getattr(private.step.per_sample, "rows_used", ()))
            private.ledger.save(files.ledger)
            controller = private.strategy.finish(staging) or None
            if client is not None and client.service is not None:
                client.save_policy(files.policy, trained_on=trained_on(
                    config, n_adapter_pairs=len(loaded.pairs), epsilon=config.epsilon, steps=trainer.step_count,
                    privacy_mode=private.strategy.privacy_mode,
                    decisions=controller.get("decisions") if controller else None),
                    results={"final_public_perplexity": public[-1], "best_public_perplexity": min(public),
                             "epsilon": privacy["epsilon"], "labels": privacy["labels"]},
                    provenance=policy_provenance(private, config, manifest, privacy))
        loaded.model.save_pretrained(files.adapter)
        model_source = Path(loaded.source).name if Path(loaded.source).is_dir() else loaded.source
        _without_local_paths(files.adapter, str(loaded.source), model_source)
        summary = {
            "raydp_version": __version__,
            "model": config.model,
            # no absolute path of this machine in a released file: a local directory by its name (the embedded
            # cache's name carries the model spec's digest), a hub model by its id
            "model_source": model_source,
            "model_type": loaded.model_type,
            "device": str(loaded.device),
            "n_adapter_pairs": len(loaded.pairs),
            "adapter_pairs": [pair.describe() for pair in loaded.pairs],
            "strategy": config.strategy,
            "recipe": config.recipe_applied,  # the recipe entry and the fields it filled (None: none)
            "privacy": privacy,
            "dropout": "off (DP run: ERRATA E12)" if config.is_private else "as configured",
            "controller": controller,
            "phase_one": phase_one,
            "resumed_from_step": resume["trainer"]["step_count"] if resume is not None else None,
            "stopped_early": trainer.stopped_early,
            "data_source": manifest.get("source"),
            "dataset_id": manifest_id(manifest),  # keyed: names the dataset for its owner only
            "data_note": SYNTHETIC_NOTE if manifest.get("synthetic") else None,
            # the record count of a DP run is not released: a patient's number of encounters would show in it
            # (the guarantee does not cover it); the number of units (N, q = B/N) is, and privacy.public_counts says what covers it
            **({"train_records": len(train)} if not config.is_private else {}),
            "eval_records": len(evaluation),
            "public_eval_records": len(public_eval),
            "max_length": max_length,
            "steps": trainer.step_count,
            "steps_per_epoch": sampler.steps_per_epoch,
            "initial_public_perplexity": public[0],
            "final_public_perplexity": public[-1],
            "best_public_perplexity": min(public),
            "initial_eval_perplexity": evals[0],
            "final_eval_perplexity": evals[-1],
            "best_eval_perplexity": min(evals),
            **{f"{when}_{split}_value_nll": pick(values)
               for split, values in value.items() if None not in values
               for when, pick in (("initial", lambda v: v[0]), ("final", lambda v: v[-1]), ("best", min))},
            **({"final_eval_nll_per_record": history.eval_rows[-1]["nll_per_record"],
                "final_public_nll_per_record": history.eval_rows[-1]["public_nll_per_record"]}
               if "nll_per_record" in history.eval_rows[-1] else {}),
            "task": task.describe(),
            **({"final_eval_accuracy": history.eval_rows[-1]["accuracy"],
                "final_public_accuracy": history.eval_rows[-1]["public_accuracy"],
                "best_public_accuracy": max(row["public_accuracy"] for row in history.eval_rows)}
               if task.is_classification else {}),
            "eval_note": EVAL_NOTE,
            "public_validation": config.public_validation or SYNTHETIC_PUBLIC,
            **({"public_validation_note": SYNTHETIC_VALIDATION_NOTE}
               if not manifest.get("synthetic") and config.public_validation is None else {}),
            "train_loop_seconds": round(trainer.train_seconds, 2),
            "wall_seconds": round(time.perf_counter() - started, 2),
        }
        files.config.write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        files.privacy_note.write_text(RUN_PRIVACY_NOTE)
        files.summary.write_text(json.dumps(summary, indent=2))
    return summary


def _without_local_paths(adapter_dir: Path, source: str, name: str) -> None:
    """PEFT writes the base model's path into ``adapter_config.json`` and the model card: a local directory's
    absolute path is replaced by its name (as in the summary), so no path of this machine is released."""
    if not Path(source).is_absolute():
        return
    for file in ("adapter_config.json", "README.md"):
        path = adapter_dir / file
        if path.is_file():
            path.write_text(path.read_text().replace(source.rstrip("/"), name))
