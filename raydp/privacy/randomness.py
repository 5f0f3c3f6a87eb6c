"""Secret sampling and noise randomness (ERRATA E12).

DP-SGD's guarantee assumes the adversary does not know which records were sampled at each step or which
noise was added. A sampler or noise generator seeded from a value that is written down (a config seed,
a trial name) gives no privacy against anyone who has that value: the whole training can be replayed
and the one unknown record tested exactly. The same seed in two runs also makes them share batches and
noise, so that the difference of two releases cancels the noise.

So every DP run draws its sampling and noise seeds from the operating system's entropy
(:func:`secrets.randbits`, i.e. ``os.urandom``), fresh for every run and every trial. They live only in
memory and in resume checkpoints (the RNG *states* are checkpointed so that a resumed run continues
the same draws); they are never written to a file meant for release (ledger, summary, metrics,
adapters, configs). ``seed`` in a config keeps controlling what is not private: initialisation, splits,
synthetic data, dropout.

``unsafe_fixed_randomness`` derives both from the config seed instead, for debugging and tests that must
replay a run exactly. Such a run's outputs carry :data:`VOID_LABEL`: its epsilon is void.

What this does not cover: the generators are fast PRNGs (numpy PCG64 for sampling, torch's Mersenne
Twister for noise), seeded secretly but not cryptographically secure, and floating-point Gaussian
sampling has known attacks on its low-order bits (Mironov 2012). Opacus's ``secure_mode`` addresses
both with a CSPRNG; that dependency is not used here.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["OS_ENTROPY", "UNSAFE_FIXED_SEED", "VOID_LABEL", "PrivateRandomness"]

OS_ENTROPY = "os-entropy"
UNSAFE_FIXED_SEED = "unsafe-fixed-seed"
VOID_LABEL = ("epsilon is void: sampling and noise randomness came from the written-down config seed "
              "(unsafe_fixed_randomness); anyone with the seed can replay the run (ERRATA E12)")

_SAMPLING_STREAM = 0x53414D50  # "SAMP"
_NOISE_STREAM = 0x4E4F4953  # "NOIS"


@dataclass(frozen=True)
class PrivateRandomness:
    """The two secret seeds of one DP run: Poisson sampling (128 bits) and noise (64 bits, torch's limit).

    Build with :meth:`fresh` (OS entropy, the default) or :meth:`unsafe_from_seed`. The seeds are kept
    out of ``repr`` so that logging the object reveals nothing."""

    sampling_entropy: int = field(repr=False)
    noise_seed: int = field(repr=False)
    source: str = OS_ENTROPY

    @classmethod
    def fresh(cls) -> PrivateRandomness:
        return cls(secrets.randbits(128), secrets.randbits(64), OS_ENTROPY)

    @classmethod
    def unsafe_from_seed(cls, seed: int) -> PrivateRandomness:
        """Reproducible randomness from a public seed: the epsilon of a run that uses it is void."""
        sampling = np.random.SeedSequence([int(seed), _SAMPLING_STREAM]).generate_state(4, np.uint32)
        noise = np.random.SeedSequence([int(seed), _NOISE_STREAM]).generate_state(2, np.uint32)
        as_int = lambda words: sum(int(w) << (32 * i) for i, w in enumerate(words))  # noqa: E731
        return cls(as_int(sampling), as_int(noise), UNSAFE_FIXED_SEED)

    @property
    def is_secret(self) -> bool:
        return self.source == OS_ENTROPY

    @property
    def label(self) -> str | None:
        return None if self.is_secret else VOID_LABEL

    def sampling_rng(self) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.sampling_entropy))

    def noise_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.noise_seed)
