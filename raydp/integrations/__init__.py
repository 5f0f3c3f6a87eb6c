"""raydp's DP step under other training loops.

* :mod:`raydp.integrations.transformers`: a ``transformers.Trainer`` script with a PEFT model trains with
  raydp's DP step, Poisson sampler, ledger, guard and filter (:class:`DPTraining`).

Nothing here is imported by ``raydp`` itself: importing this package needs only what raydp needs.
"""

from raydp.integrations.transformers import DPCallback, DPTraining, check_training_arguments

__all__ = ["DPCallback", "DPTraining", "check_training_arguments"]
