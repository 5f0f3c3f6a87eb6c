"""A fine-tuning run as a Ray actor: it owns its training loop and reaches the policy through the broker or,
over RLlink, a policy server (the client comes from :func:`raydp.control.connection.client_from_connection`;
either client decides deterministically given the run's releases and public seeds: it waits for the policy
to have trained on the run's earlier transitions and explores from the connection's public ``seed``)."""

from __future__ import annotations

import os

import ray
import torch

import raydp.control.connection
import raydp.runner.run
from raydp.config import TrainConfig, validate_config


def run_with_connection(config: dict, output: str, overwrite: bool, connection: dict | None, run_id: str,
                        progress: bool = True) -> dict:
    """One run whose policy client is built from ``connection`` (None: no controller) and closed (if it
    has ``close``: an RLlink client's socket) however the run ends."""
    cfg = validate_config(TrainConfig, config)
    # looked up on their modules at call time (as the function-level imports were): tests replace them there
    client = raydp.control.connection.client_from_connection(connection, run_id) if connection else None
    try:
        return raydp.runner.run.run_training(cfg, output, overwrite=overwrite, progress=progress, client=client)
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            close()


@ray.remote
class FineTuningRun:
    """One run in its own process, with ``threads`` torch threads (set per actor: oversubscribed
    threads cost far more than they give on a shared machine)."""

    def __init__(self, threads: int = 1):
        torch.set_num_threads(max(1, int(threads)))
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def run(self, config: dict, output: str, overwrite: bool, connection: dict | None, run_id: str,
            progress: bool = True) -> dict:
        return run_with_connection(config, output, overwrite, connection, run_id, progress)

    def pid(self) -> int:
        return os.getpid()
