"""The canary secrets' exposure (Carlini et al. 2019, the rank of each secret among random candidates,
:func:`raydp.evaluation.attacks.exposure`) as a registered attack; shown in the extraction table."""

from __future__ import annotations

from raydp.evaluation.base import AttackContext, AttackSpec


def run(ctx: AttackContext) -> dict | None:
    from raydp.evaluation import attacks  # lazy: studies and reports read this spec without importing torch

    settings = ctx.settings
    canaries = ctx.canaries
    secrets = list(canaries["secret"])
    if not (settings.exposure_candidates and secrets):
        return None
    texts = list(ctx.train["text"].iloc[canaries["train_row"].to_numpy()])
    contexts = [t[:off] for t, off in zip(texts, attacks.secret_offsets(texts, secrets))]
    ctx.say(f"exposure: {len(secrets)} canaries x {settings.exposure_candidates} candidates")
    return attacks.exposure(ctx.loaded.model, ctx.loaded.tokenizer, contexts, secrets, ctx.loaded.device,
                            candidates=settings.exposure_candidates, seed=settings.seed,
                            batch_size=settings.candidate_batch_size)


def summary(exp: dict) -> str:
    return f"exposure mean {exp['mean']:.2f} / max {exp['max']:.2f} bits"


def flat(exp: dict) -> dict:
    return {"exposure_mean": exp["mean"], "exposure_max": exp["max"]}


SPEC = AttackSpec("exposure", run, summary, flat)  # its columns are in the extraction table
