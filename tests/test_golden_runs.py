"""The golden runs' configs pin every setting, and bench/golden_runs.py compares runs as it says.

Fast, no Ray, no model: the configs under bench/golden/ are read and validated here, and the comparison is run on
small fabricated run directories. The golden runs themselves (two source trees, a few minutes) are
``python bench/golden_runs.py --against-commit HEAD`` (docs/golden-runs.md).

Every field of :class:`~raydp.config.TrainConfig`, of its nested models and of the run's strategy settings model must
be written out in each golden config, so that a later change of a default cannot move a golden run silently: a new
config field makes this test fail until the golden configs pin it (or it is listed in :data:`NOT_PINNED` with the
reason it cannot change a golden run).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from raydp.config import TrainConfig, validate_config
from raydp.strategies.registry import get_spec, settings_model

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "bench" / "golden"
CONFIGS = sorted(GOLDEN.glob("*.yaml"))

#: TrainConfig fields (dotted, e.g. "data.ids_mapping") the golden configs may leave out, each with why it cannot
#: change a golden run. Empty: every field is written out.
NOT_PINNED: dict[str, str] = {}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or as ``Model | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _unpinned(model: type[BaseModel], values: dict, prefix: str = "") -> list[str]:
    """The fields of ``model`` (nested models walked) that ``values`` does not write out."""
    missing = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        if name not in values:
            missing.append(path)
            continue
        nested = _model_of(info.annotation)
        if nested is not None and isinstance(values[name], dict):
            missing += _unpinned(nested, values[name], f"{path}.")
    return missing


def test_the_golden_set_is_the_four_arms():
    assert [p.stem for p in CONFIGS] == ["clip-schedule", "nonprivate", "rldp-frozen", "static-pairwise"]
    strategies = {p.stem: _load(p)["strategy"] for p in CONFIGS}
    assert strategies == {"nonprivate": "nonprivate", "static-pairwise": "static-pairwise",
                          "clip-schedule": "clip-schedule", "rldp-frozen": "rldp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_golden_config_validates_and_reads_back_unchanged(path):
    values = _load(path)
    config = validate_config(TrainConfig, values)
    assert config.model_dump(mode="json") == values  # nothing filled in or rewritten by validation
    if config.is_private:  # the strategy's settings as its model reads them: none left to a default or the run's clip
        assert config.strategy_settings().model_dump(mode="json") == values["settings"]
    else:
        assert values["settings"] == {}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_golden_config_pins_every_field(path):
    values = _load(path)
    missing = [f for f in _unpinned(TrainConfig, values) if f not in NOT_PINNED]
    assert not missing, f"{path.name} leaves {missing} to their defaults: write them out (or list them in NOT_PINNED)"
    unknown = sorted(set(values) - set(TrainConfig.model_fields))
    assert not unknown
    if get_spec(values["strategy"]).private:
        settings = settings_model(values["strategy"])
        missing = _unpinned(settings, values["settings"], "settings.")
        assert not missing, f"{path.name} leaves the strategy settings {missing} to their defaults"
    assert not [f for f in NOT_PINNED if f.split(".")[0] not in TrainConfig.model_fields]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_golden_run_is_short_replayable_and_single_threaded(path):
    config = validate_config(TrainConfig, _load(path))
    assert config.max_steps is not None and config.max_steps <= 200
    assert config.eval_max_records <= 500 and config.public_eval_records <= 500
    assert config.device == "cpu" and config.cpus == 1
    assert config.model == "embedded" and config.data.source == "synthetic"
    assert config.unsafe_fixed_randomness == config.is_private  # DP sampling and noise replayable
    if config.is_controlled:  # a frozen shipped policy
        settings = config.strategy_settings()
        assert settings.frozen and settings.policy_dir == "policies"
        assert (ROOT / "policies" / settings.policy / "manifest.json").is_file()


# -- the comparison, on fabricated runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden():
    spec = importlib.util.spec_from_file_location("golden_runs", ROOT / "bench" / "golden_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _fake_run(root: Path, scale: float = 1.0, sigma: float = 0.5, summary: dict | None = None) -> Path:
    import pandas as pd
    import torch
    from safetensors.torch import save_file

    (root / "adapter").mkdir(parents=True)
    tensors = {"base_model.model.h.0.lora_A.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
               "base_model.model.h.0.lora_B.weight": torch.ones(3, 2)}
    save_file(tensors, str(root / "adapter" / "adapter_model.safetensors"))
    (root / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    ledger = {"step": [0, 1], "sigma_eff": [0.5, sigma], "clip": [[0.1, 0.2], [0.1, 0.2]],
              "releases": [[{"name": "gradient", "noise_std": 0.5}]] * 2}
    pd.DataFrame(ledger).to_parquet(root / "privacy_ledger.parquet")
    pd.DataFrame({"step": [1, 2], "lr": [1e-3, 1e-3], "seconds": [0.1, 0.2]}).to_parquet(root / "train_metrics.parquet")
    base = {"final_public_value_nll": 70.0, "privacy": {"sigma_0": 0.5, "labels": ["void"]}, "steps": 2,
            "wall_seconds": 12.0, "train_loop_seconds": 3.0}
    (root / "summary.json").write_text(json.dumps({**base, **(summary or {})}))
    return root


def test_identical_runs_are_identical_whatever_their_timings(golden, tmp_path):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", summary={"wall_seconds": 99.0, "train_loop_seconds": 7.0})
    import pandas as pd
    pd.DataFrame({"step": [1, 2], "lr": [1e-3, 1e-3], "seconds": [5.0, 6.0]}).to_parquet(b / "train_metrics.parquet")
    status, detail = golden.verdict(golden.compare_runs(a, b, 0.0), 0.0)
    assert status == "identical", detail
    assert set(golden.EXCLUDED_SUMMARY_KEYS) >= {"wall_seconds", "train_loop_seconds"}


def test_a_difference_names_the_tensors_ledger_columns_and_summary_keys(golden, tmp_path):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", scale=1.0 + 1e-6, sigma=0.6, summary={"final_public_value_nll": 70.5,
                                                                        "privacy": {"sigma_0": 0.5, "labels": ["x"]}})
    status, detail = golden.verdict(golden.compare_runs(a, b, 0.0), 0.0)
    assert status == "differs"
    assert "tensors 1 of 2 (h.0.lora_A.weight; max abs diff 4.77e-06)" in detail  # 5e-6 in float32
    assert "ledger columns 1 of 4 (sigma_eff (from row 1); max abs diff 0.1)" in detail
    assert "final_public_value_nll" in detail and "privacy.labels" in detail and "privacy.sigma_0" not in detail


def test_a_margin_accepts_float_differences_within_it_and_says_so(golden, tmp_path):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", scale=1.0 + 1e-6, summary={"final_public_value_nll": 70.0 + 1e-5})
    assert golden.verdict(golden.compare_runs(a, b, 1e-6), 1e-6)[0] == "within margin"
    assert golden.verdict(golden.compare_runs(a, b, 1e-9), 1e-9)[0] == "differs"
    c = _fake_run(tmp_path / "c", summary={"steps": 3})  # an integer never moves within a margin
    assert golden.verdict(golden.compare_runs(a, c, 0.5), 0.5)[0] == "differs"


def test_a_file_on_one_side_only_differs(golden, tmp_path):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b")
    (b / "privacy_ledger.parquet").unlink()
    status, detail = golden.verdict(golden.compare_runs(a, b, 0.0), 0.0)
    assert status == "differs" and "ledger columns (only in this run)" in detail
