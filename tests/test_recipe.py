"""The recipe table (raydp.recipe) and how a run takes it: the shipped table loads and is the public search's numbers,
interpolation in log epsilon is monotone between points and clamped outside them, every flag, YAML key and study
value overrides its field, ``recipe: none`` is today's defaults exactly, config.json records the entry and reads
back unchanged, the lookup opens no file but the package's table, and every shipped study file pins the recipe."""

from __future__ import annotations

import builtins
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import raydp.recipe.table as recipe_table
from raydp.cli import build_parser, train_config_from_args
from raydp.config import TrainConfig, validate_config
from raydp.recipe import RECIPE_FIELDS, RECIPES_FILE, RecipeTable, load_table, resolve, shipped_table
from raydp.run_directory import RunDirectory

REPO = Path(__file__).resolve().parents[1]
SEARCH = REPO / "trials" / "recipe" / "search-structured.yaml"
STUDY_FILES = sorted({*REPO.glob("trials/**/*.yaml"), *REPO.glob("experiments/**/*.yaml")})
PAIRWISE = {"strategy": "static-pairwise", "epsilon": 2.0}  # the embedded model: the table has an entry
#: a flag value for every recipe field, none of them the recipe's or today's default
FLAGS = {"batch_size": ("--batch-size", "32", 32), "epochs": ("--epochs", "2", 2.0), "lr": ("--lr", "0.002", 0.002),
         "lr_decay": ("--lr-decay", "linear", "linear"), "lr_end": ("--lr-end", "0.1", 0.1),
         "warmup_steps": ("--warmup-steps", "5", 5), "weight_decay": ("--weight-decay", "0.01", 0.01),
         "clip": ("--clip", "0.2", 0.2)}


def _defaults() -> dict:
    return {k: TrainConfig.model_fields[k].default for k in RECIPE_FIELDS}


def _table(points: list[dict], model: str = "m", strategy: str = "static-pairwise") -> RecipeTable:
    """A table of one entry for ``model`` and ``strategy`` with ``points`` (epsilon, settings)."""
    shipped = json.loads(RECIPES_FILE.read_text())
    provenance, fields = shipped["entries"][0]["provenance"], set(points[0][1])  # what these points set, said
    provenance = {**provenance, "searched": [k for k in provenance["searched"] if k in fields],
                  "not_searched": {k: v for k, v in provenance["not_searched"].items() if k in fields}}
    entry = {**shipped["entries"][0], "model": model, "strategy": strategy, "provenance": provenance,
             "points": [{"epsilon": eps, "settings": settings} for eps, settings in points]}
    return RecipeTable.model_validate({**shipped, "entries": [entry]})


def _write_table(path: Path, table: RecipeTable) -> Path:
    path.write_text(json.dumps(table.model_dump(mode="json")))
    return path


@pytest.fixture
def own_table(tmp_path, monkeypatch):
    """Make the package read a table written by the test (the lookup's cache cleared before and after)."""
    def use(table: RecipeTable) -> None:
        monkeypatch.setattr(recipe_table, "RECIPES_FILE", _write_table(tmp_path / "recipes.json", table))
        load_table.cache_clear()

    yield use
    load_table.cache_clear()


# -- the table ---------------------------------------------------------------------------------------------------------

def test_the_shipped_table_loads_and_every_point_is_a_valid_run():
    table = shipped_table()
    assert table.format == "raydp-recipes" and table.format_version == 1 and table.version == "v1.2"
    assert [e.key for e in table.entries] == ["embedded/static-pairwise/default", "embedded/static-pairwise/3x",
                                              "embedded/nonprivate/default"]
    for entry in table.entries:
        assert all(i.startswith("public:") for i in entry.provenance.dataset_ids)
        assert (REPO / entry.provenance.study_file).is_file() and (REPO / entry.provenance.tuning_record).is_file()
        for point in entry.points:
            settings = point.settings.model_dump(exclude_none=True)
            assert set(settings) == set(RECIPE_FIELDS) - ({"clip"} if entry.strategy == "nonprivate" else set())
            config = validate_config(TrainConfig, {"model": entry.model, "strategy": entry.strategy,
                                                   "epsilon": point.epsilon, "recipe": "none", **settings})
            assert {k: getattr(config, k) for k in settings} == settings


def test_v1_is_the_public_searches_choice_and_todays_defaults_elsewhere():
    """No number is invented: at epsilon 0.5 and 8 the searched settings are the structured search's search_best, at 2
    v0's (trials/schedule-search.yaml's; the check of trials/recipe/check-v1.yaml kept them there), the others the
    values the searches ran with, and the provenance says which is which."""
    entry = shipped_table().entries[0]
    record = json.loads((REPO / entry.provenance.tuning_record).read_text())
    best = {float(b["epsilon"]): b for b in record["search_best"] if b["strategy"] == "static-pairwise"}
    v0 = {float(b["epsilon"]): b for b in json.loads((REPO / "trials/tuned/schedule-search.json").read_text())[
        "search_best"] if b["strategy"] == "static-pairwise"}
    assert [p.epsilon for p in entry.points] == sorted(best) == [0.5, 2.0, 8.0]
    assert sorted(entry.provenance.searched) == sorted(best[0.5]["best"]) == \
        ["clip", "lr", "lr_decay", "lr_end", "warmup_steps"]
    assert entry.provenance.dataset_ids == record["dataset_ids"]
    for point in entry.points:
        settings = point.settings.model_dump(exclude_none=True)
        chosen = best[point.epsilon] if point.epsilon != 2.0 else v0[2.0]
        searched = {**({"lr_end": 0.0, "warmup_steps": 20} if point.epsilon == 2.0 else {}), **chosen["best"]}
        assert {k: settings[k] for k in entry.provenance.searched} == searched
        assert point.public_value_nll == chosen["final_public_value_nll"] and point.trial == chosen["trial"]
        assert {k: settings[k] for k in entry.provenance.not_searched} == \
            {k: v for k, v in _defaults().items() if k in entry.provenance.not_searched}
    assert "check-v1.yaml" in entry.provenance.criterion and "keeps v0's point" in entry.provenance.note
    assert entry.points[1].source.startswith("trials/schedule-search.yaml") and entry.points[1].searched == \
        ["clip", "lr", "lr_decay"] and entry.points[0].source is None


def test_a_tie_in_log_epsilon_takes_the_smaller_epsilons_categorical_settings():
    entry = shipped_table().entries[0]
    at4 = resolve("embedded", "static-pairwise", 4.0).settings  # exactly halfway between 2 and 8 in log epsilon
    assert at4["warmup_steps"] == entry.points[1].settings.warmup_steps != entry.points[2].settings.warmup_steps


@pytest.mark.parametrize("change, words", [
    (lambda t: {**t, "format_version": 2}, "format_version 2"),
    (lambda t: {**t, "entries": [{**t["entries"][0], "provenance": {**t["entries"][0]["provenance"],
                                                                   "dataset_ids": ["synthetic:abc"]}}]}, "public"),
    (lambda t: {**t, "entries": [{**t["entries"][0], "points": t["entries"][0]["points"][::-1]}]}, "increasing"),
    (lambda t: {**t, "entries": t["entries"] * 2}, "two entries"),
])
def test_a_bad_table_is_refused_naming_why(tmp_path, change, words):
    bad = tmp_path / "recipes.json"
    bad.write_text(json.dumps(change(json.loads(RECIPES_FILE.read_text()))))
    with pytest.raises(Exception, match=words):
        load_table(bad)


# -- the lookup --------------------------------------------------------------------------------------------------------

def test_interpolation_is_monotone_between_the_shipped_points():
    for entry in shipped_table().entries:
        for low, high in zip(entry.points, entry.points[1:]):
            grid = [low.epsilon * (high.epsilon / low.epsilon) ** (i / 20) for i in range(21)]
            for key in ("lr", "clip"):
                values = [resolve(entry.model, entry.strategy, eps).settings[key] for eps in grid]
                a, b = getattr(low.settings, key), getattr(high.settings, key)
                assert values[0] == pytest.approx(a) and values[-1] == pytest.approx(b)
                steps = [y - x for x, y in zip(values, values[1:])]
                assert all(s >= -1e-15 for s in steps) or all(s <= 1e-15 for s in steps), key


def test_lr_and_clip_are_log_linear_the_rest_nearest_and_the_ends_clamped():
    table = _table([(0.5, {"batch_size": 16, "epochs": 3.0, "lr": 1e-3, "lr_decay": "constant", "lr_end": 0.0,
                           "warmup_steps": 20, "clip": 0.1}),
                    (8.0, {"batch_size": 64, "epochs": 6.0, "lr": 1e-2, "lr_decay": "cosine", "lr_end": 0.2,
                           "warmup_steps": 40, "clip": 0.01})])
    grid = [0.5 * 16 ** (i / 10) for i in range(11)]
    lrs = [resolve("m", "static-pairwise", eps, table).settings["lr"] for eps in grid]
    clips = [resolve("m", "static-pairwise", eps, table).settings["clip"] for eps in grid]
    assert all(a < b for a, b in zip(lrs, lrs[1:])) and all(a > b for a, b in zip(clips, clips[1:]))
    middle = resolve("m", "static-pairwise", 2.0, table)  # the geometric middle of 0.5 and 8
    assert middle.settings["lr"] == pytest.approx(math.sqrt(1e-3 * 1e-2))
    assert middle.settings["clip"] == pytest.approx(math.sqrt(0.1 * 0.01))
    assert middle.settings["lr_end"] == pytest.approx(0.1)
    assert "between epsilon 0.5 and 8" in middle.how and not middle.clamped
    near_low, near_high = resolve("m", "static-pairwise", 1.0, table), resolve("m", "static-pairwise", 4.0, table)
    nearest = ("batch_size", "epochs", "lr_decay", "warmup_steps")
    assert [near_low.settings[k] for k in nearest] == [16, 3.0, "constant", 20]
    assert [near_high.settings[k] for k in nearest] == [64, 6.0, "cosine", 40]
    below, above = resolve("m", "static-pairwise", 0.1, table), resolve("m", "static-pairwise", 50.0, table)
    assert below.clamped and "below the searched range [0.5, 8]" in below.how and below.settings["lr"] == 1e-3
    assert above.clamped and "above" in above.how and above.settings["lr"] == 1e-2


def test_a_clamped_epsilon_says_so_in_the_run_record():
    config = TrainConfig(strategy="static-pairwise", epsilon=0.1)
    assert config.recipe_applied["clamped"] and "below the searched range [0.5, 8]" in config.recipe_applied["how"]
    assert config.lr == shipped_table().entries[0].points[0].settings.lr


def test_only_the_exact_model_and_strategy_have_a_recipe():
    assert resolve("embedded", "static-pairwise", 2.0) is not None
    for model, strategy in (("embedded-tiny", "static-pairwise"), ("embedded", "static"),
                            ("embedded-tiny", "nonprivate"), ("gpt2", "static-pairwise")):
        assert resolve(model, strategy, 2.0) is None
        config = TrainConfig(model=model, strategy=strategy, epsilon=None if strategy == "nonprivate" else 2.0)
        assert config.recipe_applied is None and {k: getattr(config, k) for k in RECIPE_FIELDS} == _defaults()


# -- a run takes it ----------------------------------------------------------------------------------------------------

def test_auto_fills_every_unset_field_and_records_the_entry():
    config = TrainConfig(**PAIRWISE)
    point = shipped_table().entries[0].points[1]
    assert point.epsilon == 2.0
    assert {k: getattr(config, k) for k in RECIPE_FIELDS} == point.settings.model_dump()
    assert config.strategy_settings().clip == point.settings.clip  # where --clip lands: the strategy's clip
    applied = config.recipe_applied
    assert applied["entry"] == "embedded/static-pairwise/default" and applied["table"] == "raydp-recipes v1.2"
    assert applied["how"] == "at epsilon 2" and not applied["clamped"] and applied["compute_tier"] == "default"
    assert list(applied["filled"]) == list(RECIPE_FIELDS)
    # epsilon 2 is v0's point: its own search (trials/schedule-search.yaml) searched clip, lr and decay only
    assert sorted(applied["searched"]) == ["clip", "lr", "lr_decay"]
    assert sorted(applied["not_searched"]) == ["batch_size", "epochs", "lr_end", "warmup_steps", "weight_decay"]
    assert applied["source"].startswith("trials/schedule-search.yaml") and "00fc4e8" in applied["source"]
    assert "SYNTHETIC private records" in applied["selected_on"]
    at8 = TrainConfig(strategy="static-pairwise", epsilon=8.0).recipe_applied
    assert at8["source"].startswith("trials/recipe/search-structured.yaml") and "lr_end" in at8["searched"]
    between = TrainConfig(strategy="static-pairwise", epsilon=4.0).recipe_applied  # both points' sources, and a
    assert ";" in between["source"] and "lr_end" not in between["searched"]  # setting searched only where both were


def test_recipe_none_gives_todays_defaults_exactly():
    config = TrainConfig(**PAIRWISE, recipe="none")
    assert {k: getattr(config, k) for k in RECIPE_FIELDS} == _defaults() and config.recipe_applied is None
    assert config.strategy_settings().clip is None  # the strategy's own default clip (0.1 per pair)
    untabled = TrainConfig(**{**PAIRWISE, "model": "embedded-tiny"})  # no entry: the same as none
    assert {k: v for k, v in config.model_dump().items() if k not in ("recipe", "model")} == \
        {k: v for k, v in untabled.model_dump().items() if k not in ("recipe", "model")}


@pytest.mark.parametrize("field", RECIPE_FIELDS)
def test_each_recipe_field_is_overridden_by_its_flag(field):
    option, raw, value = FLAGS[field]
    args = build_parser().parse_args(["train", "-o", "run", "--strategy", "static-pairwise", "--epsilon", "2",
                                      option, raw])
    config = train_config_from_args(args)
    assert getattr(config, field) == value
    assert field not in config.recipe_applied["filled"]
    assert set(config.recipe_applied["filled"]) == set(RECIPE_FIELDS) - {field}  # the others still come from it
    if field == "clip":
        assert config.strategy_settings().clip == value


@pytest.mark.parametrize("field", RECIPE_FIELDS)
def test_each_recipe_field_is_overridden_by_the_yaml_config(tmp_path, field):
    _, _, value = FLAGS[field]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**PAIRWISE, field: value}))
    config = train_config_from_args(build_parser().parse_args(["train", "-o", "run", "--config", str(path)]))
    assert getattr(config, field) == value and field not in config.recipe_applied["filled"]


def test_a_strategy_setting_clip_wins_and_the_recipe_leaves_the_runs_clip_alone():
    args = build_parser().parse_args(["train", "-o", "run", "--strategy", "static-pairwise", "--epsilon", "2",
                                      "--set", "clip=0.3"])
    config = train_config_from_args(args)
    assert config.strategy_settings().clip == 0.3 and config.clip is None
    assert "clip" not in config.recipe_applied["filled"]


def test_recipe_flag_none_and_a_value_given_with_it():
    args = build_parser().parse_args(["train", "-o", "run", "--strategy", "static-pairwise", "--epsilon", "2",
                                      "--recipe", "none", "--lr", "0.003"])
    config = train_config_from_args(args)
    assert config.recipe == "none" and config.recipe_applied is None
    assert {k: getattr(config, k) for k in RECIPE_FIELDS} == {**_defaults(), "lr": 0.003}


def test_config_json_records_the_entry_and_reads_back_unchanged():
    config = TrainConfig(**{**PAIRWISE, "lr": 0.004})
    stored = json.loads(json.dumps(config.model_dump(mode="json")))  # as config.json holds it
    assert stored["recipe"] == "auto" and stored["recipe_applied"] == config.recipe_applied
    again = validate_config(TrainConfig, stored)
    assert again.recipe_applied == config.recipe_applied  # not re-applied, not dropped
    assert again.model_dump(mode="json") == stored
    assert validate_config(TrainConfig, json.loads(json.dumps(again.model_dump(mode="json")))) == again
    assert {k: getattr(again, k) for k in RECIPE_FIELDS} == {k: getattr(config, k) for k in RECIPE_FIELDS}


def test_a_config_stored_before_recipes_reads_back_without_one():
    stored = TrainConfig(**PAIRWISE, recipe="none").model_dump(mode="json")
    for key in ("recipe", "recipe_applied"):
        stored.pop(key)  # an older run's config.json: every other field written out
    config = validate_config(TrainConfig, stored)
    assert config.recipe == "auto" and config.recipe_applied is None
    assert {k: getattr(config, k) for k in RECIPE_FIELDS} == _defaults()


def test_a_studys_values_count_as_set(tmp_path):
    from raydp.study.config import load_study
    from raydp.study.grid import trial_config
    from raydp.study.trial import Trial

    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump({
        "name": "s", "models": ["embedded"], "epsilons": [2.0], "seeds": [0], "strategies": ["static-pairwise"],
        "settings_grid": {"static-pairwise": {"clip": [0.05], "lr": [0.001]}}, "base": {"warmup_steps": 7}}))
    study = load_study(study_file)
    trial = Trial(model="embedded", epsilon=2.0, seed=0, strategy="static-pairwise", grid={"clip": 0.05, "lr": 0.001})
    config = trial_config(study, trial)
    assert (config.lr, config.warmup_steps, config.strategy_settings().clip) == (0.001, 7, 0.05)
    assert set(config.recipe_applied["filled"]) == {"batch_size", "epochs", "lr_decay", "lr_end", "weight_decay"}
    searched = trial_config(study, Trial(model="embedded", epsilon=2.0, seed=0, strategy="static-pairwise",
                                         search={"lr": 0.02, "lr_decay": "linear"}))
    assert (searched.lr, searched.lr_decay) == (0.02, "linear") and "lr" not in searched.recipe_applied["filled"]


def test_tuned_from_values_count_as_set(tmp_path):
    from raydp.study.config import load_study
    from raydp.study.grid import trial_config, trial_grid

    values = yaml.safe_load((REPO / "trials" / "quickstart.yaml").read_text())
    values["base"] = {k: v for k, v in values["base"].items() if k != "recipe"}  # unpinned, as a user's copy
    values["tuned_from"] = str(REPO / "trials" / "tuned" / "schedule-search.json")
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(values))
    study = load_study(path)
    trial = next(t for t in trial_grid(study) if t.strategy == "static-pairwise")
    config = trial_config(study, trial)
    assert set(config.recipe_applied["filled"]) == {"batch_size", "lr_end", "warmup_steps", "weight_decay"}  # base sets epochs
    assert config.strategy_settings().clip == trial.tuned["clip"] and config.lr == trial.tuned["lr"]


# -- it reads no data --------------------------------------------------------------------------------------------------

def test_the_lookup_opens_no_file_but_the_packages_table(tmp_path, monkeypatch):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    for name in ("manifest.json", "train.parquet", "eval.parquet", "validation.parquet"):
        (dataset / name).write_text("{}")
    opened: list[Path] = []

    def recording(original, path_of):
        def wrapper(*args, **kwargs):
            opened.append(Path(path_of(*args)).resolve())
            return original(*args, **kwargs)
        return wrapper

    for owner, name, path_of in ((builtins, "open", lambda f, *a: f), (io, "open", lambda f, *a: f),
                                 (Path, "open", lambda self, *a: self), (Path, "read_text", lambda self, *a: self),
                                 (Path, "read_bytes", lambda self, *a: self)):
        monkeypatch.setattr(owner, name, recording(getattr(owner, name), path_of))
    load_table.cache_clear()  # read the table now, under the recorder
    try:
        config = TrainConfig(**PAIRWISE, data={"source": str(dataset)})
    finally:
        monkeypatch.undo()
        load_table.cache_clear()
    assert config.recipe_applied is not None
    assert opened and set(opened) == {RECIPES_FILE}, opened
    assert not any(dataset in p.parents for p in opened)


# -- a run records it --------------------------------------------------------------------------------------------------

def test_a_run_writes_the_recipe_it_took_into_config_json_and_its_summary(tmp_path, own_table):
    from raydp.runner.run import run_training

    own_table(_table([(0.5, {"batch_size": 8, "epochs": 3.0, "lr": 1e-3, "lr_decay": "cosine", "lr_end": 0.0,
                             "warmup_steps": 2, "clip": 0.05}),
                      (8.0, {"batch_size": 8, "epochs": 3.0, "lr": 4e-3, "lr_decay": "cosine", "lr_end": 0.0,
                             "warmup_steps": 2, "clip": 0.05})], model="embedded-tiny"))
    config = TrainConfig(model="embedded-tiny", strategy="static-pairwise", epsilon=2.0, max_steps=3, seed=3,
                         unsafe_fixed_randomness=True, data={"n_records": 300}, eval_max_records=16,
                         public_eval_records=16)
    assert config.lr == pytest.approx(2e-3) and config.batch_size == 8  # log-linear at 2, the geometric middle
    run_training(config, tmp_path / "run", progress=False)
    stored = json.loads(RunDirectory(tmp_path / "run").config.read_text())
    assert stored["recipe_applied"] == config.recipe_applied
    assert stored["recipe_applied"]["entry"] == "embedded-tiny/static-pairwise/default"
    assert stored["lr"] == pytest.approx(2e-3) and stored["batch_size"] == 8
    summary = json.loads(RunDirectory(tmp_path / "run").summary.read_text())
    assert summary["recipe"] == config.recipe_applied  # the summary names the entry too


# -- studies pin it ----------------------------------------------------------------------------------------------------

def test_every_shipped_and_campaign_study_file_pins_the_recipe():
    """A benchmark's or a campaign's study states its recipe (none: today's defaults), so a new table version moves
    none of them; a study that means to run the recipe says recipe: auto."""
    studies = [p for p in STUDY_FILES if "strategies" in (yaml.safe_load(p.read_text()) or {})]
    assert len(studies) >= 40 and SEARCH in studies
    unpinned = [str(p.relative_to(REPO)) for p in studies
                if (yaml.safe_load(p.read_text()).get("base") or {}).get("recipe") not in ("none", "auto")]
    assert not unpinned, f"state base.recipe in {unpinned}"


def test_the_preregistered_search_validates_on_public_data_from_todays_defaults():
    from raydp.study.config import load_study
    from raydp.study.grid import search_cells, trial_config, trial_grid

    study = load_study(SEARCH)
    assert not study.private_data and study.base["data"]["source"] == "public" and study.base["recipe"] == "none"
    assert study.epsilons == [0.5, 2.0, 8.0] and set(study.strategies) == {"nonprivate", "static-pairwise"}
    cells = search_cells(study)
    assert [c.epsilon for c in cells] == [0.5, 2.0, 8.0]
    for trial in [*trial_grid(study), *cells]:
        config = trial_config(study, trial)
        assert config.recipe_applied is None and config.common_random_numbers
        assert (config.batch_size, config.epochs) == (16, 3.0)


def test_dp_training_takes_no_recipe_of_the_configs_model():
    """A Trainer trains its own model: DPTraining must not give it the embedded model's recipe (clip 0.039 where the
    user asked for nothing), whether given fields or a TrainConfig that took the recipe."""
    pytest.importorskip("transformers")
    from raydp.integrations.transformers import DPTraining

    fields = {"strategy": "static-pairwise", "epsilon": 2.0}
    assert TrainConfig(**fields).recipe_applied is not None  # the plain config does take it
    model = torch.nn.Linear(2, 2)
    read_back = TrainConfig.model_validate(json.loads(json.dumps(TrainConfig(**fields).model_dump(mode="json"))))
    explicit = TrainConfig(recipe="auto", **fields)  # recipe set explicitly: in model_fields_set, dropped all the same
    for kwargs in (fields, {"config": TrainConfig(**fields)}, {"config": read_back}, {"config": explicit}):
        dp = DPTraining(model, [{"input_ids": [1, 2, 3]}] * 64, SimpleNamespace(pad_token_id=0), **kwargs)
        assert dp.config.recipe_applied is None and dp.config.clip == TrainConfig(recipe="none", **fields).clip
        assert dp.config.epsilon == 2.0 and dp.config.strategy == "static-pairwise"


def test_dp_training_refuses_a_recipe_asked_for_and_a_forged_record_is_refused():
    pytest.importorskip("transformers")
    from raydp.errors import ConfigError
    from raydp.integrations.transformers import DPTraining

    with pytest.raises(ConfigError, match="DPTraining takes no recipe"):
        DPTraining(torch.nn.Linear(2, 2), [{"input_ids": [1, 2, 3]}] * 64, SimpleNamespace(pad_token_id=0),
                   strategy="static-pairwise", epsilon=2.0, recipe="auto")
    # recipe_applied is validation's record of values the config holds: not a user's to write
    with pytest.raises(ValueError, match="recipe_applied is written by validation"):
        TrainConfig(strategy="static", epsilon=2.0, recipe="none", recipe_applied={"entry": "forged", "filled": {}})
    with pytest.raises(ValueError, match="recipe_applied is written by validation"):
        TrainConfig(strategy="static-pairwise", epsilon=2.0, recipe_applied={"filled": {"clip": 9.0}})


def test_a_resumed_study_runs_under_the_recipe_it_started_with(tmp_path):
    """A new study records its recipe (auto unless its file names one) in study.json and its trials' parameters; a
    resumed study whose file names none takes the recorded one; one started before recipes existed is refused."""
    from raydp.errors import ConfigError
    from raydp.study.config import StudyConfig
    from raydp.study.runner import study_recipe

    study = StudyConfig.model_validate({"name": "s", "models": ["embedded-tiny"], "epsilons": [2.0],
                                        "strategies": ["static-pairwise"], "seeds": [0]})
    assert study_recipe(study, tmp_path, resume=False).base["recipe"] == "auto"
    saved = tmp_path / "study.json"
    recorded = json.loads(json.dumps(study.model_dump(mode="json")))
    for value in ("auto", "none"):
        recorded["base"]["recipe"] = value
        saved.write_text(json.dumps(recorded))
        assert study_recipe(study, tmp_path, resume=True).base["recipe"] == value
    del recorded["base"]["recipe"]
    saved.write_text(json.dumps(recorded))  # written before recipes existed
    with pytest.raises(ConfigError, match="started before raydp had recipes"):
        study_recipe(study, tmp_path, resume=True)
    pinned = study.model_copy(update={"base": {"recipe": "none"}})
    assert study_recipe(pinned, tmp_path, resume=True) is pinned  # named in the file: compared by check_resumed_study


def test_a_study_resumes_only_under_the_recipe_table_it_started_with(tmp_path):
    """Under recipe: auto a study's trials take their unset settings from the shipped table, so study.json records the
    table (its version and a digest of its entries) and a resume under another version, or an edited table that kept
    its version, is refused with one line. A study.json from before the record resumes when no trial took another
    table's settings; under recipe: none no table is recorded or checked."""
    from raydp.errors import ConfigError
    from raydp.study.config import StudyConfig
    from raydp.study.prepare import check_resumed_study, recipe_table_id, study_record

    values = {"name": "s", "models": ["embedded-tiny"], "epsilons": [2.0], "strategies": ["static-pairwise"],
              "seeds": [0]}
    auto = StudyConfig.model_validate({**values, "base": {"recipe": "auto"}})
    saved = tmp_path / "study.json"
    saved.write_text(study_record(auto))
    assert json.loads(saved.read_text())["recipe_table"] == recipe_table_id()
    assert recipe_table_id().startswith(shipped_table().version + " sha256:")
    check_resumed_study(auto, tmp_path)  # the same table: resumed
    for recorded in ("v0.0-older sha256:0123456789abcdef", f"{shipped_table().version} sha256:0000000000000000"):
        written = json.loads(study_record(auto))
        written["recipe_table"] = recorded
        saved.write_text(json.dumps(written))
        with pytest.raises(ConfigError, match=f"ran under the recipe table {recorded}, and this raydp ships") as error:
            check_resumed_study(auto, tmp_path)
        assert "\n" not in str(error.value)
    legacy = json.loads(study_record(auto))
    del legacy["recipe_table"]
    saved.write_text(json.dumps(legacy))
    check_resumed_study(auto, tmp_path)  # before the record, and no trial took another table's settings
    trial = tmp_path / "trials" / "t0"
    trial.mkdir(parents=True)
    (trial / "config.json").write_text(json.dumps({"recipe_applied": {"table": "raydp-recipes v0.1"}}))
    with pytest.raises(ConfigError, match="ran under a recipe table it did not record, and this raydp ships"):
        check_resumed_study(auto, tmp_path)
    (trial / "config.json").write_text(json.dumps({"recipe_applied": {"table": f"raydp-recipes {shipped_table().version}"}}))
    check_resumed_study(auto, tmp_path)
    none = StudyConfig.model_validate({**values, "base": {"recipe": "none"}})
    saved.write_text(study_record(none))
    assert "recipe_table" not in json.loads(saved.read_text())
    check_resumed_study(none, tmp_path)
    with pytest.raises(ConfigError, match=r"the study file changed .*\(base\)"):  # none -> auto: the file's change
        check_resumed_study(auto, tmp_path)


def test_the_non_private_entry_is_its_searchs_choice_and_a_non_private_run_takes_it():
    """The non-private arm's own entry (the tuned reference every share of the gain is measured against): its searched
    values are trials/recipe/search-nonprivate.yaml's search_best, the rest today's defaults; a non-private run with
    no flag takes it, at no epsilon, and each flag still wins."""
    entry = next(e for e in shipped_table().entries if e.strategy == "nonprivate")
    record = json.loads((REPO / entry.provenance.tuning_record).read_text())
    best = next(b for b in record["search_best"] if b["strategy"] == "nonprivate")
    (point,) = entry.points
    settings = point.settings.model_dump(exclude_none=True)
    assert point.epsilon is None and best["epsilon"] is None and entry.provenance.dataset_ids == record["dataset_ids"]
    assert {k: settings[k] for k in entry.provenance.searched} == best["best"]
    assert {k: settings[k] for k in entry.provenance.not_searched} == \
        {k: v for k, v in _defaults().items() if k in entry.provenance.not_searched}
    config = validate_config(TrainConfig, {"model": "embedded", "strategy": "nonprivate"})
    assert (config.lr, config.lr_decay, config.weight_decay) == (best["best"]["lr"], best["best"]["lr_decay"],
                                                                 best["best"]["weight_decay"])
    assert config.recipe_applied["entry"] == "embedded/nonprivate/default" and config.recipe_applied["epsilon"] is None
    assert validate_config(TrainConfig, {"model": "embedded", "strategy": "nonprivate", "lr": 1e-3}).lr == 1e-3


def test_the_proof_data_builds_as_a_users_tables(tmp_path):
    """experiments/recipe-proof/make_data.py writes the unseen hospital's CSV and the progress letters as a user would
    bring them: deterministic in the seed, each building as a private dataset (records; free text with its unit), a
    patient's letters sharing their injury and therapist with pain that never rises from one session to the next."""
    import re
    import subprocess
    import sys

    import pandas as pd

    from raydp.data import build_dataset, load_manifest
    from raydp.data.text_source import build_text_dataset

    script = REPO / "experiments" / "recipe-proof" / "make_data.py"
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(script), str(tmp_path / out), "--records", "400", "--patients", "60"],
                       check=True, capture_output=True)
    for name in ("unseen.csv", "unseen-holdout.csv", "letters.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    records, holdout = (pd.read_csv(tmp_path / "a" / n) for n in ("unseen.csv", "unseen-holdout.csv"))
    assert len(holdout) == 1000 and not set(holdout["patient_nbr"]) & set(records["patient_nbr"])
    assert not set(holdout["encounter_id"]) & set(records["encounter_id"])
    letters = pd.read_csv(tmp_path / "a" / "letters.csv")
    assert letters["patient"].nunique() == 60 and len(letters) > 60
    for _, own in letters.groupby("patient"):
        parsed = [re.match(r"Session (\d+) with (\w+) for .* after (.*)\. Pain today (\d+) out of 10", t).groups()
                  for t in own["letter"]]
        parsed.sort(key=lambda g: int(g[0]))
        assert len({(g[1], g[2]) for g in parsed}) == 1
        assert all(int(a[3]) >= int(b[3]) for a, b in zip(parsed, parsed[1:]))
    build_dataset(tmp_path / "records", source=str(tmp_path / "a" / "unseen.csv"), progress=False)
    build_text_dataset(tmp_path / "texts", source=tmp_path / "a" / "letters.csv", text_column="letter",
                       unit_column="patient")
    assert load_manifest(tmp_path / "records")["dataset_id"] != load_manifest(tmp_path / "texts")["dataset_id"]


# -- compute tiers -----------------------------------------------------------------------------------------------------

def test_the_3x_entry_is_its_searchs_choice_at_nine_epochs():
    entry = shipped_table().entries[1]
    record = json.loads((REPO / entry.provenance.tuning_record).read_text())
    (best,) = record["search_best"]
    (point,) = entry.points
    settings = point.settings.model_dump(exclude_none=True)
    assert entry.compute_tier == "3x" and point.epsilon == best["epsilon"] == 2.0 and settings["epochs"] == 9.0
    assert {k: settings[k] for k in entry.provenance.searched} == best["best"]
    assert point.public_value_nll == best["final_public_value_nll"] and record["dataset_ids"][0].startswith("public:")
    config = TrainConfig(**PAIRWISE, compute="3x")
    assert config.recipe_applied["entry"] == "embedded/static-pairwise/3x" and "tier_note" not in config.recipe_applied
    assert (config.batch_size, config.epochs) == (best["best"]["batch_size"], 9.0)


def test_a_tier_without_its_own_entry_takes_the_default_entry_with_three_times_the_epochs():
    default, tripled = TrainConfig(strategy="nonprivate"), TrainConfig(strategy="nonprivate", compute="3x")
    assert tripled.epochs == 3 * default.epochs == 9.0
    assert {k: getattr(tripled, k) for k in RECIPE_FIELDS if k != "epochs"} == \
        {k: getattr(default, k) for k in RECIPE_FIELDS if k != "epochs"}
    record = tripled.recipe_applied
    assert record["compute_tier"] == "3x" and "not searched for nonprivate" in record["tier_note"]
    assert default.recipe_applied["compute_tier"] == "default" and "tier_note" not in default.recipe_applied
    assert TrainConfig(strategy="nonprivate", compute="3x", epochs=4).epochs == 4  # a flag still wins


def test_a_tier_with_its_own_entry_takes_it(own_table):
    table = _table([(2.0, {"batch_size": 16, "epochs": 3.0, "lr": 1e-3})], model="embedded")
    own = table.entries[0].model_copy(update={"compute_tier": "3x", "points": [
        table.entries[0].points[0].model_copy(update={"settings": table.entries[0].points[0].settings.model_copy(
            update={"batch_size": 64, "epochs": 9.0, "lr": 4e-3})})]})
    own_table(table.model_copy(update={"entries": [table.entries[0], own]}))
    config = TrainConfig(**PAIRWISE, compute="3x")
    assert (config.batch_size, config.epochs, config.lr) == (64, 9.0, 4e-3)
    assert config.recipe_applied["entry"] == "embedded/static-pairwise/3x" and "tier_note" not in config.recipe_applied
    assert (TrainConfig(**PAIRWISE).batch_size, TrainConfig(**PAIRWISE).lr) == (16, 1e-3)


def test_a_tier_needs_the_recipe_and_a_bad_tier_is_a_one_line_error():
    with pytest.raises(Exception, match="compute: 3x selects the recipe's 3x tier: it needs recipe: auto"):
        validate_config(TrainConfig, {**PAIRWISE, "compute": "3x", "recipe": "none"})
    with pytest.raises(Exception, match="compute"):
        validate_config(TrainConfig, {**PAIRWISE, "compute": "10x"})
    from raydp.errors import ConfigError
    with pytest.raises(ConfigError, match="compute tier '10x' is not one of default, 3x"):
        resolve("embedded", "static-pairwise", 2.0, tier="10x")
    # a strategy the table has no entry for: the tier cannot be applied, so the run is refused rather than run at 1x
    with pytest.raises(Exception, match="compute: 3x: the recipe table has no entry for model 'embedded' and strategy "
                                        "'static'"):
        validate_config(TrainConfig, {"strategy": "static", "epsilon": 2.0, "compute": "3x"})
    args = build_parser().parse_args(["train", "--strategy", "static-pairwise", "--epsilon", "2", "--compute", "3x",
                                      "--output", "unused"])
    assert train_config_from_args(args).epochs == 9.0


def test_the_terminal_names_the_recipe_and_its_tier():
    from raydp.recipe import recipe_line

    line = recipe_line(TrainConfig(strategy="nonprivate", compute="3x").recipe_applied)
    assert line.startswith("embedded/nonprivate/default (raydp-recipes ") and \
        "3x tier (the 3x tier was not searched for nonprivate: the default tier's settings with its epochs x3)" in line
    assert "epochs 9" in line and "searched on public data, no budget on your data" in line
    assert "chosen on DP runs of a benchmark's synthetic records" in recipe_line(TrainConfig(**PAIRWISE).recipe_applied)
    assert recipe_line(TrainConfig(**PAIRWISE, recipe="none").recipe_applied).startswith("none")


def test_the_batch_size_is_searched_on_public_data_only():
    from raydp.study.config import StudyConfig
    from raydp.study.grid import trial_config
    from raydp.study.trial import Trial

    values = {"name": "s", "models": ["embedded"], "epsilons": [2.0], "seeds": [0], "strategies": ["static-pairwise"],
              "search": "optuna", "search_space": {"static-pairwise": {"batch_size": {"choices": [16, 64]}}},
              "private_data": False, "base": {"data": {"source": "public"}, "recipe": "none"}}
    study = validate_config(StudyConfig, values)
    trial = Trial(model="embedded", strategy="static-pairwise", epsilon=2.0, seed=0, search={"batch_size": 64})
    assert trial_config(study, trial).batch_size == 64
    with pytest.raises(Exception, match="batch_size is searched on public data only"):
        validate_config(StudyConfig, {**values, "private_data": True, "base": {"recipe": "none"}})


def test_a_tier_run_that_gave_its_epochs_says_they_were_not_scaled_and_reads_back():
    config = TrainConfig(strategy="nonprivate", compute="3x", epochs=4)
    assert config.epochs == 4 and "epochs" not in config.recipe_applied["filled"]
    assert config.recipe_applied["tier_note"].endswith("but the run gave its epochs (4), not the tier's (9)")
    own = TrainConfig(**PAIRWISE, compute="3x", epochs=3)  # the tier's searched entry, its epochs overridden
    assert own.recipe_applied["tier_note"] == "the 3x tier's entry, but the run gave its epochs (3), not the tier's (9)"
    every = {k: v for k, v in TrainConfig(**PAIRWISE, recipe="none").model_dump().items() if k in RECIPE_FIELDS}
    with pytest.raises(Exception, match="compute: 3x has nothing to fill"):
        validate_config(TrainConfig, {**PAIRWISE, **every, "compute": "3x"})
    stored = json.loads(json.dumps(TrainConfig(**PAIRWISE, compute="3x").model_dump(mode="json")))
    again = validate_config(TrainConfig, stored)  # config.json read back: the record and the tier stay
    assert again.recipe_applied == stored["recipe_applied"] and again.epochs == 9.0 and again.compute == "3x"
    with pytest.raises(Exception, match="its compute tier"):  # a record of another tier than the config's
        validate_config(TrainConfig, {**stored, "compute": "default"})


def test_dp_training_takes_no_compute_tier():
    pytest.importorskip("transformers")
    from raydp.errors import ConfigError
    from raydp.integrations.transformers import DPTraining

    data, tokenizer = [{"input_ids": [1, 2, 3]}] * 64, SimpleNamespace(pad_token_id=0)
    with pytest.raises(ConfigError, match="DPTraining takes no recipe nor compute tier"):
        DPTraining(torch.nn.Linear(2, 2), data, tokenizer, strategy="static-pairwise", epsilon=2.0, compute="3x")
    dp = DPTraining(torch.nn.Linear(2, 2), data, tokenizer, config=TrainConfig(**PAIRWISE, compute="3x"))
    assert dp.config.compute == "default" and dp.config.recipe_applied is None
    assert dp.config.epochs == TrainConfig(**PAIRWISE, recipe="none").epochs


def test_a_batch_size_search_takes_choices():
    from raydp.study.config import StudyConfig

    values = {"name": "s", "models": ["embedded"], "epsilons": [2.0], "seeds": [0], "strategies": ["static-pairwise"],
              "search": "optuna", "search_space": {"static-pairwise": {"batch_size": {"low": 16, "high": 64}}},
              "private_data": False, "base": {"data": {"source": "public"}, "recipe": "none"}}
    with pytest.raises(Exception, match="batch_size: give its values as choices"):
        validate_config(StudyConfig, values)


def test_the_studys_recipe_record_changes_with_the_tiers(monkeypatch):
    import raydp.study.prepare as prepare

    before = prepare.recipe_table_id()
    monkeypatch.setattr(prepare, "TIER_FACTORS", {"default": 1, "3x": 4})
    assert prepare.recipe_table_id() != before and prepare.recipe_table_id().split()[0] == before.split()[0]
