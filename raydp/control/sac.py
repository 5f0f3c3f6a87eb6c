"""RLlib SAC configuration for the RLDP hyper-policy (RLDP Sec. 2.4, Sec. 3.1; Alg. 1 lines 31-36).

One ``algo.train()`` call performs exactly K SAC updates of B_SAC transitions each:
``num_env_runners=0``, ``n_step=1`` and ``rollout_fragment_length`` 1 make RLlib's native ratio B_SAC,
so ``training_intensity = K * B_SAC`` gives K updates per sampled transition, and the ``min_*``
reporting thresholds are 0 so ``train()`` runs one training step. The policy service calls ``train()``
once per transition a run reports (the broker runner hands out one transition per ``sample()``).
Replay is a uniform FIFO (``EpisodeReplayBuffer``) of 1-step episodes; temperature alpha is fixed
(``alpha_lr=0``); targets are Polyak-averaged after every update (tau).

Seeds: ``SACSettings.seed`` is the run's public config seed. ``debugging(seed=...)`` makes RLlib seed the
process's global generators when it builds the algorithm (the networks' initial weights); the randomness of
training after that (the SAC loss's action samples, the replay buffer's sampler, which RLlib 2.60 creates
from OS entropy) is seeded from the same value by :class:`raydp.control.training.TrainingLoop`, and each
run's exploration by :func:`raydp.control.broker.exploration_generator`: the policy's decisions are
deterministic given the runs' releases and these public seeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np

from raydp.control.features import ObservationLayout
from raydp.control.modules import MODULES
from raydp.notices import quiet_library_notices


@dataclass(frozen=True)
class SACSettings:
    """Sec. 3.1 hyper-policy settings; T_RL/B_SAC/K from Sec. 3.2 (defaults: the robust 4.5 setting)."""

    b_sac: int = 4
    k: int = 2
    gamma: float = 0.99
    tau: float = 0.01
    actor_lr: float = 2e-4
    critic_lr: float = 1e-4
    alpha: float = 0.04
    replay_capacity: int = 10_000
    hidden: int = 128
    seed: int = 0
    #: a tanh-squashed actor on [-1, 1] that starts at the zero action (residual decoding;
    #: :mod:`raydp.control.modules`); a policy saved before this field had an unsquashed one
    squashed: bool = False
    initial_log_std: float = -1.5

    def as_dict(self) -> dict:
        return asdict(self)


def spaces(layout: ObservationLayout, squashed: bool = False) -> tuple[gym.spaces.Box, gym.spaces.Box]:
    """Observation and action spaces; actions are unbounded (Eq. 24's Gaussian), or on [-1, 1] (squashed)."""
    obs = gym.spaces.Box(-np.inf, np.inf, (layout.obs_dim,), np.float32)
    bound = 1.0 if squashed else np.inf
    act = gym.spaces.Box(-bound, bound, (layout.act_dim,), np.float32)
    return obs, act


def module_spec(layout: ObservationLayout, settings: SACSettings, inference_only: bool = False):
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    quiet_library_notices()  # RLlib's own notices of the modules built from here (not the user's to act on)
    obs, act = spaces(layout, settings.squashed)
    return RLModuleSpec(module_class=MODULES[layout.architecture], observation_space=obs, action_space=act,
                        inference_only=inference_only,
                        model_config={"hidden": settings.hidden, "n_max": layout.n_slots,
                                      "f_adapter": layout.f_adapter, "g_global": layout.g_global,
                                      "squashed": settings.squashed, "initial_log_std": settings.initial_log_std})


def sac_config(layout: ObservationLayout, settings: SACSettings, env_runner_cls, env_config: dict):
    """The SACConfig of a policy service whose transitions come from ``env_runner_cls`` (built with
    ``env_config``): the broker's runner, :class:`raydp.control.broker.BrokerEnvRunner`, passed in by the
    service so that this module does not depend on the broker (the broker builds its modules from here)."""
    from ray.rllib.algorithms.sac import SACConfig

    quiet_library_notices()  # RLlib's and Tune's notices of the algorithm built from here
    obs, act = spaces(layout, settings.squashed)
    spec = module_spec(layout, settings)
    return (
        SACConfig()
        .environment(observation_space=obs, action_space=act, env_config=env_config)
        .env_runners(num_env_runners=0, env_runner_cls=env_runner_cls)
        .learners(num_learners=0)
        .training(
            gamma=settings.gamma, tau=settings.tau, actor_lr=settings.actor_lr, critic_lr=settings.critic_lr,
            initial_alpha=settings.alpha, alpha_lr=0.0,
            train_batch_size_per_learner=settings.b_sac,
            training_intensity=settings.k * settings.b_sac,
            num_steps_sampled_before_learning_starts=1,
            target_network_update_freq=0, n_step=1,
            replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": settings.replay_capacity},
        )
        .rl_module(rl_module_spec=spec)
        .reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=0,
                   min_train_timesteps_per_iteration=0)
        .debugging(seed=settings.seed, log_level="ERROR")
    )
