"""The canary secrets' exposure (Carlini et al. 2019: extrapolated from random candidates' log-perplexities, or
each secret's rank among them; :func:`raydp.evaluation.attacks.exposure`) as a registered attack; shown in the
extraction table."""

from __future__ import annotations

from raydp.evaluation.base import AttackContext, AttackSpec, present


def run(ctx: AttackContext) -> dict | None:
    from raydp.evaluation import attacks  # lazy: studies and reports read this spec without importing torch

    settings = ctx.settings
    canaries = ctx.canaries
    secrets = list(canaries["secret"])
    if not (settings.exposure_candidates and secrets):
        return None
    texts = list(ctx.train["text"].iloc[canaries["train_row"].to_numpy()])
    contexts = [t[:off] for t, off in zip(texts, attacks.secret_offsets(texts, secrets))]
    ctx.say(f"exposure ({settings.exposure_method}): {len(secrets)} canaries x {settings.exposure_candidates} "
            "candidates")
    return attacks.exposure(ctx.loaded.model, ctx.loaded.tokenizer, contexts, secrets, ctx.loaded.device,
                            candidates=settings.exposure_candidates, seed=settings.seed,
                            batch_size=settings.candidate_batch_size, method=settings.exposure_method,
                            resamples=settings.exposure_resamples)


def summary(exp: dict) -> str:
    line = f"exposure mean {exp['mean']:.2f} / max {exp['max']:.2f} bits"
    if exp.get("method") == "extrapolate":
        box = exp.get("max_interval")
        line += " (extrapolated" + (f"; max's 95% interval {box[0]:.2f}-{box[1]:.2f})" if box else ")")
    return line


def flat(exp: dict) -> dict:
    """The mean and max, the method (an evaluation before the method was recorded ranked), and the max's 95%
    interval (extrapolated only; None for rank)."""
    box = exp.get("max_interval") or (None, None)
    return {"exposure_mean": exp["mean"], "exposure_max": exp["max"], "exposure_method": exp.get("method", "rank"),
            "exposure_max_low": box[0], "exposure_max_high": box[1]}


def line(row) -> str | None:
    if not present(row.get("exposure_mean")):
        return None
    return f"exposure {row['exposure_mean']:.2f} (max {row['exposure_max']:.2f})"


SPEC = AttackSpec("exposure", run, summary, flat, line)  # its columns are in the extraction table
