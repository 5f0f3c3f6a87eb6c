"""Canary extraction (RLDP Sec. 3.3 and Appendix A.1: generations from public profiles, n-gram Jaccard against
the canary secrets, :func:`raydp.evaluation.attacks.canary_extraction`) as a registered attack. Its report
table also shows the exposure (:mod:`raydp.evaluation.exposure`) of the same canaries."""

from __future__ import annotations

from raydp.data import public_corpus
from raydp.evaluation.base import AttackContext, AttackSpec, AttackTable, Column, present

PROFILE_SEED = 9_999  # public profiles for the extraction prompts, drawn apart from probe/validation seeds


def run(ctx: AttackContext) -> dict | None:
    from raydp.evaluation import attacks  # lazy: studies and reports read this spec without importing torch

    settings = ctx.settings
    secrets = list(ctx.canaries["secret"])
    if not (settings.generations and secrets):
        return None
    profiles = public_corpus(settings.extraction_profiles, seed=PROFILE_SEED, progress=False)
    ctx.say(f"canary extraction: {settings.generations} generations ({settings.extraction_prompt} prompt)")
    return attacks.canary_extraction(
        ctx.loaded.model, ctx.loaded.tokenizer, secrets, profiles, ctx.loaded.device,
        generations=settings.generations, style=settings.extraction_prompt, seed=settings.seed,
        max_length=ctx.loaded.max_positions, batch_size=settings.generation_batch_size)


def summary(ext: dict) -> str:
    return (f"extraction n_valid {ext['n_valid']}, Jaccard_1 {ext['jaccard']['1']['mean']:.4f}, "
            f"exact {ext['exact_matches']}")


def flat(ext: dict) -> dict:
    return {"canary_n_valid": ext["n_valid"], "canary_exact_matches": ext["exact_matches"],
            **{f"canary_jaccard_{n}": ext["jaccard"][n]["mean"] for n in ("1", "2", "3", "4")}}


def line(row) -> str | None:
    if not present(row.get("canary_exact_matches")):
        return None
    valid = row.get("canary_n_valid")
    return f"canaries {int(row['canary_exact_matches'])}/{int(valid) if present(valid) else 0} extracted"


def _caption(evaluations: list[dict]) -> str:
    first = next((ev["extraction"] for ev in evaluations if isinstance(ev.get("extraction"), dict)), None)
    settings = "" if first is None else (
        f"; {first.get('generations')} generations of up to {first.get('max_new_tokens')} tokens "
        f"(temperature {first.get('temperature')}, top-p {first.get('top_p')}, top-k {first.get('top_k')}, prompt "
        f"{first.get('prompt')}), {first.get('n_canary')} canaries")
    return "canary extraction and exposure (mean ± std over seeds)" + settings


SPEC = AttackSpec("extraction", run, summary, flat, line, AttackTable(
    "table-extraction", ("extraction", "exposure"), (
        Column("valid generations", ("extraction", "n_valid"), 0),
        Column("exact matches", ("extraction", "exact_matches"), 1),
        *(Column(f"Jaccard-{n}", ("extraction", "jaccard", str(n), "mean"), 4) for n in (1, 2, 3, 4)),
        Column("exposure mean (bits)", ("exposure", "mean"), 2),
        Column("exposure max (bits)", ("exposure", "max"), 2),
        Column("max measurable (bits)", ("exposure", "max_measurable_bits"), 2, span=True)),
    _caption, "canary extraction / exposure: not run in any evaluation"))
