"""What ``raydp eval`` (and a study's ``evaluate:`` block) runs: a pydantic model only, so that the command line can
generate its flags from it without importing torch (:mod:`raydp.cli_flags`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raydp.settings import StrictModel


class EvalConfig(StrictModel):
    """What ``raydp eval`` (and a study's ``evaluate:`` block) runs. Defaults follow RLDP Sec. 3.3."""

    membership_records: int = Field(500, gt=0, description="members (train) and non-members (attack split), each")
    prompt_fraction: float = Field(0.5, gt=0, lt=1, description="share of each text's tokens that is the prompt")
    generations: int = Field(4000, ge=0, description="extraction samples, T (RLDP Sec. 3.3: 4000); 0 skips",
                             json_schema_extra={"metavar": "T"})
    extraction_prompt: Literal["paper", "narrative"] = Field(
        "paper", description="paper: Appendix A.1's instruction + profile; narrative: profile + ' secret_id='")
    extraction_profiles: int = Field(8, gt=0, description="public patient profiles the generations are spread over")
    exposure_candidates: int = Field(10_000, ge=0, description="random secrets per canary for exposure; 0 skips",
                                     json_schema_extra={"flag": "--candidates", "metavar": "K"})
    #: rank stays the default: extrapolating from 500-2,000 candidates landed within 0.3 bits of a 100,000-candidate
    #: rank but its bootstrap interval covered that rank for 44-72% of canaries only (docs/privacy.md, exposure)
    exposure_method: Literal["rank", "extrapolate"] = Field(
        "rank", description="rank: the canary's rank among the candidates (Carlini et al. 2019, Sec. 4.2; at most "
        "log2(K + 1) bits); extrapolate: a skew-normal fitted to their log-perplexities, read at the canary's "
        "(Sec. 4.3), with a bootstrap interval of the candidates' sampling error only (about 1,000 candidates suffice)")
    exposure_resamples: int = Field(200, ge=0, description="bootstrap resamples of the candidates for the "
                                    "extrapolated exposure's 95% interval; 0: no interval")
    audit: bool = Field(True, description="score the audit canaries and bound epsilon from below (it needs audit "
                       "canaries: `raydp data build --n-audit`)")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence of the audit's lower bounds")
    batch_size: int = Field(32, gt=0, description="texts per forward pass (membership, audit)")
    generation_batch_size: int = Field(500, gt=0, description="extraction samples decoded together")
    candidate_batch_size: int = Field(256, gt=0, description="exposure candidates scored together")
    seed: int = Field(0, ge=0, description="seed of the attacks' own sampling (not a privacy parameter)")
    device: str = Field("auto", description="auto, cpu, cuda, ...")
