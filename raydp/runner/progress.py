"""Training progress that reads well both on a terminal and in a log file.

On a terminal a tqdm bar is the clearest view. Off a terminal (``ray job submit``, CI, nohup, a Ray
actor's log) a bar's carriage-return updates pile up into thousands of fragments in the log, so
progress prints plain lines instead: one per evaluation, and at most one heartbeat line every
:data:`HEARTBEAT_S` seconds between evaluations so a slow run still shows it is alive.

Modes: ``"bar"``, ``"lines"``, ``"off"``, or ``"auto"`` (a bar when the stream is a terminal, lines
otherwise). ``True`` means ``"auto"`` and ``False`` ``"off"``; the environment variable
``RAYDP_PROGRESS`` (bar, lines or off) overrides ``"auto"``, for callers that only pass a boolean
(``raydp train``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from tqdm.auto import tqdm

MODES = ("bar", "lines", "off")
#: at most one heartbeat line this often (seconds) when no evaluation line was printed meanwhile
HEARTBEAT_S = 30.0


def progress_mode(progress: bool | str, stream) -> str:
    """The mode ``progress`` resolves to on ``stream`` (see the module docstring)."""
    if progress is False:
        return "off"
    if progress is True or progress == "auto":
        forced = os.environ.get("RAYDP_PROGRESS", "").strip().lower()
        if forced in MODES:
            return forced
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"
    if progress not in MODES:
        raise ValueError(f"progress must be a bool, 'auto' or one of {MODES}, got {progress!r}")
    return progress


def _shown_perplexity(row: dict) -> tuple[str, float]:
    """The perplexity progress shows: the public validation one when there is one (E15)."""
    if row.get("public_perplexity") is not None:
        return "public_ppl", row["public_perplexity"]
    return "eval_ppl", row["perplexity"]


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Progress of one run of ``total`` steps starting at ``initial`` (see the module docstring)."""

    def __init__(self, total: int, initial: int = 0, desc: str = "fine-tuning", mode: bool | str = True,
                 stream=None, heartbeat_s: float = HEARTBEAT_S, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.mode = progress_mode(mode, self.stream)
        self.total, self.step_count, self.desc = total, initial, desc
        self.heartbeat_s, self.clock = heartbeat_s, clock
        self.started = self.last_line = clock()
        self.shown: tuple[str, float] | None = None
        self.bar = (tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.stream)
                    if self.mode == "bar" else None)

    def evaluation(self, row: dict, metrics: dict | None = None) -> None:
        """An evaluation row (``metrics``: the train step it follows, for sigma); lines mode prints it."""
        self.shown = _shown_perplexity(row)
        if self.mode != "lines":
            return
        fields = {"epoch": f"{row['epoch']:.2f}"} if row.get("epoch") is not None else {}
        if row.get("public_perplexity") is not None:
            fields["public_ppl"] = f"{row['public_perplexity']:.3f}"
        fields["eval_ppl"] = f"{row['perplexity']:.3f}"
        if metrics and "sigma" in metrics:
            fields["sigma"] = f"{metrics['sigma']:.3f}"
        self._line(f"step {row['step']}/{self.total}", fields)

    def step(self, metrics: dict) -> None:
        """One train step done (``metrics`` as the loop logs them)."""
        self.step_count = metrics.get("step", self.step_count + 1)
        if self.bar is not None:
            self.bar.update(self.step_count - self.bar.n)
            self.bar.set_postfix(self._fields(metrics))
        elif self.mode == "lines" and self.clock() - self.last_line >= self.heartbeat_s:
            epoch = {"epoch": f"{metrics['epoch']:.2f}"} if "epoch" in metrics else {}
            self._line(f"step {self.step_count}/{self.total}", {**epoch, **self._fields(metrics)})

    def note(self, message: str) -> None:
        """A one-off message (e.g. why the run stopped early), printed in every mode but ``off``."""
        if self.bar is not None:
            self.bar.write(f"{self.desc}: {message}", file=self.stream)
        elif self.mode == "lines":
            self._line(message, {})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _fields(self, metrics: dict) -> dict:
        fields = {self.shown[0]: f"{self.shown[1]:.3f}"} if self.shown is not None else {}
        for key in ("loss", "sigma"):
            if key in metrics:
                fields[key] = f"{metrics[key]:.3f}"
        return fields

    def _line(self, head: str, fields: dict) -> None:
        now = self.clock()
        parts = [f"{self.desc}: {head}", *(f"{k} {v}" for k, v in fields.items()),
                 f"elapsed {_clock(now - self.started)}"]
        print(" ".join(parts), file=self.stream, flush=True)
        self.last_line = now


# -- a study's console: no third-party notices the user cannot act on, plain output off a terminal ------------------
#: the environment a process whose output is not a terminal gives the Ray workers it starts (and itself): no colour
#: codes around Ray's forwarded worker lines, and no tqdm bars (their carriage-return updates pile up in a log; a
#: process that imports tqdm, transformers or huggingface_hub after these are set has its bars off). raydp's own
#: progress prints lines off a terminal (:func:`progress_mode`).
PLAIN_OUTPUT_ENV = {"RAY_COLOR_PREFIX": "0", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def is_terminal(*streams) -> bool:
    """Whether every stream (default: stdout and stderr) is a terminal."""
    streams = streams or (sys.stdout, sys.stderr)
    return all(getattr(s, "isatty", None) is not None and s.isatty() for s in streams)


@contextlib.contextmanager
def plain_output(enabled: bool | None = None):
    """Within the block, :data:`PLAIN_OUTPUT_ENV` where ``enabled`` (default: stdout or stderr is not a terminal),
    a variable the user set keeping its value, and in this process (which imported tqdm before) transformers' and
    huggingface_hub's bars off (e.g. "Writing model shards" when an embedded model is built); restored afterwards."""
    enabled = not is_terminal() if enabled is None else enabled
    added = {k: v for k, v in PLAIN_OUTPUT_ENV.items() if k not in os.environ} if enabled else {}
    os.environ.update(added)
    hf = None
    if enabled and "HF_HUB_DISABLE_PROGRESS_BARS" in added:
        from transformers.utils import logging as hf  # lazy: only a study off a terminal needs it

        if hf.is_progress_bar_enabled():
            hf.disable_progress_bar()
        else:
            hf = None
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
        if hf is not None:
            hf.enable_progress_bar()
