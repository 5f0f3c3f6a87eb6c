"""A run's directory: the one place that names the files a training run writes, and reads them back.

Every stage that reads a run (study results, the report, private selection, evaluation, the wandb reporter) goes
through :class:`RunDirectory`; no other module spells a run's file names. What each file holds and which of it is
releasable is :data:`raydp.runner.run.RUN_PRIVACY_NOTE`'s business; this module only says where things are.

    adapter/                     the LoRA adapter (PEFT's save_pretrained)
    config.json                  the run's TrainConfig
    summary.json                 the run summary (:class:`RunSummary`)
    PRIVACY.txt                  what is releasable, and what inside it is unprotected
    privacy_ledger.parquet       every release and its accounting
    train_metrics.parquet        per-step noisy-gradient figures
    eval_metrics.parquet         perplexity (and the value-token NLL) per evaluation
    control_trace.parquet        a controlled run's per-decision trace
    controller_decisions.parquet a controlled run's decisions
    policy/                      a controlled run's policy snapshot
    evaluation.json              ``raydp eval``'s attacks and audit (written beside the run, or under the study)
    private/dataset/             the dataset the run built for itself (private records: never released)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER = "adapter"
CONFIG = "config.json"
SUMMARY = "summary.json"
PRIVACY_NOTE = "PRIVACY.txt"
LEDGER = "privacy_ledger.parquet"
TRAIN_METRICS = "train_metrics.parquet"
EVAL_METRICS = "eval_metrics.parquet"
CONTROL_TRACE = "control_trace.parquet"
CONTROLLER_DECISIONS = "controller_decisions.parquet"
POLICY = "policy"
EVALUATION = "evaluation.json"
PRIVATE = "private"

#: what a finished run's directory holds for a wandb artifact or a released copy (controller files aside)
RELEASE_FILES = (ADAPTER, SUMMARY, CONFIG, PRIVACY_NOTE, LEDGER)


@dataclass(frozen=True)
class RunSummary:
    """A run's ``summary.json``, typed where readers rely on a field; :attr:`raw` keeps every field as written.

    The fields are those every run writes (:func:`raydp.runner.run.run_training`); a field a run of another kind
    may lack (the value-token NLL, a public perplexity) is read with :meth:`get`."""

    raw: dict[str, Any]

    @property
    def model(self) -> str:
        return self.raw["model"]

    @property
    def strategy(self) -> str:
        return self.raw["strategy"]

    @property
    def steps(self) -> int:
        return int(self.raw["steps"])

    @property
    def privacy(self) -> dict[str, Any]:
        return self.raw.get("privacy") or {}

    @property
    def epsilon(self) -> float | None:
        return self.privacy.get("epsilon")

    @property
    def final_eval_perplexity(self) -> float:
        return float(self.raw["final_eval_perplexity"])

    @property
    def dataset_id(self) -> str | None:
        return self.raw.get("dataset_id")

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]


@dataclass(frozen=True)
class RunDirectory:
    """The named paths of one run's directory ``root`` (which need not exist yet: a run writes into a staging
    directory and renames it into place, :func:`raydp.runner.output.staged_output`)."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def adapter(self) -> Path:
        return self.root / ADAPTER

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def privacy_note(self) -> Path:
        return self.root / PRIVACY_NOTE

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def train_metrics(self) -> Path:
        return self.root / TRAIN_METRICS

    @property
    def eval_metrics(self) -> Path:
        return self.root / EVAL_METRICS

    @property
    def control_trace(self) -> Path:
        return self.root / CONTROL_TRACE

    @property
    def controller_decisions(self) -> Path:
        return self.root / CONTROLLER_DECISIONS

    @property
    def policy(self) -> Path:
        return self.root / POLICY

    @property
    def evaluation(self) -> Path:
        return self.root / EVALUATION

    @property
    def private(self) -> Path:
        return self.root / PRIVATE

    @property
    def private_dataset(self) -> Path:
        """The dataset a run built for itself (a synthetic source), under its owner-only ``private/``."""
        return self.private / "dataset"

    def is_finished(self) -> bool:
        """A run's directory appears only when complete, summary included (staged_output)."""
        return self.summary.is_file()

    def read_summary(self) -> RunSummary:
        return RunSummary(json.loads(self.summary.read_text()))

    def read_config(self) -> dict[str, Any] | None:
        """The run's TrainConfig as written (a dict: validating it needs :mod:`raydp.config`), or None."""
        return json.loads(self.config.read_text()) if self.config.is_file() else None
