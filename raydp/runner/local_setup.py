"""Wiring a forward-pass local-DP run (``ewft``, ``dpforward``): plan, patient cap, labels, autoencoder,
noise layer, ledger.

Order, so that an impossible request fails before any training: :func:`plan_local_run` needs only public
numbers (the target, the cap, the number of training records and epochs) and runs before the model loads;
:func:`setup_local_run` then builds everything on the loaded model.

Privacy (ERRATA E8, E11, E12):

* one unit is a patient who contributes EXACTLY ``records_per_patient`` training records (the first ones
  in file order; a patient with fewer has theirs repeated; :func:`unit_records`), or a record under
  ``privacy_unit: record``. Exactly, not at most: the receiver counts the releases it gets per patient,
  and a patient's number of encounters is itself health data; with a fixed count the training set has
  k x N_units records, N_units treated as public like everywhere else;
* each training record's embedding is released once per epoch (shuffled fixed batches: every record
  exactly once an epoch; the order is not part of the mechanism), each label once per run by randomized
  response with the run's secret generator;
* noise and label draws come from fresh OS entropy per run (:class:`PrivateRandomness`); the autoencoder
  is fitted on public records only and frozen with the user's side of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from raydp.config import TrainConfig
from raydp.data import public_corpus
from raydp.errors import ConfigError
from raydp.model.autoencoder import StackedAutoencoder, pretrain_autoencoder
from raydp.privacy.forward import ForwardLDPStep, ForwardNoiseLayer, install_noise_layer, transformer_blocks
from raydp.privacy.ledger import LOCAL_RELATION, PrivacyLedger
from raydp.privacy.local import PAPER_FIGURE_LABEL, LocalPlan, calibrate_local_scale, paper_epsilon, \
    randomized_response
from raydp.runner.privacy_setup import PrivacyUnits, private_randomness
from raydp.runner.sampling import ShuffledBatchSampler

#: public records the autoencoder is fitted on (the public population, apart from probe and validation)
PUBLIC_AUTOENCODER_SEED = 6_666
NEIGHBOURING_LOCAL = "replace-one (local DP: any two inputs of one user; sensitivity 2C)"


def is_local(strategy) -> bool:
    return getattr(strategy, "mechanism", None) == "local"


def unit_records(unit_ids: np.ndarray | None, n_records: int, k: int) -> np.ndarray:
    """Indices of exactly ``k`` training records per unit, units in order of first appearance: a unit's
    first ``k`` records, cycled when it has fewer (every record is its own unit when ``unit_ids`` is None)."""
    if unit_ids is None:
        return np.arange(n_records)
    rows: dict = {}
    for i, unit in enumerate(unit_ids.tolist()):
        rows.setdefault(unit, []).append(i)
    return np.asarray([r[j % len(r)] for r in rows.values() for j in range(k)], dtype=np.int64)


def unit_training_set(texts: list[str], units: PrivacyUnits, strategy) -> tuple[list[str], PrivacyUnits]:
    """The training texts and units with exactly ``records_per_patient`` records per patient (all records
    under the record unit)."""
    if units.ids is None:
        return texts, units
    kept = unit_records(units.ids, len(texts), strategy.settings.records_per_patient)
    return [texts[i] for i in kept], PrivacyUnits(units.name, units.count, units.ids[kept], units.held_back)


@dataclass(frozen=True)
class LocalPlanned:
    """The checked request of a local run: epochs, steps, the calibrated per-epoch sigmas."""

    plan: LocalPlan
    epochs: int
    steps_per_epoch: int
    records_per_unit: int
    n_records: int
    epsilon_label: float | None
    paper_q: float

    @property
    def planned_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def plan_local_run(config: TrainConfig, strategy, units: PrivacyUnits, n_classes: int = 2) -> LocalPlanned:
    """Calibrate the schedule's scale so the per-unit local epsilon lands on the target. Public inputs only:
    the number of units (treated as public) times the records each contributes."""
    settings = strategy.settings
    k_max = settings.records_per_patient if units.name == "patient" else 1
    if units.held_back:  # TrainConfig refuses n_audit for local strategies; a built dataset may still have them
        raise ConfigError("this dataset has audit canaries (an add/remove membership game): a local mechanism is "
                          "replace-one; build the dataset with n_audit: 0")
    n_records = k_max * units.count
    epochs = max(1, math.ceil(config.epochs - 1e-9))
    batch = min(config.batch_size, n_records)
    steps_per_epoch = math.ceil(n_records / batch)
    if config.max_steps:
        epochs = min(epochs, math.ceil(config.max_steps / steps_per_epoch))
    q = batch / n_records
    multipliers = strategy.multipliers(config.epsilon, config.delta, q, epochs, steps_per_epoch)
    share = settings.label_share
    epsilon_label = share * config.epsilon / k_max if share > 0 else None
    plan = calibrate_local_scale(multipliers, config.epsilon, config.delta, records_per_unit=k_max,
                                 epsilon_label=epsilon_label, n_classes=n_classes)
    return LocalPlanned(plan, epochs, steps_per_epoch, k_max, n_records, epsilon_label, q)


@dataclass
class LocalRun:
    planned: LocalPlanned
    step: ForwardLDPStep
    sampler: ShuffledBatchSampler
    ledger: PrivacyLedger
    layer: ForwardNoiseLayer
    units: PrivacyUnits
    strategy: object
    randomness: object
    block: int
    frozen: list[str]
    autoencoder_error: float | None

    @property
    def planned_steps(self) -> int:
        return self.planned.planned_steps


def setup_local_run(config: TrainConfig, planned: LocalPlanned, strategy, loaded, train, units: PrivacyUnits,
                    task, max_length: int, start_step: int = 0) -> LocalRun:
    """Randomized-response labels, the public autoencoder, the noise layer, ledger and step."""
    if not task.is_classification:
        raise ConfigError(f"strategy {strategy.name!r} trains a classification task (task: {{kind: classification}})")
    if len(train) != planned.n_records:
        raise ConfigError("the local plan was made for another training set than this one")
    settings = strategy.settings
    randomness = private_randomness(config, start_step)
    if planned.epsilon_label is not None:  # once per record per run, reused every epoch (post-processing);
        # a resumed run gets the labels of its checkpoint back (ForwardLDPStep.load_state_dict)
        train.labels = randomized_response(train.labels, planned.epsilon_label, task.spec.n_classes,
                                           randomness.sampling_rng())
    model = loaded.model
    blocks = transformer_blocks(model)
    block = settings.layer if settings.layer is not None else max(0, len(blocks) // 2 - 1)
    autoencoder, error = None, None
    dims = strategy.autoencoder_dims
    if dims:
        width = int(getattr(model.config, "n_embd", None) or getattr(model.config, "hidden_size"))
        autoencoder = StackedAutoencoder(width, dims).to(loaded.device)
        error = pretrain_autoencoder(autoencoder, public_hidden_states(model, blocks[block], task, loaded,
                                                                       max_length, settings.public_records),
                                     steps=settings.autoencoder_steps, seed=config.seed)
    layer = ForwardNoiseLayer(settings.clip, autoencoder, noise=randomness.noise(loaded.device))
    _, frozen = install_noise_layer(model, block, layer)
    ledger = PrivacyLedger(delta=config.delta, epsilon_target=config.epsilon, accountant="local",
                           metadata={"privacy_unit": units.name, "mechanism": "local",
                                     "neighbouring_relation": LOCAL_RELATION,
                                     "local_plan": local_plan_metadata(planned.plan),
                                     "guarantee": "local-exact" if planned.plan.is_exact() else "local-upper-bound",
                                     "guarantee_note": LOCAL_GUARANTEE_NOTE, "randomness": randomness.source,
                                     "labels": local_labels(planned, randomness)})
    step = ForwardLDPStep(layer, planned.plan.sigmas, planned.records_per_unit, ledger, planned.steps_per_epoch,
                          task.loss, strategy.name, train_split=train)
    sampler = ShuffledBatchSampler(len(train), config.batch_size, seed=config.seed)
    return LocalRun(planned, step, sampler, ledger, layer, units, strategy, randomness, block, frozen, error)


def local_plan_metadata(plan: LocalPlan) -> dict:
    """What the ledger file keeps of the plan, so that its spend can be recomputed from the file alone
    (labels included; a study composes an unfinished trial's checkpoint ledger this way)."""
    return {"records_per_unit": plan.records_per_unit, "epsilon_label": plan.epsilon_label,
            "n_classes": plan.n_classes}


def ledger_local_plan(metadata: dict, sigma_eff) -> LocalPlan | None:
    """The local plan of what a local-DP ledger charged (None for another ledger): one Gaussian release
    per row at sigma_eff * sqrt(k) per record, and the labels once the first row is charged."""
    spec = (metadata or {}).get("local_plan")
    if not isinstance(spec, dict) or not len(sigma_eff):
        return None
    k = int(spec["records_per_unit"])
    return LocalPlan(tuple(float(s) * math.sqrt(k) for s in sigma_eff), k, spec.get("epsilon_label"),
                     int(spec.get("n_classes", 2)))


LOCAL_GUARANTEE_NOTE = ("local DP on hidden embeddings: each unit's cost is the composition of the releases of its "
                        "records (one per epoch) and of its randomized-response labels, with no amplification by "
                        "subsampling (ERRATA E8); Gaussian part exact (GDP composition, Dong, Roth & Su 2019, Cor. "
                        "3.3; analytic Gaussian curve, Balle & Wang 2018)")


@torch.no_grad()
def public_hidden_states(model, block_module, task, loaded, max_length: int, n_records: int) -> list[torch.Tensor]:
    """Hidden states at ``block_module``'s output on PUBLIC prompts (what the autoencoder is fitted on)."""
    captured: list[torch.Tensor] = []

    def grab(module, inputs, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    split = task.split(public_corpus(n_records, seed=PUBLIC_AUTOENCODER_SEED), loaded.tokenizer, max_length)
    handle = block_module.register_forward_hook(grab)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(split), 32):
            batch = split.collate(list(range(start, min(start + 32, len(split)))), loaded.device)
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        handle.remove()
        model.train(was_training)
    return captured


def local_labels(planned: LocalPlanned, randomness) -> list[str]:
    labels = list(planned.plan.labels())
    if randomness.label:
        labels.append(randomness.label)
    return labels


def local_privacy_summary(run: LocalRun, config: TrainConfig) -> dict:
    """The local guarantee for the epochs charged, the ledger's Gaussian part under PLD beside it (labels
    excluded: a cross-check), and the paper's subsampled figure, labelled."""
    from raydp.privacy.accounting import get_accountant
    from raydp.privacy.accounting.rdp import DEFAULT_ORDERS

    plan, planned = run.planned.plan, run.planned
    charged = len(run.ledger)
    spent = ledger_local_plan(run.ledger.metadata, run.ledger.sigma_eff)  # what the ledger charged
    epsilon = spent.epsilon(config.delta) if spent is not None else 0.0
    labels = local_labels(planned, run.randomness)
    ledger_pld = get_accountant("pld").epsilon(run.ledger, config.delta) if charged else 0.0
    paper = paper_epsilon(plan.sigmas[:charged], planned.paper_q, planned.steps_per_epoch, config.delta) \
        if charged else 0.0
    within = epsilon <= config.epsilon * (1 + 1e-9)
    verdict = (f"epsilon={epsilon:.4f} at delta={config.delta:g} (local accounting, {run.units.name} unit, "
               f"{charged} of {planned.epochs} epochs): {'within' if within else 'OVER'} the budget "
               f"epsilon={config.epsilon:g}")
    if labels:
        verdict = f"{verdict} [{'; '.join(labels)}]"
    return {
        "mechanism": "forward-pass local DP: clipped (encoded) hidden states + Gaussian noise, randomized-response labels",
        "neighbouring_relation": NEIGHBOURING_LOCAL,
        "privacy_unit": run.units.name,
        "n_units": run.units.public_count,
        "unit_note": run.units.note,
        "records_per_unit": planned.records_per_unit,
        "epsilon_target": config.epsilon,
        "delta": config.delta,
        "q": None,
        "planned_steps": planned.planned_steps,
        "epochs_charged": charged,
        "sigma_0": plan.sigmas[0],
        "sigmas_per_epoch": list(plan.sigmas),
        "clip": run.layer.clip,
        "noise_layer_after_block": run.block,
        "frozen_user_side": len(run.frozen),
        "autoencoder": None if run.layer.autoencoder is None else {
            **run.layer.autoencoder.describe(), "public_relative_reconstruction_error": run.autoencoder_error},
        "epsilon_label": planned.epsilon_label,
        "guarantee": "local",
        "guarantee_note": LOCAL_GUARANTEE_NOTE,
        "enforcing_accountant": "local",
        "epsilon": epsilon,
        "within_budget": within,
        "verdict": verdict,
        "epsilon_by_accountant": {"local": epsilon, "pld_ledger_embeddings_only": ledger_pld},
        "paper_epsilon": paper,
        "paper_epsilon_note": PAPER_FIGURE_LABEL,
        "local_plan": plan.describe(config.delta),
        # what a study composes across trials on the same data (raydp.study.results.run_rdp_curve)
        "local_rdp": {"orders": list(DEFAULT_ORDERS), "curve": (spent.rdp_curve(DEFAULT_ORDERS).tolist() if spent
                                                                else [0.0] * len(DEFAULT_ORDERS))},
        "strategy": run.strategy.describe(),
        "privacy_mode": "strict",
        "randomness": run.randomness.source,
        "epsilon_void": not run.randomness.is_secret,
        "labels": labels,
        "privacy_label": "; ".join(labels) if labels else None,
    }
