"""Run configuration, validated before anything runs.

Every user-facing configuration is a pydantic model with ``extra="forbid"``: an unknown key, a bad
value or an impossible combination is a :class:`~raydp.errors.ConfigError` naming the field, raised
before any data is built or any model is loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raydp.errors import ConfigError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(StrictModel):
    """Where the private records come from (RLDP Sec. 2.1)."""

    source: str = Field("synthetic", description="'synthetic', a diabetic_data.csv path, or a built dataset dir")
    ids_mapping: str | None = Field(None, description="IDs_mapping.csv for a real CSV (default: embedded tables)")
    n_records: int | None = Field(2000, gt=0, description="synthetic size, or a cap on rows read from a CSV")
    seed: int = Field(0, ge=0, description="seed of the synthetic generator and of the splits")
    n_canary: int = Field(10, ge=0)
    canary_seed: int = Field(42, ge=0)


class LoraConfigModel(StrictModel):
    r: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] | None = None


class TrainConfig(StrictModel):
    """One fine-tuning run (RLDP Sec. 3.1 defaults)."""

    model: str = Field("embedded", description="embedded preset, Hugging Face name, or local model dir")
    data: DataConfig = DataConfig()
    lora: LoraConfigModel = LoraConfigModel()
    strategy: Literal["nonprivate", "static", "dp-lora", "static-pairwise"] = "nonprivate"
    epsilon: float | None = Field(None, gt=0, description="target epsilon (required for DP strategies)")
    delta: float = Field(1e-5, gt=0, lt=1, description="target delta; must be < 1/N_train")
    accountant: Literal["pld", "prv", "rdp"] = Field("pld", description="upper-bound accountant that calibrates and enforces")
    clip: float | None = Field(None, gt=0, description="static clip radius (default 1.0 flat, 0.1 per pair)")
    seed: int = Field(0, ge=0, description="training seed (initialisation, sampling, dropout)")
    epochs: float = Field(3.0, gt=0)
    max_steps: int | None = Field(None, gt=0, description="cap on the number of steps")
    batch_size: int = Field(16, gt=0)
    lr: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(100, ge=0)
    eval_every: int = Field(48, gt=0)
    eval_max_records: int | None = Field(256, gt=0, description="evaluate on at most this many eval records")
    max_length: int | None = Field(None, gt=1, description="token cap per sequence (default: model's, at most 512)")
    device: str = "auto"

    @model_validator(mode="after")
    def _consistent(self):
        if self.data.source == "synthetic" and self.data.n_records is None:
            raise ValueError("data.n_records is required for synthetic data")
        if self.strategy != "nonprivate" and self.epsilon is None:
            raise ValueError(f"strategy {self.strategy!r} needs a target epsilon")
        return self

    @property
    def is_private(self) -> bool:
        return self.strategy != "nonprivate"


def validate_config(cls: type[BaseModel], values: dict) -> BaseModel:
    """Build ``cls`` from ``values``; a validation failure becomes a one-line ConfigError naming the field."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or "config"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        raise ConfigError(f"invalid config: {where}: {message}") from None
