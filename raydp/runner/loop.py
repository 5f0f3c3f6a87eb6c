"""The fine-tuning loop, as separate steps: sample, compute gradients, update, evaluate.

RLDP Sec. 3.1 training setup: AdamW (betas 0.9/0.999, no weight decay), learning rate 5e-4 after a
linear warm-up of 100 steps, then constant (or, optionally, a linear or cosine decay to a fraction of the peak
by the last planned step: :func:`lr_multiplier`); held-out perplexity every 48 steps and at each epoch end
(Sec. 3.3). What differs between strategies is the gradient computation (and, under DP, the sampler);
the loop is shared.

Evaluations measure perplexity on the private held-out eval split (not a DP release: reported,
labelled unprotected) and on a PUBLIC validation split, which is what studies select on (ERRATA E15).

Order of durable state and outside observers (resume, ERRATA E12/E14): when a checkpoint callback is
set, a step's evaluation is checkpointed before ``on_evaluation`` tells anyone outside the run; a
controller decision is checkpointed before it is taken (its observation is then in a durable ledger)
and again right after (its action is durable before any step uses it), so a resumed run never shows
an outside observer something its ledger does not hold and never re-draws an action it already used.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from raydp.evaluation.perplexity import PerplexityResult, evaluate_perplexity
from raydp.model.batches import TokenizedSplit
from raydp.privacy.guard import BudgetExhausted
from raydp.runner.gradients import GradientComputation
from raydp.runner.history import MetricHistory
from raydp.runner.progress import Progress


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 100
    #: after the warm-up: "constant" (the paper's), "linear" or "cosine" decay to ``lr_end`` x the peak at
    #: ``total_steps`` (a decay needs ``total_steps``)
    decay: str = "constant"
    lr_end: float = 0.0
    total_steps: int | None = None
    #: when a clip group's radius changes by k between steps, scale its AdamW moments by k (first) and k^2
    #: (second), so the step size follows the new clip instead of collapsing or exploding for ~1/(1-beta2)
    #: steps; the clips are the strategy's (public) choices
    rescale_moments: bool = False


LR_DECAYS = ("constant", "linear", "cosine")


def lr_multiplier(settings: OptimizerSettings):
    """The learning-rate multiplier of update ``step`` (0-based): linear from 1/warmup to 1 over
    ``warmup_steps`` updates, then 1 ("constant") or a decay from 1 to ``lr_end`` at the last planned update
    (linear; cosine: lr_end + (1 - lr_end)(1 + cos(pi u))/2, u the fraction of the post-warm-up steps done,
    Loshchilov & Hutter 2017, SGDR, without restarts). Fixed before training from public settings, so under
    DP it is part of the (public) algorithm, not a choice made from the data."""
    warmup, decay, end = settings.warmup_steps, settings.decay, float(settings.lr_end)
    if decay not in LR_DECAYS:
        raise ValueError(f"unknown learning-rate decay {decay!r}; choose one of {', '.join(LR_DECAYS)}")
    if decay != "constant" and not settings.total_steps:
        raise ValueError("a learning-rate decay needs the run's total_steps")
    span = max(1, (settings.total_steps or 1) - warmup)

    def multiplier(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        u = min(1.0, (step - warmup) / span)
        if decay == "linear":
            return 1.0 - (1.0 - end) * u
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * u))

    return multiplier


def warmup_then_constant(warmup_steps: int):
    """LR multiplier: linear from 1/warmup to 1 over ``warmup_steps`` updates, then 1."""
    return lr_multiplier(OptimizerSettings(warmup_steps=warmup_steps))


def evaluation_steps(total_steps: int, steps_per_epoch: float, eval_every: int) -> set[int]:
    """Steps (1-based, after the update) at which to evaluate: every ``eval_every``, each epoch end, the last.

    Epoch ``e`` ends at the first step by which ``e`` epochs' worth of batches have been drawn, ``ceil(e x
    steps_per_epoch)``. (Rounding to the nearest step put a DP run's last epoch end at step 702 of 703 and evaluated
    both, about 6% of the benchmark default's run for one figure.)"""
    steps = set(range(eval_every, total_steps + 1, eval_every)) if eval_every > 0 else set()
    n_epochs = math.ceil(total_steps / steps_per_epoch - 1e-9)
    steps |= {min(total_steps, math.ceil(e * steps_per_epoch - 1e-9)) for e in range(1, n_epochs + 1)}
    steps.add(total_steps)
    return steps


class Trainer:
    """Runs ``total_steps`` updates of the trainable (LoRA) parameters of ``model``."""

    def __init__(
        self,
        model: torch.nn.Module,
        train: TokenizedSplit,
        evaluation: TokenizedSplit,
        sampler,
        gradient: GradientComputation,
        device: torch.device,
        optimizer: OptimizerSettings = OptimizerSettings(),
        eval_every: int = 48,
        eval_max_sequences: int | None = None,
        progress: bool | str = True,
        on_evaluation=None,
        on_checkpoint=None,
        checkpoint_every: int | None = None,
        public_evaluation: TokenizedSplit | None = None,
        evaluate=evaluate_perplexity,
        batch_width: int | None = None,
    ):
        """``evaluate(model, split, device, max_sequences=...)``: the task's evaluation metric (held-out
        perplexity for language modelling, the default); it returns a result with ``perplexity``,
        ``nll_per_token``, ``utility`` and ``n_tokens``. ``batch_width``: pad every training batch to this many
        tokens (a DP run's fixed width), instead of to its longest sequence."""
        self.model = model
        self.batch_width = batch_width
        self.evaluate_split = evaluate
        self.train_split = train
        self.eval_split = evaluation
        self.sampler = sampler
        self.gradient = gradient
        self.device = device
        self.eval_every = eval_every
        self.eval_max_sequences = eval_max_sequences
        self.progress = progress  # a mode of raydp.runner.progress: a bar on a terminal, lines in a log
        self.public_split = public_evaluation
        self.on_evaluation = on_evaluation  # callable(step, eval row), after the row is checkpointed
        self.on_checkpoint = on_checkpoint  # callable(trainer) at checkpoint points (see run())
        self.checkpoint_every = checkpoint_every
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=optimizer.lr, betas=optimizer.betas, weight_decay=optimizer.weight_decay
        )
        self.optimizer_settings = optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(optimizer))
        self.history = MetricHistory()
        self.step_count = 0
        self.train_seconds = 0.0  # sum of step times (aggregate only: per-step times leak batch sizes)
        self.stopped_early: str | None = None

    # -- the separate steps -------------------------------------------------------------------
    def sample(self):
        return self.train_split.collate(self.sampler.next_indices(), self.device, width=self.batch_width)

    def compute_gradients(self, batch) -> dict:
        return self.gradient.compute(self.model, batch)

    def rescale_moments(self) -> None:
        """Scale AdamW's moments of each parameter whose clip changed by k: exp_avg by k, exp_avg_sq by k^2."""
        changes = getattr(self.gradient, "clip_changes", None)
        for param, k in (changes() if changes is not None else ()):
            state = self.optimizer.state.get(param)
            if state and "exp_avg" in state:
                state["exp_avg"].mul_(k)
                state["exp_avg_sq"].mul_(k * k)

    def update(self) -> None:
        if self.optimizer_settings.rescale_moments:
            self.rescale_moments()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.gradient.after_update(self.model)  # DP strategies observe the update they caused

    def evaluate(self) -> PerplexityResult:
        return self.evaluate_split(self.model, self.eval_split, self.device, max_sequences=self.eval_max_sequences)

    def evaluate_public(self) -> PerplexityResult | None:
        if self.public_split is None:
            return None
        return self.evaluate_split(self.model, self.public_split, self.device, max_sequences=None)

    # -- the loop --------------------------------------------------------------------------------
    def train_step(self) -> dict:
        started = time.perf_counter()
        batch = self.sample()
        metrics = self.compute_gradients(batch)
        lr = self.optimizer.param_groups[0]["lr"]
        self.update()
        self.step_count += 1
        seconds = time.perf_counter() - started
        self.train_seconds += seconds
        metrics.update(step=self.step_count, lr=lr)
        if not getattr(self.gradient, "private", True):  # a DP step's time grows with its private batch size (E5)
            metrics["seconds"] = seconds
        return metrics

    def record_evaluation(self) -> dict:
        """Evaluate and log the row (``perplexity``: private eval split; ``public_perplexity``: public)."""
        result, public = self.evaluate(), self.evaluate_public()
        row = {"step": self.step_count, "epoch": self.step_count / self.sampler.steps_per_epoch,
               "perplexity": result.perplexity, "nll_per_token": result.nll_per_token, "utility": result.utility,
               "n_tokens": result.n_tokens,
               "public_perplexity": public.perplexity if public is not None else None}
        if getattr(result, "value_nll_per_record", None) is not None:  # language modelling on value-spanned data
            row.update(value_nll=result.value_nll_per_record, nll_per_record=result.nll_per_record,
                       public_value_nll=getattr(public, "value_nll_per_record", None),
                       public_nll_per_record=getattr(public, "nll_per_record", None))
        if hasattr(result, "accuracy"):  # a classification task
            row.update(accuracy=result.accuracy, public_accuracy=getattr(public, "accuracy", None))
        self.history.log_eval(**row)
        return row

    def announce_evaluation(self, row: dict) -> None:
        if self.on_evaluation is not None:
            self.on_evaluation(self.step_count, dict(row))

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything resuming needs: trainable weights, optimizer, schedule, the sampler's state (none for
        DP: its randomness is secret and redrawn on resume), torch's global RNG, history and the gradient
        computation's state (DP: ledger, strategy; no noise RNG, ERRATA E12)."""
        return {
            "step_count": self.step_count,
            "trainable": {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "train_rows": list(self.history.train_rows),
            "eval_rows": list(self.history.eval_rows),
            "gradient": self.gradient.state_dict() if hasattr(self.gradient, "state_dict") else {},
        }

    def load_state_dict(self, state: dict) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value.to(params[name].device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.history.train_rows = list(state["train_rows"])
        self.history.eval_rows = list(state["eval_rows"])
        if hasattr(self.gradient, "load_state_dict"):
            self.gradient.load_state_dict(state["gradient"])
        self.step_count = int(state["step_count"])

    def _checkpoint_due(self, evaluated: bool) -> bool:
        if self.on_checkpoint is None:
            return False
        every = self.checkpoint_every and self.step_count % self.checkpoint_every == 0
        return bool(evaluated or every or self.gradient.wants_checkpoint(self.step_count))

    def stop_reason(self) -> str | None:
        """Why the run must stop before its next step (None: go on), as the gradient computation says."""
        # DPStep says so when its planned steps are done or its guard can admit no further step; a
        # gradient computation without the method (a test double) never asks to stop.
        ask = getattr(self.gradient, "stop_reason", None)
        return ask(self.step_count) if ask is not None else None

    def run(self, total_steps: int) -> MetricHistory:
        """Evaluate once before training (step 0), then train ``total_steps`` steps with scheduled evaluations.

        The run stops early, cleanly, when the gradient computation gives a :meth:`stop_reason` before a
        step (``stopped_early`` holds it); the last step done is then evaluated and checkpointed."""
        progress = Progress(total_steps, self.step_count, f"fine-tuning ({self.gradient.name})", self.progress)
        if self.step_count == 0 and not self.history.eval_rows:
            self.announce_evaluation(self.record_evaluation())  # the initial model: nothing private trained yet
        elif self.step_count > 0:  # resumed from a checkpoint taken before this step's decision: take it
            self._decide(self.step_count)
        progress.evaluation(self.history.eval_rows[-1])  # where the run starts (resumed: its last evaluation)
        eval_at = evaluation_steps(total_steps, self.sampler.steps_per_epoch, self.eval_every)
        self.model.train()
        try:
            while self.step_count < total_steps:
                reason = self.stop_reason()
                if reason is None:
                    try:
                        metrics = self.train_step()
                    except BudgetExhausted as stop:  # a halting rule inside the step (the Renyi filter's or the
                        # PBT population filter's admit) refused it before anything was released
                        reason = str(stop)
                if reason is not None:
                    self._stop_early(reason, progress)
                    break
                metrics["epoch"] = self.step_count / self.sampler.steps_per_epoch
                self.history.log_train(**metrics)
                row = self.record_evaluation() if self.step_count in eval_at else None
                if self._checkpoint_due(row is not None):
                    self.on_checkpoint(self)
                if row is not None:
                    progress.evaluation(row, metrics)
                    self.announce_evaluation(row)
                self._decide(self.step_count)
                progress.step(metrics)
        finally:
            progress.close()
        return self.history

    def _stop_early(self, reason: str, progress: Progress) -> None:
        """Stop before the next step: the last step done gets its evaluation (checkpointed, then announced)."""
        self.stopped_early = reason
        if self.history.eval_rows[-1]["step"] != self.step_count:
            row = self.record_evaluation()
            if self.on_checkpoint is not None:
                self.on_checkpoint(self)
            progress.evaluation(row)
            self.announce_evaluation(row)
        progress.note(f"stopped early after step {self.step_count}: {reason}")

    def _decide(self, step: int) -> None:
        """Let the gradient computation's controller act after ``step``; a decision is checkpointed right
        after it is taken, before any step uses its action."""
        decides = self.gradient.wants_checkpoint(step)
        self.gradient.between_steps(step)
        if decides and self.on_checkpoint is not None:
            self.on_checkpoint(self)
