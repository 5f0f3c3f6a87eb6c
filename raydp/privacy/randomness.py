"""Secret sampling and noise randomness (ERRATA E12).

DP-SGD's guarantee assumes the adversary does not know which records were sampled at each step or which
noise was added. A sampler or noise generator seeded from a value that is written down (a config seed,
a trial name) gives no privacy against anyone who has that value: the whole training can be replayed
and the one unknown record tested exactly. The same seed in two runs also makes them share batches and
noise, so that the difference of two releases cancels the noise.

So every DP run draws its sampling and noise seeds from the operating system's entropy
(:func:`secrets.randbits`, i.e. ``os.urandom``; 128 bits each), fresh for every run, every trial and
every resume. They live only in memory: neither the seeds nor the generators' states are written to
any file, checkpoints included (a resumed run draws fresh seeds, which is sound because nothing drawn
after its checkpoint was observed outside the run; see :mod:`raydp.runner.loop`). ``seed`` in a config
keeps controlling what is not private: initialisation, splits, synthetic data. (Dropout would draw from
torch's global generator, seeded from ``seed``, on private batches; DP runs switch dropout off,
:func:`raydp.model.disable_dropout`.)

Noise generators: on CPU, numpy's PCG64 seeded with all 128 bits (torch's CPU Mersenne Twister takes
only the low 32 bits of a seed, which a search over 2^32 candidates recovers from one released
gradient); on CUDA, torch's Philox generator, which takes the full 64-bit seed.

``unsafe_fixed_randomness`` derives both from the config seed instead, for debugging and tests that must
replay a run exactly. Such a run's outputs carry :data:`VOID_LABEL`: its epsilon is void.

``common_random_numbers`` derives them from the seed too, but only on PUBLIC data (``data.source: public``, or a
dataset directory that regenerates as the public population), where no record is protected; such a run carries
:data:`PUBLIC_COMMON_LABEL` instead of the void label: candidates of a search on public episodes then
share batches and noise, so their difference is not drowned by sampling noise (common random
numbers). The run's epsilon is that of a simulation on public data either way; its source is
:data:`PUBLIC_COMMON`.

What this does not cover: the generators are fast PRNGs seeded secretly, not cryptographically secure,
and floating-point Gaussian sampling has known attacks on its low-order bits (Mironov 2012). Opacus's
``secure_mode`` addresses both with a CSPRNG; that dependency is not used here.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["OS_ENTROPY", "PUBLIC_COMMON", "UNSAFE_FIXED_SEED", "VOID_LABEL", "GaussianNoise", "PrivateRandomness"]

OS_ENTROPY = "os-entropy"
UNSAFE_FIXED_SEED = "unsafe-fixed-seed"
PUBLIC_COMMON = "public-common-random-numbers"
PUBLIC_COMMON_LABEL = ("sampling and noise randomness came from the seed (common_random_numbers): allowed only on "
                       "public data, where nobody is protected; the epsilon is that of a simulation")
VOID_LABEL = ("epsilon is void: sampling and noise randomness came from the written-down config seed "
              "(unsafe_fixed_randomness); anyone with the seed can replay the run (ERRATA E12)")

_SAMPLING_STREAM = 0x53414D50  # "SAMP"
_NOISE_STREAM = 0x4E4F4953  # "NOIS"
_SLOT_STREAM = 0x534C4F54  # "SLOT"


@dataclass(frozen=True)
class PrivateRandomness:
    """The two secret seeds of one DP run: Poisson sampling and noise, 128 bits each.

    Build with :meth:`fresh` (OS entropy, the default) or :meth:`unsafe_from_seed`. The seeds are kept
    out of ``repr`` so that logging the object reveals nothing."""

    sampling_entropy: int = field(repr=False)
    noise_seed: int = field(repr=False)
    source: str = OS_ENTROPY

    @classmethod
    def fresh(cls) -> PrivateRandomness:
        return cls(secrets.randbits(128), secrets.randbits(128), OS_ENTROPY)

    @classmethod
    def unsafe_from_seed(cls, seed: int, start_step: int = 0) -> PrivateRandomness:
        """Reproducible randomness from a public seed (and the step a resumed run starts at): the epsilon
        of a run that uses it is void."""
        sampling = np.random.SeedSequence([int(seed), _SAMPLING_STREAM, int(start_step)]).generate_state(4, np.uint32)
        noise = np.random.SeedSequence([int(seed), _NOISE_STREAM, int(start_step)]).generate_state(4, np.uint32)
        as_int = lambda words: sum(int(w) << (32 * i) for i, w in enumerate(words))  # noqa: E731
        return cls(as_int(sampling), as_int(noise), UNSAFE_FIXED_SEED)

    @classmethod
    def common_on_public_data(cls, seed: int, start_step: int = 0) -> PrivateRandomness:
        """:meth:`unsafe_from_seed`'s randomness for a run on PUBLIC data (common random numbers across the
        candidates of a search): no record is protected; the run carries :data:`PUBLIC_COMMON_LABEL` rather than
        the void label (the caller checks the data is public)."""
        fixed = cls.unsafe_from_seed(seed, start_step)
        return cls(fixed.sampling_entropy, fixed.noise_seed, PUBLIC_COMMON)

    @property
    def is_secret(self) -> bool:
        return self.source == OS_ENTROPY

    @property
    def label(self) -> str | None:
        return {UNSAFE_FIXED_SEED: VOID_LABEL, PUBLIC_COMMON: PUBLIC_COMMON_LABEL}.get(self.source)

    def sampling_rng(self) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.sampling_entropy))

    def noise(self, device: torch.device | str = "cpu") -> GaussianNoise:
        return GaussianNoise(self.noise_seed, device)

    def slot_rng(self) -> np.random.Generator:
        """The generator of the records' slots in a slotted GPU pass (:class:`raydp.privacy.clipping.RecordGraph`):
        a stream of its own, spawned from the noise seed (secret with it; replayed with it in an unsafe run)."""
        return np.random.default_rng(np.random.SeedSequence(self.noise_seed, spawn_key=(_SLOT_STREAM,)))


class GaussianNoise:
    """Standard normal draws for the DP noise from a secret seed, on the device of the tensors they noise.

    CPU: numpy ``PCG64`` seeded with the full 128-bit seed (torch's CPU generator would keep 32 bits).
    CUDA: torch's Philox generator with the low 64 bits (its whole seed). There is no state to save."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self._numpy = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed))))
            self._torch = None
        else:
            self._numpy = None
            self._torch = torch.Generator(device=self.device).manual_seed(int(seed) & (2**64 - 1))

    def randn(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._numpy is not None:
            np_dtype = np.float64 if dtype == torch.float64 else np.float32
            return torch.from_numpy(self._numpy.standard_normal(tuple(shape), dtype=np_dtype)).to(dtype)
        return torch.randn(tuple(shape), generator=self._torch, device=self.device, dtype=dtype)
