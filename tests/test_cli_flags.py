"""CLI flags generated from the config models (issue 30, raydp.cli_flags): one flag per config field, the flag's
value landing on that field, the field's description as its help, older flag names kept, unset flags leaving the
YAML config alone, and ``raydp --help`` reading no model."""

from __future__ import annotations

import subprocess
import sys
import types
import typing

import pytest
from pydantic import BaseModel, Field

from raydp.cli import build_parser, main, train_config_from_args
from raydp.cli_flags import apply_flags, check_unique, data_flags, model_flags, train_flags
from raydp.config import DataConfig, TrainConfig, validate_config
from raydp.errors import ConfigError
from raydp.strategies.registry import SPECS, settings_model

#: `raydp train`'s flags before they were generated (raydp/cli.py at 6f3d103): README, docs, trials and benches
#: use them, so every one must still parse
OLD_TRAIN_FLAGS = (
    "--output", "-o", "--config", "--overwrite", "--quiet", "--model", "--strategy", "--set", "--epsilon", "--delta",
    "--accountant", "--clip", "--epochs", "--max-steps", "--batch-size", "--lr", "--warmup-steps", "--eval-every",
    "--eval-max-records", "--max-length", "--seed", "--privacy-unit", "--unsafe-fixed-randomness", "--task",
    "--label", "--device", "--cpus", "--source", "--ids-mapping", "--text-column", "--unit-column", "--n-records",
    "--sample-fraction", "--split", "--data-seed", "--n-canary", "--canary-seed", "--n-audit", "--privacy-mode",
    "--t-warm", "--t-rl", "--b-sac", "--k", "--r-max", "--policy-arch", "--policy", "--frozen", "--save-policy",
    "--policy-dir", "--overwrite-policy", "--controller")
OLD_DATA_BUILD_FLAGS = (
    "--output", "-o", "--overwrite", "--source", "--ids-mapping", "--text-column", "--unit-column", "--n-records",
    "--sample-fraction", "--split", "--data-seed", "--n-canary", "--canary-seed", "--n-audit")
#: `raydp train`'s options that are no config field
HAND_WRITTEN = {"-h", "--help", "--output", "-o", "--config", "--overwrite", "--quiet", "--set", "--overwrite-policy",
                "--help-all", "--help-strategy"}
#: config fields with no generated flag (settings: `--set KEY=VALUE`, and the settings models' own flags)
#: set in a config file or with --set only: the strategy settings' mapping; RLDP's residual schedule (its fields would
#: collide with --clip); what the recipe filled (recipe_applied: written by validation, read from config.json)
UNFLAGGED = {("settings",), ("settings", "schedule", "clip"), ("settings", "schedule", "clip_end"),
             ("settings", "schedule", "depth_tilt"), ("settings", "schedule", "relative"), ("recipe_applied",)}
RLDP = ["--strategy", "rldp", "--epsilon", "2"]


def _leaves(model, path=()):
    """Every leaf field of ``model`` (nested models walked), as paths: an independent reading of the models."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, (*path, name))
        else:
            yield (*path, name), info


def _train_leaves() -> dict:
    leaves = dict(_leaves(TrainConfig))
    for spec in SPECS.values():
        if spec.settings:  # the light settings models: the CLI reads these without loading the strategy
            leaves.update(_leaves(settings_model(spec.name), ("settings",)))
    return leaves


def _subparser(*names):
    parser = build_parser()
    for name in names:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    parser.format_help()  # the generated flags are added when the parser is first used
    return parser


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_config_field_the_cli_exposes_has_exactly_one_flag():
    leaves = _train_leaves()
    paths = [flag.path for flag in train_flags()]
    assert sorted(paths) == sorted(set(leaves) - UNFLAGGED)  # each once, none missing, none invented
    assert len({flag.option for flag in train_flags()}) == len(paths)
    assert ("settings", "paper_mode") in paths  # RLDP's paper mode is a flag (--paper-mode)
    assert sorted(f.path for f in data_flags()) == sorted(p[1:] for p in leaves if p[0] == "data")
    assert {f.option for f in data_flags()} == {f.option for f in train_flags() if f.path[0] == "data"}


def test_the_train_parser_holds_the_generated_and_the_hand_written_flags_only():
    options = _options(_subparser("train"))
    generated = {flag.option for flag in train_flags()}
    negations = {"--no-" + flag.option[2:] for flag in train_flags() if flag.kind == "bool"}
    assert options == generated | negations | HAND_WRITTEN


def test_every_older_flag_name_still_parses():
    assert set(OLD_TRAIN_FLAGS) <= _options(_subparser("train"))
    assert set(OLD_DATA_BUILD_FLAGS) <= _options(_subparser("data", "build"))
    assert {"--task", "--policy-arch", "--data-seed", "--split"} <= {flag.option for flag in train_flags()}


def _value(config, path):
    if path[0] == "settings":
        return getattr(config.strategy_settings(), path[1])
    for key in path:
        config = getattr(config, key)
    return config


@pytest.mark.parametrize("argv, path, expected", [
    (["--lr", "0.01"], ("lr",), 0.01),
    (["--max-steps", "7"], ("max_steps",), 7),
    (["--accountant", "rdp"], ("accountant",), "rdp"),
    (["--lr-decay", "cosine"], ("lr_decay",), "cosine"),
    (["--recipe", "none"], ("recipe",), "none"),
    (["--rescale-moments"], ("rescale_moments",), True),
    (["--model", "embedded-deep"], ("model",), "embedded-deep"),
    (["--n-records", "123"], ("data", "n_records"), 123),
    (["--data-seed", "5"], ("data", "seed"), 5),
    (["--generator", "independent"], ("data", "generator"), "independent"),
    (["--split", "eval=0.1", "--split", "attack=0.3"], ("data", "fractions"), {"eval": 0.1, "attack": 0.3}),
    (["--task", "classification"], ("task", "kind"), "classification"),
    (["--lora-dropout", "0.2"], ("lora", "dropout"), 0.2),
    (["--lora-target-modules", "q_proj", "v_proj"], ("lora", "target_modules"), ("q_proj", "v_proj")),
    (["--t-rl", "9"], ("settings", "t_rl"), 9),
    (["--r-max", "2.5"], ("settings", "r_max"), 2.5),
    (["--no-noise-control"], ("settings", "noise_control"), False),
    (["--policy-arch", "paper"], ("settings", "architecture"), "paper"),
    (["--paper-mode"], ("settings", "paper_mode"), True),
])
def test_a_flag_value_lands_on_its_config_field(argv, path, expected):
    args = build_parser().parse_args(["train", "-o", "run", *RLDP, *argv])
    config = train_config_from_args(args)
    assert _value(config, path) == expected
    assert _value(train_config_from_args(build_parser().parse_args(["train", "-o", "run", *RLDP])), path) != expected


def test_paper_mode_flag_gives_the_paper_modes_and_an_explicit_one_wins():
    settings = train_config_from_args(build_parser().parse_args(
        ["train", "-o", "run", *RLDP, "--paper-mode", "--privacy-mode", "strict"])).strategy_settings()
    assert (settings.privacy_mode, settings.action_decoding, settings.architecture) == ("strict", "paper", "paper")


def test_data_build_flags_build_the_data_config():
    args = build_parser().parse_args(["data", "build", "-o", "ds", "--generator", "independent", "--data-seed", "3",
                                      "--split", "eval=0.1"])
    data = validate_config(DataConfig, apply_flags(data_flags(), args, {}))
    assert (data.generator, data.seed, data.fractions, data.n_canary) == ("independent", 3, {"eval": 0.1}, 10)


YAML = """\
strategy: rldp
epsilon: 3
lr: 0.002
rescale_moments: true
data: {n_canary: 4, seed: 9, fractions: {eval: 0.15}}
task: {kind: classification, label: diabetesMed}
lora: {r: 4}
settings: {t_warm: 7, noise_control: false}
"""


def test_unset_flags_leave_the_yaml_config_alone(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    import yaml

    from_yaml = validate_config(TrainConfig, yaml.safe_load(YAML))
    config = train_config_from_args(build_parser().parse_args(["train", "-o", "run", "--config", str(path)]))
    assert config == from_yaml and config.lr == 0.002 and config.strategy_settings().t_warm == 7
    flagged = train_config_from_args(build_parser().parse_args(
        ["train", "-o", "run", "--config", str(path), "--lr", "0.1", "--t-rl", "5", "--split", "attack=0.1",
         "--no-rescale-moments"]))
    assert flagged.model_dump() == {
        **from_yaml.model_dump(), "lr": 0.1, "rescale_moments": False,
        "settings": {"t_warm": 7, "noise_control": False, "t_rl": 5},
        "data": {**from_yaml.data.model_dump(), "fractions": {"eval": 0.15, "attack": 0.1}}}


def test_an_old_settings_block_in_the_yaml_meets_the_settings_flags(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("strategy: rldp\nepsilon: 2\nrldp: {t_warm: 3}\n")
    config = train_config_from_args(build_parser().parse_args(
        ["train", "-o", "run", "--config", str(path), "--t-rl", "8", "--set", "k=3"]))
    assert config.settings == {"t_warm": 3, "t_rl": 8, "k": 3}


@pytest.mark.parametrize("argv, words", [
    (["--accountant", "exact"], ["--accountant", "invalid choice: 'exact'"]),
    (["--lr-decay", "step"], ["--lr-decay", "invalid choice: 'step'"]),
    (["--privacy-mode", "loose"], ["--privacy-mode", "invalid choice: 'loose'"]),
    (["--strategy", "magic"], ["--strategy", "invalid choice: 'magic'"]),
    (["--batch-size", "many"], ["--batch-size", "invalid int value: 'many'"]),
])
def test_a_bad_flag_value_is_a_one_line_error(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "-o", str(tmp_path / "run"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("raydp train: error: ") and all(w in err for w in words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, words", [
    (["--lora-r", "0"], "lora.r (--lora-r): Input should be greater than 0"),
    ([*RLDP, "--t-rl", "0"], "settings.t_rl (--t-rl): Input should be greater than 0"),
    (["--split", "eval"], "--split takes SPLIT=FRACTION, got 'eval'"),
    (["--n-canary", "-1"], "data.n_canary (--n-canary): Input should be greater than or equal to 0"),
])
def test_a_value_the_model_refuses_is_a_one_line_error_naming_the_flag(tmp_path, capsys, argv, words):
    assert main(["train", "-o", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("raydp: error: ") and words in err, err
    assert not (tmp_path / "run").exists()


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_train_help_fits_a_screen_with_one_line_per_common_flag(capsys, monkeypatch):
    """`raydp train --help` lists every flag but the strategies' settings, one line each, on one screen, and says
    where those settings are; `--help-strategy rldp` lists RLDP's with their help (the full help was 312 lines)."""
    monkeypatch.setenv("COLUMNS", "80")
    out = _help(capsys, "train", "--help")
    lines = out.splitlines()
    assert len(lines) <= 80 and max(map(len, lines)) <= 80, len(lines)
    assert "--help-strategy NAME" in out and "--help-all" in out
    starts = {line.split()[0].rstrip(",") for line in lines if line.startswith("  -")}
    for flag in train_flags():
        option = flag.option if flag.kind != "bool" else f"--[no-]{flag.option[2:]}"
        assert (option in starts) == (flag.path[0] != "settings"), flag.option
    assert HAND_WRITTEN - {"--help", "-o"} <= starts
    rldp = _help(capsys, "train", "--help-strategy", "rldp")
    assert "  --t-warm T_WARM       steps before the controller acts" in rldp and "--epochs" not in rldp
    quantile = _help(capsys, "train", "--help-strategy", "quantile")  # a strategy whose settings have no flags
    assert "--set target_quantile=VALUE" in quantile and "gamma: the fraction of units left unclipped" in quantile


def test_help_strategy_refuses_an_unknown_name_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help-strategy", "rldq"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "unknown strategy 'rldq'; known:" in err


def test_a_strategy_flag_absent_from_the_help_still_parses(tmp_path):
    args = build_parser().parse_args(["train", "-o", str(tmp_path / "run"), *RLDP, "--t-warm", "7", "--no-frozen"])
    settings = train_config_from_args(args).strategy_settings()
    assert settings.t_warm == 7 and settings.frozen is False


def test_train_help_all_lists_every_flag_with_its_description(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: descriptions are not wrapped
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help-all"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    leaves = _train_leaves()
    for flag in train_flags():
        description = " ".join(leaves[flag.path].description.split())
        assert (f"{flag.option} " in out or f"{flag.option}, " in out) and description in out, flag.option
    assert "--set KEY=VALUE" in out and "rldp settings (--strategy rldp)" in out


def _imported_after(argv: list[str]) -> list[str]:
    code = ("import sys; from raydp.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('pydantic', 'raydp.config') if m in sys.modules))" % argv)
    return eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
                .splitlines()[-1])


def test_raydp_help_reads_no_model_and_train_help_does():
    assert _imported_after(["--help"]) == []
    assert _imported_after(["data", "--help"]) == []
    assert _imported_after(["train", "--help"]) == ["pydantic", "raydp.config"]


class _Inner(BaseModel):
    """An inner model."""

    seed: int = Field(0, description="inner seed")


class _Outer(BaseModel):
    seed: int = Field(0, description="outer seed")
    inner: _Inner = _Inner()


def test_generation_refuses_a_clash_an_unknown_type_and_a_missing_description():
    with pytest.raises(ConfigError, match="seed and inner.seed would both be --seed"):
        check_unique(model_flags(_Outer))

    class Listed(BaseModel):
        values: list[int] = Field([], description="some values")

    with pytest.raises(ConfigError, match="'values'.*has no flag type"):
        model_flags(Listed)

    class Bare(BaseModel):
        count: int = 3

    with pytest.raises(ConfigError, match="'count' has no description"):
        model_flags(Bare)

    class Renamed(BaseModel):
        values: list[int] = Field([], description="some values", json_schema_extra={"flag": False})
        seed: int = Field(0, description="a seed", json_schema_extra={"flag": "--my-seed"})

    assert [(f.option, f.path, f.dest) for f in model_flags(Renamed)] == [("--my-seed", ("seed",), "my_seed")]


#: `raydp eval`'s flags before they were generated (raydp/cli.py at 1871f40): tests and docs use them
OLD_EVAL_FLAGS = ("--config", "--generations", "--extraction-prompt", "--candidates", "--membership-records",
                  "--confidence", "--no-audit", "--device", "--seed", "--quiet")


def test_eval_flags_are_evalconfigs_fields_and_the_older_names_parse():
    from raydp.cli import eval_config_from_args
    from raydp.cli_flags import eval_flags
    from raydp.evaluation.settings import EvalConfig

    assert {f.path for f in eval_flags()} == {path for path, _ in _leaves(EvalConfig)}
    parser = build_parser()
    argv = ["eval", "DIR", "--generations", "7", "--extraction-prompt", "narrative", "--candidates", "11",
            "--membership-records", "5", "--confidence", "0.9", "--no-audit", "--device", "cpu", "--seed", "3",
            "--prompt-fraction", "0.25"]
    settings = eval_config_from_args(parser.parse_args(argv))
    assert settings == EvalConfig(generations=7, extraction_prompt="narrative", exposure_candidates=11,
                                  membership_records=5, confidence=0.9, audit=False, device="cpu", seed=3,
                                  prompt_fraction=0.25)
    options = {o for a in parser._subparsers._group_actions[0].choices["eval"]._actions for o in a.option_strings}
    assert set(OLD_EVAL_FLAGS) <= options
    assert eval_config_from_args(parser.parse_args(["eval", "DIR"])) == EvalConfig()  # unset: the defaults


def test_eval_flag_refused_by_the_model_names_the_flag(capsys):
    assert main(["eval", "DIR", "--confidence", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(--confidence)" in err


def test_eval_help_imports_no_torch():
    code = ("import sys, contextlib, io\nfrom raydp.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main(['eval', '--help'])\n"
            "    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False"
