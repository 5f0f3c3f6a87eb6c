"""An RLDP run's policy from its config: the saved policy it starts from (checked against its privacy
mode), or the layout and SAC settings of a new one.

Launching (:mod:`raydp.runner.launch`) and studies (:mod:`raydp.study.runner`) both need these before
any Ray actor starts, so a bad policy fails as a one-line error there rather than in a trial.
"""

from __future__ import annotations

from pathlib import Path

from raydp.control.features import ObservationLayout
from raydp.control.store import check_policy_privacy_mode, load_manifest, policy_action_decoding, resolve_policy
from raydp.errors import ConfigError

#: ``config`` below is a run's :class:`raydp.config.TrainConfig`, not imported: the config imports the
#: strategies, which import control/, and imports run one way.


def policy_layout_for(config):
    """The observation layout a new policy gets: n_max slots (shared) or the model's pair count (paper)."""
    # lazy: rllink's Ray workers load no transformers
    from raydp.model.loading import LoraSettings, expected_adapter_pairs

    settings = config.strategy_settings()
    if not settings.modes.fixed_pairs:
        return ObservationLayout(settings.architecture, settings.n_max)
    return ObservationLayout(settings.architecture,
                             expected_adapter_pairs(config.model, LoraSettings(**config.lora.model_dump())))


def sac_settings(config):
    from raydp.control.sac import SACSettings  # lazy: imports RLlib, which a run without a controller never loads

    s = config.strategy_settings()
    return SACSettings(b_sac=s.b_sac, k=s.k, gamma=s.gamma, tau=s.tau, actor_lr=s.actor_lr, critic_lr=s.critic_lr,
                       alpha=s.alpha, replay_capacity=s.replay_capacity, hidden=s.hidden, seed=config.seed,
                       squashed=s.modes.residual, initial_log_std=s.initial_log_std)


def trained_on(config, **extra) -> dict:
    """What a saved policy's manifest records about the runs that trained it: the model, privacy mode and
    clip decoding (a restored policy must match both, :func:`check_policy_privacy`), plus ``extra``."""
    s = config.strategy_settings()
    return {"model": config.model, "privacy_mode": s.privacy_mode, "action_decoding": s.action_decoding, **extra}


def check_policy_privacy(config, restore: Path | None = None) -> Path | None:
    """The saved policy an RLDP config starts from (``restore``, else ``settings.policy``; None if neither),
    after checking it may drive this run: a policy trained in paper mode saw unprivatized statistics of
    private data (ERRATA E3/E14), so it may not drive a strict run (one-line ConfigError)."""
    s = config.strategy_settings()
    if restore is None:
        restore = resolve_policy(s.policy, s.policy_dir) if s.policy else None
    if restore is not None:
        manifest = load_manifest(restore)
        check_policy_privacy_mode(manifest, s.privacy_mode, s.policy or str(restore))
        check_policy_decoding(manifest, s.action_decoding, s.policy or str(restore))
        check_policy_width(manifest, s.hidden, s.policy or str(restore))
    return restore


def check_policy_width(manifest: dict, hidden: int, name) -> None:
    """The networks are rebuilt from the run's SAC settings before the saved weights load into them: one-line
    ConfigError when the settings' hidden width is not the policy's (the load would fail in the policy service)."""
    trained = (manifest.get("sac") or {}).get("hidden")
    if trained is not None and int(trained) != int(hidden):
        raise ConfigError(f"policy {name} has networks {trained} wide; this run's settings.hidden is {hidden} "
                          f"(set settings.hidden: {trained})")


def check_policy_decoding(manifest: dict, action_decoding: str, name) -> None:
    """A policy acts in the clip decoding it learned (:func:`raydp.control.store.policy_action_decoding`):
    one-line ConfigError for a run (or server) that decodes another."""
    trained = policy_action_decoding(manifest)
    if trained != action_decoding:
        raise ConfigError(f"policy {name} acts in {trained!r} clip decoding; this run decodes "
                          f"{action_decoding!r} (set settings.action_decoding: {trained})")
