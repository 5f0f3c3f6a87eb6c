"""Which records a study on private data selects on, said before it runs.

A study selects (and plots and prints) on its public validation records: the user's own public records where the
study gives them (``base.public_validation``, :mod:`raydp.data.public_records`), else raydp's synthetic public
population. For the Diabetes 130-US schema, synthetic or real, that population is a fair proxy (on real rows it ranked
six DP and non-private arms in the same order as the real private split); for a free-text dataset it says nothing about
the user's texts. So a study on private free text without public records of its own must name its route in the study
file (nothing interactive): ``selection: none`` (the recipe alone: nothing chosen, nothing charged beyond the runs)
or ``selection: private-dp`` (a DP score on the private validation split, one end-to-end epsilon per cell;
:mod:`raydp.study.private_selection`); ``selection: private`` selects on the private eval split, unprotected and
labelled (ERRATA E15). The default, public selection on the synthetic population, is refused there.
"""

from __future__ import annotations

from pathlib import Path

from raydp.errors import ConfigError

ROUTES_WITHOUT_PUBLIC_RECORDS = ("set base.public_validation: FILE (public texts of your own with the same text and "
                                 "unit columns), selection: none (the recipe alone, nothing chosen) or selection: "
                                 "private-dp (a DP score on the private validation split)")


def selection_route(study, public_validation: str | None, manifest: dict) -> str | None:
    """The line a study prints before it runs about the records it selects on (None: the default, nothing to say);
    a one-line ConfigError for public selection on private free text without the user's public records."""
    if public_validation:
        return (f"selecting on your public records ({Path(public_validation).name}), not raydp's synthetic public "
                "population" if study.selection == "public" else None)
    if not study.private_data or not manifest.get("text_source"):
        return None
    if study.selection == "public":
        raise ConfigError("this study's private data is free text and it gives no public records of its own: raydp's "
                          "synthetic public population says nothing about your texts, so it cannot select on it; "
                          + ROUTES_WITHOUT_PUBLIC_RECORDS)
    route = {"none": "the recipe alone (selection: none): nothing is chosen on any split and nothing is charged "
                     "beyond the runs",
             "private-dp": "private selection (selection: private-dp) on the private validation split, one "
                           "end-to-end epsilon per cell (below)",
             "private": "selection on the private eval split (selection: private): unprotected, labelled (E15)"}
    return f"no public records of your texts: route: {route[study.selection]}"
