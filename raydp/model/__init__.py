"""Language models: the embedded default, Hugging Face loading, LoRA and adapter pairs (RLDP Sec. 2.2)."""

from raydp.model.adapters import AdapterPair, discover_adapter_pairs
from raydp.model.loading import LoadedModel, LoraSettings, apply_lora, disable_dropout, load_model, resolve_device
from raydp.model.loss import per_sequence_nll, token_nll

__all__ = [
    "AdapterPair",
    "LoadedModel",
    "LoraSettings",
    "apply_lora",
    "disable_dropout",
    "discover_adapter_pairs",
    "load_model",
    "per_sequence_nll",
    "resolve_device",
    "token_nll",
]
