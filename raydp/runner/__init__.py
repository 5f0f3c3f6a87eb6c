"""The fine-tuning run: sampling, gradient computation, update and evaluation as separate steps.

The names below load on first use (PEP 562): ``raydp --help`` reaches ``raydp.runner.policy_server`` for its
flags, and importing this package must not import torch for that."""

import importlib

_EXPORTS = {
    "Batch": "raydp.model.batches",
    "TokenizedSplit": "raydp.model.batches",
    "GradientComputation": "raydp.runner.gradients",
    "NonPrivateGradient": "raydp.runner.gradients",
    "OptimizerSettings": "raydp.runner.loop",
    "Trainer": "raydp.runner.loop",
    "ShuffledBatchSampler": "raydp.runner.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'raydp.runner' has no attribute {name!r}")
