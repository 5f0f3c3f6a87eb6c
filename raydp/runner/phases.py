"""A non-private phase before the DP phase (DualTune-GhostDP phase 1; JFT's first fine-tuning).

The strategy says what the phase trains on (:class:`~raydp.strategies.base.WarmStart`); this module
runs it with the shared loop (:class:`~raydp.runner.loop.Trainer`, plain mini-batch gradients) on the
run's model before the DP step is set up, and says what it did:

* ``public``: the public corpus (a synthetic population disjoint from every private record, drawn with
  its own seed, apart from the public probe and validation records), :data:`PUBLIC_PHASE_ONE_RECORDS` records
  unless the settings say how many. Nothing private is touched, not even the number of private records, so the
  run's epsilon covers the whole run and everything the phase reports is public.
* ``redacted``: the private training records after the secret detector (:mod:`raydp.data.redaction`).
  No epsilon covers this phase (ERRATA E16): the strategy labels the run. The detector's recall on the
  run's own canaries is measured on private records and reported as such (not a DP release); its recall
  per sensitive field is measured on PUBLIC records of the same schema.

Evaluations during the phase use public validation records only.
"""

from __future__ import annotations

import math
import time

from raydp.config import TrainConfig
from raydp.data import load_canaries, public_corpus
from raydp.runner.gradients import NonPrivateGradient
from raydp.runner.loop import OptimizerSettings, Trainer
from raydp.runner.sampling import ShuffledBatchSampler
from raydp.strategies.base import WarmStart

#: the public corpus of a public phase 1 (apart from the probe's 7777 and public validation's 8888)
PUBLIC_PHASE_ONE_SEED = 9_999
#: a public phase 1's records unless ``phase1_records`` says otherwise: a public constant, never the private training
#: record count (that would make phase 1, and so the released adapter, a non-DP function of the private records,
#: canaries included). About the size of the benchmark default's training set (~5,500 of 10,000 synthetic records).
PUBLIC_PHASE_ONE_RECORDS = 5_000
#: public records the detector's per-field recall is measured on
RECALL_RECORDS = 200
UNPROTECTED_NOTE = "computed on the private training records: not a DP release (unprotected)"


def phase_one_texts(warm: WarmStart, train_texts: list[str], dataset_dir, progress: bool = False,
                    keep: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    """The phase's training texts and what to report about them; ``keep``: text the detector must leave
    (a classification task's label sentences, which carry no secret of their own). A public phase never looks at
    ``train_texts``."""
    if warm.data == "public":
        n = warm.records or PUBLIC_PHASE_ONE_RECORDS
        return public_corpus(n, seed=PUBLIC_PHASE_ONE_SEED, progress=progress), {
            "data": "public", "records": n, "public_seed": PUBLIC_PHASE_ONE_SEED,
            "note": "public corpus: covered by no epsilon because it needs none"}
    if warm.data != "redacted":
        raise ValueError(f"unknown phase-1 data {warm.data!r}")
    from raydp.data.redaction import SecretDetector, canary_recall, field_recall  # spaCy: imported when used
    from raydp.data.public import public_records

    detector = SecretDetector(warm.detector, pipeline=warm.detector_pipeline, keep=keep)
    redacted = detector.redact_all(train_texts)  # one process: a run may itself be a Ray worker (no fork)
    canaries = load_canaries(dataset_dir)
    private_recall = None
    if len(canaries):  # the count only: the secrets it missed are private and stay out of every output
        measured = canary_recall(train_texts, list(canaries["secret"]), detector)
        private_recall = {k: measured[k] for k in ("found", "total", "recall")}
    public_recall = field_recall(public_records(RECALL_RECORDS, PUBLIC_PHASE_ONE_SEED, progress=False), detector)
    return redacted, {  # no count: the number of redacted texts is the private training record count
        "data": "redacted", "detector": detector.describe(),
        "canary_recall_private": None if private_recall is None else {**private_recall, "note": UNPROTECTED_NOTE},
        "field_recall_public": public_recall,
        "note": "phase 1 trained non-privately on redacted private records: no epsilon covers it (ERRATA E16)"}


def run_phase_one(warm: WarmStart, config: TrainConfig, loaded, task, train_texts: list[str], max_length: int,
                  public_eval, dataset_dir, progress: bool | str = True) -> dict:
    """Fine-tune ``loaded.model`` non-privately for ``warm.epochs`` on the phase's texts; returns its report."""
    started = time.perf_counter()
    keep = tuple(sentence for sentence, _ in task.spec.sentences) if task.is_classification else ()
    texts, report = phase_one_texts(warm, train_texts, dataset_dir, progress=bool(progress), keep=keep)
    split = task.split(texts, loaded.tokenizer, max_length)
    sampler = ShuffledBatchSampler(len(split), config.batch_size, seed=config.seed)
    steps = max(1, math.ceil(warm.epochs * sampler.steps_per_epoch - 1e-9))
    gradient = NonPrivateGradient(task.loss if task.is_classification else None)
    gradient.name = f"phase 1, non-private, {warm.data}"
    lr = warm.lr or config.lr
    trainer = Trainer(loaded.model, split, public_eval, sampler, gradient, loaded.device,
                      optimizer=OptimizerSettings(lr=lr, warmup_steps=config.warmup_steps), eval_every=0,
                      eval_max_sequences=config.eval_max_records, progress=progress, evaluate=task.evaluate)
    history = trainer.run(steps)
    rows = history.eval_rows
    if warm.data == "public":  # counts of public records; a redacted phase's are the private record count's
        report.update({"steps": trainer.step_count, "trained_records": len(split)})
    report.update({
        "epochs": warm.epochs, "lr": lr, "batch_size": config.batch_size,
        "public_perplexity_before": rows[0]["perplexity"], "public_perplexity_after": rows[-1]["perplexity"],
        **({"public_accuracy_before": rows[0]["accuracy"], "public_accuracy_after": rows[-1]["accuracy"]}
           if task.is_classification else {}),
        "seconds": round(time.perf_counter() - started, 2)})
    return report
