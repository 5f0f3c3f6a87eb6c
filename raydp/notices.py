"""Third-party notices that are not the user's to act on, filtered at the loggers that emit them.

On the bottom floor of the package (it imports nothing of raydp), so that whatever starts a library that emits them
can call :func:`quiet_library_notices`: the study's driver, a trial, the RLDP policy's actors (raydp.control.sac).
raydp's own messages and every other library message pass.
"""

from __future__ import annotations

import logging
import sys

#: third-party log messages that are not the user's to act on, by the logger that emits them and the start of the
#: message: Ray's notice that token authentication is on (raydp requires it: the notice's opt-out would be refused);
#: RLlib's deprecation of RLModule(config=...), which RLlib's own module constructor triggers; RLlib's note that SAC
#: runs on its new API stack (raydp's policies are built for it); Tune's hint to install gputil (a policy service
#: monitors no GPU); Tune's Tuner.restore hint for an interrupted experiment (raydp prints its own: ``raydp study FILE
#: --resume``), and its list of the trials with no result to read when a stopped study returns (trials that never
#: reported: raydp's header counts them unfinished and its results table marks them). raydp's own messages and every
#: other library message pass.
LIBRARY_NOTICES = {
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray cluster",),
    "ray._common.deprecation": ("DeprecationWarning: `RLModule(config=", "DeprecationWarning: `MultiRLModule(config="),
    "ray.rllib.algorithms.algorithm_config": ("You are running SAC on the new API stack",),
    "ray.rllib.algorithms.sac.sac": ("You are running SAC on the new API stack",),
    "ray.tune.utils.util": ("Install gputil for GPU system monitoring",),
    "ray.tune.tune": ("Experiment has been interrupted, but the most recent state was saved",),
    "ray.tune.analysis.experiment_analysis": ("Failed to fetch metrics for ",),
}


class LibraryNoticeFilter(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts`` (:data:`LIBRARY_NOTICES`)."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to drop
            return True
        return not message.startswith(self.starts)


def quiet_library_notices() -> None:
    """Filter :data:`LIBRARY_NOTICES` at their loggers, in this process (idempotent). Called where raydp starts what
    emits them: the study's driver before Ray and Tune start, and wherever an RLlib policy is built (a trial, a
    policy service or broker actor)."""
    for name, starts in LIBRARY_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, LibraryNoticeFilter) for f in logger.filters):
            logger.addFilter(LibraryNoticeFilter(starts))


def quiet_exit_tracebacks() -> None:
    """In this process, drop the 'Exception ignored' traceback of a SystemExit raised inside a weakref or finalizer
    callback (idempotent). Ray ends a finished Tune trial's worker with SIGTERM, and its handler raises SystemExit
    wherever the worker is: inside such a callback Python prints it as a traceback, which the study's driver forwards
    with the worker's output although nothing failed. Every other unraisable exception is printed as before."""
    previous = sys.unraisablehook
    if getattr(previous, "_raydp_quiet_exit", False):
        return

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            return
        previous(unraisable)

    hook._raydp_quiet_exit = True
    sys.unraisablehook = hook
