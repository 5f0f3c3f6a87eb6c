"""An RLDP run as a Ray actor whose controller is a policy server reached over RLlink.

:class:`raydp.runner.actor.FineTuningRun` builds a broker client from its connection; this actor builds an
:class:`raydp.control.rllink.RLlinkPolicyClient` instead (the connection dict of
:func:`raydp.control.rllink.rllink_connection`) and closes it however the run ends.
"""

from __future__ import annotations

import os

import ray


@ray.remote
class RLlinkFineTuningRun:
    """One run in its own process, with ``threads`` torch threads, controlled over RLlink."""

    def __init__(self, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, int(threads)))
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def run(self, config: dict, output: str, overwrite: bool, connection: dict, run_id: str,
            progress: bool = True) -> dict:
        from raydp.config import TrainConfig, validate_config
        from raydp.control.rllink import client_from_rllink_connection
        from raydp.runner.run import run_training

        cfg = validate_config(TrainConfig, config)
        client = client_from_rllink_connection(connection, run_id)
        try:
            return run_training(cfg, output, overwrite=overwrite, progress=progress, client=client)
        finally:
            client.close()

    def pid(self) -> int:
        return os.getpid()
