"""A study's progress on the console: one line per finished trial, instead of Ray Tune's status tables.

``[2/4] static-pairwise embedded eps2 seed0: value NLL 65.31 (public), 41 s`` on stderr when a trial ends: its
place among the experiment's trials, what it is, its final selection metric on the split it selects on, and how long
it ran. :class:`TrialLines` is the Tune callback that prints it (:func:`raydp.study.runner._run_config` adds it unless
``raydp study --verbose`` asks for Tune's own reporter). It is Tune's progress reporter of the experiment: Ray 2.60's
output engine takes the first ``ray.tune.experimental.output.ProgressReporter`` among the callbacks as the one that
announces the experiment (a table and two lines, even at verbosity 0) and prints its status, and this one prints
neither. It is pickled with the Tuner's state (``tuner.pkl``), so it holds no stream: it prints to ``sys.stderr`` as
it is when a trial ends.
"""

from __future__ import annotations

import json
import math
import sys

from ray.tune.experimental.output import AirVerbosity
from ray.tune.experimental.output import ProgressReporter as TuneProgressReporter

from raydp.study.trial import Trial, tune_trial

METRIC_NAMES = {"value_nll": "value NLL", "perplexity": "perplexity"}
#: a settings variant longer than this is cut in the line (the tables and the report name it in full)
VARIANT_CHARS = 32


def trial_label(spec: Trial | None, fallback: str) -> str:
    """``strategy [variant] model epsN seedN`` of a trial (``fallback``: Tune's name for it, when it has no spec)."""
    if spec is None:
        return fallback
    variant = spec.variant
    if variant and len(variant) > VARIANT_CHARS:
        variant = variant[:VARIANT_CHARS - 3] + "..."
    parts = [spec.strategy + (f" [{variant}]" if variant else ""), str(spec.model)]
    if spec.epsilon is not None:
        parts.append(f"eps{spec.epsilon:g}")
    if spec.seed is not None:
        parts.append(f"seed{spec.seed}")
    return " ".join(parts)


def trial_line(done: int, total: int, label: str, result: dict | None, failed: bool = False) -> str:
    """The line of one finished (or ``failed``) trial from its last Tune result."""
    result = result or {}
    head = f"[{done}/{total}] {label}"
    if failed:
        return f"{head}: failed (its error is in error.txt in its trial directory under tune/)"
    score = result.get("selection_score")
    fields = []
    if isinstance(score, (int, float)) and math.isfinite(score):
        name = METRIC_NAMES.get(result.get("selection_metric"), str(result.get("selection_metric") or "score"))
        fields.append(f"{name} {score:.2f} ({result.get('selection_split') or '?'})")
    seconds = result.get("time_total_s")
    if isinstance(seconds, (int, float)) and math.isfinite(seconds):
        fields.append(f"{seconds:.0f} s")
    return head + (": " + ", ".join(fields) if fields else ": done")


def _spec(trial) -> Trial | None:
    spec = tune_trial(getattr(trial, "config", None) or {})
    if spec is None:
        raw = (getattr(trial, "last_result", None) or {}).get("trial_spec")
        if raw:
            try:
                spec = Trial.from_dict(json.loads(raw))
            except (ValueError, TypeError, KeyError):
                spec = None
    return spec


def keep_reporters_start_time() -> None:
    """Work around a Ray 2.60 Tune bug that :class:`TrialLines` exposes: Tune calls every callback's ``setup()``
    without a start time, then ``setup(start_time=...)`` on the first ``ProgressReporter`` among its callbacks only
    (``ray.tune.tune.run``). Tune's own reporter, appended after TrialLines, keeps ``None``, and raises a TypeError
    when a trial fails or is retried (``on_trial_error``/``on_trial_recover`` print the elapsed time): a study would
    crash instead of retrying a trial (``max_failures``) or recording its failure. A ``setup`` without a start time
    now keeps the reporter's own (its construction time). Explicit and idempotent;
    tests/test_private_apis.py fails when the patched method changes its signature."""
    original = TuneProgressReporter.setup
    if getattr(original, "_raydp_keeps_start_time", False):
        return

    def setup(self, start_time=None, **kwargs):
        if start_time is None:
            start_time = getattr(self, "_start_time", None)
        return original(self, start_time=start_time, **kwargs)

    setup._raydp_keeps_start_time = True
    TuneProgressReporter.setup = setup


class TrialLines(TuneProgressReporter):
    """Prints :func:`trial_line` when a trial of the experiment finishes or fails for good (not with ``lines=False``:
    ``raydp study --quiet``), and nothing else: not Tune's announcement of the experiment, nor its status tables."""

    _heartbeat_threshold = _start_end_verbosity = AirVerbosity.DEFAULT  # what Tune's own reporters print at: never
    _intermediate_result_verbosity = AirVerbosity.VERBOSE

    def __init__(self, lines: bool = True, total: int | None = None):
        keep_reporters_start_time()  # Tune's own reporter beside this one must survive a trial's failure
        super().__init__(AirVerbosity.SILENT)
        self.lines = lines
        self.total = total  # a search's samples (its searcher creates trials as it goes); None: the trials Tune has

    def experiment_started(self, *args, **kwargs) -> None:
        pass

    def print_heartbeat(self, trials, *args, force: bool = False) -> None:
        pass

    def _print(self, trials, trial, failed: bool) -> None:
        if not self.lines:
            return
        ended = sum(1 for t in trials if t is not trial and t.status in ("TERMINATED", "ERROR")) + 1
        total = max(self.total or 0, len(trials))
        line = trial_line(ended, total, trial_label(_spec(trial), str(trial)), trial.last_result, failed)
        print(line, file=sys.stderr, flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        self._print(trials, trial, failed=False)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._print(trials, trial, failed=True)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        if self.lines:
            print(f"{trial_label(_spec(trial), str(trial))}: failed; Tune retries it from its latest checkpoint",
                  file=sys.stderr, flush=True)
