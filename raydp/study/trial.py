"""One planned trial of a study, typed: :class:`Trial`.

A study's trials are planned from its study file in :mod:`raydp.study.grid` (the grid, transfer stages, PBT
members, Optuna's SAC cells and search cells), each made by :meth:`Trial.plan` from the study config; the rest of
the study (runner, results, report) reads them as attributes. A trial travels in three forms:

* the object itself, on the driver;
* :meth:`Trial.to_dict` / :meth:`Trial.from_dict`: plain values (str, numbers, None, dicts of plain values), what
  Ray Tune's ``param_space`` holds (the trainable rebuilds the Trial from its config, :func:`tune_trial`) and what
  a trial's final report carries as ``trial_spec`` (JSON). Only the fields set are written; a dict without a
  required key, with a key a trial does not have, or with a value of the wrong type is a one-line
  :class:`~raydp.errors.ConfigError` naming the key. Dicts written before this model (the same keys) still load;
* :meth:`Trial.row` / :meth:`Trial.from_row`: the identity columns of a ``results.parquet`` row (``trial``,
  ``model``, ``strategy``, ``epsilon_target``, ``seed``, ``t_rl``, ``b_sac``, ``k``, ``frozen_policy``,
  ``variant``, ``search``, ``tuned``, ``grid``). A row only holds what identifies the trial and its arm (not its
  PBT settings, stage, Optuna id, source key, saved-policy path or privacy plan). Rows written before the ``grid`` column get the
  settings_grid values back from ``variant`` (less the search and tuned values), as the label printed them.

Its arm (:class:`raydp.study.arms.Arm`) is :attr:`Trial.arm`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import pandas as pd

from raydp.errors import ConfigError
from raydp.strategies.registry import get_spec
from raydp.study.arms import CONTROLLERS, Arm


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One trial of a study: what varies between its trials (the rest is the study's ``base``)."""

    model: str
    #: the target epsilon; None for a non-private trial
    epsilon: float | None = None
    #: None only for a lone run read back without its config.json (:meth:`from_row`); a study's trial has one
    seed: int | None
    strategy: str
    #: a controller trial's SAC cell (RLDP Sec. 3.2): T_RL, B_SAC, K
    t_rl: int | None = None
    b_sac: int | None = None
    k: int | None = None
    #: this trial's values from the study's settings_grid (a controller's: its settings block's)
    grid: dict | None = None
    #: the best values of tuned_from's search for this trial's (strategy, model, epsilon)
    tuned: dict | None = None
    #: an Optuna search_space trial's sampled values
    search: dict | None = None
    #: a PBT member's current settings (clip, sigma_scale)
    settings: dict | None = None
    #: 'source': a transfer study's stage 1 (trains the policies); 'pbt': a PBT population's member
    stage: str | None = None
    #: a PBT member's index
    member: int | None = None
    #: a transfer study's stage-2 twin: the :attr:`source_key` of the stage-1 trial whose policy it reuses, frozen
    frozen_from: str | None = None
    #: the controller's policy is frozen (a transfer twin, or the study's own controller settings say frozen)
    frozen: bool = False
    #: an Optuna-sampled trial's Tune id
    optuna_id: str | None = None
    #: the saved policy a controller trial starts from, absolute (resolved by the driver)
    policy_path: str | None = None
    #: the privacy plan the driver calibrated and charged for this trial, plain JSON
    #: (:func:`raydp.runner.privacy_setup.plan_record`); its run refuses to run another plan. Set on the trials the
    #: driver planned (:func:`raydp.study.prepare.prepare_study`); None for a searched one, planned when it runs
    privacy_plan: dict | None = None
    #: the trial's name, its run directory's (default: built from the fields above, :meth:`default_name`)
    name: str = ""

    def __post_init__(self):
        for f in fields(self):
            value = _coerce(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if self.frozen_from is not None and not self.frozen:
            object.__setattr__(self, "frozen", True)
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    # -- made from the study config ---------------------------------------------------------------
    @classmethod
    def plan(cls, study, **values) -> Trial:
        """A trial of ``study`` (a :class:`raydp.study.config.StudyConfig`): ``values`` are its fields; a
        controller trial is frozen where the study's controller settings say so."""
        trial = cls(**values)
        if not trial.frozen and trial.controller_settings(study).get("frozen"):
            trial = replace(trial, frozen=True)
        return trial

    def derive(self, **changes) -> Trial:
        """Another trial made from this one (a transfer twin, a PBT member, a search trial): its name is built
        anew unless ``changes`` give one. (``dataclasses.replace`` keeps the name: for changes that leave the
        trial the same one, e.g. its policy path or a PBT member's current settings.)"""
        return replace(self, **{"name": "", **changes})

    def controller_settings(self, study) -> dict:
        """A controller trial's settings: the study's (``strategy_settings``) with this trial's settings_grid values
        over it; {} for another strategy. The one place study code reads them."""
        if self.strategy not in CONTROLLERS:
            return {}
        return {**(study.strategy_settings.get(self.strategy) or {}), **(self.grid or {})}

    # -- what it is ---------------------------------------------------------------------------------
    def default_name(self) -> str:
        """strategy_model[_epsN]_seedN[_SAC cell][_grid values][_frozen][_optuna-ID][_memberN]."""
        parts = [self.strategy, self.model.replace("/", "_")]
        if self.epsilon is not None:
            parts.append(f"eps{self.epsilon:g}")
        parts.append(f"seed{self.seed}")
        if get_spec(self.strategy).controller:
            parts.append(f"trl{self.t_rl}-b{self.b_sac}-k{self.k}")
        if self.grid:  # settings_grid: e.g. clip0.03
            parts.append("-".join(f"{k.replace('_', '')}{v}" for k, v in self.grid.items()))
        if self.frozen_from:
            parts.append("frozen")
        if self.optuna_id:
            parts.append(f"optuna-{self.optuna_id}")
        if self.member is not None:  # a PBT population's member
            parts.append(f"member{self.member}")
        return "_".join(parts)

    @property
    def variant(self) -> str | None:
        """Its settings_grid values, search trial's sampled values and tuned_from's chosen values, as
        ``clip=0.03`` (None when it has none)."""
        values = {**(self.grid or {}), **(self.tuned or {}), **(self.search or {})}
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()) or None

    @property
    def arm(self) -> Arm:
        return Arm(self.strategy, self.variant, self.t_rl, self.b_sac, self.k, self.frozen)

    @property
    def source_key(self) -> str:
        """What pairs a transfer study's stage-2 trial with its stage-1 trial (everything but the model)."""
        return f"{self.model}|{self.epsilon}|{self.seed}|{self.t_rl}|{self.b_sac}|{self.k}"

    # -- Tune's plain dict ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain values for Tune's param_space: the required fields and name always, the others where set."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _ALWAYS or (value is not None and value is not False):
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls, values) -> Trial:
        if not isinstance(values, Mapping):
            raise ConfigError(f"trial spec: expected a mapping of a trial's fields, got {type(values).__name__}")
        unknown = next((k for k in values if k not in _FIELDS), None)
        if unknown is not None:
            raise ConfigError(f"trial spec: unknown key {unknown!r} (a trial has {', '.join(_FIELDS)})")
        missing = next((k for k in _REQUIRED if k not in values), None)
        if missing is not None:
            raise ConfigError(f"trial spec: missing key {missing!r}")
        if values.get("seed") is None:
            raise ConfigError("trial spec: seed must be an integer, got None")
        return cls(**{k: v for k, v in values.items() if not (k == "name" and v is None)})

    # -- a results.parquet row -----------------------------------------------------------------------
    def row(self) -> dict:
        """The identity columns of its results row (column names as results.parquet has always had them)."""
        return {"trial": self.name, "model": self.model, "strategy": self.strategy, "epsilon_target": self.epsilon,
                "seed": self.seed, "t_rl": self.t_rl, "b_sac": self.b_sac, "k": self.k,
                "frozen_policy": self.frozen, "variant": self.variant, "search": _json(self.search),
                "tuned": _json(self.tuned), "grid": _json(self.grid)}

    @classmethod
    def from_row(cls, row: Mapping) -> Trial:
        """The trial of a results row (a dict or a pandas row; NaN is missing). Needs ``trial``, ``model`` and
        ``strategy``; a row written before the ``grid`` column gets its grid values back from ``variant``."""
        def get(name):
            value = row.get(name) if hasattr(row, "get") else None
            return None if _nan(value) else value

        missing = next((k for k in ("trial", "model", "strategy") if get(k) is None), None)
        if missing is not None:
            raise ConfigError(f"results row: missing column {missing!r}")
        search, tuned = _from_json("search", get("search")), _from_json("tuned", get("tuned"))
        grid = _from_json("grid", get("grid")) if "grid" in row else _legacy_grid(get("variant"), search, tuned)
        frozen = get("frozen_policy")
        return cls(name=get("trial"), model=get("model"), strategy=get("strategy"), epsilon=get("epsilon_target"),
                   seed=get("seed"), t_rl=get("t_rl"), b_sac=get("b_sac"), k=get("k"), grid=grid, search=search,
                   tuned=tuned, frozen=bool(frozen) if frozen is not None else False)


def tune_trial(config: Mapping) -> Trial | None:
    """The trial a Tune config names: its own spec (``trial``) or, in a study started when every config held
    every spec, ``trial_specs[trial_name]``; None for an Optuna-sampled trial (its spec is made when it runs)."""
    if config.get("trial") is not None:
        return Trial.from_dict(config["trial"])
    if config.get("trial_name") is not None:
        return Trial.from_dict((config.get("trial_specs") or {})[config["trial_name"]])
    return None


_FIELDS = tuple(f.name for f in fields(Trial))
_REQUIRED = ("model", "seed", "strategy")
_ALWAYS = ("model", "epsilon", "seed", "strategy", "name")
_KINDS = {"model": str, "strategy": str, "stage": str, "frozen_from": str, "optuna_id": str, "policy_path": str,
          "name": str, "epsilon": float, "seed": int, "t_rl": int, "b_sac": int, "k": int, "member": int,
          "grid": dict, "tuned": dict, "search": dict, "settings": dict, "frozen": bool, "privacy_plan": dict}
_KIND_WORDS = {str: "a string", float: "a number", int: "an integer", dict: "a mapping", bool: "true or false"}
_STAGES = ("source", "pbt")


def _nan(value) -> bool:
    """None, NaN or pandas' NA: a missing value (what a results table holds where a trial has none)."""
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _plain(value):
    """A numpy scalar as the Python value it holds; anything else as it is."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value


def _coerce(name: str, value):
    kind = _KINDS[name]
    wrong = ConfigError(f"trial spec: {name} must be {_KIND_WORDS[kind]}, got {value!r}")
    if kind is bool:
        value = _plain(value)
        if not isinstance(value, bool):
            raise wrong
        return value
    if name == "name" and value is None:
        return ""
    if _nan(value):
        if name in ("model", "strategy"):
            raise ConfigError(f"trial spec: {name} must be {_KIND_WORDS[kind]}, got None")
        return None
    value = _plain(value)
    if kind is str:
        if not isinstance(value, str):
            raise wrong
        if name == "stage" and value not in _STAGES:
            raise ConfigError(f"trial spec: stage must be one of {', '.join(_STAGES)}, got {value!r}")
        return value
    if kind is dict:
        if not isinstance(value, Mapping) or any(not isinstance(k, str) for k in value):
            raise wrong
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong
    if kind is int:
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise wrong
        return int(value)
    return float(value)


def _json(values: dict | None) -> str | None:
    return json.dumps(values, sort_keys=True) if values else None


def _from_json(name: str, text) -> dict | None:
    if text is None or text == "":
        return None
    if isinstance(text, Mapping):
        return dict(text)
    try:
        values = json.loads(text)
    except (TypeError, ValueError):
        raise ConfigError(f"results row: column {name!r} is not JSON: {str(text)[:80]!r}") from None
    return values or None


def _legacy_grid(variant, search: dict | None, tuned: dict | None) -> dict | None:
    """A row written before the ``grid`` column: its settings_grid values from ``variant`` (``clip=0.03, k=2``),
    less the keys the search and tuned values fill; numbers as the label printed them (4 significant digits)."""
    if not isinstance(variant, str) or not variant:
        return None
    grid = {}
    for part in variant.split(", "):
        key, sep, text = part.partition("=")
        if not sep:
            continue
        grid[key] = _parse_value(text)
    for key in {**(tuned or {}), **(search or {})}:
        grid.pop(key, None)
    return grid or None


def _parse_value(text: str):
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)
