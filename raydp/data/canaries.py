"""Secret canaries for memorisation audits (RLDP Sec. 2.1, Table 1, Sec. 3.3) and audit canaries.

``n_canary`` distinct 10-character secrets over [A-Z0-9] are drawn with ``canary_seed``; each is appended as
`` secret_id=<CANARY>.`` (the form ending Table 1's sample: "... days. secret_id=O119XP9N56.") to the narrative
of a synthetic record of its own patient (the ``'canary'`` population: the private parameters, ids apart from
every split), and those records join train (:mod:`raydp.data.splits`). The secrets depend only on
``canary_seed`` and ``n_canary``. (The paper appends them to real training records; choosing which records
carry them from the training set's rows made one patient's presence move the canaries of others, so a
neighbouring table gave training sets that differ in up to 2 n_canary + 1 patients,
more than the one patient the guarantee is for.)

Audit canaries (the one-run audit of Steinke, Nasr and Jagielski 2023, Sec. 3): ``n_audit`` further
records, each its own patient, each carrying its own secret in the same format and each included in
train by an independent fair coin. Secrets and coins come from ``SeedSequence([canary_seed,
AUDIT_COIN_STREAM])``, independent of the training mechanism's randomness (OS entropy, ERRATA E12), so
the auditor may know them; the coins are private to the data owner like the data itself.
"""

from __future__ import annotations

import re
import string

import numpy as np

from raydp.errors import DataError

ALPHABET = string.ascii_uppercase + string.digits
LENGTH = 10
PREFIX = " secret_id="
# Matches an injected canary at the end of a narrative; group 1 is the secret.
PATTERN = re.compile(r" secret_id=([A-Z0-9]{10})\.$")
AUDIT_COIN_STREAM = 0x434F494E  # "COIN"


def suffix(secret: str) -> str:
    """The text appended to a narrative that carries ``secret``."""
    return f"{PREFIX}{secret}."


def draw_canaries(n_canary: int, canary_seed: int) -> list[str]:
    """``n_canary`` distinct secrets, deterministic in the seed."""
    if isinstance(n_canary, bool) or not isinstance(n_canary, (int, np.integer)) or n_canary < 0:
        raise DataError(f"n_canary must be an integer >= 0, got {n_canary!r}")
    return random_secrets(np.random.default_rng(canary_seed), int(n_canary))


def random_secrets(rng: np.random.Generator, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct uniform secrets of the canary format, none in ``exclude``."""
    alphabet = np.array(list(ALPHABET))
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        s = "".join(alphabet[rng.integers(0, len(ALPHABET), size=LENGTH)])
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def draw_audit_canaries(n_audit: int, canary_seed: int, exclude: set[str]) -> tuple[list[str], np.ndarray]:
    """(secrets, inclusion coins) of ``n_audit`` audit canaries: distinct secrets not in ``exclude`` (the
    secret canaries) and independent fair coins (Steinke et al. 2023, Alg. 1: S_i uniform on {-1, +1})."""
    if isinstance(n_audit, bool) or not isinstance(n_audit, (int, np.integer)) or n_audit < 0:
        raise DataError(f"n_audit must be an integer >= 0, got {n_audit!r}")
    rng = np.random.default_rng(np.random.SeedSequence([canary_seed, AUDIT_COIN_STREAM]))
    secrets = random_secrets(rng, int(n_audit), exclude)
    included = rng.random(int(n_audit)) < 0.5
    return secrets, included


#: sentences of a record's narrative an audit canary keeps before its secret
AUDIT_SENTENCES = 6


def audit_text(narrative: str, secret: str) -> str:
    """An audit canary's text: the first :data:`AUDIT_SENTENCES` sentences of its record and its secret.

    Short on purpose: the secret is a large share of the sequence's tokens, so a mechanism that leaks shows it
    in the secret's likelihood (a full narrative would dilute a canary's gradient many-fold and make the audit
    weak). Six sentences rather than three: under the clause tokenizer a sentence is one token, and three left
    many canaries with the same context (race and gender only), which weakened a noise-off run's audit from 2.6
    to 1.3. DP covers any record, whatever its form, so the audit's bound applies unchanged.
    """
    sentences = narrative.split(". ")
    return ". ".join(sentences[:AUDIT_SENTENCES]).rstrip(".") + "." + suffix(secret)
