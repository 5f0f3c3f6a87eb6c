"""One registry of DP strategies: name -> class, each with its pydantic settings model.

The CLI's ``--strategy`` choices, :class:`~raydp.config.TrainConfig`'s ``strategy`` and ``settings`` and the
study file's ``strategies`` all derive from this table. Classes are imported when first asked for, so
reading the names costs nothing. A strategy's settings come from ``TrainConfig.settings`` (validated by
its ``settings_model``; the top-level ``clip`` fills a ``clip`` setting left unset), RLDP's included (they were
once a separate ``rldp:`` block, its spec's ``legacy_block``, which old configs still use: they are
migrated when read, :func:`raydp.config.upgrade_train_values`).

Capabilities are declared here, in each strategy's :class:`StrategySpec` (like Opacus's ``get_optimizer_class``
table), and code outside a strategy's own module asks for a capability, never for a name: ``private`` (False for
``nonprivate`` only), ``controller`` (a live policy
sets the dials: the run needs a policy client, and studies grid its SAC cell), ``population`` (Tune's PBT sets the
dials across a population) and ``challenger`` (a learned method that reports test against the tuned baselines).
A strategy class's ``adaptive_sigma`` says it chooses sigma from earlier releases, so its runs are enforced and
reported by the Renyi filter (ERRATA E13).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from raydp.errors import ConfigError

NONPRIVATE = "nonprivate"


@dataclass(frozen=True)
class StrategySpec:
    name: str
    target: str  # "module:Class"
    summary: str
    #: "module:Class" of the settings model where it can be imported without the strategy (no numpy, no torch):
    #: the CLI builds a flag per setting from it (:mod:`raydp.cli_flags`); None: the class's ``settings_model``
    settings: str | None = None
    #: the config block that held the settings before they moved under ``settings`` (RLDP: ``rldp``); read only
    #: to migrate an old config or study (:func:`raydp.config.upgrade_train_values`)
    legacy_block: str | None = None
    #: False for the one non-private strategy: no epsilon, no DP step
    private: bool = True
    #: a live policy sets the dials: the run needs a policy client (:mod:`raydp.control`), runs as a Ray actor,
    #: and a study grids (or searches) its SAC cell, can share, save and transfer its policy
    controller: bool = False
    #: the dials are set by Tune's Population Based Training across a population (``search: pbt``)
    population: bool = False
    #: a learned method (a controller or a learned schedule) that study reports test against the tuned baselines
    challenger: bool = False
    #: its clip settings multiply each adapter pair's median per-sample gradient norm on public records (unless its
    #: settings say ``relative: false``): the radii a run's ledger holds are not the settings (the report says so)
    relative_clips: bool = False

    def load(self):
        if not self.target:
            raise ConfigError(f"{self.name!r} has no strategy class: it is the non-private gradient")
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_SPECS = (
    StrategySpec("static", "raydp.strategies.static:StaticStrategy",
                 "DP-SGD, one flat clip C=1 over all LoRA gradients, constant sigma_0"),
    StrategySpec("dp-lora", "raydp.strategies.static:DPLoRAStrategy",
                 "the paper's DP-LoRA baseline: static DP-SGD on the LoRA adapters"),
    StrategySpec("static-pairwise", "raydp.strategies.static:StaticPairwiseStrategy",
                 "pairwise clipping with C_i=0.1 per LoRA pair, constant sigma_0"),
    StrategySpec("clip-schedule", "raydp.strategies.clipschedule:ClipScheduleStrategy",
                 "an open-loop per-pair clip schedule (multiples of public gradient norms), searched on public data",
                 challenger=True, relative_clips=True),
    StrategySpec("ewpba", "raydp.strategies.ewpba:EWPBAStrategy",
                 "EW-FT's epoch-weighted noise schedule (EWPBA, Alg. 1) on static DP-SGD, flat clip C=1"),
    StrategySpec("ewft", "raydp.strategies.forward:EWFTStrategy",
                 "EW-FT: forward-pass local DP on hidden embeddings, autoencoder, EWPBA schedule (local accounting)"),
    StrategySpec("dpforward", "raydp.strategies.forward:DPForwardStrategy",
                 "DP-Forward: forward-pass local DP on hidden embeddings, uniform schedule (local accounting)"),
    StrategySpec("dualtune", "raydp.strategies.dualtune:DualTuneStrategy",
                 "DualTune-GhostDP: non-private phase 1 (public, or redacted private: labelled), then flat DP-SGD "
                 "with ghost clipping"),
    StrategySpec("rldp", "raydp.strategies.rldp:RLDPStrategy",
                 "RLDP: a SAC policy sets per-pair clips and sigma online (Renyi filter)",
                 settings="raydp.strategies.rldp_settings:RLDPSettings", legacy_block="rldp",
                 controller=True, challenger=True),
    StrategySpec("adaclip", "raydp.strategies.adaclip:AdaClipStrategy",
                 "AdaClip (Pichapati et al. 2019): per-coordinate centring and scaling from noisy gradients"),
    StrategySpec("auto-clip", "raydp.strategies.autoclip:AutoClipStrategy",
                 "automatic clipping (Bu et al. 2023): per-sample normalisation g / (||g|| + gamma)"),
    StrategySpec("quantile", "raydp.strategies.quantile:QuantileClipStrategy",
                 "quantile-adaptive clipping (Andrew et al. 2021), noisy unclipped count charged"),
    StrategySpec("dc-sgd-p", "raydp.strategies.dcsgd:DCSGDPercentileStrategy",
                 "DC-SGD-P (Wei et al. 2025): clip at a percentile of a DP norm histogram"),
    StrategySpec("dc-sgd-e", "raydp.strategies.dcsgd:DCSGDExpectedErrorStrategy",
                 "DC-SGD-E (Wei et al. 2025): clip minimising expected squared error from a DP norm histogram"),
    StrategySpec("geoclip", "raydp.strategies.geoclip:GeoClipStrategy",
                 "GeoClip (Gilani et al. 2025): clipping and noise in a basis estimated from noisy gradients"),
    StrategySpec("psac", "raydp.strategies.psac:PSACStrategy",
                 "PSAC (Xia et al. 2023): per-sample adaptive clipping, non-monotonic weight"),
    StrategySpec("pbt", "raydp.strategies.pbt:PBTStrategy",
                 "a Population Based Training member: (clip, sigma) set by Ray Tune's PBT (Renyi filter)", population=True),
)

#: the DP strategies
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in _SPECS}
#: every value of ``TrainConfig.strategy``: the DP strategies and the non-private gradient
SPECS: dict[str, StrategySpec] = {
    NONPRIVATE: StrategySpec(NONPRIVATE, "", "no privacy: the plain mini-batch gradient (the reference arm)",
                             private=False),
    **STRATEGIES}
STRATEGY_CHOICES: tuple[str, ...] = tuple(SPECS)


def get_spec(name: str) -> StrategySpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_CHOICES)}") from None


def is_private(name: str) -> bool:
    return get_spec(name).private


def is_controller(name: str) -> bool:
    """A live policy sets the strategy's dials (it needs a policy client)."""
    return get_spec(name).controller


def with_capability(names, capability: str) -> list[str]:
    """The names among ``names`` whose spec declares ``capability`` (e.g. ``"controller"``)."""
    return [name for name in names if getattr(get_spec(name), capability)]


def capability_names(capability: str) -> str:
    """The registered names with ``capability``, quoted, for a message: ``'rldp'``, or ``'a' or 'b'``."""
    return " or ".join(repr(name) for name in with_capability(STRATEGY_CHOICES, capability))


def strategy_class(name: str):
    return get_spec(name).load()


def settings_model(name: str):
    """The pydantic model of strategy ``name``'s settings (None: it takes none), loaded from the spec's light
    ``settings`` module where it has one, so that reading it loads no strategy."""
    spec = get_spec(name)
    if spec.settings:
        module, _, attr = spec.settings.partition(":")
        return getattr(importlib.import_module(module), attr)
    return strategy_class(name).settings_model if spec.target else None


def strategy_settings(name: str, values: dict | None = None, **run_values):
    """The validated settings of strategy ``name`` from ``values`` (a mapping; errors name ``settings.X``).
    ``run_values`` (the run's ``clip``, ``batch_size``...) fill settings of the same name that ``values``
    leaves unset, so a strategy that needs the run's batch size reads the run's own."""
    from raydp.settings import validate_config

    model = settings_model(name)
    if model is None:
        raise ConfigError(f"strategy {name!r} takes no settings")
    values = dict(values or {})
    for key, value in run_values.items():
        if value is not None and key in model.model_fields and key not in values:
            values[key] = value
    return validate_config(model, values, where="settings.")

def make_strategy(name: str, settings=None, **kwargs):
    """Strategy ``name`` with its settings (a settings model or a mapping; RLDP also takes ``client``)."""
    if settings is None or isinstance(settings, dict):
        settings = strategy_settings(name, settings)
    return strategy_class(name)(settings, **kwargs)
