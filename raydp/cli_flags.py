"""Command-line flags generated from the pydantic config models: a config field is declared once.

Each leaf field of :class:`~raydp.config.TrainConfig` (its nested ``data``, ``task`` and ``lora`` models included)
and of every strategy settings model the registry can load without its strategy (``StrategySpec.settings``, e.g.
RLDP's) becomes one argparse flag, and the same :class:`Flag` records turn parsed flags back into config values
(:func:`apply_flags`), so that nothing else lists the fields. A flag's

* name is the field's (``n_records``: ``--n-records``), or the ``flag`` recorded next to the field
  (``Field(..., json_schema_extra={"flag": "--data-seed"})``): used where the field's own name would collide, or
  to keep a flag's older name; ``"flag": False`` gives a field no generated flag (its flag, if any, is
  hand-written in :mod:`raydp.cli`, e.g. ``settings``' ``--set``);
* type follows the annotation: ``int``, ``float``, ``str``; a ``Literal`` gives its choices; ``bool`` gives
  ``--x/--no-x``; ``dict[str, T]`` a repeatable ``--x KEY=VALUE``; ``tuple[T, ...]`` one or more values; an
  ``X | None`` is ``X``. A field of another type must say ``"flag": False`` (generation refuses it otherwise);
* help is the field's description, with its default; ``metavar`` and ``choices`` may be recorded beside ``flag``;
* default is None: a flag left unset never overrides a value of the YAML config.

Reading the models imports :mod:`raydp.config` (pydantic): the CLI adds these flags to a subcommand's parser only
when that subcommand is parsed (:class:`raydp.cli.RaydpParser`), so ``raydp --help`` stays light.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass, field

from raydp.errors import ConfigError

#: argparse options a field may record in ``json_schema_extra`` besides ``flag``
EXTRA_OPTIONS = ("metavar", "choices")


@dataclass(frozen=True)
class Flag:
    """One generated flag: its option, where its value goes in the config, and how argparse reads it."""

    option: str  # "--data-seed"
    path: tuple[str, ...]  # ("data", "seed"): the value's place in the config mapping
    kind: str  # "value", "bool", "pairs" (dict[str, T]: repeatable KEY=VALUE) or "list" (tuple[T, ...])
    kwargs: dict = field(compare=False)  # argparse's add_argument keywords (help, type, choices, ...)
    group: str | None = None  # the argument group's title (None: the subcommand's own options)
    group_description: str | None = None
    item_type: type | None = None  # a "pairs" flag's value type

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def _strip_optional(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_model(annotation) -> bool:
    from pydantic import BaseModel  # lazy: `import raydp.cli_flags` loads no pydantic

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _extra(info) -> dict:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def _default_text(info) -> str:
    from pydantic_core import PydanticUndefined  # lazy: `import raydp.cli_flags` loads no pydantic

    default = info.default
    if default is PydanticUndefined or default is None or info.default_factory is not None:
        return ""
    if isinstance(default, bool):
        default = "on" if default else "off"
    return f" (default: {default})"


def _plain(text: str | None) -> str:
    """``text`` on one line, reStructuredText roles and literals as plain text (``:mod:`raydp.x```: raydp.x)."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", " ".join((text or "").split()))
    return re.sub(r"``([^`]*)``", r"\1", text)


def _first_line(model) -> str | None:
    doc = (model.__doc__ or "").strip()
    return _plain(doc.split("\n\n")[0]) or None


def _help(name: str, info, kind: str) -> str:
    description = _plain(info.description)
    if not description:
        raise ConfigError(f"config field {name!r} has no description: its flag's help is the description")
    if "default" not in description.lower():
        description += _default_text(info)
    if kind == "pairs":
        description += " (repeatable)"
    return description.replace("%", "%%")  # argparse formats help with %


def _argparse_for(name: str, annotation) -> tuple[str, dict, type | None]:
    """(kind, add_argument keywords, a pairs flag's value type) of a leaf field's annotation."""
    annotation = _strip_optional(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return "bool", {"action": argparse.BooleanOptionalAction}, None
    if origin is typing.Literal:
        return "value", {"type": type(args[0]), "choices": list(args)}, None
    if annotation in (int, float, str):
        return "value", {"type": annotation}, None
    if origin is dict and len(args) == 2 and args[0] is str and args[1] in (int, float, str):
        return "pairs", {"action": "append", "metavar": "KEY=VALUE"}, args[1]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str):
        return "list", {"type": args[0], "nargs": "+"}, None
    raise ConfigError(f"config field {name!r} ({annotation}) has no flag type: record json_schema_extra="
                      "{'flag': False} beside it and write its flag by hand, or teach raydp.cli_flags the type")


def model_flags(model, path: tuple[str, ...] = (), group: str | None = None,
                group_description: str | None = None) -> list[Flag]:
    """The flags of ``model``'s leaf fields (nested models' fields too, each nested model its own group), their
    values going under ``path`` of the config."""
    flags = []
    for name, info in model.model_fields.items():
        extra = _extra(info)
        where = ".".join((*path, name))
        if extra.get("flag") is False:
            continue
        annotation = _strip_optional(info.annotation)
        if _is_model(annotation):
            flags += model_flags(annotation, (*path, name), group=name, group_description=_first_line(annotation))
            continue
        kind, kwargs, item_type = _argparse_for(where, info.annotation)
        kwargs.update({key: extra[key] for key in EXTRA_OPTIONS if key in extra})
        kwargs["help"] = _help(where, info, kind)
        if "choices" in extra and "metavar" in extra:  # choices hidden by a metavar: the help lists them
            kwargs["help"] += "; one of: " + ", ".join(map(str, extra["choices"]))
        option = extra.get("flag") or "--" + name.replace("_", "-")
        flags.append(Flag(option, (*path, name), kind, kwargs, group, group_description, item_type))
    return flags


def check_unique(flags: list[Flag]) -> tuple[Flag, ...]:
    """``flags``, refused (naming both fields) where two would share an option or a destination."""
    seen: dict[str, Flag] = {}
    for flag in flags:
        for key in (flag.option, flag.dest):
            other = seen.get(key)
            if other is not None and other.path != flag.path:
                raise ConfigError(f"config fields {'.'.join(other.path)} and {'.'.join(flag.path)} would both be "
                                  f"{flag.option}: record a flag for one (json_schema_extra={{'flag': '--...'}})")
            seen[key] = flag
    return tuple(flags)


def settings_group(strategy: str) -> str:
    """The argument group of ``strategy``'s settings flags."""
    return f"{strategy} settings (--strategy {strategy})"


@functools.cache
def train_flags() -> tuple[Flag, ...]:
    """The flags of ``raydp train``: TrainConfig's fields, then each light strategy settings model's (under
    ``settings``)."""
    from raydp.config import TrainConfig  # lazy: `raydp --help` loads no pydantic
    from raydp.strategies.registry import SPECS, settings_model

    flags = model_flags(TrainConfig)
    for spec in SPECS.values():
        if spec.settings:  # importable without the strategy (no numpy, no torch)
            model = settings_model(spec.name)
            flags += model_flags(model, ("settings",), group=settings_group(spec.name),
                                 group_description=_first_line(model))
    return check_unique(flags)


@functools.cache
def data_flags() -> tuple[Flag, ...]:
    """The flags of ``raydp data build``: DataConfig's fields (the same names as ``raydp train``'s)."""
    from raydp.config import DataConfig  # lazy: `raydp --help` loads no pydantic

    return check_unique(model_flags(DataConfig))


@functools.cache
def eval_flags() -> tuple[Flag, ...]:
    """The flags of ``raydp eval``: EvalConfig's fields."""
    from raydp.evaluation.settings import EvalConfig  # lazy: `raydp --help` loads no pydantic

    return check_unique(model_flags(EvalConfig))


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...], groups: bool = True) -> None:
    """Add ``flags`` to ``parser`` (each nested model's in an argument group), every default None."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags:
        target = parser
        if groups and flag.group is not None:
            if flag.group not in made:
                made[flag.group] = parser.add_argument_group(flag.group, flag.group_description)
            target = made[flag.group]
        target.add_argument(flag.option, dest=flag.dest, default=None, **flag.kwargs)


def _pairs(flag: Flag, items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        try:
            value = flag.item_type(raw)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise ConfigError(f"{flag.option} takes {flag.kwargs.get('metavar', 'KEY=VALUE')}, got {item!r}")
        out[key.strip()] = value
    return out


def flag_value(flag: Flag, args: argparse.Namespace):
    """The config value ``flag`` was given on the command line (None: not given)."""
    raw = getattr(args, flag.dest, None)
    if raw is None:
        return None
    return _pairs(flag, raw) if flag.kind == "pairs" else raw


def apply_flags(flags, args: argparse.Namespace, values: dict) -> dict:
    """``values`` (a config mapping, e.g. read from YAML) with every flag given on the command line set at its
    field's place (a ``dict`` field's pairs merged into the mapping's); flags left unset change nothing."""
    values = dict(values)
    for flag in flags:
        value = flag_value(flag, args)
        if value is None:
            continue
        *parents, leaf = flag.path
        node = values
        for depth, key in enumerate(parents):
            child = node.get(key)
            if child is not None and not isinstance(child, dict):
                where = ".".join(parents[:depth + 1])
                raise ConfigError(f"invalid config: {where}: give a mapping ({flag.option} sets {leaf} in it)")
            node[key] = dict(child or {})
            node = node[key]
        if flag.kind == "pairs" and isinstance(node.get(leaf), dict):
            value = {**node[leaf], **value}
        node[leaf] = value
    return values


def naming_flags(error: ConfigError, flags, args: argparse.Namespace, where: str = "") -> ConfigError:
    """``error`` (a config's one-line validation error, :func:`raydp.settings.validate_config`) naming the flag too,
    where a flag given on the command line set the field it names: ``invalid config: data.n_records (--n-records):
    ...``."""
    text = str(error)
    for flag in flags:
        head = f"invalid config: {where}{'.'.join(flag.path)}:"
        if text.startswith(head) and flag_value(flag, args) is not None:
            return ConfigError(f"{head[:-1]} ({flag.option}):{text[len(head):]}")
    return error


# --- `raydp train --help`: one screen -------------------------------------------------------------------------------
# The full help of every flag is 300 lines; `--help` gives one line per common flag, a strategy's own settings are
# listed by `--help-strategy NAME`, and `--help-all` prints argparse's full help. Only the help changes: every flag is
# on the parser, and parses, whichever help was read.

#: a summary keeps the help's default where it is this short
SHORT_DEFAULT = 24


def _help_width() -> int:
    return max(60, shutil.get_terminal_size().columns - 2)  # argparse's own width


def _summary(text: str) -> str:
    """A flag's help in brief: its first clause (up to its first ``;`` or sentence end), without its parentheses, and
    with its default where that is short."""
    text = " ".join((text or "").replace("%%", "%").split())
    default = re.search(r" ?\(default: [^()]*\)", text)
    rest = text[:default.start()] + text[default.end():] if default else text
    while re.search(r" ?\([^()]*\)", rest):  # parentheses, innermost first
        rest = re.sub(r" ?\([^()]*\)", "", rest)
    head = re.split(r"; |(?<=[A-Za-z0-9`'])(?<!\be\.g)(?<!\bi\.e)\. ", rest, maxsplit=1)[0].strip()
    head = head[:-1] if head.endswith(".") and not head.endswith("..") else head
    if default and len(default.group().strip()) <= SHORT_DEFAULT:
        head += " " + default.group().strip()
    return head


def _fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters at a word, ``...`` marking the cut."""
    if len(line) <= width:
        return line
    cut = line[:width - 3]
    return (cut[:cut.rfind(" ")] if " " in cut.strip() else cut).rstrip(" ,;:") + "..."


def _brief_metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar:
        name = action.metavar
    elif action.choices and len("{" + ",".join(map(str, action.choices)) + "}") <= SHORT_DEFAULT:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    elif action.choices:
        name = "CHOICE"
    else:
        name = {int: "N", float: "X"}.get(action.type) or (action.dest.upper() if len(action.dest) <= 10 else "VALUE")
    return f" {name}" + (" ..." if action.nargs in ("+", "*") else "")


def _brief_line(action: argparse.Action, width: int) -> str:
    options = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):  # --x, --no-x
        options = [f"--[no-]{options[0][2:]}", *options[2:]]
    left = ", ".join(options) + _brief_metavar(action)
    return _fit(f"  {left:<24}  {_summary(action.help)}", width)


def train_brief_help(parser: argparse.ArgumentParser) -> str:
    """``raydp train --help``: one line per flag but the strategy settings' (the first clause of each flag's help),
    then the strategies' names, and where a strategy's settings and every flag's full help are."""
    from raydp.strategies.registry import STRATEGY_CHOICES  # lazy: as train_flags

    width = _help_width()
    hidden = {flag.dest for flag in train_flags() if flag.path[0] == "settings"}
    lines = [parser.format_usage().rstrip(), ""]
    if parser.description:
        lines += [*textwrap.wrap(parser.description, width), ""]
    for group in parser._action_groups:  # argparse's own order: the options, then each config model's group
        actions = [a for a in group._group_actions if a.dest not in hidden and a.help != argparse.SUPPRESS]
        if actions:
            lines.append(_fit(f"{group.title}:" + (f" {_summary(group.description)}" if group.description else ""),
                              width))
            lines += [_brief_line(action, width) for action in actions]
            lines.append("")
    lines += [*textwrap.wrap(f"strategies (--strategy NAME): {', '.join(STRATEGY_CHOICES)}", width), ""]
    flagged = "; ".join(f"{name}'s {len(fs)} flags, e.g. {', '.join(f.option for f in fs[:3])}"
                        for name, fs in _strategies_with_flags())
    lines += textwrap.wrap(f"Not listed: each strategy's own settings ({flagged}; any strategy's as --set "
                           "KEY=VALUE): raydp train --help-strategy NAME. Each line above is the start of the flag's "
                           "help: raydp train --help-all gives it whole.", width)
    return "\n".join(lines) + "\n"


def _strategies_with_flags() -> list[tuple[str, list[Flag]]]:
    """(strategy, its settings' flags) of each strategy whose settings have flags (those the registry loads light)."""
    from raydp.strategies.registry import SPECS  # lazy: as train_flags

    by_name = [(name, [flag for flag in train_flags() if flag.group == settings_group(name)]) for name in SPECS]
    return [(name, flags) for name, flags in by_name if flags]


def strategy_help(name: str) -> str:
    """``raydp train --help-strategy NAME``: the strategy's own settings, each with its full help: its flags where the
    registry loads its settings model light (RLDP's), else its settings as ``--set KEY=VALUE`` (importing the strategy).
    ConfigError for an unknown name."""
    from raydp.strategies.registry import STRATEGY_CHOICES, get_spec, settings_model  # lazy: as train_flags

    if name not in STRATEGY_CHOICES:
        raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_CHOICES)}")
    spec = get_spec(name)
    flagged = dict(_strategies_with_flags())
    model = settings_model(name)
    if model is None:
        return f"strategy {name!r} takes no settings ({spec.summary})\n"
    parser = argparse.ArgumentParser(prog="raydp train", add_help=False, usage=(
        f"raydp train --strategy {name} [SETTING ...]" if name in flagged else
        f"raydp train --strategy {name} [--set KEY=VALUE ...]"))
    if name in flagged:
        add_flags(parser, tuple(flagged[name]))
        note = "Each setting is also --set KEY=VALUE, or a key under settings: in --config's YAML."
    else:
        group = parser.add_argument_group(settings_group(name), _first_line(model))
        for key, info in model.model_fields.items():
            description = _plain(info.description)
            if "default" not in description.lower():
                description += _default_text(info)
            group.add_argument(f"--set {key}=VALUE", dest=key, action="store_true",
                               help=description.replace("%", "%%"))
        note = "Give a setting as --set KEY=VALUE, or as a key under settings: in --config's YAML."
    summary = textwrap.wrap(f"{name}: {spec.summary}. {note}", _help_width())
    return "\n".join([parser.format_help().rstrip(), "", *summary]) + "\n"
