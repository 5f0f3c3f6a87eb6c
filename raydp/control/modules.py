"""RLlib RLModules for the RLDP hyper-policy (RLDP Eq. 22-27) on RLlib's new API stack.

Both modules subclass RLlib's ``DefaultSACTorchRLModule`` and only build the networks in ``setup()``;
the SAC forward passes, target networks and losses (Huber Bellman loss, Eq. 25; soft actor loss,
Eq. 27; Polyak targets, Eq. 26) are RLlib's.

* :class:`PaperSACModule`: the paper's architecture for a fixed number n of adapters: state encoder
  2 x (Linear 128, LayerNorm, GELU) (Eq. 22), a Gaussian actor head (mu, log std) in R^{n+1} (Eq. 23),
  twin critics Q(z, a) of two 128-unit ReLU layers (Eq. 25). One difference: RLlib builds one optimizer
  per network (actor, critic, twin critic), so each keeps its own copy of the Eq. 22 encoder instead of
  sharing one (sharing would need a custom Learner).
* :class:`SharedSACModule`: size-agnostic, for transfer across models with different numbers of
  adapters. One network is shared across adapters: adapter i's (mu_i, log std_i) come from
  enc([f_i, g]) (its own features f_i, the global features g); the noise action comes from
  [masked mean_i enc([f_i, g]), enc_g(g)]. Critic: a per-adapter MLP on [f_i, g, a_i], masked-mean
  pooled, joined with an MLP on [g, a_sigma]. Slots beyond the model's adapters are masked out of the
  actor's log-probability and the critic.

Actions follow Eq. 24 (an unsquashed Gaussian, :class:`MaskedGaussian`): the decoding of Eq. 10-15
(:mod:`raydp.control.decoding`) applies exp/min and tanh itself. log std is clamped to [-5, 2].

``residual`` decoding needs a bounded action: ``model_config["squashed"]`` makes the actor a
tanh-squashed Gaussian (:class:`MaskedSquashedGaussian`, RLlib's ``TorchSquashedGaussian`` with the mask: SAC's
log-probability with the tanh change of variables, Haarnoja et al. 2018, arXiv:1801.01290, App. C, Eq. 21), so the
entropy bonus cannot push the action past its bound. Its mean layer starts at zero (every action 0: the residual
controller starts exactly on the learned schedule, a behaviour-cloning initialisation that needs no data) and
its log std at ``model_config["initial_log_std"]``.
The actor returns ``[mu | log_std | mask]`` so that the stock SAC learner's
``action_dist_cls.from_logits`` sees the mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from ray.rllib.algorithms.sac.torch.default_sac_torch_rl_module import DefaultSACTorchRLModule
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import (
    TorchDeterministic,
    TorchDiagGaussian,
    TorchSquashedGaussian,
)
from ray.rllib.core.models.base import ENCODER_OUT

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class _MaskedLogits:
    """What both actors' distributions share: logits ``[mu | log_std | mask]`` (log std clamped) and the mask of the
    adapter slots that exist."""

    def __init__(self, loc, scale, mask=None):
        super().__init__(loc=loc, scale=scale)
        self.mask = torch.ones_like(loc) if mask is None else mask

    @classmethod
    def from_logits(cls, logits, **kwargs):
        loc, log_std, mask = logits.chunk(3, dim=-1)
        return cls(loc=loc, scale=log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).exp(), mask=mask)


class MaskedGaussian(_MaskedLogits, TorchDiagGaussian):
    """Diagonal Gaussian (Eq. 24) whose log-probability and entropy skip masked (padding) dimensions."""

    def logp(self, value):
        return (self._dist.log_prob(value) * self.mask).sum(-1)

    def entropy(self):
        return (self._dist.entropy() * self.mask).sum(-1)

    def to_deterministic(self) -> TorchDeterministic:
        return TorchDeterministic(loc=self.loc)


class MaskedSquashedGaussian(_MaskedLogits, TorchSquashedGaussian):
    """tanh of a diagonal Gaussian, on [-1, 1] (residual decoding); log-probability (with the tanh Jacobian) summed
    over the unmasked dimensions."""

    def _squashed_logp(self, unsquashed):
        # the parent's per-dimension terms (Normal log-density minus log(1 - tanh(u)^2)), masked before the sum
        jacobian = 2.0 * (math.log(2.0) - unsquashed - nn.functional.softplus(-2.0 * unsquashed))
        return ((self._dist.log_prob(unsquashed) - jacobian) * self.mask).sum(-1)

    def to_deterministic(self) -> TorchDeterministic:
        return TorchDeterministic(loc=torch.tanh(self.loc))


def action_distribution(squashed: bool):
    """The actor's distribution class: tanh-squashed (residual decoding) or the paper's unsquashed Gaussian."""
    return MaskedSquashedGaussian if squashed else MaskedGaussian


def greedy_action(logits: torch.Tensor, squashed: bool = False) -> torch.Tensor:
    """The deterministic action of a frozen policy: the Gaussian mean (its tanh, for a squashed actor)."""
    mean = logits.chunk(3, dim=-1)[0]
    return torch.tanh(mean) if squashed else mean


def explore_action(logits: torch.Tensor, generator: torch.Generator, squashed: bool = False) -> torch.Tensor:
    """One draw of the policy's distribution with ``generator`` (a run's public exploration stream)."""
    dist = action_distribution(squashed).from_logits(logits)
    noise = torch.randn(dist.loc.shape, generator=generator, dtype=dist.loc.dtype)
    draw = dist.loc + dist._dist.scale * noise
    return torch.tanh(draw) if squashed else draw


def act(module, obs, generator: torch.Generator | None = None):
    """``module``'s action for one observation (float32 numpy): a draw of its distribution with ``generator`` (a run's
    public exploration stream), or its greedy action without one. The broker and the RLlink client both act here."""
    squashed = bool(module.model_config.get("squashed", False))
    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: torch.as_tensor(obs[None])})[Columns.ACTION_DIST_INPUTS]
        action = explore_action(logits, generator, squashed) if generator is not None else greedy_action(logits,
                                                                                                          squashed)
    return action[0].numpy().astype("float32")


def start_on_the_schedule(mean_layer: nn.Linear, rows, log_std_rows, initial_log_std: float) -> None:
    """Zero the weights and bias of ``mean_layer``'s mean ``rows`` (every action's mean is 0: residual decoding's
    zero action is the schedule) and set its ``log_std_rows`` to weight 0, bias ``initial_log_std``."""
    with torch.no_grad():
        mean_layer.weight[rows] = 0.0
        mean_layer.bias[rows] = 0.0
        mean_layer.weight[log_std_rows] = 0.0
        mean_layer.bias[log_std_rows] = float(initial_log_std)


def state_encoder(d_in: int, hidden: int) -> nn.Sequential:
    """Eq. 22: 2 x (Linear, LayerNorm, GELU)."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
                         nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU())


def q_head(d_in: int, hidden: int) -> nn.Sequential:
    """Eq. 25's critic: two ReLU layers of ``hidden`` units, then the scalar Q."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


class _ObsEncoder(nn.Module):
    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.net = state_encoder(d_in, hidden)

    def forward(self, batch):
        return {ENCODER_OUT: self.net(batch[Columns.OBS])}


class _ObsActionEncoder(_ObsEncoder):
    def forward(self, batch):
        return {ENCODER_OUT: torch.cat([self.net(batch[Columns.OBS]), batch[Columns.ACTIONS]], dim=-1)}


class _GaussianHead(nn.Module):
    """Eq. 23: mu and log std, plus an all-ones mask."""

    def __init__(self, hidden: int, act_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 2 * act_dim)

    def forward(self, z):
        out = self.linear(z)
        return torch.cat([out, torch.ones_like(out[..., : out.shape[-1] // 2])], dim=-1)


class PaperSACModule(DefaultSACTorchRLModule):
    """The paper's SAC networks for a fixed adapter count (see the module docstring)."""

    def setup(self):
        hidden = self.model_config.get("hidden", 128)
        d, na = self.observation_space.shape[0], self.action_space.shape[0]
        self.twin_q = True
        squashed = bool(self.model_config.get("squashed", False))
        self.action_dist_cls = action_distribution(squashed)
        self.pi_encoder = _ObsEncoder(d, hidden)
        self.pi = _GaussianHead(hidden, na)
        if squashed:
            start_on_the_schedule(self.pi.linear, slice(0, na), slice(na, 2 * na),
                                  self.model_config.get("initial_log_std", -1.5))
        if not self.inference_only:
            self.qf_encoder, self.qf = _ObsActionEncoder(d, hidden), q_head(hidden + na, hidden)
            self.qf_twin_encoder, self.qf_twin = _ObsActionEncoder(d, hidden), q_head(hidden + na, hidden)


def _split_obs(obs: torch.Tensor, n_max: int, f: int, g: int):
    per = obs[..., : n_max * f].reshape(*obs.shape[:-1], n_max, f)
    glob = obs[..., n_max * f: n_max * f + g]
    mask = obs[..., n_max * f + g: n_max * f + g + n_max]
    return per, glob, mask


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the adapter axis (-2) of ``x`` [B, N, H] where mask [B, N] is 1."""
    w = mask.unsqueeze(-1)
    return (x * w).sum(-2) / w.sum(-2).clamp_min(1.0)


class _PassObs(nn.Module):
    """The shared actor does its own encoding per adapter; its 'encoder' passes the observation on."""

    def forward(self, batch):
        return {ENCODER_OUT: batch[Columns.OBS]}


class _SharedActor(nn.Module):
    def __init__(self, n_max: int, f: int, g: int, hidden: int):
        super().__init__()
        self.n_max, self.f, self.g = n_max, f, g
        self.adapter_enc = state_encoder(f + g, hidden)
        self.adapter_head = nn.Linear(hidden, 2)
        self.global_enc = state_encoder(g, hidden)
        self.sigma_head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, 2))

    def forward(self, obs):
        per, glob, mask = _split_obs(obs, self.n_max, self.f, self.g)
        x = torch.cat([per, glob.unsqueeze(-2).expand(*per.shape[:-1], self.g)], dim=-1)
        e = self.adapter_enc(x)  # [B, N, H]
        mu_ls = self.adapter_head(e)  # [B, N, 2]
        s = self.sigma_head(torch.cat([_masked_mean(e, mask), self.global_enc(glob)], dim=-1))  # [B, 2]
        mu = torch.cat([mu_ls[..., 0], s[..., :1]], dim=-1)
        log_std = torch.cat([mu_ls[..., 1], s[..., 1:]], dim=-1)
        full_mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)
        return torch.cat([mu, log_std, full_mask], dim=-1)


class _SharedCriticEncoder(nn.Module):
    def __init__(self, n_max: int, f: int, g: int, hidden: int):
        super().__init__()
        self.n_max, self.f, self.g = n_max, f, g
        self.adapter_net = nn.Sequential(nn.Linear(f + g + 1, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.global_net = nn.Sequential(nn.Linear(g + 1, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())

    def forward(self, batch):
        per, glob, mask = _split_obs(batch[Columns.OBS], self.n_max, self.f, self.g)
        actions = batch[Columns.ACTIONS]
        x = torch.cat([per, glob.unsqueeze(-2).expand(*per.shape[:-1], self.g),
                       actions[..., : self.n_max].unsqueeze(-1)], dim=-1)
        pooled = _masked_mean(self.adapter_net(x), mask)
        return {ENCODER_OUT: torch.cat([pooled, self.global_net(torch.cat([glob, actions[..., -1:]], -1))], -1)}


class SharedSACModule(DefaultSACTorchRLModule):
    """Size-agnostic SAC networks over ``n_max`` adapter slots (see the module docstring)."""

    def setup(self):
        hidden = self.model_config.get("hidden", 128)
        n_max, f, g = self.model_config["n_max"], self.model_config["f_adapter"], self.model_config["g_global"]
        self.twin_q = True
        squashed = bool(self.model_config.get("squashed", False))
        self.action_dist_cls = action_distribution(squashed)
        self.pi_encoder = _PassObs()
        self.pi = _SharedActor(n_max, f, g, hidden)
        if squashed:  # (mu, log std) per adapter, and the noise action's from the sigma head's last layer
            initial = self.model_config.get("initial_log_std", -1.5)
            start_on_the_schedule(self.pi.adapter_head, slice(0, 1), slice(1, 2), initial)
            start_on_the_schedule(self.pi.sigma_head[-1], slice(0, 1), slice(1, 2), initial)
        if not self.inference_only:
            head = lambda: nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))  # noqa: E731
            self.qf_encoder, self.qf = _SharedCriticEncoder(n_max, f, g, hidden), head()
            self.qf_twin_encoder, self.qf_twin = _SharedCriticEncoder(n_max, f, g, hidden), head()


MODULES = {"paper": PaperSACModule, "shared": SharedSACModule}
