"""Old configs still load (issue 30): RLDP's settings were a separate ``rldp:`` block of a run config (and
``base.rldp`` of a study); they are now ``settings`` like every strategy's, and an old file is migrated when read."""

from __future__ import annotations

import json

import pytest

from raydp.config import TrainConfig, upgrade_train_values
from raydp.errors import ConfigError
from raydp.settings import validate_config
from raydp.study.config import StudyConfig, upgrade_study_values
from raydp.study.grid import trial_config, trial_grid


def test_an_rldp_block_becomes_the_rldp_runs_settings():
    old = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "rldp": {"t_rl": 7, "privacy_mode": "paper"}})
    new = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "settings": {"t_rl": 7, "privacy_mode": "paper"}})
    assert old == new and old.settings == {"t_rl": 7, "privacy_mode": "paper"}
    assert old.strategy_settings().t_rl == 7 and old.strategy_settings().privacy_mode == "paper"
    assert "rldp" not in old.model_dump()


def test_an_rldp_block_of_another_strategy_is_dropped_as_it_was_ignored():
    """Every old run's config.json carried the block (defaults included), whatever its strategy."""
    config = validate_config(TrainConfig, {"strategy": "static", "epsilon": 2.0, "clip": 0.5, "rldp": {"t_rl": 7}})
    assert config.settings == {} and config.strategy_settings().clip == 0.5
    assert validate_config(TrainConfig, {"rldp": {"t_rl": 7}}).settings == {}


def test_a_stored_run_config_with_an_rldp_block_round_trips(tmp_path):
    """A run directory's config.json written before the change (TrainConfig.model_dump with its `rldp` block)."""
    dumped = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "settings": {"t_rl": 9}}).model_dump(
        mode="json")
    old = {**{k: v for k, v in dumped.items() if k != "settings"}, "settings": {},
           "rldp": {"t_rl": 9, "policy": None, "frozen": False, "policy_dir": "policies"}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = TrainConfig.model_validate(json.loads((tmp_path / "config.json").read_text()))
    assert config.strategy_settings().t_rl == 9 and config.strategy_settings().policy is None


def test_an_rldp_block_and_settings_naming_the_same_setting_is_one_line_error():
    with pytest.raises(ConfigError, match=r"^invalid config: config: rldp.t_rl and settings.t_rl are both set"):
        validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "rldp": {"t_rl": 7}, "settings": {"t_rl": 8}})
    with pytest.raises(ConfigError, match="rldp: give the strategy's settings as a mapping"):
        validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "rldp": 3})
    assert upgrade_train_values({"strategy": "rldp", "rldp": {"k": 1}, "settings": {"t_rl": 2}}) == \
        {"strategy": "rldp", "settings": {"k": 1, "t_rl": 2}}


def test_a_bad_rldp_setting_names_the_settings_field():
    with pytest.raises(ConfigError, match=r"^invalid config: settings\.t_rl: "):
        validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "settings": {"t_rl": 0}})
    with pytest.raises(ConfigError, match=r"^invalid config: settings\.t_rll: unknown field"):
        validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "rldp": {"t_rll": 3}})


STUDY = {"name": "s", "models": ["embedded-tiny"], "epsilons": [2.0], "strategies": ["static", "rldp"],
         "sac_grid": {"t_rl": [4], "b_sac": [4], "k": [2]}, "base": {"max_steps": 8}}


def test_a_study_base_rldp_block_becomes_its_strategy_settings():
    old = validate_config(StudyConfig, {**STUDY, "base": {"max_steps": 8, "rldp": {"t_warm": 3, "n_max": 8}},
                                        "settings_grid": {"rldp": {"action_decoding": ["paper", "relative"]}}})
    new = validate_config(StudyConfig, {**STUDY, "strategy_settings": {"rldp": {"t_warm": 3, "n_max": 8}},
                                        "settings_grid": {"rldp": {"action_decoding": ["paper", "relative"]}}})
    assert old == new and old.base == {"max_steps": 8}
    trials = trial_grid(old)
    rldp = [t for t in trials if t.strategy == "rldp"]
    settings = [trial_config(old, t).strategy_settings() for t in rldp]
    assert [(s.t_warm, s.n_max, s.t_rl, s.action_decoding) for s in settings] == [(3, 8, 4, "paper"),
                                                                                (3, 8, 4, "relative")]
    static = next(t for t in trials if t.strategy == "static")
    assert trial_config(old, static).settings == {}  # the block is RLDP's: a baseline trial never sees it


def test_a_saved_study_json_with_base_rldp_compares_equal_after_the_upgrade():
    """A study directory's study.json (resume compares it with the study file) written before the change."""
    study = validate_config(StudyConfig, {**STUDY, "strategy_settings": {"rldp": {"t_warm": 3}}})
    saved = json.loads(json.dumps(study.model_dump(mode="json")))
    old = {**saved, "base": {**saved["base"], "rldp": {"t_warm": 3}}, "strategy_settings": {}}
    assert upgrade_study_values(old) == saved
    with pytest.raises(ValueError, match="base.rldp.t_warm and strategy_settings.rldp.t_warm are both set"):
        upgrade_study_values({**saved, "base": {"rldp": {"t_warm": 2}}})


def test_the_config_models_load_without_pandas_scipy_or_torch():
    """The CLI reads the models to build its flags (issue 30): importing raydp.config must stay light."""
    import subprocess
    import sys

    code = ("import sys, raydp.config, raydp.strategies.rldp_settings; "
            "print(sorted(m for m in ('pandas', 'scipy', 'torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
