"""Models: local from_pretrained path, LoRA placement, adapter-pair discovery, per-sequence loss."""

import shutil

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from raydp.errors import ModelError
from raydp.model import LoraSettings, load_model, per_sequence_nll


def _save_tiny(kind: str, path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=3, n_head=2))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    else:
        model = MistralForCausalLM(MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64))
    model.save_pretrained(path)
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


@pytest.mark.parametrize(
    "kind, modules, kv_out",
    [("gpt2", ["c_attn"], None), ("llama", ["q_proj", "v_proj"], 16), ("mistral", ["q_proj", "v_proj"], 16)],
)
def test_adapter_pairs_on_tiny_configs(kind, modules, kv_out, tmp_path, tiny_tokenizer_dir):
    path = _save_tiny(kind, tmp_path / kind, tiny_tokenizer_dir)
    loaded = load_model(str(path), device="cpu", progress=False)
    pairs = loaded.pairs
    assert len(pairs) == 3 * len(modules)
    assert [p.index for p in pairs] == list(range(len(pairs)))
    assert [p.layer for p in pairs] == sorted(p.layer for p in pairs)
    assert {p.module_name.rsplit(".", 1)[-1] for p in pairs} == set(modules)
    assert pairs[0].relative_depth == 0.0 and pairs[-1].relative_depth == 1.0
    for pair in pairs:
        assert pair.a.shape[0] == 8 and pair.b.shape[1] == 8  # rank 8
        assert pair.a.shape[1] == 32  # d_in = hidden size
        if pair.module_name.endswith("v_proj"):
            assert pair.b.shape[0] == kv_out  # 2 kv heads x head_dim 8
    if kind == "gpt2":
        assert pairs[0].b.shape[0] == 3 * 32  # fused q, k, v
    # Only LoRA parameters are trainable, and they are exactly the discovered pairs.
    trainable = {id(p) for p in loaded.model.parameters() if p.requires_grad}
    assert trainable == {id(t) for pair in pairs for t in (pair.a, pair.b)}
    assert all(p.dtype == torch.float32 for p in loaded.trainable_parameters())


def test_lora_settings_applied(tmp_path, tiny_tokenizer_dir):
    path = _save_tiny("gpt2", tmp_path / "g", tiny_tokenizer_dir)
    loaded = load_model(str(path), device="cpu", lora=LoraSettings(r=4, alpha=8, dropout=0.0), progress=False)
    assert loaded.pairs[0].a.shape[0] == 4
    lora_module = loaded.model.base_model.model.transformer.h[0].attn.c_attn
    assert lora_module.scaling["default"] == pytest.approx(8 / 4)


def test_bad_model_names(tmp_path):
    with pytest.raises(ModelError, match="unknown embedded model"):
        load_model("embedded-nonexistent", device="cpu", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path / "empty"), device="cpu", progress=False)
    with pytest.raises(ModelError, match="unknown device"):
        load_model("embedded", device="tpu:7", progress=False)


def test_per_sequence_loss_ignores_padding_and_other_samples():
    torch.manual_seed(0)
    vocab = 11
    logits = torch.randn(2, 6, vocab)
    ids = torch.randint(0, vocab, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    got = per_sequence_nll(logits, ids, mask)
    # Independent computation: a plain loop over positions with log_softmax.
    for b in range(2):
        n = int(mask[b].sum())
        terms = [-torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]] for t in range(n - 1)]
        assert got[b].item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)
    # Sequence 1 alone (unpadded) gives the same loss as inside the padded batch.
    alone = per_sequence_nll(logits[1:, :3], ids[1:, :3], mask[1:, :3])
    assert alone.item() == pytest.approx(got[1].item(), rel=1e-6)
    # Changing padding positions' logits or ids changes nothing.
    logits2, ids2 = logits.clone(), ids.clone()
    logits2[1, 3:] = 100.0
    ids2[1, 3:] = 0
    assert torch.allclose(per_sequence_nll(logits2, ids2, mask), got)
