"""RLDP's residual decoding (issue 29): a tanh-squashed actor whose zero action is the learned clip schedule."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from raydp.config import TrainConfig, validate_config
from raydp.control.decoding import decode_residual
from raydp.control.features import ObservationLayout
from raydp.control.modules import MaskedSquashedGaussian, explore_action, greedy_action
from raydp.control.sac import SACSettings, module_spec
from raydp.strategies.clipschedule_settings import ClipScheduleSettings

SCHEDULE = {"clip": 0.5, "clip_end": 0.2, "depth_tilt": 0.4, "relative": True}


def residual_config(**settings):
    values = {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "data": {"n_records": 400},
              "max_steps": 16, "eval_every": 100, "eval_max_records": 16, "public_eval_records": 16,
              "warmup_steps": 4,
              "settings": {"t_warm": 4, "t_rl": 4, "b_sac": 4, "k": 2, "n_max": 8, "hidden": 32,
                           "action_decoding": "residual", "noise_control": False, "schedule": SCHEDULE,
                           "residual_range": 0.5, **settings}}
    return validate_config(TrainConfig, values)


def test_residual_factors_are_bounded_and_zero_is_the_schedule():
    factors = decode_residual([0.0, 1.0, -1.0, 0.5, 7.0, -7.0], 0.7)
    assert factors[0] == 1.0
    np.testing.assert_allclose(factors[1:], [math.exp(0.7), math.exp(-0.7), math.exp(0.35), math.exp(0.7),
                                             math.exp(-0.7)])
    with pytest.raises(ValueError):
        decode_residual([math.nan], 0.7)


def test_residual_decoding_needs_sigma_on_the_plan():
    with pytest.raises(Exception, match="noise_control: false"):
        residual_config(noise_control=True)


def test_the_squashed_log_probability_is_the_change_of_variables():
    """Against torch.distributions' own tanh-transformed Normal (an independent computation), masked dims out."""
    torch.manual_seed(0)
    loc, log_std = torch.randn(5, 4), torch.randn(5, 4).clamp(-2, 1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]]).expand(5, 4)
    dist = MaskedSquashedGaussian.from_logits(torch.cat([loc, log_std, mask], dim=-1))
    value, logp = dist.rsample_and_logp()
    assert value.abs().max() < 1
    reference = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(loc, log_std.exp()), [torch.distributions.TanhTransform(cache_size=1)])
    expected = (reference.log_prob(value.clamp(-1 + 1e-6, 1 - 1e-6)) * mask).sum(-1)
    torch.testing.assert_close(logp, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(dist.logp(value), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("architecture", ["shared", "paper"])
def test_a_fresh_squashed_actor_starts_on_the_schedule(architecture):
    layout = ObservationLayout(architecture, 8 if architecture == "shared" else 3)
    torch.manual_seed(1)
    module = module_spec(layout, SACSettings(hidden=32, squashed=True, initial_log_std=-1.5)).build()
    obs = torch.as_tensor(np.random.default_rng(0).normal(size=(6, layout.obs_dim)), dtype=torch.float32)
    with torch.no_grad():
        logits = module.forward_inference({"obs": obs})["action_dist_inputs"]
    greedy = greedy_action(logits, squashed=True)
    assert torch.equal(greedy, torch.zeros_like(greedy))  # the zero action: every clip on the schedule
    drawn = explore_action(logits, torch.Generator().manual_seed(3), squashed=True)
    assert drawn.abs().max() < 1 and drawn.std() < 0.5  # log std -1.5: exploration near the schedule
    assert isinstance(module.action_dist_cls.from_logits(logits), MaskedSquashedGaussian)


@pytest.mark.slow  # the fast tier covers its feature elsewhere; CI's 20-minute budget (2026-11-28)
def test_a_residual_run_follows_the_schedule_times_its_factors(local_ray, tmp_path):
    """Between decisions each pair's clip is the schedule's C_i(t) times the last decision's factor, inside
    [e^-rho, e^rho] of it; sigma stays on the plan, so PLD accounts the run (no filter)."""
    from raydp.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
    from raydp.runner.launch import train
    from raydp.strategies.clipschedule import base_clips, multiplier

    config = residual_config()
    summary = train(config, tmp_path / "run", progress=False)
    controller = summary["controller"]
    assert controller["action_decoding"] == "residual" and controller["decisions"] == 3  # steps 8, 12, 16
    reference, steps = np.asarray(controller["pair_reference"]), summary["steps"]
    schedule = ClipScheduleSettings(**SCHEDULE)
    depths = [pair["relative_depth"] for pair in summary["adapter_pairs"]]
    trace = pd.read_parquet(tmp_path / "run" / "control_trace.parquet")
    decisions = pd.read_parquet(tmp_path / "run" / "controller_decisions.parquet")
    factors = np.ones(len(reference))
    for _, row in trace.iterrows():
        step = int(row["step"])  # 1-based; its clips were set at 0-based step - 1
        expected = base_clips(schedule, reference, depths, len(reference)) * multiplier(schedule, step - 1, steps)
        expected = expected * factors
        np.testing.assert_allclose([row[f"clip_{i}"] for i in range(len(reference))], expected, rtol=1e-9)
        taken = decisions[decisions["step"] == step]
        if len(taken):
            factors = np.asarray(taken.iloc[0]["residual"])
            assert np.all(factors >= math.exp(-0.5) - 1e-12) and np.all(factors <= math.exp(0.5) + 1e-12)
    assert summary["privacy"]["guarantee"] == "fixed-schedule" and summary["privacy"]["within_budget"]
    assert len(PrivacyLedger.load(tmp_path / "run" / LEDGER_FILENAME)) == steps


def test_the_public_validation_reward_is_the_change_of_the_public_value_nll(local_ray, tmp_path):
    """reward: public-validation: each reward is the change of minus the value-token NLL per record of the first
    reward_records public validation records between decisions; the last decision's utility is the final model's."""
    from raydp.evaluation.evaluate import load_trained_model
    from raydp.evaluation.perplexity import evaluate_perplexity
    from raydp.runner.launch import train
    from raydp.runner.run import public_validation_split
    from raydp.runner.task import Task

    config = residual_config(reward="public-validation", reward_records=8)
    summary = train(config, tmp_path / "run", progress=False)
    decisions = pd.read_parquet(tmp_path / "run" / "controller_decisions.parquet")
    utilities = decisions["utility"].to_numpy()
    assert decisions["reward"].isna().tolist() == [True, False, False]
    np.testing.assert_allclose(decisions["reward"].to_numpy()[1:], np.diff(utilities), rtol=1e-12)
    trained = load_trained_model(tmp_path / "run", config, "cpu")
    split = public_validation_split(trained.tokenizer, summary["max_length"], config.public_eval_records, Task())
    final = evaluate_perplexity(trained.model, split, torch.device("cpu"), max_sequences=8).value_nll_per_record
    assert utilities[-1] == pytest.approx(-final, rel=1e-5)


def test_a_public_validation_file_must_be_apart_from_the_private_data(tmp_path, raydp_cache):
    """public_validation steers selection and the public-validation reward, charged nothing: the private dataset's own
    source file, or a file sharing one of its patients, is refused before anything is charged or trained."""
    from raydp.data.synthetic import generate_records
    from raydp.errors import ConfigError
    from raydp.runner.run import run_training

    private = generate_records(300, seed=3, progress=False)
    private.to_csv(tmp_path / "private.csv", index=False)
    public = generate_records(40, seed=4, progress=False)
    public["patient_nbr"] = public["patient_nbr"] + 10**9  # disjoint ids
    public.to_csv(tmp_path / "public.csv", index=False)
    shared = public.copy()
    shared.loc[0, "patient_nbr"] = private["patient_nbr"].iloc[0]
    shared.to_csv(tmp_path / "shared.csv", index=False)
    base = {"model": "embedded-tiny", "strategy": "static-pairwise", "epsilon": 2.0, "max_steps": 2,
            "eval_max_records": 8, "public_eval_records": 8, "data": {"source": str(tmp_path / "private.csv")}}
    for name, message in (("private.csv", "own source file"), ("shared.csv", "shares patients")):
        with pytest.raises(ConfigError, match=message):
            run_training(validate_config(TrainConfig, {**base, "public_validation": str(tmp_path / name)}),
                         tmp_path / f"run-{name}", progress=False)
        assert not (tmp_path / f"run-{name}").exists()
    summary = run_training(validate_config(TrainConfig, {**base, "public_validation": str(tmp_path / "public.csv")}),
                           tmp_path / "run-public", progress=False)
    assert summary["public_validation"].endswith("public.csv") and summary["steps"] == 2
