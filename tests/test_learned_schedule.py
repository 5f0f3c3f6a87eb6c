"""Issue 29's parts: the learning-rate decay, the open-loop clip schedule, AdamW moment rescaling when a
clip changes, common random numbers on public data, and Optuna searches over a strategy's settings."""

import json
import math

import numpy as np
import pytest
import torch
import yaml

from raydp.errors import ConfigError
from raydp.model.batches import Batch
from raydp.privacy import BudgetGuard, PrivacyLedger
from raydp.privacy.engine import DPStep
from raydp.privacy.randomness import PrivateRandomness
from raydp.runner.loop import OptimizerSettings, lr_multiplier
from raydp.strategies.base import Dials, Strategy, StrategyContext
from raydp.strategies.registry import make_strategy

from tests.test_dp_engine import padded_batch, tiny_lora_model


# -- the learning-rate schedule ------------------------------------------------------------------------
@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
def test_lr_multiplier_follows_its_formula(decay):
    warmup, total, end = 10, 110, 0.1
    f = lr_multiplier(OptimizerSettings(warmup_steps=warmup, decay=decay, lr_end=end, total_steps=total))
    for step in range(warmup):
        assert f(step) == pytest.approx((step + 1) / warmup)
    for step in (10, 35, 60, 85, 110, 200):
        u = min(1.0, (step - warmup) / (total - warmup))
        want = {"constant": 1.0, "linear": 1 - (1 - end) * u,
                "cosine": end + (1 - end) * (1 + math.cos(math.pi * u)) / 2}[decay]
        assert f(step) == pytest.approx(want)
    if decay != "constant":
        assert f(total) == pytest.approx(end) and f(warmup) == pytest.approx(1.0)


def test_a_decay_without_total_steps_or_with_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(OptimizerSettings(decay="linear"))
    with pytest.raises(ValueError, match="unknown learning-rate decay"):
        lr_multiplier(OptimizerSettings(decay="step", total_steps=10))


# -- the clip schedule --------------------------------------------------------------------------------
def _context(n=3, steps=101):
    depths = tuple(np.linspace(0, 1, n))
    return StrategyContext(n, depths, q=0.1, planned_steps=steps, sigma_0=1.0, epsilon_target=2.0, delta=1e-5)


def test_clip_schedule_with_absolute_constant_clips_is_static_pairwise():
    schedule = make_strategy("clip-schedule", {"clip": 0.07, "relative": False})
    static = make_strategy("static-pairwise", {"clip": 0.07})
    for s in (schedule, static):
        s.setup(_context())
    assert not schedule.needs_public_probe
    for step in (0, 50, 100):
        assert schedule.dials(step).clip == static.dials(step).clip
    assert (schedule.clip_mode, schedule.allocation) == (static.clip_mode, static.allocation)


def test_clip_schedule_interpolates_geometrically_and_tilts_with_depth():
    s = make_strategy("clip-schedule", {"clip": 2.0, "clip_end": 0.5, "depth_tilt": 1.5})
    s.setup(_context(n=3, steps=101))
    norms = np.array([[0.1, 1.0, 0.0], [0.3, 3.0, 5.0], [0.2, 2.0, 5.0]])  # pair 2: a zero norm is ignored
    s.calibrate_public(norms, np.zeros(3))
    assert np.allclose(s.reference, [0.2, 2.0, 5.0])
    first, middle, last = (np.array(s.dials(t).clip) for t in (0, 50, 100))
    tilt = np.exp(1.5 * (np.array([0.0, 0.5, 1.0]) - 0.5))
    assert np.allclose(first, 2.0 * s.reference * tilt)
    assert np.allclose(last, 0.5 * s.reference * tilt)
    assert np.allclose(middle, 1.0 * s.reference * tilt)  # sqrt(2 * 0.5)
    assert first[2] / first[0] == pytest.approx(5.0 / 0.2 * math.exp(1.5))


def test_a_relative_clip_schedule_needs_the_public_probe():
    s = make_strategy("clip-schedule", {"clip": 1.0})
    s.setup(_context())
    assert s.needs_public_probe
    with pytest.raises(ConfigError, match="public probe"):
        s.dials(0)


# -- moment rescaling ---------------------------------------------------------------------------------
class _HalvingClip(Strategy):
    """Pairwise clips that halve after the first step."""

    name = "halving"

    def dials(self, step):
        return Dials((0.4 if step == 0 else 0.2,) * self.context.n_pairs)


def test_moments_are_rescaled_by_the_clip_change_as_adamw_defines_them():
    from raydp.runner.loop import Trainer

    model, pairs = tiny_lora_model(n_layer=2)
    strategy = _HalvingClip()
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                   epsilon_target=1e6, delta=1e-5))
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
    step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                  planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(3), device=torch.device("cpu"))
    trainer = Trainer.__new__(Trainer)  # only the update path: no data, no evaluation
    params = [p for p in model.parameters() if p.requires_grad]
    trainer.optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    trainer.optimizer_settings = OptimizerSettings(warmup_steps=0, rescale_moments=True)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    trainer.gradient, trainer.model = step, model
    ids, mask = padded_batch()
    batch = Batch(list(range(ids.shape[0])), ids, mask)
    step.compute(model, batch)
    trainer.update()
    assert step.clip_changes() == []  # nothing to compare the first step with
    before = {p: (trainer.optimizer.state[p]["exp_avg"].clone(), trainer.optimizer.state[p]["exp_avg_sq"].clone())
              for p in params}
    step.compute(model, batch)
    grads = {p: p.grad.detach().clone() for p in params}
    changes = step.clip_changes()
    assert len(changes) == 2 * len(pairs) and all(k == pytest.approx(0.5) for _, k in changes)
    trainer.update()
    b1, b2 = 0.9, 0.999
    for p in params:  # AdamW's moment updates (Loshchilov & Hutter 2019), on the moments scaled by k and k^2
        m, v = before[p]
        assert torch.allclose(trainer.optimizer.state[p]["exp_avg"], b1 * 0.5 * m + (1 - b1) * grads[p], atol=1e-7)
        assert torch.allclose(trainer.optimizer.state[p]["exp_avg_sq"],
                              b2 * 0.25 * v + (1 - b2) * grads[p] ** 2, atol=1e-9)


# -- common random numbers ------------------------------------------------------------------------------
def test_common_random_numbers_only_on_public_data():
    from raydp.config import TrainConfig
    from raydp.runner.privacy_setup import private_randomness

    with pytest.raises(ValueError, match="public data only"):
        TrainConfig(strategy="static", epsilon=2.0, common_random_numbers=True)
    config = TrainConfig(strategy="static", epsilon=2.0, common_random_numbers=True, data={"source": "public"})
    a, b = private_randomness(config), private_randomness(config)
    assert a.label is None and not a.is_secret and a.source == "public-common-random-numbers"
    assert (a.sampling_entropy, a.noise_seed) == (b.sampling_entropy, b.noise_seed)
    other = private_randomness(config.model_copy(update={"seed": 1}))
    assert other.noise_seed != a.noise_seed
    assert PrivateRandomness.unsafe_from_seed(0).label is not None  # the unsafe option keeps its void label
    assert private_randomness(TrainConfig(strategy="static", epsilon=2.0, data={"source": "public"})).is_secret


def test_common_random_numbers_are_refused_on_a_built_private_dataset(tmp_path):
    from raydp.config import DataConfig, TrainConfig
    from raydp.data import resolve_dataset
    from raydp.runner.privacy_setup import private_randomness

    private = resolve_dataset(DataConfig(n_records=200), tmp_path / "private", progress=False)
    public = resolve_dataset(DataConfig(source="public", n_records=200), tmp_path / "public", progress=False)
    for source, allowed in ((private, False), (public, True)):
        config = TrainConfig(strategy="static", epsilon=2.0, common_random_numbers=True, data={"source": str(source)})
        if allowed:
            assert private_randomness(config).label is None
        else:
            with pytest.raises(ConfigError, match="is not public"):
                private_randomness(config)


# -- Optuna over a search space --------------------------------------------------------------------------
SEARCH_STUDY = {
    "name": "search",
    "models": ["embedded-tiny"],
    "epsilons": [2.0],
    "seeds": [0],
    "strategies": ["clip-schedule"],
    "search": "optuna",
    "optuna": {"num_samples": 3, "seed": 0},
    "search_space": {"clip-schedule": {"clip": {"low": 0.3, "high": 3.0, "log": True},
                                       "lr": {"low": 1e-4, "high": 2e-3, "log": True},
                                       "lr_decay": {"choices": ["constant", "cosine"]}}},
    "resources": {"cpus_per_trial": 1},
    "private_data": False,
    "wandb": {"mode": "disabled"},
    "base": {"data": {"source": "public", "n_records": 300}, "max_steps": 8, "eval_max_records": 16,
             "public_eval_records": 16, "warmup_steps": 2, "common_random_numbers": True},
}


def _write(tmp_path, **changes):
    values = json.loads(json.dumps(SEARCH_STUDY))
    values.update(changes)
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"search": "grid"}, "search_space is searched by Optuna: set search: optuna"),
    ({"seeds": [0, 1]}, "give one seed"),
    ({"search_space": {"static": {"clip": {"low": 0.1, "high": 1}}}}, "search_space.static: not a strategy"),
    ({"search_space": {"clip-schedule": {"colour": {"low": 0.1, "high": 1}}}}, "search_space.clip-schedule.colour"),
    ({"search_space": {"clip-schedule": {"clip": {"low": 1, "high": 0.1}}}}, "low < high"),
    ({"search_space": {"clip-schedule": {"clip": {"low": 0.1, "high": 1}}},
      "strategy_settings": {"clip-schedule": {"clip": 1.0}}}, "give it one place"),
    ({"search_space": {"clip-schedule": {"lr": {"low": 1e-4, "high": 1.0}}}, "base": {
        "data": {"source": "public", "n_records": 300}, "lr_decay": "cosine", "max_steps": 8}},
     None),  # valid: run fields are not settings
    ({"base": {"data": {"n_records": 300}, "common_random_numbers": True, "max_steps": 8}},
     "common_random_numbers fixes the DP sampling and noise"),
])
def test_invalid_search_studies_fail_with_one_line(tmp_path, changes, message, capsys):
    from raydp.cli import main
    from raydp.study.config import load_study

    path = _write(tmp_path, **changes)
    if message is None:
        load_study(path)
        return
    if "common_random_numbers" in message:  # a trial's config error: raised when the study is prepared
        changes = {**changes, "private_data": True}
        path = _write(tmp_path, **changes)
    assert main(["study", str(path), "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_optuna_search_over_a_strategy_runs_and_records_its_best(tmp_path):
    import optuna
    import pandas as pd

    from raydp.study.runner import run_study

    study_dir = run_study(_write(tmp_path), results_dir=tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    searched = table[table["search"].notna()]
    assert len(searched) == 3 and (searched["status"] == "TERMINATED").all()
    values = [json.loads(v) for v in searched["search"]]
    assert all(0.3 <= v["clip"] <= 3.0 and 1e-4 <= v["lr"] <= 2e-3 and v["lr_decay"] in ("constant", "cosine")
               for v in values)
    assert len({v["clip"] for v in values}) == 3  # Optuna proposed three candidates
    for _, row in searched.iterrows():  # each trial ran with its sampled values
        config = json.loads(row["config"])
        v = json.loads(row["search"])
        assert config["settings"]["clip"] == pytest.approx(v["clip"]) and config["lr"] == pytest.approx(v["lr"])
        assert config["lr_decay"] == v["lr_decay"] and config["common_random_numbers"]
        assert not row["privacy_labels"]  # common random numbers on public data carry no void label
    summary = json.loads((study_dir / "study_summary.json").read_text())
    best = summary["search_best"][0]
    column = "final_public_value_nll"
    assert best["trials"] == 3 and best[column] == pytest.approx(searched[column].min())
    # Optuna's own storage holds the same three finished trials and their values
    storage = f"sqlite:///{study_dir / 'tune' / 'optuna.sqlite3'}"
    stored = optuna.load_study(study_name="search-search-clip-schedule-embedded-tiny-eps2", storage=storage)
    complete = [t for t in stored.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3
    assert sorted(t.value for t in complete) == pytest.approx(sorted(searched[column]))
