"""Public narratives, without canaries (Sec. 2.2), from two synthetic populations disjoint from every private split.

* :func:`public_corpus`: the **public** population (``generate_records(population='public')``, seed stream
  ``SeedSequence([seed, PUBLIC_STREAM])``, ids from 9e9/8e9): a related public release, what public validation,
  the public probe, public episodes and public phase-1 fine-tuning use.
* :func:`pretraining_corpus`: the **pre-training** population (ids from 11e9/10e9), far from the private one:
  the embedded model's tokenizer and pre-training corpus. (The independent generator has one public population;
  its pre-training corpus is that population, as before the structured records.)

Private ids (synthetic or real) are below 4.5e8, so no public record coincides with a private one. Synthetic
records describe no real patient.
"""

from __future__ import annotations

import pandas as pd

from raydp.data.schema import IdMaps
from raydp.data.synthetic import DEFAULT_GENERATOR, generate_records
from raydp.data.verbalise import verbalise_records


def pretraining_corpus(n: int, seed: int = 0, *, progress: bool = True, generator: str = DEFAULT_GENERATOR) -> list[str]:
    """``n`` narratives of the generic pre-training population (the embedded model's tokenizer and pre-training;
    :mod:`raydp.data.structured`): far from the private population, which fine-tuning then has to learn."""
    population = "pretraining" if generator == "structured" else "public"
    return verbalise_records(generate_records(n, seed, population=population, progress=progress,
                                              generator=generator), progress=progress)


def public_records(n: int, seed: int = 0, *, progress: bool = True, generator: str = DEFAULT_GENERATOR) -> pd.DataFrame:
    """``n`` records of the public synthetic population (``generator``: :data:`raydp.data.synthetic.GENERATORS`)."""
    return generate_records(n, seed, population="public", progress=progress, generator=generator)


def public_corpus(
    n: int, seed: int = 0, *, id_maps: IdMaps | None = None, progress: bool = True,
    generator: str = DEFAULT_GENERATOR, spans: bool = False,
):
    """``n`` public narratives (no canaries), deterministic per seed; with ``spans``, (narratives, their value
    spans) (:func:`raydp.data.verbalise.verbalise_spans`)."""
    return verbalise_records(public_records(n, seed, progress=progress, generator=generator), id_maps,
                             progress=progress, spans=spans)
