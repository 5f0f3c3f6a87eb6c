"""The public corpus: narratives of a disjoint synthetic population, without canaries (Sec. 2.2).

Used to train the tokenizer and pre-train the embedded model. The records come from
``generate_records(population='public')``: seed stream ``SeedSequence([seed, PUBLIC_STREAM])`` and
encounter/patient ids from 9e9/8e9 up, so they never coincide with a private split (synthetic or
real, whose ids are below 4.5e8). Synthetic records describe no real patient.
"""

from __future__ import annotations

import pandas as pd

from raydp.data.schema import IdMaps
from raydp.data.synthetic import generate_records
from raydp.data.verbalise import verbalise_records


def public_records(n: int, seed: int = 0, *, progress: bool = True) -> pd.DataFrame:
    """``n`` records of the public synthetic population."""
    return generate_records(n, seed, population="public", progress=progress)


def public_corpus(
    n: int, seed: int = 0, *, id_maps: IdMaps | None = None, progress: bool = True
) -> list[str]:
    """``n`` public narratives (no canaries), deterministic per seed."""
    return verbalise_records(public_records(n, seed, progress=progress), id_maps, progress=progress)
