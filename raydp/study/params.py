"""What a study's trainable is given, typed: :class:`TrialParams`.

Ray Tune hands a function trainable one ``config`` dict, the study's ``param_space`` resolved for that trial; it must
stay a dict of plain JSON values (Tune grid-searches its ``trial`` key, Optuna samples ``t_rl``/``b_sac``/``k`` or a
search cell's ``search``, PBT mutates ``pbt``). So the driver builds one :class:`TrialParams` of what every trial
shares and writes it with :meth:`TrialParams.to_tune`; each route adds its own keys to that dict; and the trainable
reads the dict back with :meth:`TrialParams.from_tune` at its entry, where a missing key, a key no route writes or a
value of the wrong type is a one-line :class:`~raydp.errors.ConfigError` (a study that does not validate raises its
pydantic error).

The keys, by who writes them:

* every trial: ``study`` (the validated study file), ``dataset`` (the built dataset on the driver), ``dataset_id``
  (that dataset's keyed id, :func:`raydp.data.manifest_id`, read on the driver), ``study_dir``,
  ``wandb`` (where the trials log, resolved on the driver), ``connection`` (a shared policy's, or None),
  ``log_checkpoints``, ``n_trials`` (the audits' family size), ``lifetime_nonce`` (the tag of the study's lifetime
  charge); with the study's ``storage``: ``storage`` and ``dataset_remote``;
* a grid trial: ``trial``, its :class:`~raydp.study.trial.Trial` spec; in a study started before each config held its
  own spec, ``trial_name`` and ``trial_specs`` instead;
* an Optuna-sampled SAC cell: ``t_rl``, ``b_sac``, ``k``; a search_space or bandit trial: ``search_cell`` (a Trial) and
  ``search`` (the sampled values);
* a PBT member: ``population`` and ``population_namespace`` (its population filter's actor), ``pbt`` (its current
  settings and member index) and ``pbt_members`` (every member's spec).

The driver's privacy plan of a grid trial travels in its spec (:attr:`Trial.privacy_plan
<raydp.study.trial.Trial.privacy_plan>`, set by :func:`raydp.study.prepare.prepare_study`): :attr:`TrialParams.expected_plan`.
The trainable passes it to :func:`raydp.runner.run.run_training`, which refuses to run a plan that differs from it,
so the plan the study charged is the plan that runs, on the dataset it was charged on (the plan names the dataset's
id). A searched trial (Optuna, a search cell, the bandit) is planned only when it runs: it carries no plan and is not
compared, and is refused on a dataset with a lifetime budget (:func:`raydp.study.trainable.check_trial_charged`). Every
trial's lifetime receipt names the driver's ``dataset_id``, not its own copy's, so a trial on another copy (a node's
stale cache) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from raydp.data import load_manifest, manifest_id
from raydp.errors import ConfigError
from raydp.study.config import StudyConfig
from raydp.study.trial import Trial, tune_trial


@dataclass(frozen=True, kw_only=True)
class TrialParams:
    """A study trial's parameters (see the module docstring for who writes each)."""

    study: StudyConfig
    dataset: str
    study_dir: str
    #: the keyed id of the driver's dataset (the one its trials were charged on); read from ``dataset``'s manifest
    #: when not given (on the driver, where that directory is)
    dataset_id: str | None = None
    #: where the trial logs to wandb (:func:`raydp.study.trainable.wandb_target`); None: resolved in the trial
    wandb: dict | None = None
    #: the study's shared policy (:meth:`raydp.control.service.PolicySession.connection`), or None
    connection: dict | None = None
    log_checkpoints: bool = True
    n_trials: int = 1
    lifetime_nonce: str | None = None
    storage: str | None = None
    dataset_remote: str | None = None
    #: a grid trial's own spec
    trial: Trial | None = None
    #: an Optuna-sampled SAC cell
    t_rl: int | None = None
    b_sac: int | None = None
    k: int | None = None
    #: a search_space (or bandit) trial: its cell and sampled values
    search_cell: Trial | None = None
    search: dict | None = None
    #: a PBT member
    population: str | None = None
    population_namespace: str | None = None
    pbt: dict | None = None
    pbt_members: dict | None = None

    def __post_init__(self):
        if self.dataset_id is None:  # the driver's: read where the dataset was built (a trial's params carry it)
            object.__setattr__(self, "dataset_id", manifest_id(load_manifest(self.dataset)))

    # -- the trial's privacy plan -----------------------------------------------------------------------
    @property
    def expected_plan(self) -> dict | None:
        """The privacy plan the driver calibrated (and charged) for this trial, as plain JSON
        (:func:`raydp.runner.privacy_setup.plan_record`); None for a searched trial, which the driver did not plan."""
        return self.trial.privacy_plan if self.trial is not None else None

    # -- Tune's plain dict ------------------------------------------------------------------------------
    def to_tune(self) -> dict:
        """Tune's config: plain JSON values; every trial's keys always, the others where set."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in _ALWAYS:
                continue
            if isinstance(value, StudyConfig):
                value = value.model_dump(mode="json")
            elif isinstance(value, Trial):
                value = value.to_dict()
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_tune(cls, config: Mapping) -> TrialParams:
        """The parameters of Tune's ``config`` (the study is validated first: a bad study file raises its own error)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"trial params: expected Tune's config mapping, got {type(config).__name__}")
        study = StudyConfig(**config["study"]) if "study" in config else None
        if study is None:
            raise ConfigError("trial params: missing key 'study'")
        unknown = next((k for k in config if k not in _FIELDS and k not in _LEGACY), None)
        if unknown is not None:
            raise ConfigError(f"trial params: unknown key {unknown!r} (known: {', '.join(_FIELDS)})")
        missing = next((k for k in _REQUIRED if config.get(k) is None), None)
        if missing is not None:
            raise ConfigError(f"trial params: missing key {missing!r}")
        values = {k: config[k] for k in _FIELDS if k in config and k != "study"}
        values["trial"] = tune_trial(config)  # its own spec, or a legacy config's trial_specs[trial_name]
        if values.get("search_cell") is not None:
            values["search_cell"] = Trial.from_dict(values["search_cell"])
        for name, kind in _KINDS.items():
            value = values.get(name)
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ConfigError(f"trial params: {name} must be {_KIND_WORDS[kind]}, got {value!r}")
        return cls(study=study, **values)


_FIELDS = tuple(f.name for f in fields(TrialParams))
#: written for every trial, None or not
_ALWAYS = ("study", "dataset", "dataset_id", "study_dir", "wandb", "connection", "log_checkpoints", "n_trials",
           "lifetime_nonce")
#: a trial without ``dataset_id`` (a study started before its trials carried it) could not tell its dataset copy from
#: the one it was charged on: refused
_REQUIRED = ("dataset", "dataset_id", "study_dir")
#: a study started when every config held every spec (read by :func:`raydp.study.trial.tune_trial`)
_LEGACY = ("trial_name", "trial_specs")
_KINDS = {"dataset": str, "dataset_id": str, "study_dir": str, "wandb": dict, "connection": dict,
          "log_checkpoints": bool, "n_trials": int, "lifetime_nonce": str, "storage": str, "dataset_remote": str,
          "t_rl": int, "b_sac": int, "k": int, "search": dict, "population": str, "population_namespace": str,
          "pbt": dict, "pbt_members": dict}
_KIND_WORDS = {str: "a string", dict: "a mapping", bool: "true or false", int: "an integer"}
