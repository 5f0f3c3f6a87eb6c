"""RLDP as published, or as raydp runs it: the one place the paper's modes are read.

Three of RLDP's settings have a ``"paper"`` value, each a place where raydp departs from the paper:

* ``privacy_mode``: ``strict`` (raydp's default) shows the controller DP releases only; ``paper`` shows it the exact
  per-pair norms and losses of RLDP Sec. 2.4, which no accountant covers (ERRATA E3): the run's epsilon covers the
  gradient only and every artifact stating it carries :data:`PAPER_MODE_LABEL`;
* ``action_decoding``: ``relative`` (default) or ``relative-capped`` decode a clip relative to the pair's public
  reference norm; ``residual`` corrects a learned clip schedule; ``paper`` is Eq. 10, ``C_i = min(exp(a_i), 1)``
  (:mod:`raydp.control.decoding`);
* ``architecture``: ``shared`` (default) is size-agnostic; ``paper`` is Eq. 22-27 for a fixed number of pairs.

``paper_mode: true`` (one setting, ``--paper-mode``) reproduces RLDP as published: each of the three that the
settings leave unset takes its paper value (:func:`apply_paper_mode`); one given explicitly keeps its value (e.g.
``paper_mode: true, privacy_mode: strict``: the paper's decoding and architecture under strict statistics).

No component compares these strings. The settings are resolved here, once, into a :class:`ControllerModes`
(:func:`resolve`) whose fields say what each component needs: whether the controller observes raw statistics
(and the label that goes with it), the clip decoding's bounds, whether the policy controls a fixed number of
pairs. Stored records keep the strings (a run's summary, a policy manifest's ``privacy_mode``, a provenance
entry's): :func:`unprotected` reads one, and counts anything but ``strict`` (a missing or unknown mode included)
as unprotected, so the label is never lost.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER = "paper"
STRICT = "strict"
PRIVACY_MODES = (STRICT, PAPER)
RESIDUAL = "residual"
DECODINGS = (PAPER, "relative", "relative-capped", RESIDUAL)
ARCHITECTURES = ("shared", PAPER)
#: the settings ``paper_mode`` sets, each with raydp's default
PAPER_SETTINGS = {"privacy_mode": STRICT, "action_decoding": "relative", "architecture": "shared"}

PAPER_MODE_LABEL = ("epsilon covers the gradient releases only; the controller observed unprivatized "
                    "statistics")


def apply_paper_mode(values: dict) -> dict:
    """``values`` (RLDP's settings, a mapping) with ``paper_mode: true`` spelled out: each of
    :data:`PAPER_SETTINGS` left unset takes the paper's value; one given explicitly is kept."""
    if not isinstance(values, dict) or values.get("paper_mode") is not True:
        return values
    return {**{key: PAPER for key in PAPER_SETTINGS}, **{k: v for k, v in values.items() if v is not None}}


@dataclass(frozen=True)
class ControllerModes:
    """What RLDP's components need from its modes (:func:`resolve`)."""

    #: the controller observes the exact statistics of the last micro-batch (paper), not DP releases (strict)
    raw_statistics: bool
    #: clip multiplier bounds relative to each pair's public reference norm; None: Eq. 10, ``min(exp(a_i), 1)``, or
    #: residual decoding
    clip_bounds: tuple[float, float] | None
    #: the policy controls exactly the model's number of adapter pairs (Eq. 22-27), not a padded shared set
    fixed_pairs: bool
    #: residual decoding: squashed actions in [-1, 1] correct a learned clip schedule
    residual: bool = False

    @property
    def privacy_mode(self) -> str:
        """The recorded string (summaries, decisions, policy manifests, provenance)."""
        return recorded_privacy_mode(self.raw_statistics)

    @property
    def label(self) -> str | None:
        """The caveat on the run's epsilon (:data:`PAPER_MODE_LABEL`), or None."""
        return PAPER_MODE_LABEL if self.raw_statistics else None


def resolve(privacy_mode: str = STRICT, action_decoding: str = "relative",
            architecture: str = "shared") -> ControllerModes:
    """The one reading of RLDP's three mode settings (values already validated, ``paper_mode`` applied)."""
    from raydp.control.decoding import MULTIPLIER_BOUNDS  # lazy: numpy; the settings model imports this module

    return ControllerModes(raw_statistics=unprotected(privacy_mode), clip_bounds=MULTIPLIER_BOUNDS.get(action_decoding),
                           fixed_pairs=architecture == PAPER, residual=action_decoding == RESIDUAL)


def resolve_values(values: dict | None) -> ControllerModes:
    """:func:`resolve` of a settings mapping not (yet) validated (a study's ``strategy_settings`` and grid
    variant): ``paper_mode`` applied, an unset mode at raydp's default."""
    values = apply_paper_mode(dict(values or {}))
    return resolve(**{key: values.get(key) or default for key, default in PAPER_SETTINGS.items()})


def unprotected(privacy_mode: str | None) -> bool:
    """Whether a (recorded) privacy mode may have shown the controller unprivatized statistics: anything but
    ``strict``, a missing or unknown mode included (never assumed strict; ERRATA E3/E14)."""
    return privacy_mode != STRICT


def recorded_privacy_mode(raw_statistics: bool) -> str:
    return PAPER if raw_statistics else STRICT


def fixed_pairs(architecture: str) -> bool:
    """Whether a (stored) policy architecture controls a fixed number of adapter pairs (Eq. 22-27)."""
    return architecture == PAPER
