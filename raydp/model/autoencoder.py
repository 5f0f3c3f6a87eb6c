"""The stacked autoencoder of EW-FT (Sec. 5.3): hidden width -> d before the noise, d -> width after.

``dims`` lists the encoder's output sizes, e.g. ``(32, 8)``: width -> 32 -> 8, and the decoder mirrors
it (8 -> 32 -> width); Tanh between layers. The paper sets one layer 768 -> 64 at BERT width (and d = 4
in most of its experiments). Lower d means less noise in total for the same per-entry noise (the curse
of dimensionality the paper addresses) but a coarser embedding.

The autoencoder is trained on PUBLIC records only (:func:`pretrain_autoencoder`: reconstruction of the
hidden states at the noise layer's block on the public corpus) and then frozen: its encoder is part of
the user's side of the local mechanism, so it must not depend on private records.
"""

from __future__ import annotations

import torch
from torch import nn

from raydp.errors import ConfigError


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class StackedAutoencoder(nn.Module):
    def __init__(self, width: int, dims: tuple[int, ...]):
        super().__init__()
        if not dims or any(int(d) < 1 for d in dims):
            raise ConfigError(f"autoencoder sizes must be positive integers, got {list(dims)}")
        self.width, self.dims = int(width), tuple(int(d) for d in dims)
        self.encoder = _mlp([self.width, *self.dims])
        self.decoder = _mlp([*reversed(self.dims), self.width])

    @property
    def code_size(self) -> int:
        return self.dims[-1]

    def encode(self, h: torch.Tensor) -> torch.Tensor:
        return self.encoder(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def describe(self) -> dict:
        return {"width": self.width, "dims": list(self.dims)}


def pretrain_autoencoder(autoencoder: StackedAutoencoder, hidden_batches, steps: int = 200, lr: float = 1e-3,
                         seed: int = 0) -> float:
    """Fit ``autoencoder`` to reconstruct PUBLIC hidden states (``hidden_batches``: a list of tensors
    ``[batch, seq, width]``) by mean squared error; returns the final relative reconstruction error
    ||h - dec(enc(h))||^2 / ||h - mean||^2 over all batches. Freezes the autoencoder afterwards."""
    generator = torch.Generator().manual_seed(seed)  # public data, public seed
    data = torch.cat([h.detach().reshape(-1, h.shape[-1]).float() for h in hidden_batches])
    autoencoder.train()
    optimizer = torch.optim.Adam(autoencoder.parameters(), lr=lr)
    for _ in range(int(steps)):
        rows = torch.randint(0, data.shape[0], (min(1024, data.shape[0]),), generator=generator)
        x = data[rows]
        loss = (autoencoder.decode(autoencoder.encode(x)) - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    autoencoder.eval()
    for p in autoencoder.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        error = (autoencoder.decode(autoencoder.encode(data)) - data).pow(2).sum()
        spread = (data - data.mean(dim=0)).pow(2).sum().clamp_min(1e-12)
    return float(error / spread)
