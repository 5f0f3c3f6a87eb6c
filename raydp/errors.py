"""User-facing errors.

A :class:`RaydpError` is a problem with what the user asked for (a bad config, a missing column, an
impossible budget). The CLI prints its message as one line and exits non-zero; it never prints a
traceback for it. Anything else is a bug and keeps its traceback.
"""


class RaydpError(Exception):
    """An error in the user's input, reported as one line."""


class DataError(RaydpError):
    """A dataset (CSV, mapping file, split directory) is missing, malformed or has a bad value."""


class ModelError(RaydpError):
    """A model name or path cannot be resolved or loaded."""


class ConfigError(RaydpError):
    """A configuration value is invalid."""


def did_you_mean(word, choices) -> str:
    """`` (did you mean X?)``, X the one of ``choices`` nearest ``word`` (difflib), for an unknown key's one-line
    error; empty when none is near."""
    import difflib  # lazy: the errors module is imported by everything

    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1)
    return f" (did you mean {close[0]}?)" if close else ""
