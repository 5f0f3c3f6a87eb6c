"""raydp's DP step under an existing ``transformers.Trainer`` script.

A user with a Hugging Face ``Trainer`` script and a PEFT (LoRA) model keeps it, and adds::

    dp = DPTraining(model, train_dataset, tokenizer, strategy="static", epsilon=2.0, batch_size=16, epochs=1)
    args = TrainingArguments(..., max_steps=dp.planned_steps, max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[dp.callback])
    dp.attach(trainer)
    trainer.train()
    dp.summary()["epsilon"]

What each piece does (nothing of the DP step is copied: it is :class:`raydp.privacy.engine.DPStep` as
wired by :func:`raydp.runner.privacy_setup.setup_private_run`, the same object raydp's own loop drives):

* :class:`DPTraining` checks the request and calibrates sigma_0 for the data's public size before the
  Trainer exists (:func:`~raydp.runner.privacy_setup.plan_private_run`: q = B/N, the planned steps
  ``dp.planned_steps`` (ERRATA E10), delta < 1/N), then, in :meth:`DPTraining.attach`, sets up the run
  on the Trainer's model and device: secret sampling and noise randomness (E12), ledger, guard or Renyi
  filter (E4, E13), the strategy, dropout off (E12).
* :meth:`DPTraining.attach` installs the thin hook, three of the Trainer's documented override points on
  that one Trainer instance:

  - ``get_train_dataloader``: a DataLoader whose batch sampler is raydp's
    :class:`~raydp.runner.sampling.PoissonSampler` (secret randomness): every step's batch is a Poisson
    sample of privacy units (E5, E11), empty samples included; the Trainer's sampler, shuffling and
    ``per_device_train_batch_size`` choose nothing. Batches reach the Trainer as one opaque object, so
    the Trainer never counts their tokens or sizes (its flops and token counters stay 0: the Poisson
    batch size is private, E5);
  - ``training_step``: :meth:`DPStep.compute <raydp.privacy.engine.DPStep.compute>` in place of the
    Trainer's forward/backward: per-unit gradients, clipping, calibrated noise, the mean over the
    EXPECTED batch size (E1, E5), the ledger row. It computes no reportable loss: the Trainer receives
    a constant 0;
  - ``log``: the Trainer's ``loss``/``train_loss`` entries (a training loss on private data would be a
    release no accountant counts, E3) are removed; post-processed figures of the release are logged
    instead (``dp_sigma_eff``, ``dp_noisy_grad_norm``, ``dp_epsilon_spent``, ``dp_steps_charged``; beside the
    epsilon, ``dp_epsilon_void: 1`` when the randomness is not secret, E12); the
    Trainer's evaluation metrics (any ``metric_key_prefix``) are logged as ``unprotected_*`` (e.g.
    ``unprotected_eval_loss``) unless ``DPTraining(..., eval_data_is_public=True)``: an eval set of
    private records is covered by no accountant (E15), and selecting a checkpoint on it is refused. The
    callback relabels the same metrics for later callbacks and for ``evaluate()``'s caller.

* :class:`DPCallback` (``dp.callback``) keeps the guarantee around the Trainer's own steps: at train
  begin it refuses unsafe ``TrainingArguments`` (:func:`check_training_arguments`) and a Trainer that is
  not attached, resumed, or whose ``max_steps`` is not the plan's, and it wraps the Trainer's
  ``optimizer.step`` (the optimizer hook): every update first checks that the gradient about to be
  applied is exactly the DP step's (nothing in between, e.g. gradient clipping, accumulation, another
  callback or a hook, changed it; otherwise it refuses the update), then shows the strategy its update;
  at every step end the controller acts (``between_steps``) and the guard is asked whether another step
  may run (``control.should_training_stop`` when the budget or the plan is spent); it saves the ledger
  (and the privacy summary) where the user says, at every checkpoint and at the end.

Mixed precision, gradient accumulation, gradient clipping, ``torch.compile``, NEFTune, gradient
checkpointing, several devices and resuming from a checkpoint are refused (one-line
:class:`~raydp.errors.ConfigError`). The optimizer and the learning-rate schedule are the Trainer's: they
only post-process the noisy gradient.

What stays the user's responsibility (the integration cannot see it) is listed in docs/integrations.md,
"transformers.Trainer". The refusals and the ``unprotected_*`` labels are :mod:`raydp.integrations.trainer_checks`;
the records and their Poisson batches, :mod:`raydp.integrations.trainer_batches`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from raydp.config import TrainConfig
from raydp.control.policies import trained_on
from raydp.data import load_manifest, manifest_id, public_corpus
from raydp.data.identity import is_dataset_id, keyed_id, owner_key_path
from raydp.errors import ConfigError
from raydp.integrations.trainer_batches import BATCH_KEY, PoissonBatches, _Indices, training_split
from raydp.integrations.trainer_checks import (EVAL_NOTE, LOSS_NOTE, TIMING_LOG_KEYS, UNPROTECTED_PREFIX,
                                               _check_served_policy, _check_trainer_class, check_trainable_dtypes,
                                               check_training_arguments, relabel_unprotected, unprotected_name)
from raydp.integrations.trainer_checks import FUSED_BACKWARD_OPTIMIZERS, TRAINING_LOG_KEYS  # noqa: F401  (re-exported)
from raydp.model.adapters import discover_adapter_pairs
from raydp.model.batches import TokenizedSplit
from raydp.model.loading import disable_dropout
from raydp.privacy.guard import BudgetExhausted
from raydp.privacy.ledger import LEDGER_FILENAME
from raydp.privacy.lifetime import read_budget
from raydp.runner.privacy_setup import (
    LifetimeCharge,
    PrivacyUnits,
    PrivateRun,
    build_strategy,
    charge_lifetime,
    plan_private_run,
    privacy_summary,
    setup_private_run,
)
from raydp.runner.run import PUBLIC_PROBE_SEED, policy_provenance

__all__ = ["BATCH_KEY", "DPCallback", "DPTraining", "PoissonBatches", "check_training_arguments", "relabel_unprotected",
           "unprotected_name"]

#: the privacy summary :meth:`DPTraining.save` writes beside the ledger (the integration's own file)
SUMMARY_FILENAME = "privacy_summary.json"


# -- the integration ------------------------------------------------------------------------------------

class DPTraining:
    """raydp's DP training of a PEFT model under a ``transformers.Trainer`` (see the module docstring).

    ``config``: a :class:`raydp.config.TrainConfig`, or its fields as keyword arguments (``strategy``,
    ``epsilon``, ``delta``, ``batch_size`` = the expected number of privacy units per step, ``epochs``,
    ``max_steps``, ``accountant``, ``clip``, ``settings``, ``rldp``, ``privacy_unit``,
    ``unsafe_fixed_randomness``, ``seed``, ``max_length``, ``dp_width``: the tokens every batch is padded to,
    default max_length); its model, data, learning-rate and evaluation fields are not used (those are the
    Trainer's), nor is a recipe (:mod:`raydp.recipe`: it is looked up by the config's model, not the Trainer's). ``train_dataset``: the private training records (texts,
    records with ``text_column``, or tokenised records); the Trainer must be given the same object or none.
    ``units``: the privacy unit of every record (e.g. a patient id; ERRATA E11), or None: every record is
    its own unit. ``loss(logits, input_ids, attention_mask)``: the per-example loss (default: per-sequence
    next-token NLL, :func:`raydp.model.loss.per_sequence_nll`). ``controller``: RLDP's policy client.
    ``public_texts``: public records for a strategy that calibrates on them (default: raydp's public
    corpus). ``ledger_path``: where the ledger is written (default ``<output_dir>/privacy_ledger.parquet``),
    with ``privacy_summary.json`` beside it. ``eval_data_is_public``: allow checkpoint selection on the
    Trainer's eval metrics (only when the eval data is public, ERRATA E15). ``log_epsilon``: log the epsilon
    spent so far at every logging step (a fresh accountant composition each time: ~0.1-0.4 s on a CPU).
    ``dataset_id``: the identity of the private dataset in a policy's provenance (ERRATA E14): give the
    ``dataset_id`` of the raydp dataset the records come from (its manifest's, :mod:`raydp.data.identity`), so
    that studies on it compose this run's spend; default: the owner-keyed id of the tokenised training records,
    which matches no raydp dataset. Never a plain hash of the records: one that anyone can recompute lets
    whoever knows all records but one recover the last (a one-line error). A dataset with a lifetime budget
    (:mod:`raydp.privacy.lifetime`) is charged this run's plan when it is set up, or the run is refused.
    ``dataset``: the raydp dataset directory the records come from, instead of its ``dataset_id``: its manifest
    gives the id and says whether it has a lifetime budget, so a budgeted dataset whose register is not found
    here is refused (fail closed). A bare ``dataset_id`` is accepted only where its budget register is found: an
    id alone cannot say that a dataset has no budget."""

    def __init__(self, model: torch.nn.Module, train_dataset, tokenizer=None, config: TrainConfig | None = None, *,
                 units: Sequence | None = None, text_column: str = "text", loss=None, controller=None,
                 public_texts: list[str] | None = None, ledger_path: str | Path | None = None,
                 eval_data_is_public: bool = False, log_epsilon: bool = True, dataset_id: str | None = None,
                 dataset: str | Path | None = None, **config_fields: Any):
        if config is not None and config_fields:
            raise ConfigError("pass a TrainConfig or its fields as keyword arguments, not both")
        # the Trainer trains its own model, not ``config.model``: a recipe looked up by the config's model (the embedded
        # one unless set) would give its clip to another model, so DPTraining takes no recipe (``recipe: none``)
        if config is None:
            if config_fields.get("recipe", "none") != "none" or config_fields.get("compute", "default") != "default":
                raise ConfigError("DPTraining takes no recipe nor compute tier (a recipe is looked up by the config's "
                                  "model, not the Trainer's): leave recipe and compute unset and give the settings "
                                  "you want (TrainerRecipe builds them from a named entry)")
            config = TrainConfig(**{**config_fields, "recipe": "none"})
        elif config.recipe != "none" or config.recipe_applied is not None:
            # the fields the user set, without what a recipe filled (a config.json read back lists those as set)
            filled = set((config.recipe_applied or {}).get("filled") or {})
            config = TrainConfig(**{k: getattr(config, k) for k in config.model_fields_set
                                    if k not in {"recipe", "recipe_applied", "compute", *filled}}, recipe="none")
        self.config = config
        if not self.config.is_private:
            raise ConfigError("DPTraining needs a DP strategy (strategy='static', 'static-pairwise', ...)")
        self.model = model
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.loss = loss
        self.public_texts = public_texts
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None
        self.eval_data_is_public = bool(eval_data_is_public)
        if self.config.common_random_numbers or self.config.data.source == "public":
            raise ConfigError("DPTraining trains on the records it is given, which it cannot tell public: "
                              "common_random_numbers (and data.source: public) are for raydp's own public episodes")
        self.manifest = {"dataset_id": dataset_id}  # what the lifetime charge reads
        if dataset is not None:
            self.manifest = load_manifest(dataset)
            if dataset_id is not None and dataset_id != manifest_id(self.manifest):
                raise ConfigError(f"dataset_id is not the id of {dataset}: give one of them")
            dataset_id = manifest_id(self.manifest)
        if isinstance(dataset_id, str) and dataset_id.startswith("public:"):
            raise ConfigError("dataset_id 'public:...' names raydp's public population; the Trainer's records are "
                              "private: give the 'rdi1:' id of their raydp dataset (or none)")
        if dataset_id is not None and not is_dataset_id(dataset_id):
            raise ConfigError(f"dataset_id {str(dataset_id)[:24]!r}... is not a raydp dataset id (the dataset_id of a "
                              "dataset's manifest.json, 'rdi1:...'): a plain hash of the records would reveal them")
        if dataset is None and dataset_id is not None and read_budget(dataset_id) is None:
            # no register here: an id alone cannot say whether the dataset has a lifetime budget (set on another
            # machine, or on a rebuild of its source), and running would leave a budgeted run uncharged (fail closed)
            raise ConfigError(f"dataset {dataset_id} may have a lifetime budget that this machine cannot see from its "
                              f"id alone (no register beside {owner_key_path()}): pass dataset=DIR, whose manifest "
                              "says")
        self.dataset_id = dataset_id
        self.log_epsilon = bool(log_epsilon)
        if self.config.is_controlled and controller is None:
            raise ConfigError(f"strategy {self.config.strategy!r} needs a policy client: "
                              "DPTraining(..., controller=client)")
        if controller is not None:
            _check_served_policy(controller, self.config)
        self.client = controller
        self.strategy = build_strategy(self.config, controller)
        if getattr(self.strategy, "mechanism", None) == "local":
            raise ConfigError(f"strategy {self.config.strategy!r} is a forward-pass local mechanism (its own "
                              "accounting and classifier): use raydp train")
        if self.strategy.warm_start() is not None:
            raise ConfigError(f"strategy {self.config.strategy!r} has a non-private phase 1 before DP training: run it "
                              "with raydp train, or set its phase1_epochs to 0")
        max_length = self.config.max_length or min(_max_positions(model), 512)
        ids = None if units is None else np.asarray(units)
        if ids is not None and ids.shape != (len(train_dataset),):
            raise ConfigError(f"units must give one privacy unit per record ({len(train_dataset)}), got shape "
                              f"{ids.shape}")
        wanted = self.config.privacy_unit
        if wanted == "patient" and ids is None:
            raise ConfigError("privacy_unit 'patient' needs units=<the unit of every record>")
        if wanted == "record" or ids is None:
            self.units = PrivacyUnits("record", len(train_dataset))
            ids = None
        else:
            self.units = PrivacyUnits("patient", int(len(np.unique(ids))), ids)
        # every Poisson batch padded to one public width, so that no record changes the shapes the others are
        # computed with (raydp.runner.run.dp_batch_width; here no public records are known: dp_width, else max_length)
        self.width = min(self.config.dp_width or max_length, max_length)
        self.split = training_split(train_dataset, tokenizer, self.width, units=ids, text_column=text_column)
        self.max_length = max_length
        #: the checked request: q, planned steps, sigma_0 (no model needed; one-line errors before training)
        self.plan = plan_private_run(self.config, self.units.public_count, self.strategy)
        if self.dataset_id is not None:  # a raydp dataset with a lifetime budget: charged (or refused) here
            charge_lifetime(self.manifest, {f"trainer:{uuid.uuid4().hex[:12]}": LifetimeCharge.of(
                self.plan, self.config, self.strategy, self.units.name)})
        self.run: PrivateRun | None = None
        self.trainer: Trainer | None = None
        self.callback = DPCallback(self)
        self.batches: PoissonBatches | None = None
        self.dropout_disabled = 0
        self.last_metrics: dict = {}
        self.stopped_early: str | None = None
        self.step_seconds = 0.0  # aggregate only (per-step times grow with the private batch size, E5)
        self._expected: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.controller: dict | None = None  # the strategy's finish() summary, after training
        self._trained = False

    # -- the plan ----------------------------------------------------------------------------------
    @property
    def planned_steps(self) -> int:
        """Steps the budget is calibrated for: set ``TrainingArguments(max_steps=dp.planned_steps)``."""
        return self.plan.planned_steps

    @property
    def q(self) -> float:
        return self.plan.q

    # -- attaching -------------------------------------------------------------------------------------
    def attach(self, trainer: Trainer) -> DPTraining:
        """Set up the private run on ``trainer``'s model and device and install the hook (Poisson batches,
        the DP step as ``training_step``, the loss-free log) on this Trainer instance; adds
        :attr:`callback` first among its callbacks if it is not there."""
        if self.trainer is not None:
            raise ConfigError("this DPTraining is already attached to a Trainer (one DPTraining drives one training)")
        if trainer.model is not self.model:
            raise ConfigError("the Trainer's model is not the model given to DPTraining")
        if trainer.train_dataset is not None and trainer.train_dataset is not self.train_dataset:
            raise ConfigError("the Trainer's train_dataset is not the one DPTraining samples from: pass the same "
                              "object (or none)")
        _check_trainer_class(trainer)
        check_training_arguments(trainer.args, planned_steps=self.planned_steps,
                                 eval_data_is_public=self.eval_data_is_public)
        model = self.model
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            raise ConfigError("the model has gradient checkpointing enabled, which the per-sample gradient hooks do "
                              "not support; call model.gradient_checkpointing_disable()")
        device = next(p for p in model.parameters()).device
        check_trainable_dtypes(model)
        pairs = discover_adapter_pairs(model)
        if not pairs:
            raise ConfigError("the model has no LoRA adapter pairs (wrap it with peft.get_peft_model and a LoraConfig)")
        self.dropout_disabled = disable_dropout(model)  # dropout masks come from a public-seeded generator (E12)
        probe = self._public_probe(device) if self.strategy.needs_public_probe else None
        self.run = setup_private_run(self.config, self.plan, model, pairs, self.units, device, strategy=self.strategy,
                                     public_batch=probe, loss=self.loss)
        self.device = device
        self.batches = PoissonBatches(self.run.sampler, max(1, round(1.0 / self.plan.q)))
        self.trainer = trainer
        trainer.get_train_dataloader = self._train_dataloader
        trainer.training_step = self._training_step
        original_log = trainer.log
        # the caller's dict is relabelled in place (train() returns it); the Trainer's log gets a copy to add to
        trainer.log = lambda logs, start_time=None: original_log(dict(self._released_logs(logs)), start_time)
        handler = trainer.callback_handler
        handler.callbacks = [self.callback] + [cb for cb in handler.callbacks if cb is not self.callback]
        if trainer.eval_dataset is not None and not self.eval_data_is_public:
            print(f"raydp: note: {EVAL_NOTE}", file=sys.stderr)
        return self

    def _public_probe(self, device):
        """A batch of PUBLIC records for a strategy that calibrates on them (RLDP's histogram bins)."""
        texts = self.public_texts
        if texts is None:
            texts = public_corpus(self.strategy.public_probe_records, seed=PUBLIC_PROBE_SEED, progress=False)
        if self.tokenizer is None:
            raise ConfigError(f"strategy {self.config.strategy!r} calibrates on public texts: pass the tokenizer")
        split = TokenizedSplit(list(texts), self.tokenizer, self.max_length)
        return split.collate(list(range(len(split))), device)

    # -- the hook (bound onto the Trainer instance) ------------------------------------------------
    def _train_dataloader(self) -> torch.utils.data.DataLoader:
        """Poisson batches of privacy units from the run's secret sampler, collated on the model's device into
        one opaque input (no tokens or sizes the Trainer could count or log; the dataset's length, which it logs,
        is the released number of units)."""
        split, device = self.split, self.device
        return torch.utils.data.DataLoader(
            _Indices(self.units.public_count), batch_sampler=self.batches, num_workers=0,
            collate_fn=lambda indices: {BATCH_KEY: split.collate(indices, device, width=self.width)})

    def _training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The DP step in place of the Trainer's forward/backward; returns a constant 0 (no loss is released)."""
        trainer = self.trainer
        zero = torch.zeros((), device=trainer.args.device)
        if BATCH_KEY not in inputs:
            raise ConfigError("the Trainer's batch is not a Poisson sample from DPTraining (its dataloader was "
                              "replaced)")
        self.model.train()
        started = time.perf_counter()
        try:
            self.last_metrics = self.run.step.compute(self.model, inputs[BATCH_KEY])
        except BudgetExhausted as stop:  # the guard or the Renyi filter refused the step before any release
            self.stopped_early = str(stop)
            self._expected = {}
            trainer.control.should_training_stop = True
            return zero
        finally:
            self.step_seconds += time.perf_counter() - started
        self._expected = {id(t): (t.grad, t.grad.detach().clone()) for p in self.run.step.pairs for t in (p.a, p.b)}
        return zero

    def _released_logs(self, logs: dict) -> dict:
        """The Trainer's log without its training loss, with post-processed figures of the DP release; the
        Trainer's other metrics (its evaluations') renamed ``unprotected_*`` unless the eval data is public (E15)."""
        training = "loss" in logs or "train_loss" in logs
        # in place: the Trainer returns this very dict from train() (TrainOutput.metrics), and save_metrics writes it
        released = {k: v for k, v in logs.items() if k not in ("loss", "train_loss")}
        if not self.eval_data_is_public:
            released = {unprotected_name(k): v for k, v in released.items()}
        # timings and the Trainer's memory metrics (skip_memory_metrics=False: peaks follow the private batch sizes)
        released = {UNPROTECTED_PREFIX + k if k in TIMING_LOG_KEYS or ("_mem_" in k and not k.startswith(
            UNPROTECTED_PREFIX)) else k: v for k, v in released.items()}
        logs.clear()
        logs.update(released)
        if training and self.run is not None:
            if self.last_metrics:
                logs["dp_sigma_eff"] = float(self.last_metrics["sigma_eff"])
                logs["dp_noisy_grad_norm"] = float(self.last_metrics["noisy_grad_norm"])
                logs["dp_clip_mean"] = float(self.last_metrics["clip_mean"])
            logs["dp_steps_charged"] = len(self.run.ledger)
            if self.log_epsilon:  # a fresh composition of the ledger at every logging step
                logs["dp_epsilon_spent"] = self.epsilon_spent()
                if not self.run.randomness.is_secret:  # unsafe_fixed_randomness: as the summary's epsilon_void
                    logs["dp_epsilon_void"] = 1
        return logs

    # -- what the callback asks -----------------------------------------------------------------------
    def _check_ready(self, args, state, train_dataloader, optimizer) -> None:
        if self.run is None or self.trainer is None:
            raise ConfigError("DPTraining is not attached: call dp.attach(trainer) before trainer.train()")
        if self._trained:
            raise ConfigError("this DPTraining has trained once; a new training needs a new DPTraining (and spends "
                              "budget again on the same people, ERRATA E14)")
        check_training_arguments(args, planned_steps=self.planned_steps, eval_data_is_public=self.eval_data_is_public)
        if state.global_step != 0:
            raise ConfigError("resuming a DP run from a Trainer checkpoint is not supported (its ledger would restart "
                              "empty and under-report epsilon); train from the start")
        if train_dataloader is not None and getattr(train_dataloader, "batch_sampler", None) is not self.batches:
            raise ConfigError("the Trainer's dataloader is not DPTraining's Poisson sampler (was get_train_dataloader "
                              "replaced after dp.attach?)")
        if optimizer is None:
            raise ConfigError("the Trainer has no optimizer at train begin; cannot check the gradients it applies")
        self._trained = True
        self._check_optimizer_steps(optimizer)

    def _check_optimizer_steps(self, optimizer) -> None:
        """Wrap ``optimizer.step`` (the Trainer's optimizer instance): the gradient it is about to apply is
        checked right at the call, after every callback and hook ran, and the strategy observes the update
        right after it."""
        inner = optimizer.step

        @functools.wraps(inner)  # keeps the LR scheduler's mark on the step it wrapped
        def step(*args, **kwargs):
            self._check_gradient(optimizer)
            result = inner(*args, **kwargs)
            self._after_update()
            return result

        optimizer.step = step

    def _check_gradient(self, optimizer) -> None:
        """Before ``optimizer.step()``: every parameter's gradient is the DP step's, unchanged, or None."""
        expected = self._expected
        if expected is None:
            raise ConfigError("optimizer.step() without a DP step before it (training_step was replaced?); refusing "
                              "to apply a gradient the DP step did not produce")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            entry = expected.get(id(p))
            if entry is None:
                if p.grad is not None:
                    raise ConfigError("a parameter outside the DP step's LoRA pairs has a gradient; refusing to apply "
                                      "it (it was neither clipped nor noised)")
            elif p.grad is not entry[0] or not torch.equal(p.grad, entry[1]):
                raise ConfigError("the gradient about to be applied is not the DP step's (something between "
                                  "training_step and optimizer.step changed it: clipping, accumulation, a hook); "
                                  "refusing to apply it")

    def _after_update(self) -> None:
        self._expected = None
        self.run.step.after_update(self.model)

    def _step_end(self, control) -> None:
        """After the update: the controller acts, then the guard says whether another step may run."""
        step = len(self.run.ledger)
        self.run.step.between_steps(step)
        reason = self.stopped_early or self.run.step.stop_reason(step)
        if reason is not None:
            if step < self.planned_steps and self.stopped_early is None:
                self.stopped_early = reason
            control.should_training_stop = True

    # -- results ----------------------------------------------------------------------------------------
    @property
    def ledger(self):
        return None if self.run is None else self.run.ledger

    @property
    def steps_charged(self) -> int:
        return 0 if self.run is None else len(self.run.ledger)

    def epsilon_spent(self) -> float:
        """Epsilon of the ledger so far: the enforcing accountant's fresh composition (fixed schedule), or the
        Renyi filter's spent curve (adaptive sigma); 0 before the first step."""
        ledger = self.run.ledger if self.run is not None else None
        if not ledger:
            return 0.0
        if self.plan.adaptive:
            return float(self.run.guard.spent(ledger))
        return float(self.run.guard.accountant.epsilon(ledger, self.config.delta))

    def summary(self) -> dict:
        """:func:`raydp.runner.privacy_summary` of the run (the guarantee, every accountant, unit, labels),
        with what this integration adds (steps, early stop, the loss note, dropout)."""
        if self.run is None:
            raise ConfigError("DPTraining is not attached: nothing trained yet")
        out = privacy_summary(self.run, self.config)
        out.update(integration="transformers.Trainer", steps=len(self.run.ledger), stopped_early=self.stopped_early,
                   controller=self.controller or None, loss_note=LOSS_NOTE,
                   eval_note=("the Trainer's eval data is declared public (eval_data_is_public=True)"
                              if self.eval_data_is_public else EVAL_NOTE),
                   dropout=f"off: {self.dropout_disabled} dropout rates set to 0 in the model (ERRATA E12)",
                   unprotected_dp_step_seconds_total=round(self.step_seconds, 3))  # timing: see TIMING_LOG_KEYS
        return out

    def ledger_file(self) -> Path:
        """Where the ledger goes: :attr:`ledger_path`, else ``<output_dir>/privacy_ledger.parquet``."""
        return Path(self.ledger_path or Path(self.trainer.args.output_dir) / LEDGER_FILENAME)

    def finish(self) -> dict | None:
        """After training, once: the strategy writes what it keeps (RLDP: its clip/noise trace and decisions,
        and it leaves its policy) beside the ledger; its summary joins :meth:`summary` as ``controller``."""
        if self.run is None or self.controller is not None:
            return self.controller
        directory = self.ledger_file().parent
        directory.mkdir(parents=True, exist_ok=True)
        self.controller = self.strategy.finish(directory) or {}
        if self.client is not None and getattr(self.client, "service", None) is not None:
            self._send_provenance(directory)
        return self.controller

    def _send_provenance(self, directory: Path) -> None:
        """A policy this run trained must remember it (ERRATA E14): the run's provenance entry (dataset
        id, privacy mode and unit, epsilon, RDP curve), as :func:`raydp.runner.run.run_training`
        gives it, goes to the policy's owner through ``save_policy`` (the RLlink server records it). The dataset
        is named by its keyed id, never by a hash anyone could recompute."""
        privacy = privacy_summary(self.run, self.config)
        manifest = {"dataset_id": self.dataset_id or keyed_id(  # the Trainer's records: private, so keyed
            hashlib.sha256(json.dumps(self.split.sequences).encode()).hexdigest())}
        self.client.save_policy(
            directory / "policy", trained_on=trained_on(self.config, n_adapter_pairs=len(self.run.step.pairs),
                                                        epsilon=self.config.epsilon, steps=len(self.run.ledger),
                                                        privacy_mode=self.run.strategy.privacy_mode,
                                                        decisions=self.controller.get("decisions")),
            results={"epsilon": privacy["epsilon"], "labels": privacy["labels"]},
            provenance=policy_provenance(self.run, self.config, manifest, privacy))

    def save(self, path: str | Path | None = None) -> Path:
        """Write the ledger to ``path`` (default :meth:`ledger_file`) and the privacy summary beside it as
        ``privacy_summary.json``; returns the ledger's path."""
        if self.run is None:
            raise ConfigError("DPTraining is not attached: nothing to save")
        path = Path(path) if path is not None else self.ledger_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.run.ledger.save(path)
        (path.parent / SUMMARY_FILENAME).write_text(json.dumps(self.summary(), indent=2, default=_jsonable))
        return path


def _jsonable(value):
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def _max_positions(model) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 512)


class DPCallback(TrainerCallback):
    """The Trainer-side guard of a :class:`DPTraining` (``dp.callback``): refusals before training; it wraps
    the Trainer's ``optimizer.step`` so that every update first checks that the gradient is the DP step's and
    then shows the strategy its update; the controller and the budget guard at every step end; the ledger
    at every checkpoint and at the end."""

    def __init__(self, dp: DPTraining):
        self.dp = dp

    def on_train_begin(self, args, state, control, train_dataloader=None, optimizer=None, **kwargs):
        self.dp._check_ready(args, state, train_dataloader, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self.dp._step_end(control)
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """First among the callbacks: the evaluation's metrics are relabelled in place (E15), so later
        callbacks and ``evaluate()``'s caller get ``unprotected_*`` unless the eval data is public."""
        if metrics is not None and not self.dp.eval_data_is_public:
            relabel_unprotected(metrics)

    def on_save(self, args, state, control, **kwargs):
        if self.dp.run is not None and args.should_save:
            self.dp.save()

    def on_train_end(self, args, state, control, **kwargs):
        if self.dp.run is not None and args.should_save:
            self.dp.finish()
            self.dp.save()
