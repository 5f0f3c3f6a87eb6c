"""raydp: differentially private LLM fine-tuning on Ray with an RL controller for the privacy dials.

``raydp data build|show`` builds and inspects a dataset; ``raydp train`` runs one fine-tuning (an RLDP
run as a Ray actor controlled by a live RLlib SAC policy); ``raydp study`` runs a study on Ray Tune;
``raydp eval`` attacks a finished run and audits its epsilon; ``raydp report`` prints a study's tables and
writes its HTML report; ``raydp policy list|show|export`` manages saved policies.
User errors (bad config, bad CSV, unknown model, unwritable output) are one line on stderr and exit
status 2, with nothing half-written; ``raydp eval`` exits with status 3 when a run's audit bound exceeds
its claimed epsilon (a privacy bug).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from raydp import __version__
from raydp.errors import ConfigError, RaydpError
from raydp.files import private_umask
from raydp.run_directory import EVALUATION, RunDirectory


class RaydpParser(argparse.ArgumentParser):
    """raydp's parsers: an error is one line (no usage block); a subcommand's flags generated from the config models
    (:mod:`raydp.cli_flags`, given as ``flags``: a function that adds them) are added only when that subcommand is
    parsed or its help shown, so ``raydp --help`` reads no model (and imports no pydantic)."""

    def __init__(self, *args, flags=None, brief=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending_flags = flags
        self._brief = brief  # a function of the parser giving its --help (then --help-all gives argparse's full help)

    def _add_generated_flags(self) -> None:
        add, self._pending_flags = self._pending_flags, None
        if add is not None:
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_generated_flags()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_generated_flags()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_generated_flags()
        return self._brief(self) if self._brief is not None else super().format_help()

    def format_full_help(self) -> str:
        self._add_generated_flags()
        return super().format_help()

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    from raydp.cli_flags import add_flags, train_flags  # lazy: `raydp --help` loads no pydantic

    add_flags(parser, train_flags())


def _train_brief_help(parser) -> str:
    from raydp.cli_flags import train_brief_help  # lazy: `raydp --help` loads no pydantic

    return train_brief_help(parser)


class _FullHelp(argparse.Action):
    """``--help-all``: every flag with its full help."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_full_help(), sys.stdout)
        parser.exit()


class _StrategyHelp(argparse.Action):
    """``--help-strategy NAME``: a strategy's own settings with their help."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest=dest, default=default, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from raydp.cli_flags import strategy_help  # lazy: `raydp --help` loads no pydantic

        try:
            text = strategy_help(values)
        except ConfigError as exc:
            parser.error(f"--help-strategy: {exc}")
        parser._print_message(text, sys.stdout)
        parser.exit()


def _add_eval_flags(parser) -> None:
    from raydp.cli_flags import add_flags, eval_flags  # lazy: `raydp --help` loads no pydantic

    add_flags(parser, eval_flags())


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    from raydp.cli_flags import add_flags, data_flags  # lazy: `raydp --help` loads no pydantic

    add_flags(parser, data_flags())


LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str) -> None:
    """One level for raydp's own loggers and the libraries it drives (``--log-level``); Ray's workers read
    ``RAY_LOG_LEVEL``-style settings from the environment, so it is exported for them too."""
    number = getattr(logging, level.upper())
    logging.basicConfig(level=number, format="%(levelname)s %(name)s: %(message)s")
    for name in ("raydp", "ray", "ray.tune", "ray.rllib", "transformers", "wandb"):
        logging.getLogger(name).setLevel(number)
    os.environ.setdefault("RAYDP_LOG_LEVEL", level)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", level)


def build_parser() -> argparse.ArgumentParser:
    parser = RaydpParser(prog="raydp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"raydp {__version__}")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="messages of raydp, Ray, transformers and wandb at this level and above (default: warning)")
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="build and inspect datasets")
    data_cmds = data.add_subparsers(dest="data_command", required=True)
    build = data_cmds.add_parser("build", help="build splits, canaries and manifest as Parquet",
                                 flags=_add_data_flags)  # DataConfig's fields (raydp.cli_flags)
    build.add_argument("--output", "-o", required=True, help="dataset directory to create")
    build.add_argument("--overwrite", action="store_true", help="replace an existing dataset directory")
    show = data_cmds.add_parser("show", help="print a dataset's manifest and sizes (--sample: one record too)")
    show.add_argument("dataset", help="dataset directory")
    show.add_argument("--sample", action="store_true",
                      help="also print the first record of the eval split: private data on your terminal (its "
                           "scrollback, a CI log, a shared screen keep it), so only when asked")
    budget = data_cmds.add_parser("budget", help="set (once) or show a private dataset's lifetime privacy budget")
    budget.add_argument("dataset", help="dataset directory")
    budget.add_argument("--epsilon", type=float, help="set the lifetime epsilon (with --delta); once only")
    budget.add_argument("--delta", type=float, help="the lifetime delta")
    budget.add_argument("--privacy-unit", choices=("patient", "record"), default="patient",
                        help="what the budget protects (default: patient); runs of another unit are refused")

    train = commands.add_parser(
        "train", help="run one fine-tuning, writing everything under --output",
        description="Run one fine-tuning, writing everything under --output. Each flag sets the config field of its "
                    "name, over --config's YAML.",
        usage="raydp train --output DIR [--config FILE] [FLAG ...]",
        flags=_add_train_flags,  # TrainConfig's fields and strategy settings (raydp.cli_flags)
        brief=_train_brief_help)  # one line per common flag; --help-strategy NAME and --help-all give the rest
    train.add_argument("--help-all", action=_FullHelp, help="every flag with its full help, the strategies' too")
    train.add_argument("--help-strategy", action=_StrategyHelp, metavar="NAME",
                       help="a strategy's own settings with their help, e.g. --help-strategy rldp")
    train.add_argument("--output", "-o", required=True, help="run directory to create")
    train.add_argument("--config", help="YAML file with TrainConfig fields (flags override it)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.add_argument("--set", dest="set_settings", action="append", metavar="KEY=VALUE",
                       help="a setting of the strategy (repeatable; VALUE is read as YAML), e.g. --set clip=0.5")
    train.add_argument("--overwrite-policy", action="store_true", help="replace an existing --save-policy (rldp)")

    study = commands.add_parser("study", help="run a study file on Ray Tune (e.g. trials/quickstart.yaml)")
    study.add_argument("path", help="study file (YAML)")
    study.add_argument("--results-dir", default="runs/studies", help="where the study directory goes")
    study.add_argument("--resume", action="store_true", help="restore a stopped study (Tuner.restore) and finish it")
    study.add_argument("--check", action="store_true", help="validate the study (configs, budgets) and list its trials")
    study.add_argument("--quiet", action="store_true", help="no progress: neither a line per trial nor progress bars")
    study.add_argument("--verbose", "-v", action="count", default=0,
                       help="Ray Tune's own status tables instead of a line per finished trial (-vv: also a block per "
                            "result)")
    report = commands.add_parser("report", help="a study's (or a run's) tables and its HTML report")
    report.add_argument("study_dir", metavar="DIR", help="a study's directory (<results-dir>/<name>) or a run directory")
    report.add_argument("more_studies", metavar="MORE", nargs="*",
                        help="further study directories: print the tables of all their trials together, a later "
                             "study's arm replacing the same arm of an earlier one (e.g. an arm rerun after a fix); "
                             "no HTML then")
    report.add_argument("--html", metavar="FILE", help="where the HTML report goes (default DIR/report.html)")

    evaluate = commands.add_parser("eval", help="attack a finished run and audit its epsilon (writes evaluation.json)",
                                   flags=_add_eval_flags)  # EvalConfig's fields (raydp.cli_flags)
    evaluate.add_argument("run_dir", metavar="DIR", help="a run directory, or a study directory (every trial)")
    evaluate.add_argument("--config", help="YAML file with EvalConfig fields (flags override it)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress lines (the results still print)")

    from raydp.runner import policy_server  # lazy: `import raydp.cli` loads no torch (raydp.runner's package does)

    policy_server.add_arguments(commands.add_parser(
        "policy-server", help="serve an RLDP policy over RLlink to runs started with --controller rllink://HOST:PORT"))
    migrate = commands.add_parser("migrate", help="rewrite old run, study and policy files so that they name datasets "
                                  "by their keyed id, never by a plain hash of the records")
    migrate.add_argument("paths", nargs="+", metavar="PATH", help="run, study or policy directories (or policies/)")
    migrate.add_argument("--check", action="store_true",
                         help="change nothing; list the files that still hold a plain dataset hash (exit 1 if any)")
    policy = commands.add_parser("policy", help="list, show and export saved RLDP policies")
    policy_cmds = policy.add_subparsers(dest="policy_command", required=True)
    plist = policy_cmds.add_parser("list", help="the saved policies")
    plist.add_argument("--policy-dir", default="policies")
    pshow = policy_cmds.add_parser("show", help="a policy's manifest")
    pshow.add_argument("name", help="policy name (under --policy-dir) or path")
    pshow.add_argument("--policy-dir", default="policies")
    pexport = policy_cmds.add_parser("export", help="write a policy as a portable .tar.gz")
    pexport.add_argument("name", help="policy name (under --policy-dir) or path")
    pexport.add_argument("--to", required=True, help="archive to write (.tar.gz)")
    pexport.add_argument("--policy-dir", default="policies")
    pexport.add_argument("--overwrite", action="store_true")
    pexport.add_argument("--include-private-replay", action="store_true",
                         help="export a paper-mode policy although its replay buffer holds unprivatized "
                              "statistics of private data (ERRATA E14)")
    return parser


def train_config_from_args(args: argparse.Namespace):
    """The run's TrainConfig: the ``--config`` YAML's values, each flag given on the command line overriding its
    field (:mod:`raydp.cli_flags`: one flag per field); a strategy's settings (``--set`` and the settings flags) go
    under ``settings`` of the config's strategy, after an old config's settings block has moved there."""
    from raydp.cli_flags import (  # lazy: `raydp --help` loads no pydantic
        apply_flags, flag_value, naming_flags, train_flags)
    from raydp.config import (  # lazy: `raydp --help` loads no pandas
        TrainConfig, load_yaml_mapping, upgrade_train_values, validate_config)

    values = load_yaml_mapping(args.config) if args.config else {}
    setting_flags = [flag for flag in train_flags() if flag.path[0] == "settings"]
    values = apply_flags([flag for flag in train_flags() if flag.path[0] != "settings"], args, values)
    if args.set_settings or any(flag_value(flag, args) is not None for flag in setting_flags):
        try:
            values = upgrade_train_values(values)  # an old settings block moves under settings first
        except ValueError as exc:
            raise ConfigError(f"invalid config: {exc}") from None
        settings = values.get("settings") or {}
        if not isinstance(settings, dict):
            raise ConfigError("invalid config: settings: give the strategy's settings as a mapping")
        settings = dict(settings)
        for item in args.set_settings or ():
            import yaml  # lazy: only --set reads YAML here (keeps `import raydp.cli` light)

            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
            settings[key.strip()] = yaml.safe_load(raw)
        values = apply_flags(setting_flags, args, {**values, "settings": settings})
    try:
        return validate_config(TrainConfig, values)
    except ConfigError as exc:
        raise naming_flags(exc, train_flags(), args) from None


def cmd_data_build(args) -> int:
    from raydp.data import build_from_config, describe_dataset, load_manifest, manifest_id  # lazy: no pandas in --help
    from raydp.privacy.lifetime import adopt  # lazy: `raydp --help` loads no pandas

    from raydp.cli_flags import apply_flags, data_flags, naming_flags  # lazy: `raydp --help` loads no pydantic
    from raydp.config import DataConfig, validate_config  # lazy: `raydp --help` loads no pandas

    try:
        data = validate_config(DataConfig, apply_flags(data_flags(), args, {}), where="data.")
    except ConfigError as exc:
        raise naming_flags(exc, data_flags(), args, where="data.") from None
    build_from_config(data, args.output, overwrite=args.overwrite)
    manifest = load_manifest(args.output)
    adopt(manifest_id(manifest), manifest.get("source_sha256"))  # a rebuilt source keeps its lifetime budget
    _print_dataset(describe_dataset(args.output), args.output)
    return 0


def _print_dataset(info: dict, path, sample: bool = False) -> None:
    """The dataset's description; a record (the first of the eval split) only with ``sample``: a terminal's
    scrollback and a CI log are not private places, so nothing prints a record unasked (a study never does)."""
    info = dict(info)
    record = info.pop("sample_eval_narrative", None)
    print(json.dumps(info, indent=2, default=str))
    if not sample:
        return
    if not record:
        print(f"\n(the eval split of {path} is empty: no record to show)")
        return
    if not info.get("synthetic", True):  # a real record: the owner's terminal only, and said so
        print("\nPRIVATE: a record of the eval split follows (it is data of a real person: do not paste it anywhere)")
    print(f"\nsample narrative (eval split of {path}):\n{record}")


def cmd_data_show(args) -> int:
    from raydp.data import describe_dataset  # lazy: `raydp --help` loads no pandas

    _print_dataset(describe_dataset(args.dataset), args.dataset, sample=args.sample)
    return 0


def cmd_data_budget(args) -> int:
    from raydp.data import load_manifest, manifest_id  # lazy: `raydp --help` loads no pandas
    from raydp.privacy.lifetime import (  # lazy: `raydp --help` loads no pandas
        read_budget, register_for, set_dataset_budget, spend_record_path, spent_epsilon, spent_so_far)

    manifest = load_manifest(args.dataset)
    dataset_id = manifest_id(manifest)
    if (args.epsilon is None) != (args.delta is None):
        raise ConfigError("set a lifetime budget with both --epsilon and --delta")
    if args.epsilon is not None:  # the register, and lifetime_budget in the dataset's manifest
        register = set_dataset_budget(args.dataset, args.epsilon, args.delta, args.privacy_unit)
    else:
        register = read_budget(dataset_id, manifest.get("source_sha256"))
    where = register_for(dataset_id, manifest.get("source_sha256"))
    if register is None:
        print(f"dataset {dataset_id}: no lifetime budget (set one with --epsilon E --delta D)")
        spent = spent_so_far(dataset_id, 1e-5)  # the record of what DP runs spent on it without one
        if spent is not None:
            print(f"  recorded: {spent['runs']} DP run(s) compose to epsilon {spent['epsilon']:.3f} at delta 1e-05 "
                  f"(their planned RDP curves, in {spend_record_path(dataset_id)})")
        return 0
    print(f"dataset {dataset_id}: lifetime budget epsilon={register['epsilon']:g} at delta={register['delta']:g} per "
          f"{register['privacy_unit']}; {len(register['charges'])} run(s) charged, composed epsilon "
          f"{spent_epsilon(register):.3f} (kept in {where}, private)")
    return 0


def cmd_train(args) -> int:
    from raydp.runner.launch import train  # lazy: `raydp --help` loads no pandas

    config = train_config_from_args(args)
    summary = train(config, args.output, overwrite=args.overwrite, progress=not args.quiet,
                    overwrite_policy=args.overwrite_policy)
    print(f"run written to {Path(args.output).absolute()}")
    keys = ("model", "strategy", "device", "n_adapter_pairs", "train_records", "steps",
            "initial_public_value_nll", "final_public_value_nll", "initial_eval_value_nll", "final_eval_value_nll",
            "initial_public_perplexity", "final_public_perplexity", "initial_eval_perplexity",
            "final_eval_perplexity", "wall_seconds")
    if "final_eval_accuracy" in summary:  # a classification task
        keys = (*keys[:-1], "final_public_accuracy", "final_eval_accuracy", keys[-1])
    for key in keys:
        if key in summary:  # a DP run releases no record count; a run without value spans no value NLL
            print(f"  {key:<26} {summary[key]}")
    print("  (eval_*: private eval split, not a DP release; public_*: public validation; a classification "
          "task's perplexity is its label perplexity)" if "final_eval_accuracy" in summary else
          "  (eval_perplexity: private eval split, not a DP release; public_perplexity: public validation)")
    from raydp.recipe import recipe_line  # lazy, as the train import above

    print(f"  {'recipe':<26} {recipe_line(summary.get('recipe'))}")
    privacy = summary["privacy"]
    if privacy.get("epsilon") is not None and privacy.get("guarantee") == "local":
        print(f"  privacy unit               {privacy['privacy_unit']} ({privacy['n_units']} in train, at most "
              f"{privacy['records_per_unit']} records each)")
        print(f"  sigma per epoch            {', '.join(f'{s:.4f}' for s in privacy['sigmas_per_epoch'])} (x 2C, "
              f"C={privacy['clip']:g}, noise after block {privacy['noise_layer_after_block']}, "
              f"{privacy['neighbouring_relation']})")
        print(f"  epsilon[local]             {privacy['epsilon']:.4f}  (enforcing: composition of the unit's releases, "
              "no subsampling)")
        print(f"  epsilon[paper, subsampled] {privacy['paper_epsilon']:.4f}  (NOT a guarantee: ERRATA E8)")
        print(f"  verdict                    {privacy['verdict']}")
    elif privacy.get("epsilon") is not None:
        print(f"  privacy unit               {privacy['privacy_unit']} ({privacy['n_units']} in train)")
        print(f"  sigma_0                    {privacy['sigma_0']:.4f} (q={privacy['q']:.4g}, "
              f"{privacy['planned_steps']} planned steps, {privacy['neighbouring_relation']})")
        if privacy.get("filter"):
            print(f"  epsilon[renyi-filter]      {privacy['epsilon']:.4f}  (enforcing: the guarantee under "
                  "adaptive sigma)")
        for name, eps in privacy["epsilon_by_accountant"].items():
            if privacy.get("filter"):
                kind = "ledger composed as if fixed in advance; not a guarantee"
            else:
                kind = "enforcing, upper bound" if name == privacy["enforcing_accountant"] else (
                    "approximation" if name in ("gdp", "edgeworth") else "upper bound")
            print(f"  epsilon[{name}]{'':<{17 - len(name)}} {eps:.4f}  ({kind})")
        print(f"  verdict                    {privacy['verdict']}")
        paper = (privacy.get("strategy") or {}).get("paper_calibration")
        if paper and paper.get("sigma") is not None:
            print(f"  paper's sigma (Edgeworth)  {paper['sigma']:.4f} would spend epsilon[pld] "
                  f"{paper['epsilon_pld_at_that_sigma']:.4f}  (not used: Edgeworth enforces nothing, ERRATA E9)")
        if privacy.get("privacy_label"):
            print(f"  LABEL: {privacy['privacy_label']}")
    phase = summary.get("phase_one")
    if phase and "data" in phase:  # a non-private phase before the DP phase (DualTune-GhostDP)
        counts = (f"{phase['trained_records']} records, {phase['steps']} steps, " if phase["data"] == "public"
                  else "")  # a redacted phase's counts are the private record count's: not reported
        print(f"  phase 1 (non-private)      {phase['data']}: {counts}"
              f"public perplexity {phase['public_perplexity_before']:.4f} -> {phase['public_perplexity_after']:.4f}")
        if phase["data"] == "redacted":
            recall = phase.get("canary_recall_private")
            fields = phase.get("field_recall_public") or {}
            overall = fields.get("overall", {}).get("recall") if isinstance(fields.get("overall"), dict) else None
            print(f"  secret detector            {phase['detector']['level']}: canary recall "
                  f"{'n/a' if recall is None else format(recall['recall'], '.3f')} (private records, not a DP "
                  f"release), field recall {'n/a' if overall is None else format(overall, '.3f')} (public records)")
    controller = summary.get("controller")
    if controller and "decisions" in controller:  # RLDP's controller summary
        print(f"  controller                 {controller['decisions']} decisions, {controller['transitions']} "
              "transitions")
        service = summary.get("policy_service") or {}
        if service:
            print(f"  SAC                        {service['train_calls']} train() calls, "
                  f"{service['module_steps_trained']} transitions sampled in updates")
        if summary.get("saved_policy"):
            print(f"  policy saved to            {summary['saved_policy']}")
        transport = summary.get("controller_transport")  # a registered transport's record (raydp.control.transports)
        if transport:
            print(f"  controller transport       {transport.get('kind')}"
                  + (f" at {transport['address']}" if transport.get("address") else "")
                  + (f" ({transport['note']})" if transport.get("note") else ""))
    if summary.get("stopped_early"):
        print(f"  stopped early: {summary['stopped_early']}")
    if summary.get("data_note"):
        print(f"  note: {summary['data_note']}")
    return 0


def cmd_study(args) -> int:
    from raydp.study.config import load_study  # lazy: `raydp --help` loads no pandas

    if args.check:
        import tempfile  # lazy: only --check needs it (keeps `import raydp.cli` light)

        from raydp.study.prepare import prepare_study  # lazy: `raydp --help` loads no pandas

        study = load_study(args.path)
        if study.selection == "private-dp":
            from raydp.study.private_selection import plan_study  # lazy: `raydp --help` loads no torch

            with tempfile.TemporaryDirectory() as tmp:
                dataset, plans = plan_study(study, Path(tmp), progress=False)
                route = _selection_route(study, dataset)
            print(f"study {study.name}: private selection over {len(plans)} cell(s), all configs valid")
            if route:
                print(f"  {route}")
            for plan in plans.values():
                print(f"  {plan.key}: each trial at epsilon {plan.trial_epsilon:.4g}; the released best at "
                      f"{plan.end_to_end_epsilon:.4g}")
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            dataset, trials = prepare_study(study, Path(tmp), progress=False)
            route = _selection_route(study, dataset)
        from raydp.study.routes import study_routes  # lazy: as above

        searched = "".join(f" and {route.planned_line(study)}" for route in study_routes(study) if route.name != "grid")
        print(f"study {study.name}: {len(trials)} grid trials{searched}, all configs valid and every budget reachable")
        if route:
            print(f"  {route}")
        for t in trials[:20]:
            print(f"  {t.name}")
        if len(trials) > 20:
            print(f"  ... and {len(trials) - 20} more")
        return 0
    from raydp.notices import quiet_library_notices
    from raydp.runner.progress import plain_output  # lazy: `raydp --help` loads no tqdm
    from raydp.study.tables import format_study, record_outcome  # lazy: `raydp --help` loads no pandas
    from raydp.study.runner import run_study  # lazy: `raydp --help` loads no pandas

    from raydp.report import write_report  # lazy: `raydp --help` loads no pandas

    study = load_study(args.path)  # fail fast on a bad file
    quiet_library_notices()  # Ray's and Tune's notices that are not the user's to act on (raydp.notices)
    with plain_output(), _tune_verbosity(0 if args.quiet else args.verbose):
        study_dir = run_study(args.path, args.results_dir, progress=not args.quiet, resume=args.resume)
    if study.selection == "private-dp":  # one released trial per cell: no results table, no page of every trial
        from raydp.study.selection_release import format_selection  # lazy: `raydp --help` loads no pandas

        print(format_selection(study_dir))
        print(f"\nstudy written to {study_dir}; release only what {study_dir / 'PRIVACY.txt'} lists")
        return 0
    record_outcome(study_dir)  # what the table prints, and the trial each cell would release, in study_summary.json
    print(format_study(study_dir))
    print(f"\nstudy written to {study_dir}\n  HTML report: {write_report(study_dir)}\n  every table: raydp report "
          f"{study_dir}")
    unfinished = json.loads((study_dir / "study_summary.json").read_text()).get("unfinished_trials")
    if unfinished:  # one line, the only resume hint that names our command
        print(f"raydp: study stopped with {unfinished} trial(s) unfinished; finish it with: raydp study {args.path} "
              f"--resume --results-dir {args.results_dir}", file=sys.stderr)
        return 130
    return 0


def _selection_route(study, dataset: str) -> str | None:
    """What a study says before it runs about the records it selects on (:mod:`raydp.study.selection_route`)."""
    from raydp.data import load_manifest
    from raydp.study.selection_route import selection_route

    return selection_route(study, study.base.get("public_validation"), load_manifest(dataset))


@contextlib.contextmanager
def _tune_verbosity(level: int):
    """Within the block, Ray Tune's console at ``level`` (``raydp study --verbose``; 0: raydp's line per trial);
    the environment is restored afterwards."""
    from raydp.study.searches import TUNE_VERBOSE_ENV  # lazy: `raydp --help` loads no pandas

    before = os.environ.get(TUNE_VERBOSE_ENV)
    if level:
        os.environ[TUNE_VERBOSE_ENV] = str(min(level, 2))
    try:
        yield
    finally:
        if level and before is None:
            os.environ.pop(TUNE_VERBOSE_ENV, None)
        elif level:
            os.environ[TUNE_VERBOSE_ENV] = before


def cmd_report(args) -> int:
    from raydp.report import write_report  # lazy: `raydp --help` loads no pandas
    from raydp.study.tables import format_report  # lazy: `raydp --help` loads no pandas

    if args.more_studies:
        if args.html:
            raise ConfigError("--html is for one study: the HTML report of several is not written")
        print(format_report(args.study_dir, *args.more_studies))
        return 0
    if (Path(args.study_dir) / "released").is_dir() and not (Path(args.study_dir) / "results.parquet").exists():
        from raydp.study.selection_release import format_selection  # lazy: `raydp --help` loads no pandas

        print(format_selection(args.study_dir))  # a private-dp study: its released trials only
        return 0
    if (Path(args.study_dir) / "results.parquet").exists():
        print(format_report(args.study_dir))
    page = write_report(args.study_dir, args.html)
    print(f"HTML report written to {page}")
    return 0


def eval_config_from_args(args):
    from raydp.cli_flags import apply_flags, eval_flags, naming_flags  # lazy: `raydp --help` loads no pydantic
    from raydp.evaluation.settings import EvalConfig  # lazy: as above
    from raydp.settings import load_yaml_mapping, validate_config  # lazy: as above

    values = apply_flags(eval_flags(), args, load_yaml_mapping(args.config, "eval config") if args.config else {})
    try:
        return validate_config(EvalConfig, values)
    except ConfigError as exc:
        raise naming_flags(exc, eval_flags(), args) from None


def cmd_eval(args) -> int:
    from raydp.evaluation.evaluate import evaluate_run, evaluation_path  # lazy: `raydp --help` loads no pandas
    from raydp.evaluation.results import summary_line  # lazy: `raydp --help` loads no pandas

    settings = eval_config_from_args(args)
    root = Path(args.run_dir)
    runs = sorted(p for p in (root / "trials").iterdir() if RunDirectory(p).is_finished()) \
        if (root / "results.parquet").is_file() and (root / "trials").is_dir() else [root]
    violations = 0
    if len(runs) > 1:
        print(f"{len(runs)} trials: each audit bound is taken at confidence 1 - {1 - settings.confidence:g}/{len(runs)} "
              "(Bonferroni), so that any false VIOLATION among them stays below "
              f"{1 - settings.confidence:g}")
    for run in runs:
        result = evaluate_run(run, settings, progress=not args.quiet, audits_in_family=len(runs))
        print(f"{run.name}: {summary_line(result)}")
        violations += (result.get("audit") or {}).get("consistent") is False
    where = sorted({str(evaluation_path(run).parent) for run in runs})
    print(f"{EVALUATION} written for {len(runs)} run(s): "
          + (where[0] if len(where) == 1 else "in each run's folder (a released cell's: its study's work/evaluations/)"))
    if violations:
        print(f"raydp: {violations} run(s) leak more than their claimed epsilon: a privacy bug", file=sys.stderr)
        return 3
    return 0


def cmd_policy_list(args) -> int:
    from raydp.control.store import list_policies  # lazy: `raydp --help` loads no pandas

    policies = list_policies(args.policy_dir)
    if not policies:
        print(f"no saved policies in {args.policy_dir}")
        return 0
    print(f"{'name':<28} {'arch':<7} {'trained on':<34} {'transitions':>11}  {'final ppl':<10} provenance (E14)")
    for p in policies:
        t, r = p.get("trained_on") or {}, p.get("results") or {}
        on = _trained_on_brief(t)
        ppl = r.get("final_public_perplexity", r.get("final_eval_perplexity"))  # public split first (E15)
        lifetime = p["totals"].get("transitions")  # over the policy's whole training (its lifetime), not one session's
        print(f"{p['name']:<28} {p['architecture']:<7} {on:<34} {'?' if lifetime is None else lifetime:>11}  "
              f"{'' if ppl is None else f'{ppl:.4f}':<10} {_provenance_brief(p['provenance'], p['privacy_mode'])}")
    return 0


def _trained_on_brief(t: dict) -> str:
    """'model (N pairs, eps E)'; what a manifest does not record is left out (a policy saved by an RLlink
    policy server knows its runs' count, not their pair counts or epsilons)."""
    parts = [f"{t['n_adapter_pairs']} pairs" if t.get("n_adapter_pairs") is not None else None,
             f"eps {t['epsilon']:g}" if isinstance(t.get("epsilon"), (int, float)) else None,
             f"rllink, {t.get('runs', 0)} run(s)" if t.get("transport") == "rllink" else None]
    parts = [p for p in parts if p]
    return f"{t.get('model', 'unknown')}" + (f" ({', '.join(parts)})" if parts else "")


def _provenance_brief(provenance: list[dict], mode: str) -> str:
    """'paper|strict, N run(s) on dataset(s) <id>, ...' (ERRATA E14)."""
    hashes = list(dict.fromkeys(e.get("dataset_id") or "unknown" for e in provenance))
    return f"{mode}, {len(provenance)} run(s) on dataset(s) {', '.join(hashes) or 'none recorded'}"


def _manifest_for_display(manifest: dict) -> dict:
    """The manifest with its provenance made explicit (legacy manifests included) and each RDP curve
    abbreviated (the full curves are in manifest.json)."""
    from raydp.control.store import policy_privacy_mode, provenance_of  # lazy: `raydp --help` loads no pandas

    entries = []
    for e in provenance_of(manifest):
        e = dict(e)
        for key in ("rdp_orders", "rdp_curve"):
            if isinstance(e.get(key), list):
                e[key] = f"{len(e[key])} values (see manifest.json)"
        entries.append(e)
    return {**manifest, "privacy_mode": policy_privacy_mode(manifest), "provenance": entries}


def cmd_policy_show(args) -> int:
    from raydp.control.store import load_manifest, resolve_policy  # lazy: `raydp --help` loads no pandas

    path = resolve_policy(args.name, args.policy_dir)
    print(json.dumps({"path": str(path), **_manifest_for_display(load_manifest(path))}, indent=2))
    return 0


def cmd_policy_export(args) -> int:
    from raydp.control.modes import unprotected
    from raydp.control.store import (  # lazy: `raydp --help` loads no pandas
        export_policy, load_manifest, policy_privacy_mode, resolve_policy)

    path = resolve_policy(args.name, args.policy_dir)
    manifest = load_manifest(path)
    archive = export_policy(path, Path(args.to), overwrite=args.overwrite,
                            include_private_replay=args.include_private_replay)
    print(f"policy {path.name} exported to {archive.absolute()}")
    if unprotected(policy_privacy_mode(manifest)):
        print("  WARNING: paper-mode policy: the archive's replay buffer holds unprivatized statistics of "
              "private data (ERRATA E14)")
    return 0


def cmd_policy_server(args) -> int:
    from raydp.runner import policy_server  # lazy: `import raydp.cli` loads no torch

    return policy_server.run(args)


def cmd_migrate(args) -> int:
    from raydp.migrate import migrate  # lazy: `raydp --help` loads no pandas

    result = migrate(args.paths, check=args.check)
    if args.check:
        for path in result.remaining:
            print(f"plain dataset hash: {path}")
        print(f"{len(result.remaining)} file(s) still name a dataset by a plain hash"
              + ("; run `raydp migrate` on them (the data owner's key is needed)" if result.remaining else ""))
        return 1 if result.remaining else 0
    for sha, new in result.mapping.items():
        print(f"dataset id {new}")
    print(f"rewrote {len(result.rewritten)} file(s); {len(result.datasets)} dataset manifest(s) gained their id; "
          f"{len(result.policies)} polic(ies) converted to the pickle-free format")
    left = migrate(args.paths, check=True).remaining  # what still looks like a plain hash after the rewrite
    if left:
        for path in left:
            print(f"still a plain dataset hash: {path}")
        print(f"raydp: {len(left)} file(s) still hold what looks like a plain dataset hash (from a study or run whose "
              "results or dataset are not under these paths: give them too, or delete the files)", file=sys.stderr)
        return 1
    return 0


COMMANDS = {("data", "build"): cmd_data_build, ("data", "show"): cmd_data_show, ("data", "budget"): cmd_data_budget,
            ("train", None): cmd_train,
            ("study", None): cmd_study, ("report", None): cmd_report, ("eval", None): cmd_eval,
            ("policy", "list"): cmd_policy_list, ("policy", "show"): cmd_policy_show,
            ("policy", "export"): cmd_policy_export, ("policy-server", None): cmd_policy_server,
            ("migrate", None): cmd_migrate}



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    sub = getattr(args, "data_command", None) or getattr(args, "policy_command", None)
    handler = COMMANDS[(args.command, sub)]
    try:
        with private_umask():  # what any command writes may hold private data: owner-only (raydp.files)
            return handler(args)
    except RaydpError as exc:
        print(f"raydp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raydp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
