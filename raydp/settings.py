"""Validated settings: the base of every user-facing configuration model, and its one-line errors.

Every user-facing configuration is a pydantic model with ``extra="forbid"``: an unknown key, a bad
value or an impossible combination is a :class:`~raydp.errors.ConfigError` naming the field, raised
before any data is built or any model is loaded.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from raydp.errors import ConfigError, did_you_mean


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def load_yaml_mapping(path, what: str = "config") -> dict:
    """A YAML file that must hold a mapping; unreadable, invalid or non-mapping files are ConfigErrors."""
    import yaml

    try:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{what} {path} must be a mapping of fields")
    return values


def validate_config(cls: type[BaseModel], values: dict, where: str = "") -> BaseModel:
    """Build ``cls`` from ``values``; a validation failure becomes a one-line ConfigError naming the field
    (prefixed with ``where``, e.g. ``settings.``)."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        if err["type"] == "missing":  # a misspelt required key is both: the unknown one says which it is
            err = next((e for e in errors if e["type"] == "extra_forbidden"), err)
        field = ".".join(str(part) for part in err["loc"])
        where = f"{where}{field}" if field else (where.rstrip(".") or "config")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field" + did_you_mean(err["loc"][-1], fields_at(cls, err["loc"][:-1]))
        raise ConfigError(f"invalid config: {where}: {message}") from None


def fields_at(model, loc) -> list[str]:
    """The field names of the model found at ``loc`` (a pydantic error's location) inside ``model``: nested and
    optional models, and the values of dicts, lists and tuples, walked; empty where no model is there."""
    import types
    import typing

    def models(annotation, rest):
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            return [found for arg in typing.get_args(annotation) for found in models(arg, rest)]
        if not rest:
            return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin in (dict, list, tuple, set, frozenset) and args:  # the next part is a key or an index
            return models(args[-1] if origin is dict else args[0], rest[1:])
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and rest[0] in annotation.model_fields:
            return models(annotation.model_fields[rest[0]].annotation, rest[1:])
        return []

    found = models(model, tuple(loc))
    return list(found[0].model_fields) if found else []
