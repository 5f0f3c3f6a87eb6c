"""Silencing transformers' own progress bars (weight loading/saving) for quiet runs."""

from __future__ import annotations

import contextlib

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def transformers_progress(enabled: bool):
    """Within the block, transformers shows its progress bars only if ``enabled``; restored afterwards."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
