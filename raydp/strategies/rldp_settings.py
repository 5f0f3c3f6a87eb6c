"""RLDP's settings model (``settings:`` of a run whose strategy is ``rldp``), importable without the strategy.

The strategy (:mod:`raydp.strategies.rldp`) imports numpy, pyarrow and the controller's features; this module
imports pydantic only, so the registry can hand the model to the CLI (which builds a flag per setting) and to
:class:`~raydp.config.TrainConfig` without loading them.

These settings were once a separate ``rldp:`` block of the run config (``RLDPConfig``); a config or
study that still has one is migrated when it is read (:func:`raydp.config.upgrade_train_values`,
:func:`raydp.study.config.upgrade_study_values`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raydp.control.modes import RESIDUAL, ControllerModes, apply_paper_mode, resolve
from raydp.settings import StrictModel
from raydp.strategies.clipschedule_settings import ClipScheduleSettings

#: public records that set a public probe's histogram bins and loss bound (every strategy that calibrates on them)
PUBLIC_PROBE_RECORDS = 32


class RLDPSettings(StrictModel):
    """The RLDP controller (RLDP Sec. 2.4, Alg. 1, Sec. 3.1-3.2; ERRATA E3/E4)."""

    paper_mode: bool = Field(False, description=(
        "reproduce RLDP as published: privacy_mode, action_decoding and architecture left unset take their paper "
        "value (raw statistics, UNPROTECTED and labelled; Eq. 10; Eq. 22-27); one set explicitly keeps its value "
        "(raydp.control.modes)"))
    privacy_mode: Literal["strict", "paper"] = Field(
        "strict", description="strict: the controller sees only DP releases; paper: raw statistics (labelled)")
    t_warm: int = Field(50, ge=0, description="steps before the controller acts (Alg. 1 line 13)")
    t_rl: int = Field(112, gt=0, description="steps between decisions (T_RL)")
    b_sac: int = Field(4, gt=0, description="transitions per SAC update (B_SAC)")
    k: int = Field(2, gt=0, description="SAC updates per decision (K)")
    r_max: float = Field(5.0, gt=0, description="reward lower bound -R_max (Eq. 20)")
    initial_clip: float = Field(0.1, gt=0, le=1.0, description="C_0 per pair before the controller acts")
    noise_control: bool = Field(
        True, description="the policy also sets sigma (Eq. 11-15; Renyi filter, ERRATA E13); false: sigma stays "
                          "sigma_0 and the policy sets the clips only, accounted like a fixed-sigma run")
    action_decoding: Literal["paper", "relative", "relative-capped", "residual"] = Field(
        "relative", description="clip actions as Eq. 10 (C_i = min(e^a_i, 1)), or relative to each pair's public "
                             "reference norm (C_i = r_i e^a_i, e^a_i in [1e-3, 10]; relative-capped: in [1e-3, 1]), "
                             "or residual: C_i(t) = schedule_i(t) e^(residual_range a_i) with a tanh-squashed a_i in "
                             "[-1, 1] that starts at 0, the schedule (raydp.control.decoding; needs noise_control: "
                             "false)")
    schedule: ClipScheduleSettings = Field(default_factory=ClipScheduleSettings, description=(
        "residual decoding: the learned clip schedule the actions correct (clip-schedule's settings; the search's "
        "choice, e.g. trials/tuned/schedule-search.json); in a config file or study (no flag: its fields would "
        "collide with --clip)"), json_schema_extra={"flag": False})
    residual_range: float = Field(0.7, gt=0, le=3, description=(
        "residual decoding: a clip moves by at most a factor e^residual_range either way from the schedule"))
    reward: Literal["paper", "public-validation"] = Field("paper", description=(
        "paper: Eq. 17-20 on the DP loss release; public-validation: the change of minus the value-token NLL on "
        "public validation records between decisions (potential-based, free; raydp.control.reward)"))
    reward_records: int = Field(256, gt=0, description="public-validation reward: public records scored per decision")
    initial_log_std: float = Field(-1.5, ge=-5, le=2, description=(
        "residual decoding: the squashed actor's log std before training (its mean starts at 0)"))
    clip_floor: float = Field(1e-3, gt=0, lt=1.0, description="lower bound on decoded clip radii")
    histogram_bins: int = Field(24, ge=2, description="bins of the DP norm histogram (strict mode)")
    histogram_decades: float = Field(6.0, gt=0, description="log10 width of the histogram, centred on the public norm")
    histogram_noise: float = Field(4.0, gt=0, description="histogram noise std per unit sigma and sensitivity")
    loss_noise: float = Field(4.0, gt=0, description="loss-sum noise std per unit sigma and sensitivity")
    public_probe_records: int = Field(PUBLIC_PROBE_RECORDS, gt=0,
                                      description="public records that set the bins and loss bound")
    architecture: Literal["shared", "paper"] = Field(
        "shared", description="shared: size-agnostic (transfers across models); paper: Eq. 22-27 for fixed n",
        json_schema_extra={"flag": "--policy-arch"})
    n_max: int = Field(64, gt=0, description="adapter slots of a shared policy")
    hidden: int = Field(128, gt=0, description="hidden width of the actor and critics")
    gamma: float = Field(0.99, ge=0, lt=1, description="SAC discount")
    tau: float = Field(0.01, gt=0, le=1, description="SAC target-network update rate")
    actor_lr: float = Field(2e-4, gt=0, description="SAC actor learning rate")
    critic_lr: float = Field(1e-4, gt=0, description="SAC critic learning rate")
    alpha: float = Field(0.04, gt=0, description="SAC's fixed entropy temperature")
    replay_capacity: int = Field(10_000, gt=0, description="transitions the replay buffer holds")
    policy: str | None = Field(None, description="start from a saved policy (name under policy_dir, or a path)")
    frozen: bool = Field(False, description="act with the saved policy without training it")
    save_policy: str | None = Field(None, description="also save the trained policy as policy_dir/NAME")
    policy_dir: str = Field("policies", description="where named policies live")

    @model_validator(mode="before")
    @classmethod
    def _paper_mode(cls, values):
        return apply_paper_mode(values)

    @property
    def modes(self) -> ControllerModes:
        """The one reading of the mode settings (raydp.control.modes): what each component needs."""
        return resolve(self.privacy_mode, self.action_decoding, self.architecture)

    @model_validator(mode="after")
    def _consistent(self):
        if self.action_decoding == RESIDUAL and self.noise_control:
            raise ValueError("residual decoding corrects the clip schedule only: set noise_control: false (sigma "
                             "stays on the plan)")
        if self.frozen and not self.policy:
            raise ValueError("a frozen policy needs --policy NAME")
        if self.frozen and self.save_policy:
            raise ValueError("a frozen policy is not trained; there is nothing new to save")
        return self
