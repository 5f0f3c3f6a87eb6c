"""Forward-pass local DP on hidden embeddings (EW-FT Sec. 4, 5.3; DP-Forward): the noise layer and the
gradient computation of a local-DP run.

The noise layer sits after transformer block k (``layer``). For each example the hidden states
``h`` (``[seq, width]``, a fixed-length left-filled prompt, so the release has a fixed shape and the
sequence length shows nowhere) go through the autoencoder's encoder to ``[seq, d]`` (DP-Forward: no
autoencoder, d = width), are normalised and clipped to Frobenius norm C (Eq. 11)::

    z <- z / max(1, ||z||_F / C)

so any two inputs are within 2C (replace-one sensitivity: in local DP any two inputs of one user are
neighbours), get Gaussian noise of std ``sigma_e * 2C`` in epoch e (sigma_e is the multiplier of the
sensitivity; :mod:`raydp.privacy.local`), and are decoded back to the width. Blocks 0..k and the encoder
are the user's side: they are frozen (no private gradient flows back to them), so the trained model is
post-processing of the noisy embeddings and the randomized-response labels. Blocks k+1.. are the
provider's side: their LoRA adapters train, non-privately, on what was released.

Each epoch releases every training example's embedding once (a fixed pass over the data, not Poisson
sampling: there is no amplification to claim, ERRATA E8). The ledger gets one row per epoch, charged
before the epoch's first release, as a Gaussian mechanism without subsampling (q = 1) whose noise
multiplier is ``sigma_e / sqrt(k_max)``: the k_max records of one unit compose exactly to that
(Dong, Roth & Su 2019, Cor. 3.3). The noise draws come from the run's secret generator (ERRATA E12).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from raydp.errors import ConfigError
from raydp.privacy.clipping import refuse_compiled
from raydp.privacy.guard import BudgetExhausted

FORWARD_RELEASE = "embedding"


#: relative margin under C in the clip factor, so rounding cannot put a clipped norm above C
CLIP_MARGIN = 1e-6


def clip_frobenius(z: torch.Tensor, clip: float) -> torch.Tensor:
    """Each example (dim 0) scaled to Frobenius norm <= ``clip`` over all its other dims (Eq. 11), in
    float32 or wider (a bf16 clip overshoots C by ~0.5%)."""
    if z.dtype not in (torch.float32, torch.float64):
        z = z.float()
    norms = z.flatten(1).norm(dim=1).clamp_min(1e-12)
    factors = torch.clamp(clip * (1 - CLIP_MARGIN) / norms, max=1.0)
    return z * factors.view(-1, *([1] * (z.dim() - 1)))


class ForwardNoiseLayer(nn.Module):
    """enc -> clip to C -> + N(0, (sigma * 2C)^2) -> dec. ``sigma=None``: no noise (never during a
    private run: the run sets the epoch's sigma before each release)."""

    def __init__(self, clip: float, autoencoder=None, noise=None):
        """``noise``: the run's secret Gaussian source (:class:`raydp.privacy.randomness.GaussianNoise`)."""
        super().__init__()
        if not clip > 0:
            raise ConfigError(f"the noise layer's clip must be > 0, got {clip}")
        self.clip = float(clip)
        self.autoencoder = autoencoder
        self.noise = noise
        self.sigma: float | None = None
        self.calls = 0  # passes through the layer: a DP step checks that its forward pass went through it

    @property
    def sensitivity(self) -> float:
        return 2.0 * self.clip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # encode, clip and noise in float32 (the autoencoder is float32; bf16 would round the clip and the
        # noise), then back to the model's dtype
        self.calls += 1
        h = hidden.float()
        z = self.autoencoder.encode(h) if self.autoencoder is not None else h
        z = clip_frobenius(z, self.clip)
        if self.sigma is not None:
            if self.noise is None:
                raise ConfigError("the noise layer has no noise source")
            noise = self.noise.randn(z.shape, dtype=torch.float32).to(device=z.device)
            z = z + (self.sigma * self.sensitivity) * noise
        out = self.autoencoder.decode(z) if self.autoencoder is not None else z
        return out.to(hidden.dtype)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks (GPT-2 ``transformer.h``, Llama/Mistral ``model.layers``,
    BERT/RoBERTa ``encoder.layer``), through PEFT's wrappers."""
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("h", "layers", "layer") and len(module):
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise ConfigError("cannot find the model's transformer blocks (looked for .h, .layers, .layer)")
    return min(candidates, key=lambda c: c[0])[2]


def install_noise_layer(model: nn.Module, block: int, layer: ForwardNoiseLayer):
    """Route block ``block``'s output hidden states through ``layer``; freeze every trainable parameter
    of blocks 0..block (the user's side). Returns the hook handle and the names of the frozen tensors."""
    blocks = transformer_blocks(model)
    if not 0 <= block < len(blocks) - 1:
        raise ConfigError(f"noise layer after block {block}: the model has blocks 0..{len(blocks) - 1} and at "
                          "least one must follow the noise")
    frozen = []
    for i in range(block + 1):
        for name, p in blocks[i].named_parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(f"block{i}.{name}")
    provider = {id(p) for b in blocks[block + 1:] for p in b.parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in provider]
    if outside:  # e.g. LoRA on the embeddings: trained on raw private activations, before the noise
        raise ConfigError(f"trainable parameters outside the blocks after the noise layer ({outside[0]}, ...): "
                          "a local mechanism trains only the provider's side; restrict lora.target_modules")

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (layer(output[0]), *output[1:])
        return layer(output)

    return blocks[block].register_forward_hook(hook), frozen


class ForwardLDPStep:
    """The gradient computation of a local-DP run: sets the epoch's sigma, charges the epoch's release
    to the ledger before it happens, and takes the plain gradient of the mean per-example loss on the
    noisy forward pass (the labels in the batch are the randomized-response ones)."""

    def __init__(self, layer: ForwardNoiseLayer, sigmas: tuple[float, ...], records_per_unit: int, ledger,
                 steps_per_epoch: int, loss, strategy_name: str, train_split=None):
        """``train_split``: the training split, whose labels are the randomized-response release; they
        are checkpointed and restored, never redrawn (a redraw would be a second, uncharged release)."""
        self.layer = layer
        self.sigmas = tuple(float(s) for s in sigmas)
        self.records_per_unit = int(records_per_unit)
        self.ledger = ledger
        self.steps_per_epoch = int(steps_per_epoch)
        self.loss = loss
        self.name = f"local:{strategy_name}"
        self.private = True
        self.planned_steps = self.steps_per_epoch * len(self.sigmas)
        self.step = 0
        self.train_split = train_split
        self.resumed_mid_epoch = False

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def compute(self, model: nn.Module, batch) -> dict:
        epoch = self.epoch_of(self.step)
        if epoch >= len(self.sigmas):
            raise ConfigError(f"step {self.step} is past the planned {len(self.sigmas)} epochs")
        if self.resumed_mid_epoch:  # the loop asks stop_reason first; this is the step's own refusal
            raise BudgetExhausted(self._mid_epoch_message(), spent=math.nan,
                                  epsilon_target=self.ledger.epsilon_target or math.nan, steps_done=self.step,
                                  remaining_steps=self.planned_steps - self.step)
        if len(self.ledger) <= epoch:  # charged before the epoch's first release
            self.ledger.record_gaussian(1.0, self.sigmas[epoch] / math.sqrt(self.records_per_unit),
                                        name=FORWARD_RELEASE, step=epoch)
        self.layer.sigma = self.sigmas[epoch]
        refuse_compiled(model)
        calls = self.layer.calls
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        if self.layer.calls == calls:  # the pass skipped the noise hook (a compiled graph): nothing was noised
            raise ValueError("the forward pass did not go through the noise layer (a compiled or replaced block?): "
                             "the embeddings were not noised; pass the eager model")
        losses = self.loss(logits, batch.input_ids, batch.attention_mask, batch.labels)
        loss = losses.mean()
        loss.backward()
        self.step += 1
        # the loss is computed from released (noisy) embeddings and randomized labels: post-processing
        return {"loss": float(loss.detach()), "sigma": self.sigmas[epoch], "epoch_release": epoch}

    def after_update(self, model: nn.Module) -> None:
        pass

    def wants_checkpoint(self, step: int) -> bool:
        return False

    def between_steps(self, step: int) -> None:
        pass

    def _mid_epoch_message(self) -> str:
        return (f"resumed in the middle of epoch {self.epoch_of(self.step) + 1}: its records' embeddings may "
                "already have been released once, and releasing them again would exceed the budget")

    def stop_reason(self, step: int) -> str | None:
        if self.resumed_mid_epoch:  # the receiver saw part of this epoch before the interruption
            return self._mid_epoch_message()
        if step >= self.planned_steps:
            return f"the planned {len(self.sigmas)} epochs of releases are done"
        return None

    def state_dict(self) -> dict:
        # no RNG state: a resumed run draws fresh secret noise (ERRATA E12); the randomized labels are a
        # release (private state, like every checkpoint: it lives outside the run directory)
        labels = None if self.train_split is None or self.train_split.labels is None else \
            self.train_split.labels.tolist()
        return {"step": self.step, "ledger": self.ledger.to_arrow(), "released_labels": labels}

    def load_state_dict(self, state: dict) -> None:
        """Restore into a fresh run: the ledger gets exactly the checkpoint's rows (the epochs charged), the
        training split the labels released before. A run resumed inside an epoch stops at its next step
        (:meth:`compute`): part of that epoch was released, and a second release is not in the plan."""
        if len(self.ledger):
            raise ValueError("restore a local-DP step before its first step, into an empty ledger")
        self.ledger.extend_from_arrow(state["ledger"])
        self.step = int(state["step"])
        if state.get("released_labels") is not None and self.train_split is not None:
            self.train_split.labels = np.asarray(state["released_labels"], dtype=np.int64)
        self.resumed_mid_epoch = self.step % self.steps_per_epoch != 0
