"""LoRA adapter-pair discovery (RLDP Sec. 2.2-2.3).

RLDP clips and controls each LoRA pair ``(A_i, B_i)`` as one privacy unit. This module lists the pairs
of a PEFT model in a stable order (by layer, then by module name) with what the controller needs to
know about each: its layer index, its module name and its relative depth in [0, 1].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer

_LAYER_INDEX = re.compile(r"\.(?:h|layers|layer|blocks|block)\.(\d+)\.")


@dataclass(frozen=True)
class AdapterPair:
    """One LoRA pair: ``delta W = B A`` on ``module_name``."""

    index: int
    module_name: str
    layer: int
    relative_depth: float
    a: torch.nn.Parameter
    b: torch.nn.Parameter

    @property
    def num_params(self) -> int:
        return self.a.numel() + self.b.numel()

    def describe(self) -> dict:
        """The pair without its tensors (for manifests and logs)."""
        return {
            "index": self.index,
            "module_name": self.module_name,
            "layer": self.layer,
            "relative_depth": self.relative_depth,
            "shape_a": list(self.a.shape),
            "shape_b": list(self.b.shape),
        }


def _num_layers(model: torch.nn.Module, found_layers: list[int]) -> int:
    config = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return max(found_layers) + 1 if found_layers else 1


def discover_adapter_pairs(model: torch.nn.Module, adapter_name: str = "default") -> list[AdapterPair]:
    """The ordered LoRA pairs of a PEFT model (GPT-2 ``c_attn``, Llama/Mistral ``q_proj``/``v_proj``).

    Works on the PEFT model itself or on a wrapper (e.g. Opacus's ``GradSampleModule``): the returned
    parameters are the model's own tensors.
    """
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in getattr(module, "lora_A", {}):
            continue
        match = _LAYER_INDEX.search(name + ".")
        layer = int(match.group(1)) if match else 0
        clean = name.removeprefix("_module.")
        found.append((layer, clean, module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight))
    if not found:
        return []
    found.sort(key=lambda item: (item[0], item[1]))
    n_layers = _num_layers(model, [f[0] for f in found])
    denominator = max(n_layers - 1, 1)
    return [
        AdapterPair(
            index=i,
            module_name=name,
            layer=layer,
            relative_depth=min(layer / denominator, 1.0),
            a=a,
            b=b,
        )
        for i, (layer, name, a, b) in enumerate(found)
    ]
