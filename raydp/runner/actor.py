"""A fine-tuning run as a Ray actor: it owns its training loop and talks to the policy via the broker."""

from __future__ import annotations

import os

import ray


@ray.remote
class FineTuningRun:
    """One run in its own process, with ``threads`` torch threads (set per actor: oversubscribed
    threads cost far more than they give on a shared machine)."""

    def __init__(self, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, int(threads)))
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def run(self, config: dict, output: str, overwrite: bool, connection: dict | None, run_id: str,
            progress: bool = True) -> dict:
        from raydp.config import TrainConfig, validate_config
        from raydp.control.service import client_from_connection
        from raydp.runner.run import run_training

        cfg = validate_config(TrainConfig, config)
        client = client_from_connection(connection, run_id) if connection else None
        return run_training(cfg, output, overwrite=overwrite, progress=progress, client=client)

    def pid(self) -> int:
        return os.getpid()
