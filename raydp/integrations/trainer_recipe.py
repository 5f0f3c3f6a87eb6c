"""A recipe (:mod:`raydp.recipe`) for a ``transformers.Trainer`` script.

``TrainingArguments`` always carry values (the Trainer's own defaults), so a recipe cannot fill "what the user left
unset" there the way ``raydp train`` does. Instead the user names the recipe entry and builds both halves from it::

    recipe = TrainerRecipe.of("embedded", "static-pairwise", epsilon=2.0)
    dp = DPTraining(model, train_dataset, tokenizer, strategy="static-pairwise", epsilon=2.0, **recipe.dp_fields())
    args = recipe.training_arguments(dp, output_dir="out", logging_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[dp.callback])

:meth:`TrainerRecipe.dp_fields` gives :class:`~raydp.integrations.transformers.DPTraining` the settings that shape the
DP plan (expected batch size, epochs, clip); :meth:`TrainerRecipe.training_arguments` the optimizer's and the
schedule's (learning rate, decay and its end, warm-up, weight decay), with the DP plan's ``max_steps`` and the
Trainer's gradient clipping off. Every keyword the user passes wins over the recipe, field by field. The entry is
named, not looked up from the Trainer's model: a recipe searched on one model is a starting point for another,
which the user chooses knowingly. Like every recipe it reads no data and costs no budget.

Two differences from raydp's own loop remain: the Trainer's warm-up starts from a learning rate of 0, raydp's from
1/warmup_steps of the peak (:func:`raydp.runner.loop.lr_multiplier`), both reaching the peak after ``warmup_steps``;
and the Trainer's AdamW applies weight decay to the weights but not to biases and LayerNorm parameters, raydp's to
every trained parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raydp.errors import ConfigError
from raydp.recipe import Resolved, resolve

#: the recipe's fields that shape the DP plan (DPTraining's), the rest being the optimizer's (TrainingArguments')
PLAN_FIELDS = ("batch_size", "epochs", "clip")


@dataclass(frozen=True)
class TrainerRecipe:
    """One recipe entry's settings, split between DPTraining and TrainingArguments."""

    resolved: Resolved

    @classmethod
    def of(cls, model: str, strategy: str, epsilon: float | None, tier: str = "default") -> TrainerRecipe:
        """The shipped table's entry for ``model`` and ``strategy`` at ``epsilon`` and compute ``tier`` (one-line
        ConfigError for none)."""
        resolved = resolve(model, strategy, epsilon, tier=tier)
        if resolved is None:
            raise ConfigError(f"the recipe table has no entry for model {model!r} and strategy {strategy!r}"
                              + ("" if epsilon is not None else " without an epsilon"))
        return cls(resolved)

    @property
    def settings(self) -> dict:
        return dict(self.resolved.settings)

    def record(self) -> dict:
        """What the recipe filled, as a run records it (``recipe_applied``): every field of the entry."""
        return self.resolved.record(self.settings)

    def dp_fields(self, **overrides: Any) -> dict:
        """DPTraining's keyword arguments from the recipe (``batch_size``, ``epochs``, ``clip``), ``overrides``
        winning."""
        return {**{k: v for k, v in self.settings.items() if k in PLAN_FIELDS}, **overrides}

    def training_arguments(self, dp, output_dir: str, **overrides: Any):
        """``transformers.TrainingArguments`` for ``dp`` (a :class:`~raydp.integrations.transformers.DPTraining`):
        the recipe's learning rate, schedule, warm-up and weight decay, ``max_steps=dp.planned_steps`` and
        ``max_grad_norm=0.0`` (the DP step clips; the Trainer's clipping is refused), ``overrides`` winning."""
        from transformers import TrainingArguments  # lazy: the recipe is read without transformers

        s = self.settings
        values: dict[str, Any] = {"output_dir": output_dir, "max_steps": dp.planned_steps, "max_grad_norm": 0.0,
                                  **self._schedule(s)}
        if "lr" in s:
            values["learning_rate"] = s["lr"]
        if "warmup_steps" in s:
            values["warmup_steps"] = s["warmup_steps"]
        if "weight_decay" in s:
            values["weight_decay"] = s["weight_decay"]
        return TrainingArguments(**{**values, **overrides})

    @staticmethod
    def _schedule(s: dict) -> dict:
        """The Trainer's scheduler for the recipe's decay to ``lr_end`` x the peak (raydp.runner.loop.lr_multiplier):
        constant after the warm-up; cosine to a floor (``cosine_with_min_lr``); linear to a floor (``polynomial``
        of power 1 to the absolute end rate)."""
        decay, end = s.get("lr_decay"), float(s.get("lr_end") or 0.0)
        if decay is None:
            return {}
        if decay == "constant":
            return {"lr_scheduler_type": "constant_with_warmup"}
        if decay == "cosine":
            return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": end}} if end \
                else {"lr_scheduler_type": "cosine"}
        if end:
            lr = s.get("lr")
            if lr is None:
                raise ConfigError("a recipe's linear decay to lr_end needs its lr")
            return {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"lr_end": lr * end, "power": 1.0}}
        return {"lr_scheduler_type": "linear"}
