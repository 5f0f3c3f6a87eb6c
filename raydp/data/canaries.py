"""Secret canaries for memorisation audits (RLDP Sec. 2.1, Table 1, Sec. 3.3).

``n_canary`` distinct 10-character secrets over [A-Z0-9] are drawn with ``canary_seed``; the same
generator then permutes the train rows once and the first ``n_canary`` rows of that permutation
receive one secret each, appended as `` secret_id=<CANARY>.`` (the form ending Table 1's sample:
"... days. secret_id=O119XP9N56."). The secrets depend only on ``canary_seed`` and ``n_canary``.
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


def suffix(secret: str) -> str:
    """The text appended to a narrative that carries ``secret``."""
    return f"{PREFIX}{secret}."


def draw_canaries(n_canary: int, n_train: int, canary_seed: int) -> tuple[list[str], np.ndarray]:
    """(secrets, train row indices), both of length ``n_canary``; deterministic in the seed."""
    if isinstance(n_canary, bool) or not isinstance(n_canary, (int, np.integer)) or n_canary < 0:
        raise DataError(f"n_canary must be an integer >= 0, got {n_canary!r}")
    if n_canary > n_train:
        raise DataError(f"n_canary={n_canary} exceeds the {n_train} train records")
    rng = np.random.default_rng(canary_seed)
    alphabet = np.array(list(ALPHABET))
    secrets: list[str] = []
    seen: set[str] = set()
    while len(secrets) < n_canary:
        s = "".join(alphabet[rng.integers(0, len(ALPHABET), size=LENGTH)])
        if s not in seen:
            seen.add(s)
            secrets.append(s)
    rows = rng.permutation(n_train)[:n_canary].astype(np.int64)
    return secrets, rows
