"""The embedded default model: a small GPT-2 built from config, pre-trained briefly on public data.

Nothing is downloaded. The tokenizer is a byte-level BPE (clause pre-tokenisation by default,
:mod:`raydp.model.tokenizer`) trained on the pre-training corpus (a synthetic population far from and disjoint
from every private split, :func:`raydp.data.public.pretraining_corpus`), and the model is a GPT-2-architecture
network pre-trained non-privately on the same corpus so that private fine-tuning starts from a model that
already speaks the narratives' language but not the private population's. Both are saved with
``save_pretrained`` into a cache and loaded back through the same ``from_pretrained`` path as any
Hugging Face model. Builds are deterministic per seed, cached by a hash of their spec, and written
atomically (a directory appears in the cache only once complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from raydp.errors import ModelError
from raydp.model.hf_progress import transformers_progress
from raydp.model.loss import per_sequence_nll
from raydp.model.tokenizer import train_bpe_tokenizer

EMBEDDED_FORMAT_VERSION = 2  # 2: structured public records, clause tokenizer (the structured benchmark)
IDENTIFIER_STREAM = 0x49444E54  # "IDNT": the random identifiers of the pre-training corpus
MARKER_FILE = "raydp_embedded.json"


@dataclass(frozen=True)
class EmbeddedModelSpec:
    """Architecture and pre-training recipe of an embedded model."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_positions: int = 512
    vocab_size: int = 2048
    pretokenize: str = "clauses"  # raydp.model.tokenizer.PRETOKENIZATIONS
    generator: str = "structured"  # of the pre-training corpus (raydp.data.public.pretraining_corpus)
    #: share of pre-training narratives that end in a random identifier in the canary format (" secret_id=" and 10
    #: random [A-Z0-9]), so that character-level tokens, which the clause tokenizer otherwise rarely emits, have
    #: trained embeddings: a model that cannot represent a random string cannot memorise a canary either, and the
    #: extraction, exposure and audit attacks would under-state what DP has to prevent. Public, random: no canary.
    identifier_fraction: float = 0.25
    public_records: int = 4000
    tokenizer_records: int = 800  # BPE training is superlinear in corpus size; the template is repetitive
    pretrain_steps: int = 200
    pretrain_batch_size: int = 16
    pretrain_lr: float = 2e-3
    seed: int = 0

    def cache_key(self) -> str:
        payload = json.dumps({"format": EMBEDDED_FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: Named embedded models. ``embedded`` is the default everywhere; ``embedded-deep`` has twice the
#: layers (and so twice the LoRA pairs), for policy-transfer experiments.
EMBEDDED_PRESETS: dict[str, EmbeddedModelSpec] = {
    "embedded": EmbeddedModelSpec(),
    "embedded-deep": EmbeddedModelSpec(n_layer=8),
    "embedded-tiny": EmbeddedModelSpec(n_layer=2, n_embd=32, n_head=2, public_records=1600, pretrain_steps=200),
    # twice the adapters of embedded-tiny: tests policy transfer to a model with more adapter pairs
    "embedded-tiny-deep": EmbeddedModelSpec(n_layer=4, n_embd=32, n_head=2, public_records=1600, pretrain_steps=200),
    # GPT-2 small's width and depth (768 x 12 layers, 12 heads) on the embedded tokenizer: for benchmarks
    # at a realistic adapter size (a GPU is advised; briefly pre-trained, so its perplexity means little)
    "embedded-small": EmbeddedModelSpec(n_layer=12, n_embd=768, n_head=12, pretrain_steps=60, pretrain_lr=5e-4),
    # the default model with GPT-2's word pre-tokenisation (~340 tokens per narrative instead of ~50): the embedded
    # tokenizer before the structured benchmark, kept for the throughput comparison (bench/bench_episode.py) and
    # its equivalence study (trials/throughput-equivalence.yaml)
    "embedded-words": EmbeddedModelSpec(pretokenize="words"),
}


def default_cache_dir() -> Path:
    """``$RAYDP_CACHE`` if set, else ``~/.cache/raydp``."""
    return Path(os.environ.get("RAYDP_CACHE", Path.home() / ".cache" / "raydp")).expanduser()


def is_embedded_name(name: str) -> bool:
    return name in EMBEDDED_PRESETS


def ensure_embedded_model(
    name: str = "embedded", cache_dir: str | Path | None = None, spec: EmbeddedModelSpec | None = None,
    progress: bool = True,
) -> Path:
    """Return the directory of the embedded model ``name``, building and caching it if needed."""
    if spec is None:
        if name not in EMBEDDED_PRESETS:
            raise ModelError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_PRESETS)}")
        spec = EMBEDDED_PRESETS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{name}-{spec.cache_key()}"
    if (target / MARKER_FILE).exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create model cache {target.parent}: {exc.strerror}") from None
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        # the build draws from torch's global generator (initialisation, pre-training batches): fork it, so that
        # whatever the caller seeded (a run's LoRA initialisation) is the same on a cold cache as on a warm one
        with torch.random.fork_rng(devices=[]):
            _build(spec, staging, progress=progress, name=name)
        try:  # a directory publish (the whole model at once), not a file write: atomic_write replaces one file
            staging.rename(target)
        except OSError:
            if not (target / MARKER_FILE).exists():  # not a concurrent builder winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(spec: EmbeddedModelSpec, out: Path, progress: bool, name: str) -> None:
    from raydp.data.public import pretraining_corpus

    started = time.perf_counter()
    texts = pretraining_corpus(spec.public_records, seed=spec.seed, generator=spec.generator)
    if spec.identifier_fraction > 0:
        from raydp.data.canaries import random_secrets, suffix

        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, IDENTIFIER_STREAM]))
        carriers = rng.random(len(texts)) < spec.identifier_fraction
        ids = iter(random_secrets(rng, int(carriers.sum())))
        texts = [t + suffix(next(ids)) if c else t for t, c in zip(texts, carriers)]
    tokenizer = train_bpe_tokenizer(texts[: spec.tokenizer_records], vocab_size=spec.vocab_size,
                                    pretokenize=spec.pretokenize)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # No dropout in the backbone: it is frozen during fine-tuning, and on CPU dropout's random
        # masks cost as much as the matrix products of a model this small.
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(spec.seed)
    model = GPT2LMHeadModel(config)
    losses = _pretrain(model, tokenizer, texts, spec, progress=progress, name=name)
    with transformers_progress(progress):
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "name": name,
        "spec": asdict(spec),
        "format_version": EMBEDDED_FORMAT_VERSION,
        "pretrain_loss_first": losses[0],
        "pretrain_loss_last": losses[-1],
        "build_seconds": round(time.perf_counter() - started, 2),
        "note": "pre-trained on a synthetic pre-training corpus that describes no real patient",
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2))


def _pretrain(model, tokenizer, texts, spec: EmbeddedModelSpec, progress: bool, name: str) -> list[float]:
    """Brief non-private pre-training on the pre-training corpus (mean per-sequence NLL, AdamW)."""
    encoded = tokenizer(texts, truncation=True, max_length=spec.n_positions)["input_ids"]
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_lr, weight_decay=0.0)
    warmup = max(1, spec.pretrain_steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    # a bar on a terminal only (disable=None); in a log, one line when done
    bar = tqdm(range(spec.pretrain_steps), desc=f"pre-training {name} (pre-training corpus)",
               disable=None if progress else True, leave=False)
    for _ in bar:
        idx = torch.randint(len(encoded), (spec.pretrain_batch_size,), generator=generator).tolist()
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = per_sequence_nll(logits, batch["input_ids"], batch["attention_mask"]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if progress:
        print(f"pre-trained {name} on the pre-training corpus: {spec.pretrain_steps} steps, final loss "
              f"{losses[-1]:.3f}", file=sys.stderr)
    model.eval()
    return losses


__all__ = [
    "EMBEDDED_PRESETS",
    "EmbeddedModelSpec",
    "default_cache_dir",
    "ensure_embedded_model",
    "is_embedded_name",
]
