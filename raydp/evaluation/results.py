"""The evaluation's settings and its output format (``evaluation.json``): light, so that studies and results
can read them without loading models (:mod:`raydp.evaluation.evaluate` runs the attacks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raydp.evaluation.registry import ATTACKS
from raydp.settings import StrictModel

EVALUATION_FILE = "evaluation.json"
EVALUATION_FORMAT = 1
LABEL = ("attack and audit metrics are computed from private records (train, attack split, canaries): not a DP "
         "release, not covered by any accountant; for the data owner only, never for selection (ERRATA E15)")


class EvalConfig(StrictModel):
    """What ``raydp eval`` (and a study's ``evaluate:`` block) runs. Defaults follow RLDP Sec. 3.3."""

    membership_records: int = Field(500, gt=0, description="members (train) and non-members (attack split), each")
    prompt_fraction: float = Field(0.5, gt=0, lt=1, description="share of each text's tokens that is the prompt")
    generations: int = Field(4000, ge=0, description="extraction samples, T (RLDP Sec. 3.3: 4000); 0 skips")
    extraction_prompt: Literal["paper", "narrative"] = Field(
        "paper", description="paper: Appendix A.1's instruction + profile; narrative: profile + ' secret_id='")
    extraction_profiles: int = Field(8, gt=0, description="public patient profiles the generations are spread over")
    exposure_candidates: int = Field(10_000, ge=0, description="random secrets per canary for exposure; 0 skips")
    audit: bool = Field(True, description="score the audit canaries and bound epsilon from below")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence of the audit's lower bounds")
    batch_size: int = Field(32, gt=0, description="texts per forward pass (membership, audit)")
    generation_batch_size: int = Field(500, gt=0, description="extraction samples decoded together")
    candidate_batch_size: int = Field(256, gt=0, description="exposure candidates scored together")
    seed: int = Field(0, ge=0, description="seed of the attacks' own sampling (not a privacy parameter)")
    device: str = Field("auto", description="auto, cpu, cuda, ...")


def summary_line(result: dict) -> str:
    """One line: the headline numbers of an evaluation (each registered attack's that ran)."""
    parts = [spec.summary(result[spec.key]) for spec in ATTACKS if result.get(spec.key)]
    return "; ".join(parts) or "nothing evaluated"


def flat_metrics(result: dict) -> dict:
    """The headline numbers as flat columns (study results; Tune's final report)."""
    out: dict = {}
    for spec in ATTACKS:
        if result.get(spec.key):
            out.update(spec.flat(result[spec.key]))
    out["eval_seconds"] = (result.get("seconds") or {}).get("total")
    return out
