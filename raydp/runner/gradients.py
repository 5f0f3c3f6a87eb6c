"""Gradient computations: the part of a training step that differs between strategies.

A gradient computation takes the model and a batch, leaves the gradient to apply in each trainable
parameter's ``.grad``, and returns what the step may report (loss, batch size, ...). The training
loop does the rest (sampling, optimiser update, evaluation), so private strategies plug in here
without copying the loop.
"""

from __future__ import annotations

from typing import Protocol

import torch

from raydp.model.batches import Batch
from raydp.model.loss import per_sequence_nll


class GradientComputation(Protocol):
    """Fills ``.grad`` of the trainable parameters for one batch and returns metrics of the step."""

    name: str
    #: a DP step: its time depends on the secret sampling (ERRATA E5), so the loop does not record it
    private: bool

    def compute(self, model: torch.nn.Module, batch: Batch) -> dict: ...

    def after_update(self, model: torch.nn.Module) -> None:
        """Called after the optimiser applied the gradient (e.g. to show a strategy its update)."""

    def wants_checkpoint(self, step: int) -> bool:
        """Whether the loop must checkpoint after ``step`` (before :meth:`between_steps`)."""

    def between_steps(self, step: int) -> None:
        """Called after step ``step`` is complete and checkpointed (a controller decides here)."""

    def stop_reason(self, step: int) -> str | None:
        """Asked before each step, ``step`` steps done: why the run must stop now (e.g. the privacy
        budget cannot pay for another step), or None to go on. The loop then stops cleanly."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class NonPrivateGradient:
    """Plain mini-batch gradient of the mean per-example loss (no privacy). ``loss``: the task's
    per-example loss (:class:`raydp.runner.task.Task`; language modelling by default)."""

    name = "nonprivate"
    private = False

    def __init__(self, loss=None):
        self.loss = loss

    def compute(self, model: torch.nn.Module, batch: Batch) -> dict:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        if self.loss is None:
            losses = per_sequence_nll(logits, batch.input_ids, batch.attention_mask)
        else:
            losses = self.loss(logits, batch.input_ids, batch.attention_mask, batch.labels)
        loss = losses.mean()
        loss.backward()
        return {"loss": float(loss.detach()), "batch_size": batch.size}

    def after_update(self, model: torch.nn.Module) -> None:
        pass

    def wants_checkpoint(self, step: int) -> bool:
        return False

    def between_steps(self, step: int) -> None:
        pass

    def stop_reason(self, step: int) -> str | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
