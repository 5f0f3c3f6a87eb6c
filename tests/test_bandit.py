"""The episode-level contextual bandit (raydp.study.schedule_bandit) and its study (search: bandit, raydp.study.bandit).

The bandit is checked against a brute-force search of a known loss surface, not against itself; the study runs
for real (Ray Tune, local ray.init) on public episodes of the embedded-tiny model."""

import json
import math

import numpy as np
import pytest
import yaml

from raydp.study.schedule_bandit import Dimension, ScheduleBandit
from tests.test_learned_schedule import SEARCH_STUDY


def _surface(epsilon: float, values: dict) -> float:
    """A loss whose best clip moves with epsilon (log-linear, as a clip's optimum does) and whose best lr does
    not; ``decay: cosine`` is better by 0.3 everywhere."""
    best_log_clip = -3.0 + 0.8 * math.log(epsilon)
    return ((math.log(values["clip"]) - best_log_clip) ** 2 + 2.0 * (math.log10(values["lr"]) + 3.0) ** 2
            + (0.0 if values["decay"] == "cosine" else 0.3))


SPACE = {"clip": Dimension(low=1e-3, high=3.0, log=True), "lr": Dimension(low=1e-4, high=1e-2, log=True),
         "decay": Dimension(choices=("constant", "cosine"))}
EPSILONS = (0.5, 2.0, 8.0)


def _grid_losses(epsilon: float, n: int = 4000) -> np.ndarray:
    """The surface over a large independent uniform sample of the space (brute force, no model)."""
    rng = np.random.default_rng(123)
    return np.array([_surface(epsilon, {name: dim.draw(rng) for name, dim in SPACE.items()}) for _ in range(n)])


def _learned(budget_per_context: int, noise: float, seed: int = 0) -> ScheduleBandit:
    bandit = ScheduleBandit(space=SPACE, epsilon_range=(0.5, 8.0), seed=seed, candidates=512)
    rng = np.random.default_rng(seed + 99)
    draw = 0
    for _ in range(budget_per_context):
        for eps in EPSILONS:
            values = bandit.random_values(np.random.default_rng([seed, draw])) if draw < 6 else \
                bandit.suggest(eps, draw)
            bandit.observe(eps, values, _surface(eps, values) + noise * rng.standard_normal())
            draw += 1
    return bandit


def test_the_bandits_decisions_rank_near_the_best_of_a_brute_force_search_in_every_context():
    bandit = _learned(budget_per_context=10, noise=0.05)
    random_pick = ScheduleBandit(space=SPACE, epsilon_range=(0.5, 8.0), seed=7)
    for eps in EPSILONS:
        losses = _grid_losses(eps)
        decided = _surface(eps, bandit.decide(eps))
        share_better = float((losses < decided).mean())
        assert share_better < 0.05, (eps, decided, share_better)  # in the best 5% of the space
        # and the decision follows the context: its clip is near this epsilon's optimum, not another's
        best_log_clip = -3.0 + 0.8 * math.log(eps)
        assert abs(math.log(bandit.decide(eps)["clip"]) - best_log_clip) < 0.6
        # a random arm is not (the check can fail)
        assert float((losses < _surface(eps, random_pick.random_values(np.random.default_rng(int(eps * 10))))).mean()) > 0.03


def test_one_diverged_episode_does_not_derail_the_decisions():
    """A run that diverges (a loss 100x the others, as one public episode of experiments/bandit/bandit-search.yaml did) must
    not set the model's scale: the bandit caps losses at Tukey's fence before it fits them."""
    bandit = _learned(budget_per_context=10, noise=0.05)
    worst = max(range(len(bandit.observations)), key=lambda i: bandit.observations[i].loss)
    bandit.observations[worst].loss = 1e3 * max(o.loss for o in bandit.observations)
    for eps in EPSILONS:
        assert float((_grid_losses(eps) < _surface(eps, bandit.decide(eps))).mean()) < 0.05


def test_thompson_sampling_explores_and_is_reproducible():
    bandit = _learned(budget_per_context=3, noise=0.05)
    again = _learned(budget_per_context=3, noise=0.05)
    picks = [bandit.suggest(2.0, draw) for draw in range(100, 106)]
    assert picks == [again.suggest(2.0, draw) for draw in range(100, 106)]  # public, seeded randomness
    assert len({p["clip"] for p in picks}) > 1  # different draws try different arms
    assert bandit.decide(2.0) == bandit.decide(2.0)


def test_encoding_saving_and_bad_observations():
    assert Dimension(low=1e-3, high=1e-1, log=True).encode(1e-2) == [pytest.approx(0.5)]
    assert Dimension(choices=(False, True)).encode(True) == [0.0, 1.0]
    bandit = _learned(budget_per_context=3, noise=0.05)
    copy = ScheduleBandit.from_dict(json.loads(json.dumps(bandit.to_dict())))
    assert copy.decide(2.0) == bandit.decide(2.0) and copy.predict(2.0, bandit.decide(2.0)) == \
        pytest.approx(bandit.predict(2.0, bandit.decide(2.0)))
    mean, low, high = bandit.predict(2.0, bandit.decide(2.0))
    assert low < mean < high


def test_predictions_are_in_nats_and_a_diverged_episode_does_not_pull_them():
    """At a tried arm, with little noise, the prediction is that episode's loss (the standardisation undone, an
    independent check of the back-transform); a diverged episode elsewhere moves it by little."""
    bandit = _learned(budget_per_context=6, noise=0.0)
    probe = bandit.observations[-1]
    mean, low, high = bandit.predict(probe.epsilon, probe.values)
    assert mean == pytest.approx(probe.loss, abs=0.05 * (high - low) + 0.05)
    worst = max(range(len(bandit.observations) - 1), key=lambda i: bandit.observations[i].loss)
    bandit.observations[worst].loss = 1e3  # the fit's cache follows the observations' content
    assert bandit.predict(probe.epsilon, probe.values)[0] == pytest.approx(probe.loss, abs=0.5)
    assert set(bandit.length_scales()) == {"epsilon", "clip", "lr", "decay=constant", "decay=cosine"}
    with pytest.raises(ValueError, match="finite"):
        bandit.observe(2.0, bandit.decide(2.0), float("nan"))
    with pytest.raises(ValueError, match="lacks 'decay'"):
        bandit.observe(2.0, {"clip": 0.1, "lr": 1e-3}, 1.0)
    with pytest.raises(ValueError, match="no observations"):
        ScheduleBandit(space=SPACE, epsilon_range=(0.5, 8.0)).decide(2.0)


#: the Optuna search study of tests/test_learned_schedule.py, searched by the bandit over two epsilons
BANDIT_STUDY = {**SEARCH_STUDY, "name": "bandit", "epsilons": [1.0, 4.0], "search": "bandit",
                "bandit": {"num_samples": 1, "seed": 0, "startup_trials": 1, "candidates": 64},
                "base": {**SEARCH_STUDY["base"], "max_steps": 6}}
del BANDIT_STUDY["optuna"]


def _write(tmp_path, **changes):
    (tmp_path / "bandit.yaml").write_text(yaml.safe_dump({**BANDIT_STUDY, **changes}))
    return tmp_path / "bandit.yaml"


def test_the_searcher_cycles_the_epsilons_learns_from_finished_episodes_and_resumes(tmp_path):
    """Tune's side, driven by hand: contexts in a fixed cycle, random values for the start-up rounds, then
    Thompson draws from what finished; a failed episode teaches nothing; a saved searcher goes on where it was."""
    from ray.tune.search import Searcher

    from raydp.config import validate_config
    from raydp.study.bandit import BanditSearch
    from raydp.study.config import StudyConfig

    study = validate_config(StudyConfig, {**json.loads(json.dumps(BANDIT_STUDY)),
                                          "bandit": {"num_samples": 3, "seed": 0, "startup_trials": 1,
                                                     "candidates": 64}})
    searcher = BanditSearch(study)
    first = [searcher.suggest(f"t{i}") for i in range(2)]
    assert [c["search_cell"]["epsilon"] for c in first] == [1.0, 4.0]
    for i, config in enumerate(first):
        assert 0.3 <= config["search"]["clip"] <= 3.0
        searcher.on_trial_complete(f"t{i}", {"selection_score": 60.0 + i})
    searcher.on_trial_complete("t9", {"selection_score": 1.0})  # unknown trial: ignored
    assert [o.loss for o in searcher.bandit.observations] == [60.0, 61.0]
    third = searcher.suggest("t2")  # a Thompson draw given the two episodes
    assert third["search_cell"]["epsilon"] == 1.0
    assert third["search"] == searcher.bandit.suggest(1.0, 2)  # the bandit's draw number 2, reproducible
    searcher.on_trial_complete("t2", error=True)
    assert len(searcher.bandit.observations) == 2
    searcher.save(str(tmp_path / "searcher.pkl"))
    again = BanditSearch(study)
    again.restore(str(tmp_path / "searcher.pkl"))
    assert again.suggest("t3") == searcher.suggest("t3")
    for i in range(4, 6):
        assert searcher.suggest(f"t{i}") is not None
    assert searcher.suggest("t6") == Searcher.FINISHED  # num_samples x epsilons in all


@pytest.mark.parametrize("changes, message", [
    ({"private_data": True, "base": {"data": {"n_records": 300}, "max_steps": 6}}, "public episodes only"),
    ({"models": ["embedded-tiny", "embedded"]}, "one search_space strategy and one model"),
    ({"search_space": {}}, "search: bandit chooses one strategy's values: give its search_space"),
    ({"seeds": [0, 1]}, "give one seed"),
    ({"selection": "private"}, "public episodes only"),
])
def test_invalid_bandit_studies_fail_with_one_line(tmp_path, changes, message, capsys):
    from raydp.cli import main

    assert main(["study", str(_write(tmp_path, **changes)), "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "bandit").exists()


@pytest.mark.slow  # the fast tier covers its feature elsewhere; CI's 20-minute budget (2026-11-28)
def test_a_bandit_study_learns_across_epsilons_and_its_decisions_drive_a_later_study(local_ray, tmp_path):
    import pandas as pd

    from raydp.study.config import load_study
    from raydp.study.grid import trial_config, trial_grid
    from raydp.study.runner import run_study

    study_dir = run_study(_write(tmp_path), results_dir=tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    searched = table[table["search"].notna()]
    assert len(searched) == 2 and (searched["status"] == "TERMINATED").all()
    assert sorted(searched["epsilon_target"]) == [1.0, 4.0]  # the contexts, each num_samples times
    for _, row in searched.iterrows():  # each trial ran with the values the bandit chose for it
        config, v = json.loads(row["config"]), json.loads(row["search"])
        assert 0.3 <= v["clip"] <= 3.0 and config["settings"]["clip"] == pytest.approx(v["clip"])
        assert config["lr"] == pytest.approx(v["lr"]) and config["common_random_numbers"]
    from tests.releasable import unclassified_study

    assert unclassified_study(study_dir) == []
    # Tune handed each finished episode's score to the searcher (its saved state, as Tune checkpoints it)
    import pickle

    states = sorted((study_dir / "tune" / "bandit-bandit").glob("searcher-state-*.pkl"))
    assert states, "Tune saved no searcher state"
    learned = ScheduleBandit.from_dict(pickle.loads(states[-1].read_bytes())["bandit"])
    assert sorted(o.loss for o in learned.observations) == pytest.approx(sorted(searched["final_public_value_nll"]))
    # the saved bandit holds every finished episode, and its decisions are each cell's search_best
    bandit = ScheduleBandit.load(study_dir / "bandit.json")
    assert len(bandit.observations) == 2
    assert sorted(o.loss for o in bandit.observations) == pytest.approx(sorted(searched["final_public_value_nll"]))
    summary = json.loads((study_dir / "study_summary.json").read_text())
    best = {b["epsilon"]: b for b in summary["search_best"]}
    assert set(best) == {1.0, 4.0}
    for eps, b in best.items():
        assert b["best"] == bandit.decide(eps) and b["trials"] == 1 and b["decided_by"].startswith("bandit")
    record = json.loads((study_dir / "tuning_record.json").read_text())
    (tmp_path / "trials" / "tuned").mkdir(parents=True)
    (tmp_path / "trials" / "tuned" / "bandit.json").write_text(json.dumps(record))
    final = {"name": "final", "models": ["embedded-tiny"], "epsilons": [1.0, 4.0], "strategies": ["clip-schedule"],
             "tuned_from": "tuned/bandit.json", "base": {"data": {"n_records": 300}}}
    (tmp_path / "trials" / "final.yaml").write_text(yaml.safe_dump(final))
    later = load_study(tmp_path / "trials" / "final.yaml")
    for trial in trial_grid(later):
        config = trial_config(later, trial)
        assert config.settings["clip"] == pytest.approx(best[trial.epsilon]["best"]["clip"])
