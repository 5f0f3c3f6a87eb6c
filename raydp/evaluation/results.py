"""The evaluation's settings and its output format (``evaluation.json``): light, so that studies and results
can read them without loading models (:mod:`raydp.evaluation.evaluate` runs the attacks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

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
    """One line: the headline numbers of an evaluation."""
    parts = []
    mia = result.get("membership")
    if mia:
        parts.append(f"MIA AUC {mia['loss']['auc']:.3f} (calibrated {mia['calibrated']['auc']:.3f}), "
                     f"TPR@1%FPR {mia['loss']['tpr_at_fpr_0.01']:.3f}")
    ext = result.get("extraction")
    if ext:
        parts.append(f"extraction n_valid {ext['n_valid']}, Jaccard_1 {ext['jaccard']['1']['mean']:.4f}, "
                     f"exact {ext['exact_matches']}")
    exp = result.get("exposure")
    if exp:
        parts.append(f"exposure mean {exp['mean']:.2f} / max {exp['max']:.2f} bits")
    audit = result.get("audit")
    if audit:
        claimed = audit["claimed_epsilon"]
        verdict = {True: "not refuted", False: "VIOLATION: the one-run bound exceeds the claimed epsilon",
                   None: f"not compared ({audit.get('note') or 'no claimed epsilon'})"}[audit["consistent"]]
        parts.append(f"audit epsilon >= {audit['epsilon_one_run']:.3f} (one run) / "
                     f"{audit['epsilon_clopper_pearson']:.3f} (Clopper-Pearson) vs claimed "
                     f"{'n/a' if claimed is None else f'{claimed:.3f}'}: {verdict}")
    return "; ".join(parts) or "nothing evaluated"


def flat_metrics(result: dict) -> dict:
    """The headline numbers as flat columns (study results; Tune's final report)."""
    out: dict = {}
    mia = result.get("membership")
    if mia:
        for kind, prefix in (("loss", "mia"), ("calibrated", "mia_cal")):
            out[f"{prefix}_auc"] = mia[kind]["auc"]
            out[f"{prefix}_tpr_at_fpr_0.01"] = mia[kind]["tpr_at_fpr_0.01"]
            out[f"{prefix}_tpr_at_fpr_0.001"] = mia[kind]["tpr_at_fpr_0.001"]
        if "base_model" in mia:
            out["mia_base_model_auc"] = mia["base_model"]["auc"]
        out["mia_member_mean_logp"] = mia["loss"]["member_mean_logp"]
        out["mia_member_mean_ppl"] = mia["loss"]["member_mean_ppl"]
    ext = result.get("extraction")
    if ext:
        out["canary_n_valid"] = ext["n_valid"]
        out["canary_exact_matches"] = ext["exact_matches"]
        for n in ("1", "2", "3", "4"):
            out[f"canary_jaccard_{n}"] = ext["jaccard"][n]["mean"]
    exp = result.get("exposure")
    if exp:
        out["exposure_mean"], out["exposure_max"] = exp["mean"], exp["max"]
    audit = result.get("audit")
    if audit:
        out["audit_epsilon_one_run"] = audit["epsilon_one_run"]
        out["audit_epsilon_clopper_pearson"] = audit["epsilon_clopper_pearson"]
        out["audit_m"] = audit["m"]
        out["audit_consistent"] = audit["consistent"]
    out["eval_seconds"] = (result.get("seconds") or {}).get("total")
    return out
