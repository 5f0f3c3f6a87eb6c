"""Accountants of heterogeneous Poisson-subsampled Gaussian compositions (add/remove-one).

==========  =================  ====================================================================
name        is_upper_bound     what
==========  =================  ====================================================================
``rdp``     True               Opacus's RDP analysis, running sum over orders
``prv``     True               Opacus's PRV composition, upper bound ``eps_upper``
``pld``     True               dp_accounting's pessimistic PLD (``PoissonSampledDpEvent(Gaussian)``)
``gdp``     False              CLT / mu-GDP with RLDP Eq. 7 fixed; comparison with the paper only
``edgeworth`` False            Edgeworth expansion (Wang et al. 2022); reported beside an upper bound only (E9)
==========  =================  ====================================================================

Every DP summary reports :data:`REPORTED_ACCOUNTANTS`' figures of the ledger; only upper bounds enforce.
"""

from __future__ import annotations

from raydp.errors import ConfigError
from raydp.privacy.accounting.base import Accountant, Composition, LedgerTracker
from raydp.privacy.accounting.edgeworth import EdgeworthAccountant
from raydp.privacy.accounting.gdp import GDPAccountant
from raydp.privacy.accounting.grid import DEFAULT_GRID, Grid, StepHistogram, as_histogram
from raydp.privacy.accounting.pld import PLDAccountant
from raydp.privacy.accounting.prv import PRVAccountant
from raydp.privacy.accounting.rdp import RDPAccountant

ACCOUNTANTS: dict[str, type[Accountant]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "pld": PLDAccountant,
    "gdp": GDPAccountant,
    "edgeworth": EdgeworthAccountant,
}

#: Accountants whose figures every DP summary, study table and report shows (ERRATA E2, E9).
REPORTED_ACCOUNTANTS = ("pld", "prv", "rdp", "gdp", "edgeworth")


def get_accountant(accountant: str | Accountant, **kwargs) -> Accountant:
    """An accountant instance from a name ('rdp', 'prv', 'pld', 'gdp', 'edgeworth') or an instance (returned as is)."""
    if isinstance(accountant, Accountant):
        return accountant
    cls = ACCOUNTANTS.get(str(accountant).lower())
    if cls is None:
        raise ConfigError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    return cls(**kwargs)


__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_GRID",
    "REPORTED_ACCOUNTANTS",
    "EdgeworthAccountant",
    "Accountant",
    "Composition",
    "GDPAccountant",
    "Grid",
    "LedgerTracker",
    "PLDAccountant",
    "PRVAccountant",
    "RDPAccountant",
    "StepHistogram",
    "as_histogram",
    "get_accountant",
]
