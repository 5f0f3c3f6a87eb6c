"""Loading causal LMs (embedded default or Hugging Face) and attaching LoRA (RLDP Sec. 2.2, 3.1).

One path for every model: ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
on a hub name (``gpt2``, ``meta-llama/Llama-3.2-1B``, ``mistralai/Mistral-7B-v0.1``), a local
directory, or an embedded preset name (built into the cache first, then loaded from there).

Encoders (BERT, RoBERTa, DistilBERT: :data:`ENCODERS`; EW-FT's and DualTune's models) load with
``AutoModelForMaskedLM``: they train the classification task only, as a prompt ending in the mask token
whose masked-LM logits of the class words are the classifier (:mod:`raydp.runner.task`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from raydp.errors import ModelError
from raydp.model.adapters import AdapterPair, discover_adapter_pairs
from raydp.model.hf_progress import transformers_progress
from raydp.model.embedded import EMBEDDED_PRESETS, ensure_embedded_model, is_embedded_name

#: LoRA targets per architecture (the attention q and v projections; GPT-2 fuses q, k, v in c_attn).
LORA_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
}
#: Encoder (masked-LM) architectures: the classification task only.
ENCODERS = {"bert", "roberta", "distilbert"}
#: Architectures whose projections are ``Conv1D`` (weights stored transposed).
FAN_IN_FAN_OUT = {"gpt2"}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (paper Sec. 2.2: rank 8, alpha 16; dropout 0.05)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None  # None: by architecture, see LORA_TARGETS


@dataclass
class LoadedModel:
    """A LoRA-wrapped causal LM ready for fine-tuning."""

    model: PeftModel
    tokenizer: object
    pairs: list[AdapterPair]
    device: torch.device
    source: str
    model_type: str
    max_positions: int
    info: dict = field(default_factory=dict)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def is_encoder(self) -> bool:
        return self.model_type in ENCODERS


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when present, else CPU. Nothing in raydp requires a GPU. On CUDA, cuBLAS's fixed workspace is
    set before any CUDA work (the deterministic kernels of a DP step's isolated records need it:
    :func:`raydp.privacy.clipping.deterministic_kernels`)."""
    if device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise ModelError(f"unknown device {device!r}") from None
        if resolved.type == "cuda" and not torch.cuda.is_available():
            raise ModelError(f"device {device!r} requested but CUDA is not available")
    if resolved.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # a value the user set is kept
    return resolved


def check_model_name(name_or_path: str) -> None:
    """Cheap checks of a model name before anything is built: embedded presets, local paths, and that the Hub
    answers for a Hub name or has it cached (:func:`hub_options`)."""
    if name_or_path.startswith("embedded") and not is_embedded_name(name_or_path):
        raise ModelError(f"unknown embedded model {name_or_path!r}; known: {', '.join(EMBEDDED_PRESETS)}")
    if not is_embedded_name(name_or_path):
        _local_model_dir(name_or_path)
        hub_options(name_or_path)


#: seconds the one look at the Hub waits for an answer (HF_HUB_ETAG_TIMEOUT where set)
HUB_TIMEOUT_S = 5.0


def hub_options(name_or_path: str) -> dict:
    """``from_pretrained``'s keywords for ``name_or_path``: none for an embedded preset, a local directory, or with
    the Hub offline (``HF_HUB_OFFLINE=1``). For a Hub name, one HEAD request of its ``config.json`` with no retry:
    an unreachable Hub costs huggingface_hub about a minute of retries (5, 1-8 s apart, per file) before it fails.
    Unreachable, a model in the local cache loads from there (``local_files_only``); one that is not is a one-line
    ModelError. A Hub that answers, even "no such model", leaves the rest to ``from_pretrained``."""
    if is_embedded_name(name_or_path) or _local_model_dir(name_or_path) is not None:
        return {}
    from huggingface_hub import constants, get_hf_file_metadata, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():
        return {}
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_TIMEOUT_S)
    try:  # huggingface_hub's own template, at the endpoint it uses (get_hf_file_metadata does not retry)
        get_hf_file_metadata(f"{constants.ENDPOINT}/{name_or_path}/resolve/{constants.DEFAULT_REVISION}/config.json",
                             timeout=timeout)
        return {}
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status is not None and status < 500 and status not in (408, 429):
            return {}  # the Hub answered (no such repo, gated, ...): from_pretrained's error says which
        reason = f"HTTP {status}"
    except Exception as exc:  # no route, no DNS, refused, timed out: one attempt, no retries
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
    try:
        cached = isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    except ValueError:  # not a valid repo id: from_pretrained's error says so
        cached = False
    if cached:
        return {"local_files_only": True}
    raise ModelError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} for model {name_or_path!r} "
                     f"({reason}), and it is not in the local cache: connect, give a local model directory, or set "
                     "HF_HUB_OFFLINE=1 to use cached models without trying the Hub")


#: the files ``AutoTokenizer`` reads a vocabulary from (a fast tokenizer's tokenizer.json, a BPE vocab.json with
#: its merges.txt, a WordPiece vocab.txt, a SentencePiece model, Mistral's tekken.json) or its settings from
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json", "tokenizer_config.json")


def _no_tokenizer(name_or_path: str, where: str, empty: bool = False) -> ModelError:
    found = "what is there gives an empty vocabulary" if empty else "none is there"
    return ModelError(f"model {name_or_path!r} has no tokenizer: looked for {', '.join(TOKENIZER_FILES)} in {where}, "
                      f"and {found} (save the tokenizer beside the weights: tokenizer.save_pretrained(DIR))")


def _local_model_dir(name_or_path: str) -> Path | None:
    path = Path(name_or_path).expanduser()
    if name_or_path.startswith((".", "/", "~")) or path.exists():
        if not (path / "config.json").exists():
            raise ModelError(f"model path {name_or_path!r} is not a model directory (no config.json)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            # AutoTokenizer would build an empty tokenizer from the config alone, and training would fail far later
            raise _no_tokenizer(name_or_path, str(path.absolute()))
        return path
    return None


def resolve_model_source(name_or_path: str, cache_dir: str | Path | None = None, progress: bool = True) -> str:
    """Map an embedded preset to its cached directory; check that a local path is a model directory."""
    if is_embedded_name(name_or_path):
        return str(ensure_embedded_model(name_or_path, cache_dir=cache_dir, progress=progress))
    check_model_name(name_or_path)
    local = _local_model_dir(name_or_path)
    return str(local) if local is not None else name_or_path


def load_model(
    name_or_path: str = "embedded",
    device: str = "auto",
    lora: LoraSettings | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer and attach LoRA to the attention q/v projections.

    On CUDA the frozen base weights load in bf16 where supported; LoRA parameters stay fp32 (PEFT's
    ``autocast_adapter_dtype``). On CPU everything is fp32.
    """
    torch_device = resolve_device(device)
    source = resolve_model_source(name_or_path, cache_dir=cache_dir, progress=progress)
    dtype = torch.float32
    if torch_device.type == "cuda" and torch.cuda.is_bf16_supported():
        dtype = torch.bfloat16
    options = hub_options(name_or_path)  # an unreachable Hub: one attempt, not a minute of retries
    try:
        with transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(source, **options)
            if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):  # no vocabulary: nothing but special tokens
                raise _no_tokenizer(name_or_path, source if Path(source).is_dir() else f"the Hub's {source}",
                                    empty=True)
            kind = getattr(AutoConfig.from_pretrained(source, **options), "model_type", None)
            auto = AutoModelForMaskedLM if kind in ENCODERS else AutoModelForCausalLM
            # transformers looks for a PEFT adapter in the repo without local_files_only: it is given it here too
            base = auto.from_pretrained(source, dtype=dtype, **options,
                                        **({"adapter_kwargs": dict(options)} if options else {}))
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model {name_or_path!r}: {first_line}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model_type = getattr(base.config, "model_type", "unknown")
    fuse_activations(base)
    base.config.use_cache = False  # no key/value cache in training and evaluation; generation asks for one
    peft_model = apply_lora(base, model_type, lora or LoraSettings())
    peft_model.to(torch_device)
    pairs = discover_adapter_pairs(peft_model)
    max_positions = int(
        getattr(base.config, "n_positions", None) or getattr(base.config, "max_position_embeddings", 1024)
    )
    return LoadedModel(
        model=peft_model,
        tokenizer=tokenizer,
        pairs=pairs,
        device=torch_device,
        source=source,
        model_type=model_type,
        max_positions=max_positions,
        info={"base_dtype": str(dtype).removeprefix("torch."), "n_pairs": len(pairs)},
    )


def fuse_activations(model: torch.nn.Module) -> int:
    """Replace GPT-2's ``gelu_new`` (``NewGELUActivation``: eight elementwise passes in Python) by transformers'
    ``GELUTanh`` (``torch.nn.functional.gelu(approximate="tanh")``, one fused kernel) in place; returns how many.

    The same function (Hendrycks & Gimpel 2016, the tanh approximation), other rounding: outputs differ by at most a
    few float32 ulps (a test bounds it). On one CPU thread it makes the embedded model's forward and backward about
    10-20% cheaper (``docs/throughput.md``)."""
    from transformers.activations import GELUTanh, NewGELUActivation

    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                replaced += 1
    return replaced


def apply_lora(model: torch.nn.Module, model_type: str, settings: LoraSettings) -> PeftModel:
    """Freeze ``model`` and attach LoRA adapters (only A and B are trainable)."""
    targets = list(settings.target_modules) if settings.target_modules else LORA_TARGETS.get(model_type)
    if not targets:
        raise ModelError(
            f"no default LoRA targets for model type {model_type!r}; known: {', '.join(LORA_TARGETS)}"
            " (set lora target_modules explicitly)"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        fan_in_fan_out=model_type in FAN_IN_FAN_OUT,
        bias="none",
        task_type=None if model_type in ENCODERS else "CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # PEFT calls a transformers method deprecated in 5.x
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as exc:
        raise ModelError(f"cannot attach LoRA to {targets} on {model_type!r}: {str(exc).splitlines()[0]}") from None


def expected_adapter_pairs(name_or_path: str, lora: LoraSettings | None = None) -> int:
    """Number of LoRA pairs the model will get, from its config alone (no weights loaded): layers x
    targeted projections per layer. Raises ModelError if the config cannot be read."""
    from transformers import AutoConfig

    if is_embedded_name(name_or_path):
        n_layers, model_type = EMBEDDED_PRESETS[name_or_path].n_layer, "gpt2"
    else:
        source = resolve_model_source(name_or_path, progress=False)
        try:
            cfg = AutoConfig.from_pretrained(source, **hub_options(name_or_path))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the config of {name_or_path!r}: {exc}") from None
        model_type = cfg.model_type
        n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    targets = (lora.target_modules if lora and lora.target_modules else None) or LORA_TARGETS.get(model_type)
    if not targets:
        raise ModelError(f"no default LoRA targets for model type {model_type!r}; set lora.target_modules")
    return int(n_layers) * len(targets)


def disable_dropout(model) -> int:
    """Set every dropout probability to 0 (LoRA's and the backbone's); returns how many places changed.

    DP runs call this (ERRATA E12): dropout masks come from torch's global generator, seeded from the
    public ``seed``, and are laid out over the whole padded batch, so with known masks a record's
    gradient depends on which other records were sampled and the per-sample sensitivity argument no
    longer holds. Without dropout nothing random but the secret sampling and noise touches private data.
    Covers dropout modules (``nn.Dropout`` and its relatives) and attention dropout kept as a float
    attribute (``attention_dropout`` in Llama and Mistral, applied functionally)."""
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p != 0.0:
            module.p = 0.0
            changed += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate != 0.0:
            module.attention_dropout = 0.0
            changed += 1
    return changed
