"""Membership inference (RLDP Sec. 3.3; the loss attack and its base-model calibration,
:func:`raydp.evaluation.attacks.membership_inference`) as a registered attack."""

from __future__ import annotations

import numpy as np

from raydp.data import load_split
from raydp.evaluation.base import AttackContext, AttackSpec, AttackTable, Column, present


def run(ctx: AttackContext) -> dict:
    from raydp.evaluation import attacks  # lazy: studies and reports read this spec without importing torch

    settings, rng = ctx.settings, ctx.rng
    train = ctx.train
    plain = ~train["has_canary"].to_numpy()
    if "audit_canary" in train:
        plain &= ~train["audit_canary"].to_numpy()
    members = list(train.loc[plain, "text"])
    nonmembers = list(load_split(ctx.dataset, "attack")["text"])
    n = min(settings.membership_records, len(members), len(nonmembers))
    members = [members[i] for i in np.sort(rng.choice(len(members), n, replace=False))]
    nonmembers = [nonmembers[i] for i in np.sort(rng.choice(len(nonmembers), n, replace=False))]
    ctx.say(f"membership inference: {n} members vs {n} non-members")
    return attacks.membership_inference(ctx.loaded.model, ctx.loaded.tokenizer, members, nonmembers,
                                        ctx.loaded.device, prompt_fraction=settings.prompt_fraction,
                                        max_length=ctx.max_length, batch_size=settings.batch_size)


def summary(mia: dict) -> str:
    return (f"MIA AUC {mia['loss']['auc']:.3f} (calibrated {mia['calibrated']['auc']:.3f}), "
            f"TPR@1%FPR {mia['loss']['tpr_at_fpr_0.01']:.3f}")


def flat(mia: dict) -> dict:
    out = {}
    for kind, prefix in (("loss", "mia"), ("calibrated", "mia_cal")):
        out[f"{prefix}_auc"] = mia[kind]["auc"]
        out[f"{prefix}_tpr_at_fpr_0.01"] = mia[kind]["tpr_at_fpr_0.01"]
        out[f"{prefix}_tpr_at_fpr_0.001"] = mia[kind]["tpr_at_fpr_0.001"]
    if "base_model" in mia:
        out["mia_base_model_auc"] = mia["base_model"]["auc"]
    out["mia_member_mean_logp"] = mia["loss"]["member_mean_logp"]
    out["mia_member_mean_ppl"] = mia["loss"]["member_mean_ppl"]
    return out


def line(row) -> str | None:
    if not present(row.get("mia_auc")):
        return None
    calibrated = row.get("mia_cal_auc")
    return f"membership AUC {row['mia_auc']:.2f}" + (f" (calibrated {calibrated:.2f})" if present(calibrated) else "")


def _caption(evaluations: list[dict]) -> str:
    return "membership inference (mean ± std over seeds); members / non-members per trial: " + ", ".join(
        dict.fromkeys(f"{ev['membership'].get('n_members')} / {ev['membership'].get('n_nonmembers')}"
                      for ev in evaluations if isinstance(ev.get("membership"), dict)))


SPEC = AttackSpec("membership", run, summary, flat, line, AttackTable(
    "table-membership", ("membership",), (
        Column("AUC (loss)", ("membership", "loss", "auc")),
        Column("TPR@0.1% FPR", ("membership", "loss", "tpr_at_fpr_0.001"), 4),
        Column("TPR@1% FPR", ("membership", "loss", "tpr_at_fpr_0.01"), 4),
        Column("AUC (calibrated)", ("membership", "calibrated", "auc")),
        Column("TPR@0.1% (cal.)", ("membership", "calibrated", "tpr_at_fpr_0.001"), 4),
        Column("TPR@1% (cal.)", ("membership", "calibrated", "tpr_at_fpr_0.01"), 4),
        Column("member mean log p", ("membership", "loss", "member_mean_logp")),
        Column("non-member mean log p", ("membership", "loss", "nonmember_mean_logp")),
        Column("member ppl", ("membership", "loss", "member_mean_ppl"), 4),
        Column("non-member ppl", ("membership", "loss", "nonmember_mean_ppl"), 4),
        Column("null AUC (base model)", ("membership", "base_model", "auc"))),
    _caption, "membership inference: not run in any evaluation"))
