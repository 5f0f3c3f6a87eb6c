"""What a ``transformers.Trainer`` may do and say under raydp's DP step (:mod:`raydp.integrations.transformers`).

* the refusals: ``TrainingArguments`` under which the Trainer would change the DP step's gradient, its sampling or
  its step count, or select on (possibly private) eval data (:func:`check_training_arguments`); a Trainer subclass
  whose own training step or loss the DP step would bypass; trainable parameters that are not float32; an RLlink
  policy that may not drive the run;
* the labels: every metric the Trainer computes on data is ``unprotected_*`` unless the eval data is declared public
  (ERRATA E15), its timings always (they grow with the private batch sizes, E5); the notes that say why.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from raydp.config import TrainConfig
from raydp.errors import ConfigError

#: what the Trainer reports as its training loss under DP (and why it is not a loss)
LOSS_NOTE = ("the Trainer's loss is not computed under DP: training_step returns a constant 0 and the "
             "'loss'/'train_loss' log entries are removed (a training loss on private data is a release no "
             "accountant counts, ERRATA E3); the logged dp_* figures are post-processing of the DP release")
#: the prefix of every metric the Trainer computes on data (its evaluations, under any metric_key_prefix) in
#: every log, in what evaluate() returns and in what callbacks see, unless the eval data is declared public (E15)
UNPROTECTED_PREFIX = "unprotected_"
#: what a training log may carry unlabelled: public counters, the schedule, and post-processing of the DP release
TRAINING_LOG_KEYS = frozenset({"epoch", "step", "learning_rate", "total_flos"})
#: the Trainer's timings: they grow with the private Poisson batch sizes (E5), so they are always labelled
#: ``unprotected_*``, as a run directory's wall times are, whether or not the eval data is public
TIMING_LOG_KEYS = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second",
                             "train_tokens_per_second"})
EVAL_NOTE = ("the Trainer's evaluation metrics are computed on its eval data, which no accountant covers (ERRATA E15): "
             "they reach logs, callbacks and evaluate()'s result as unprotected_* (e.g. unprotected_eval_loss); pass "
             "DPTraining(..., eval_data_is_public=True) only if that data is public")
#: optimizers that update inside the backward pass (they would never apply the DP step's gradient)
FUSED_BACKWARD_OPTIMIZERS = ("lomo", "adalomo")


def check_training_arguments(args, *, planned_steps: int | None = None, eval_data_is_public: bool = False) -> None:
    """Raise a one-line :class:`ConfigError` for ``TrainingArguments`` under which the Trainer would change the
    DP step's gradient, its sampling or its step count, or select on (possibly private) eval data."""
    def refuse(message: str):
        raise ConfigError(f"TrainingArguments: {message}")

    if args.max_grad_norm not in (None, 0, 0.0):
        refuse(f"max_grad_norm={args.max_grad_norm:g} would rescale the DP step's noisy gradient; set max_grad_norm=0 "
               "(the DP step clips every privacy unit itself)")
    if args.gradient_accumulation_steps != 1:
        refuse(f"gradient_accumulation_steps={args.gradient_accumulation_steps} would charge one DP step per "
               "micro-batch and apply their last gradient only; set 1 (the Poisson batch is the step's whole batch)")
    if args.fp16 or args.bf16:
        refuse("fp16/bf16 mixed precision is not supported: the loss scaler would rescale the DP gradient and skip "
               "steps already charged; set fp16=False, bf16=False")
    if getattr(args, "torch_compile", False):
        refuse("torch_compile=True is not supported (the per-sample gradient hooks need the eager model)")
    if getattr(args, "neftune_noise_alpha", None) is not None:
        refuse("neftune_noise_alpha draws embedding noise over the padded batch from the public-seeded generator "
               "(like dropout, ERRATA E12); unset it")
    if getattr(args, "gradient_checkpointing", False):
        refuse("gradient_checkpointing=True is not supported with the per-sample gradient hooks; set it False")
    if getattr(args, "auto_find_batch_size", False):
        refuse("auto_find_batch_size=True restarts training after an out-of-memory error; set it False "
               "(the expected batch size is DPTraining's batch_size)")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel=True replaces the model's forward; set it False")
    if getattr(args, "include_num_input_tokens_seen", False) not in (False, "no", None):
        refuse("include_num_input_tokens_seen counts the private batches' tokens and logs a token rate (a timing) "
               "at every step, past the DP log; set it False")
    if args.world_size > 1 or args.n_gpu > 1 or getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        refuse("training on several devices (DDP, DataParallel, DeepSpeed, FSDP) is not supported: it would split "
               "the Poisson sample; train on one device")
    optim = str(getattr(args.optim, "value", args.optim)).lower()
    if optim in FUSED_BACKWARD_OPTIMIZERS:
        refuse(f"optim={optim!r} updates inside the backward pass and would never apply the DP gradient")
    if not eval_data_is_public and (args.load_best_model_at_end or args.metric_for_best_model is not None
                                    or str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"):
        refuse("selecting a checkpoint on eval metrics (load_best_model_at_end, metric_for_best_model, "
               "save_strategy='best') uses the eval split, which no accountant covers (ERRATA E15); pass "
               "DPTraining(..., eval_data_is_public=True) only if the eval data is public")
    if planned_steps is not None and args.max_steps != planned_steps:
        refuse(f"max_steps={args.max_steps} but the privacy plan calibrated sigma for exactly {planned_steps} steps; "
               f"set max_steps=dp.planned_steps ({planned_steps}), or change epochs/max_steps in DPTraining")


def _check_trainer_class(trainer: Trainer) -> None:
    """A Trainer subclass whose training_step or compute_loss carries its own logic would be bypassed."""
    cls = type(trainer)
    if cls.training_step is not Trainer.training_step:
        raise ConfigError(f"{cls.__name__} overrides training_step, which the DP step replaces; use a Trainer without "
                          "that override")
    if cls.compute_loss is not Trainer.compute_loss or getattr(trainer, "compute_loss_func", None) is not None:
        raise ConfigError(f"{cls.__name__} has its own loss (compute_loss or compute_loss_func), which the DP step "
                          "would not use; pass a per-example loss as DPTraining(..., loss=fn)")


def check_trainable_dtypes(model: torch.nn.Module) -> None:
    """Every trainable parameter must be float32: the DP step clips per-sample gradients in the parameters'
    dtype, and in bf16/fp16 the rounding of the clip factor and of the sums lets a clipped contribution exceed
    its clip radius (measured: 1.0072 C with bf16 LoRA weights), which the accountant does not allow for. A
    frozen base in bf16 is fine. One-line ConfigError naming the first offending parameter."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ConfigError(f"trainable parameter {name} is {str(p.dtype).removeprefix('torch.')}: DP clipping needs "
                              "float32 trainable parameters (cast the LoRA adapters with .float(); the frozen base may "
                              "stay in bf16/fp16)")


def unprotected_name(key: str) -> str:
    """``eval_loss`` -> ``unprotected_eval_loss`` (E15): every key but a training log's public ones
    (:data:`TRAINING_LOG_KEYS`) and the DP release's ``dp_*``, whatever its prefix (``test_loss`` too)."""
    if key in TRAINING_LOG_KEYS or key.startswith(("dp_", UNPROTECTED_PREFIX)):
        return key
    return UNPROTECTED_PREFIX + key


def relabel_unprotected(metrics: dict) -> None:
    """Rename, in place, every metric :func:`unprotected_name` labels (the dict the Trainer's ``evaluate``
    passes to its callbacks and returns)."""
    for key in list(metrics):
        label = unprotected_name(key)
        if label != key:
            metrics[label] = metrics.pop(key)


def _check_served_policy(client, config: TrainConfig) -> None:
    """An RLlink policy server's policy must be one that may drive this run (same privacy mode and clip
    decoding, ERRATA E3/E14); a one-line ConfigError otherwise (the broker's client is checked by raydp's
    launcher, which starts its policy)."""
    served = getattr(getattr(client, "config", None), "env_config", None)
    if not isinstance(served, dict) or "policy" not in served:
        return
    # lazy: Ray (RLlib) only with an RLlink policy
    from raydp.control.rllink import check_run_declaration, check_served_policy

    settings = config.strategy_settings()
    run = {"privacy_mode": settings.privacy_mode, "action_decoding": settings.action_decoding}
    check_served_policy(served["policy"] or {}, run, getattr(client, "service", None) or "(RLlink)")
    check_run_declaration(client, run)  # the client's uploads are admitted and labelled by what it declares
