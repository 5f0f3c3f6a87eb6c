"""Run configuration, validated before anything runs.

Every user-facing configuration is a pydantic model with ``extra="forbid"``: an unknown key, a bad
value or an impossible combination is a :class:`~raydp.errors.ConfigError` naming the field, raised
before any data is built or any model is loaded.
"""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raydp.settings import StrictModel, load_yaml_mapping, validate_config  # noqa: F401  (re-exported)
from raydp.control.transports import transport_for
from raydp.recipe import COMPUTE_TIERS, RECIPE_FIELDS, resolve
from raydp.strategies.registry import (NONPRIVATE, SPECS, STRATEGY_CHOICES, get_spec, settings_model, strategy_class,
                                       strategy_settings, with_capability)


#: records of the embedded default's synthetic dataset (docs/benchmark.md): with the default split fractions,
#: ~2,000 eval records (enough that the seed spread, not the evaluation sample, dominates) and ~5,500 in train
SYNTHETIC_DEFAULT_RECORDS = 10_000


class DataConfig(StrictModel):
    """Where the private records come from (RLDP Sec. 2.1)."""

    source: str = Field("synthetic", description="'synthetic', 'public' (the public population: pre-training "
                        "a policy or tuning a baseline, no private budget), a diabetic_data.csv path, or a built "
                        "dataset dir")
    ids_mapping: str | None = Field(None, description="IDs_mapping.csv for a real CSV (default: embedded tables)")
    text_column: str | None = Field(None, description=(
        "the source is a table of free text (.csv, .parquet, .jsonl; raydp.data.text_source): its column of texts"))
    unit_column: str | None = Field(None, description="with text_column: the column naming each text's privacy unit "
                                    "(a patient, a user); all of a unit's texts go to one split and DP protects units")
    n_records: int | None = Field(None, gt=0, description="synthetic size (default 10000); not for a CSV (use "
                                  "sample_fraction)")
    sample_fraction: float | None = Field(None, gt=0, le=1, description=(
        "a CSV only: keep each patient with this probability, decided by its own id (so one patient's presence "
        "never moves another); default: every row"))
    fractions: dict[str, float] | None = Field(None, description=(
        "split fractions of patients: attack (default 0.2), eval (0.2), validation (0.05: the private validation "
        "split); train takes the rest. Each patient's split depends on its own id and the seed only"),
        json_schema_extra={"flag": "--split", "metavar": "SPLIT=FRACTION"})
    generator: Literal["structured", "independent"] = Field("structured", description=(
        "synthetic records: structured (latent condition and severity per patient, dependent fields; the default) "
        "or independent (every field drawn on its own: the benchmark before structured records)"))
    seed: int = Field(0, ge=0, description="seed of the synthetic generator and of the splits",
                      json_schema_extra={"flag": "--data-seed"})
    n_canary: int = Field(10, ge=0, description="secret canaries planted in train (the extraction attacks' targets)")
    canary_seed: int = Field(42, ge=0, description="seed of the canaries' secrets")
    n_audit: int = Field(0, ge=0, description=(
        "audit canaries for the empirical epsilon audit (raydp eval), each in train by a fair coin; they are "
        "synthetic records added to the training set, so they are off unless asked for (e.g. 100)"))

    @model_validator(mode="before")
    @classmethod
    def _synthetic_size(cls, values):
        if isinstance(values, dict) and values.get("source", "synthetic") in ("synthetic", "public") \
                and values.get("n_records") is None and values.get("text_column") is None:
            values = {**values, "n_records": SYNTHETIC_DEFAULT_RECORDS}
        return values

    @model_validator(mode="after")
    def _check_sources(self):
        generated = self.source in ("synthetic", "public")
        if (self.text_column is None) != (self.unit_column is None):
            raise ValueError("a text table needs both text_column and unit_column")
        if self.text_column is not None and generated:
            raise ValueError("text_column and unit_column describe a text table given as source (.csv, .parquet, "
                             ".jsonl), not the synthetic records")
        if not generated and self.n_records is not None and not Path(self.source).expanduser().is_dir():
            raise ValueError("n_records sizes synthetic data; to subsample a CSV use sample_fraction (each patient "
                             "is kept on its own, so one patient's presence never moves another)")
        if generated and self.sample_fraction is not None:
            raise ValueError("sample_fraction subsamples a CSV; n_records sizes synthetic data")
        from raydp.data.splits import check_fractions  # lazy: the data package loads pandas and scipy

        try:
            check_fractions(self.fractions)
        except Exception as exc:
            raise ValueError(str(exc)) from None
        return self


class LoraConfigModel(StrictModel):
    """The LoRA adapters that are trained (the model's own weights stay frozen)."""

    r: int = Field(8, gt=0, description="LoRA rank", json_schema_extra={"flag": "--lora-r"})
    alpha: int = Field(16, gt=0, description="LoRA scaling: an adapter's update is scaled by alpha / r",
                       json_schema_extra={"flag": "--lora-alpha"})
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the adapters' input",
                           json_schema_extra={"flag": "--lora-dropout"})
    target_modules: tuple[str, ...] | None = Field(
        None, description="names of the modules that get adapters (default: by the model's architecture)",
        json_schema_extra={"flag": "--lora-target-modules"})


class TaskConfig(StrictModel):
    """What the run trains and evaluates (:mod:`raydp.runner.task`)."""

    kind: Literal["lm", "classification"] = Field(
        "lm", description="lm: language modelling, judged by perplexity; classification: a label field of the "
                          "narratives as a prompt classifier, judged by accuracy (EW-FT, DualTune)",
        json_schema_extra={"flag": "--task"})
    label: Literal["change", "diabetesMed", "readmitted"] = Field(
        "change", description="the label field of a classification task (readmitted is independent of every "
                              "other field in synthetic records: use it with the real CSV)")


def upgrade_train_values(values):
    """An old run config's values in today's form (every TrainConfig is read through this, so old YAML files, a
    stored run's ``config.json`` and a study's base all load; ``raydp migrate`` rewrites stored ones). A strategy's
    legacy settings block (RLDP's ``rldp:`` of older configs: its spec's ``legacy_block``) moves under ``settings``
    when the config runs that strategy, and is dropped otherwise: every old run's config.json carried it, defaults
    included, whatever its strategy, and no other strategy read it."""
    if not isinstance(values, dict):
        return values
    blocks = {spec.legacy_block: name for name, spec in SPECS.items() if spec.legacy_block and spec.legacy_block in values}
    if not blocks:
        return values
    values = dict(values)
    for block, owner in blocks.items():
        legacy = values.pop(block)
        if values.get("strategy", NONPRIVATE) != owner or legacy is None:
            continue
        if not isinstance(legacy, dict):
            raise ValueError(f"{block}: give the strategy's settings as a mapping (under settings)")
        settings = values.get("settings") or {}
        if not isinstance(settings, dict):
            continue  # the field's own validation names it
        both = sorted(set(legacy) & set(settings))
        if both:
            raise ValueError(f"{block}.{both[0]} and settings.{both[0]} are both set: {block}'s settings now go under "
                             "settings only")
        values["settings"] = {**legacy, **settings}
    return values


class TrainConfig(StrictModel):
    """One fine-tuning run (RLDP Sec. 3.1 defaults)."""

    model: str = Field("embedded", description="embedded preset, Hugging Face name, or local model dir")
    data: DataConfig = Field(default_factory=DataConfig)
    task: TaskConfig = TaskConfig()
    lora: LoraConfigModel = LoraConfigModel()
    strategy: str = Field("nonprivate", description="nonprivate, or a registered DP strategy "
                          "(raydp.strategies.registry)",
                          json_schema_extra={"choices": STRATEGY_CHOICES, "metavar": "NAME"})
    #: no generated flag: `raydp train --set KEY=VALUE` (hand-written), and a flag per field of each strategy
    #: settings model the registry loads without its strategy (raydp.cli_flags)
    settings: dict = Field(default_factory=dict, description="the strategy's own settings (its settings model)",
                           json_schema_extra={"flag": False})
    epsilon: float | None = Field(None, gt=0, description="target epsilon (required for DP strategies)")
    delta: float = Field(1e-5, gt=0, lt=1, description="target delta; must be < 1/N_train")
    accountant: Literal["pld", "prv", "rdp"] = Field("pld", description="upper-bound accountant that calibrates and enforces")
    clip: float | None = Field(None, gt=0, description="clip radius of a strategy with a `clip` setting "
                               "(static: default 1.0 flat, 0.1 per pair)")
    seed: int = Field(0, ge=0, description="seed of what is not private: initialisation, dropout, the "
                      "non-private sampler (DP sampling and noise use OS entropy, ERRATA E12)")
    privacy_unit: Literal["auto", "patient", "record"] = Field(
        "auto", description="what DP protects (ERRATA E11): patient (all of a patient's encounters; the "
                            "default on data with patient ids) or record (one encounter)")
    unsafe_fixed_randomness: bool = Field(
        False, description="UNSAFE: derive DP sampling and noise from `seed` (replayable; the epsilon is void)")
    common_random_numbers: bool = Field(False, description=(
        "PUBLIC data only (data.source: public): DP sampling and noise from `seed`, so the candidates of a search share "
        "them (common random numbers); refused on private data, where only unsafe_fixed_randomness does this"))
    public_eval_records: int = Field(2000, gt=0, description="PUBLIC validation records evaluated beside the "
                                     "private eval split (selection uses them, ERRATA E15)")
    public_validation: str | None = Field(None, description=(
        "a file of PUBLIC records from the private data's domain to validate and select on, instead of the synthetic "
        "public population (which says nothing about a real dataset's task): a CSV in the diabetic_data.csv schema "
        "for Diabetes data, a table with the same text and unit columns for a free-text dataset; refused when it "
        "shares a unit with the private data"), json_schema_extra={"metavar": "FILE"})
    recipe: Literal["auto", "none"] = Field("auto", description=(
        "auto: every recipe setting left unset (batch_size, epochs, lr, lr_decay, lr_end, warmup_steps, weight_decay, "
        "clip) takes the package's recipe for this model, strategy and epsilon, searched on PUBLIC data "
        "(raydp.recipe; no budget on your data), where the table has one; none: today's defaults"))
    compute: Literal[COMPUTE_TIERS] = Field("default", description=(
        "the compute tier whose recipe entry fills the unset settings: default (today's records processed per run, "
        "3 epochs of the train split) or 3x (three times them; a strategy whose 3x tier was not searched takes its "
        "default entry with the epochs x3); needs recipe: auto"))
    #: what the recipe filled: written by validation, kept in config.json (the summary names it too)
    recipe_applied: dict | None = Field(None, description=(
        "the recipe entry this config took and the fields it filled (None: none); written by validation"),
        json_schema_extra={"flag": False})
    epochs: float = Field(3.0, gt=0, description="passes over the train split (may be fractional)")
    max_steps: int | None = Field(None, gt=0, description="cap on the number of steps")
    batch_size: int = Field(16, gt=0, description="records per step (a DP strategy's expected batch: Poisson "
                            "sampling at rate batch_size / N)")
    lr: float = Field(5e-4, gt=0, description="peak learning rate of AdamW (reached after the warm-up)")
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up (a few % of a default run)")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant (the paper's), or a linear or cosine decay to lr_end x lr "
                                "at the last planned step")
    lr_end: float = Field(0.0, ge=0, le=1, description="the decay's final learning rate, as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description=(
        "AdamW's decoupled weight decay (Loshchilov & Hutter, ICLR 2019) on the trained parameters; under DP it is "
        "post-processing (it reads the parameters, not the data); 0: the paper's setting (RLDP Sec. 3.1)"))
    rescale_moments: bool = Field(False, description=(
        "when a strategy changes a pair's clip by a factor k, scale that pair's AdamW moments by k and k^2 (the step "
        "size follows the clip instead of freezing or jumping for hundreds of steps)"))
    eval_every: int | None = Field(None, gt=0, description=(
        "steps between evaluations (beside step 0, each epoch end and the last, which are always evaluated); default: "
        "those only (evaluating 2,000 + 2,000 records is a third of a default run)"))
    eval_max_records: int | None = Field(2000, gt=0, description="evaluate on at most this many eval records")
    dp_width: int | None = Field(None, gt=1, description=(
        "DP runs: the tokens every training batch is padded to (a longer training record is cut to it), a public "
        "constant, so that no record changes the shapes the others are computed with; default: the longest public "
        "validation record, at most max_length"))
    max_length: int | None = Field(None, gt=1, description="token cap per sequence (default: model's, at most 512; "
                                   "a classification prompt is exactly this long, default 384, left-filled)")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:1, ...")
    cpus: int | None = Field(None, gt=0, description="CPU threads of the run (default: all of this machine's)")
    controller: str = Field("broker", description="where an RLDP run's policy is: 'broker' (a policy service "
                            "started for the run) or 'rllink://HOST:PORT', a policy server reached over RLlib's "
                            "RLlink protocol (raydp.control.rllink; HOST is IPv4 loopback only, localhost meaning "
                            "127.0.0.1, and defaults to 127.0.0.1: reach a remote server through an SSH tunnel)",
                            json_schema_extra={"metavar": "URL"})

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, values):
        return upgrade_train_values(values)

    @model_validator(mode="after")
    def _recipe(self):
        """Each recipe field the config leaves unset (not in ``model_fields_set``: no flag, YAML key or study value
        gave it) takes the recipe's value; ``recipe_applied`` records the entry and the fields. A validated config
        dumped and read again (config.json) sets every field, so it fills nothing and keeps its record."""
        if "recipe_applied" in self.model_fields_set and self.recipe_applied is not None:
            # a config read back (config.json): its record stays (an older table's entry is history), but only as
            # the record of values this config holds, under recipe: auto; validation writes it, a user does not
            filled = self.recipe_applied.get("filled") if isinstance(self.recipe_applied, dict) else None
            if self.recipe != "auto" or not isinstance(filled, dict) or \
                    any(k not in RECIPE_FIELDS or getattr(self, k) != v for k, v in filled.items()) or \
                    self.recipe_applied.get("compute_tier", "default") != self.compute:
                raise ValueError("recipe_applied is written by validation: it must record the values this config "
                                 "holds and its compute tier, under recipe: auto (remove it to let validation write "
                                 "it)")
            return self
        if self.recipe == "none":
            if self.compute != "default":
                raise ValueError(f"compute: {self.compute} selects the recipe's {self.compute} tier: it needs recipe: "
                                 "auto (with recipe: none, set epochs yourself)")
            return self
        if self.strategy not in STRATEGY_CHOICES:
            return self  # an unknown strategy: _consistent names it
        # public config values only: no data is read
        resolved = resolve(self.model, self.strategy, self.epsilon, tier=self.compute)
        if resolved is None:
            if self.compute != "default":  # nothing would give the tier its compute: say so rather than run 1x
                raise ValueError(f"compute: {self.compute}: the recipe table has no entry for model {self.model!r} "
                                 f"and strategy {self.strategy!r}, so no tier to apply (set epochs yourself)")
            return self
        tier_epochs = resolved.settings.get("epochs")
        if self.compute != "default" and "epochs" in self.model_fields_set and tier_epochs != self.epochs:
            # the tier's compute did not happen: say so (scaled from the default tier or the tier's own entry)
            note = resolved.tier_note or f"the {self.compute} tier's entry"
            resolved = replace(resolved, tier_note=f"{note}, but the run gave its epochs ({self.epochs:g}), not the "
                                                   f"tier's ({tier_epochs:g})")
        unset = [k for k in RECIPE_FIELDS if k not in self.model_fields_set and k in resolved.settings]
        if "clip" in unset and ("clip" in self.settings or "clip" not in
                                getattr(settings_model(self.strategy), "model_fields", {})):
            unset.remove("clip")  # the strategy's own settings.clip wins over the run's clip (as for --clip)
        if not unset:
            if self.compute != "default":
                raise ValueError(f"compute: {self.compute} has nothing to fill: every recipe setting is given (drop "
                                 "compute, or leave epochs to the tier)")
            return self
        filled = {k: resolved.settings[k] for k in unset}
        for key, value in filled.items():  # validated by the table's model (TrainConfig's constraints)
            self.__dict__[key] = value  # frozen model: set as validation does; the field stays out of fields_set
        self.__dict__["recipe_applied"] = resolved.record(filled)
        return self

    @field_validator("controller")
    @classmethod
    def _controller_address(cls, value: str) -> str:
        transport_for(value).parse(value)  # ValueError: one line naming the field
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {self.strategy!r}; known: {', '.join(STRATEGY_CHOICES)}")
        spec = get_spec(self.strategy)
        if self.controller != "broker":
            if not spec.controller:
                controlled = ", ".join(with_capability(STRATEGY_CHOICES, "controller"))
                raise ValueError(f"controller {self.controller!r} drives a run whose dials a policy sets (strategy "
                                 f"{controlled}), not {self.strategy!r}")
        if transport_for(self.controller).external:  # the policy lives outside the run (a server owns it)
            for key in ("policy", "frozen", "save_policy"):
                if getattr(self.strategy_settings(), key):
                    raise ValueError(f"settings.{key} does not apply with controller "
                                     f"{self.controller!r}: the policy server owns the policy")
        if self.common_random_numbers and self.data.source != "public" and not Path(self.data.source).expanduser().is_dir():
            # a dataset directory (a study's built dataset) is checked when the run starts: its manifest says
            raise ValueError("common_random_numbers fixes the DP sampling and noise: it is for public data only "
                             "(data.source: public); on private data the randomness is secret (ERRATA E12)")
        if spec.private and self.epsilon is None:
            raise ValueError(f"strategy {self.strategy!r} needs a target epsilon")
        if self.settings and not spec.private:
            raise ValueError(f"strategy {self.strategy!r} takes no `settings`")
        if spec.private:
            self.strategy_settings()  # a bad setting is an error naming it, before anything runs
            if getattr(strategy_class(self.strategy), "mechanism", None) == "local":
                if self.task.kind != "classification":
                    raise ValueError(f"strategy {self.strategy!r} perturbs a classifier's hidden states: set "
                                     "task: {kind: classification} (--task classification)")
                if self.data.n_audit:
                    raise ValueError(f"strategy {self.strategy!r} is a local (replace-one) mechanism: the one-run "
                                     "audit's add/remove canaries (data.n_audit) do not apply; set n_audit: 0")
        return self

    def strategy_settings(self):
        """The strategy's validated settings model (from ``settings``; RLDP's too)."""
        return strategy_settings(self.strategy, self.settings, clip=self.clip, batch_size=self.batch_size)

    @property
    def is_private(self) -> bool:
        return get_spec(self.strategy).private

    @property
    def is_controlled(self) -> bool:
        """A live policy sets this run's dials (it needs a policy client)."""
        return get_spec(self.strategy).controller
