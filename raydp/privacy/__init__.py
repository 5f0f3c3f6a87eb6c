"""Privacy accounting: the per-step ledger, accountants, calibration of sigma_0 and the budget guard.

Mechanism: Poisson-subsampled Gaussian steps under the add/remove-one neighbouring relation (ERRATA E6);
each step's releases combine into one noise multiplier sigma_eff (E1, E3). The ledger describes the
mechanism; the accountants (``rdp``, ``prv``, ``pld`` upper bounds; ``gdp`` approximation for comparison
with the paper, E2/E9) turn it into epsilon; :func:`calibrate_sigma` picks sigma_0 and
:class:`BudgetGuard` enforces the budget (E4).
"""

from raydp.privacy.accounting import (
    Accountant,
    GDPAccountant,
    Grid,
    LedgerTracker,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    get_accountant,
)
from raydp.privacy.calibration import CalibrationResult, SigmaEffMap, calibrate_sigma, planned_steps
from raydp.privacy.guard import BudgetExhausted, BudgetGuard, FinalCheck, GuardStatus
from raydp.privacy.ledger import (
    NEIGHBOURING_RELATION,
    PrivacyLedger,
    Release,
    allocate_noise,
    combine_sigma_eff,
    gradient_release,
    gradient_sigma_eff,
)

__all__ = [
    "NEIGHBOURING_RELATION",
    "Accountant",
    "BudgetExhausted",
    "BudgetGuard",
    "CalibrationResult",
    "FinalCheck",
    "GDPAccountant",
    "Grid",
    "GuardStatus",
    "LedgerTracker",
    "PLDAccountant",
    "PRVAccountant",
    "PrivacyLedger",
    "RDPAccountant",
    "Release",
    "SigmaEffMap",
    "allocate_noise",
    "calibrate_sigma",
    "combine_sigma_eff",
    "get_accountant",
    "gradient_release",
    "gradient_sigma_eff",
    "planned_steps",
]
