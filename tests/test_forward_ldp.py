"""Classification task and forward-pass local DP (EW-FT, DP-Forward) against independent computations:
the task's labels against the verbaliser, per-example classification gradients against a naive loop,
the noise layer's clipping bound and noise scale, the freezing of the user's side, and a whole run's
ledger recomputed with dp_accounting."""

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from transformers import GPT2Config, GPT2LMHeadModel

from raydp.config import TrainConfig, validate_config
from raydp.data import generate_records, verbalise_records
from raydp.data.tasks import classification_spec, to_classification
from raydp.errors import ConfigError
from raydp.model.adapters import discover_adapter_pairs
from raydp.model.classifier import per_example_cross_entropy
from raydp.model.loading import LoraSettings, apply_lora
from raydp.privacy.clipping import PerSampleGradientComputer, pair_norms
from raydp.privacy.forward import ForwardNoiseLayer, clip_frobenius, install_noise_layer
from raydp.privacy.randomness import PrivateRandomness
from raydp.runner.launch import train


def test_labels_are_the_records_fields_and_the_clause_is_gone():
    records = generate_records(200, seed=3, progress=False)
    texts = verbalise_records(records, progress=False)
    for field, positive in (("change", "Ch"), ("diabetesMed", "Yes")):
        spec = classification_spec(field)
        inputs, labels, kept = to_classification(texts, spec)
        assert len(kept) == len(texts)  # synthetic records always carry these fields
        want = (records[field].to_numpy() != positive).astype(int)  # class 0 is the positive sentence
        assert labels.tolist() == want.tolist()
        for text in inputs:
            assert text.endswith(spec.prompt)
            assert all(sentence not in text for sentence, _ in spec.sentences)
    spec = classification_spec("readmitted")  # <30 and >30 merge into "readmitted"
    assert spec.classes == ("readmitted", "not")
    _, labels, _ = to_classification(texts, spec)
    assert labels.tolist() == (records["readmitted"].to_numpy() == "NO").astype(int).tolist()
    with pytest.raises(ConfigError, match="unknown label field"):
        classification_spec("age")


def tiny_model(seed=0, n_layer=3):
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=n_layer, n_head=2,
                                      embd_pdrop=0, attn_pdrop=0, resid_pdrop=0))
    model = apply_lora(base, "gpt2", LoraSettings(r=4, alpha=8, dropout=0.0))
    pairs = discover_adapter_pairs(model)
    with torch.no_grad():
        for pair in pairs:
            pair.b.normal_(0, 0.5)
    model.train()
    return model, pairs


def test_per_example_classification_gradients_equal_a_naive_loop():
    model, pairs = tiny_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.tensor([0, 1, 1, 0, 1])
    class_ids = (7, 11)

    def loss(logits, input_ids, attention_mask, labels):
        return per_example_cross_entropy(logits, labels, class_ids)

    grads = PerSampleGradientComputer(model, pairs, loss=loss).compute(ids, mask, labels)
    for row in range(5):  # textbook: one example at a time with autograd
        model.zero_grad()
        logits = model(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1]).logits
        per_example_cross_entropy(logits, labels[row:row + 1], class_ids).sum().backward()
        for i, pair in enumerate(pairs):
            assert torch.allclose(grads.a[i][row], pair.a.grad, atol=1e-6)
            assert torch.allclose(grads.b[i][row], pair.b.grad, atol=1e-6)
    assert (pair_norms(grads) > 0).all()


def test_noise_layer_clips_every_example_to_c_and_adds_noise_of_std_sigma_times_2c():
    z = torch.randn(64, 50, 8) * torch.logspace(-3, 2, 64).view(-1, 1, 1)
    clipped = clip_frobenius(z, 0.7)
    norms = clipped.flatten(1).norm(dim=1)
    assert (norms <= 0.7 * (1 + 1e-6)).all()
    small = z.flatten(1).norm(dim=1) <= 0.7
    assert torch.allclose(clipped[small], z[small])  # inside the ball: untouched
    layer = ForwardNoiseLayer(0.7, noise=PrivateRandomness.fresh().noise("cpu"))
    layer.sigma = 1.5
    out = layer(z)
    residual = (out - clipped).flatten()
    assert residual.std().item() == pytest.approx(1.5 * 2 * 0.7, rel=0.02)  # 25,600 draws: 4.5 s.e.
    assert abs(residual.mean().item()) < 0.1
    layer.noise = None
    with pytest.raises(ConfigError, match="no noise source"):
        layer(z)


def test_noise_layer_freezes_the_users_side_and_perturbs_the_providers_input():
    model, pairs = tiny_model(n_layer=3)
    layer = ForwardNoiseLayer(1.0, noise=PrivateRandomness.fresh().noise("cpu"))
    ids = torch.randint(1, 50, (2, 8))
    before = model(input_ids=ids).logits.detach()
    handle, frozen = install_noise_layer(model, 0, layer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and all(".h.0." not in n for n in trainable) and any(".h.1." in n for n in trainable)
    layer.sigma = 1.0
    noisy1, noisy2 = model(input_ids=ids).logits.detach(), model(input_ids=ids).logits.detach()
    assert not torch.allclose(noisy1, before) and not torch.allclose(noisy1, noisy2)  # fresh noise per release
    handle.remove()
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)
    with pytest.raises(ConfigError, match="at least one must follow"):
        install_noise_layer(model, 2, layer)


def train_run(out, **values) -> dict:
    """One run, quietly, of the config these values validate to (as `raydp train` validates its flags)."""
    return train(validate_config(TrainConfig, values), out, progress=False)


TINY_LM = {"model": "embedded-tiny", "data": {"n_records": 300}, "epochs": 2, "max_length": 96}
TINY = {**TINY_LM, "task": {"kind": "classification"}}


@pytest.fixture(scope="module")
def ewft_run(tmp_path_factory, raydp_cache):
    out = tmp_path_factory.mktemp("ldp") / "ewft"
    train_run(out, strategy="ewft", epsilon=8, **TINY)
    return out


def test_a_local_run_charges_each_epoch_once_and_its_epsilon_is_recomputed_independently(ewft_run):
    summary = json.loads((ewft_run / "summary.json").read_text())
    privacy = summary["privacy"]
    assert summary["task"]["kind"] == "classification" and 0 <= summary["final_eval_accuracy"] <= 1
    rows = pq.read_table(ewft_run / "privacy_ledger.parquet", columns=["step", "q", "sigma_eff"]).to_pylist()
    k, sigmas = privacy["records_per_unit"], privacy["sigmas_per_epoch"]
    assert [r["step"] for r in rows] == [0, 1] and all(r["q"] == 1.0 for r in rows)  # no subsampling (E8)
    assert [r["sigma_eff"] for r in rows] == pytest.approx([s / math.sqrt(k) for s in sigmas], rel=1e-12)
    assert sigmas[0] > sigmas[1]  # EWPBA: more noise first
    # dp_accounting, composed here from the file: the k records x 2 epochs of Gaussian releases, then the
    # k label releases (k-ary randomized response) by basic composition: the bound the run must respect.
    accountant = PLDAccountant()
    for s in sigmas:
        accountant.compose(dp_event.GaussianDpEvent(s), k)
    gaussian = accountant.get_epsilon(privacy["delta"])
    assert privacy["epsilon_by_accountant"]["pld_ledger_embeddings_only"] == pytest.approx(gaussian, rel=0.02)
    assert gaussian < privacy["epsilon"] <= gaussian + k * privacy["epsilon_label"] + 1e-6
    assert privacy["epsilon"] <= privacy["epsilon_target"] and privacy["within_budget"]
    assert privacy["epsilon"] >= 0.95 * privacy["epsilon_target"]
    assert privacy["paper_epsilon"] < 0.75 * privacy["epsilon"]  # the paper's subsampled figure, labelled
    assert "NOT a guarantee" in privacy["paper_epsilon_note"]


def test_a_local_run_trains_only_the_providers_side(ewft_run):
    from safetensors.torch import load_file

    privacy = json.loads((ewft_run / "summary.json").read_text())["privacy"]
    block = privacy["noise_layer_after_block"]
    weights = load_file(str(next((ewft_run / "adapter").glob("*.safetensors"))))
    user = [v for n, v in weights.items() if "lora_B" in n and f".h.{block}." in n]
    provider = [v for n, v in weights.items() if "lora_B" in n and f".h.{block + 1}." in n]
    assert user and all(float(v.abs().max()) == 0.0 for v in user)  # LoRA B starts at 0: never trained
    assert provider and any(float(v.abs().max()) > 0.0 for v in provider)


def test_local_strategies_need_a_classification_task(tmp_path):
    with pytest.raises(ConfigError, match=r"task: \{kind: classification\}"):
        train_run(tmp_path / "x", strategy="dpforward", epsilon=8)
    assert not (tmp_path / "x").exists()


def test_ewpba_run_follows_its_schedule_and_stays_within_budget(tmp_path, raydp_cache):
    out = tmp_path / "ewpba"
    train_run(out, strategy="ewpba", epsilon=2, **TINY_LM)
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    shape = privacy["schedule"]["per_epoch"]
    assert privacy["schedule"]["kind"] == "per_epoch" and shape[0] > shape[-1] == 1.0
    rows = pq.read_table(out / "privacy_ledger.parquet", columns=["q", "sigma_eff"]).to_pylist()
    q = privacy["q"]
    epochs = [math.floor(t * q) for t in range(len(rows))]
    want = [privacy["sigma_0"] * shape[min(e, len(shape) - 1)] for e in epochs]
    assert [r["sigma_eff"] for r in rows] == pytest.approx(want, rel=1e-9)
    accountant = PLDAccountant()
    for row in rows:
        accountant.compose(dp_event.PoissonSampledDpEvent(row["q"], dp_event.GaussianDpEvent(row["sigma_eff"])))
    assert privacy["epsilon"] == pytest.approx(accountant.get_epsilon(privacy["delta"]), rel=0.02)
    assert privacy["epsilon"] <= privacy["epsilon_target"]


def test_a_classification_study_runs_a_local_strategy_beside_dp_sgd_on_ray(local_ray, tmp_path):
    """`raydp study` with the classification task: ewft beside static DP-SGD, attacked after training; the
    results carry accuracy,
    the report an accuracy table, and the study composes the local run's RDP curve (labels included) with
    the DP-SGD run's ledger (ERRATA E7/E14), warning that their neighbouring relations differ."""
    import pandas as pd
    import yaml

    from raydp.report import write_report
    from raydp.study.runner import run_study
    from raydp.study.tables import format_report

    study = {"name": "cls", "models": ["embedded-tiny"], "epsilons": [8.0], "seeds": [0],
             "strategies": ["ewft", "static"], "resources": {"cpus_per_trial": 1}, "wandb": {"mode": "disabled"},
             "evaluate": {"generations": 10, "exposure_candidates": 20, "membership_records": 8, "audit": False},
             "attack": "all",
             "base": {"task": {"kind": "classification"}, "data": {"n_records": 300}, "epochs": 2,
                      "max_length": 64, "eval_max_records": 32, "public_eval_records": 32}}
    path = tmp_path / "cls.yaml"
    path.write_text(yaml.safe_dump(study))
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert sorted(table["strategy"]) == ["ewft", "static"] and (table["status"] == "TERMINATED").all()
    assert table["within_budget"].all() and (table["epsilon"] <= 8.0).all()
    assert table["final_public_accuracy"].between(0, 1).all() and table["mia_auc"].notna().all()  # attacked
    composed = json.loads((study_dir / "study_summary.json").read_text())["tuning_aware_epsilon"]
    sources = {run["name"].split("_")[0]: run["curve"] for d in composed.values() for run in d["composed"]}
    assert sources == {"ewft": "local", "static": "ledger"}
    assert any("neighbouring relations" in w for d in composed.values() for w in d["warnings"])
    assert format_report(study_dir) and write_report(study_dir).is_file()


def test_the_noise_layer_finds_the_blocks_of_a_llama_model_too():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    model = apply_lora(base, "llama", LoraSettings(r=4, alpha=8, dropout=0.0))
    ids = torch.randint(1, 50, (2, 8))
    before = model(input_ids=ids).logits.detach()
    layer = ForwardNoiseLayer(0.5, noise=PrivateRandomness.fresh().noise("cpu"))
    layer.sigma = 2.0
    handle, frozen = install_noise_layer(model, 1, layer)
    assert frozen and not torch.allclose(model(input_ids=ids).logits, before)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".layers.2." in n for n in trainable)  # only the provider's side
    handle.remove()


def test_each_patient_contributes_exactly_k_records_so_the_count_is_not_released():
    from raydp.runner.local_setup import unit_records

    units = np.array([7, 7, 7, 3, 9, 9])  # patient 7 has three records, 3 has one, 9 has two
    rows = unit_records(units, len(units), 2)
    assert rows.tolist() == [0, 1, 3, 3, 4, 5]  # first k in file order; a single record repeated
    assert unit_records(units, len(units), 1).tolist() == [0, 3, 4]
    assert unit_records(None, 4, 3).tolist() == [0, 1, 2, 3]  # record unit: every record once


def test_a_resumed_local_step_keeps_its_released_labels_and_will_not_re_release_an_epoch():
    from raydp.model.batches import Batch
    from raydp.privacy.guard import BudgetExhausted
    from raydp.privacy.ledger import PrivacyLedger
    from raydp.privacy.forward import ForwardLDPStep

    class Split:  # stands in for the training split: only its (released) labels matter here
        labels = np.array([0, 1, 1, 0])

    def loss(logits, input_ids, attention_mask, labels):
        return per_example_cross_entropy(logits, labels, (7, 11))

    model, _ = tiny_model()
    layer = ForwardNoiseLayer(1.0, noise=PrivateRandomness.fresh().noise("cpu"))
    install_noise_layer(model, 0, layer)
    first = ForwardLDPStep(layer, (2.0, 1.0), 1, PrivacyLedger(delta=1e-5), 3, loss, "ewft", train_split=Split())
    ids = torch.randint(1, 50, (2, 8))
    first.compute(model, Batch([0, 1], ids, torch.ones_like(ids), labels=torch.tensor([0, 1])))
    state = first.state_dict()
    split = type("Redrawn", (), {"labels": np.array([1, 1, 1, 1])})()  # a resume's fresh draw: discarded
    resumed = ForwardLDPStep(layer, (2.0, 1.0), 1, PrivacyLedger(delta=1e-5), 3, loss, "ewft", train_split=split)
    resumed.load_state_dict(state)
    assert split.labels.tolist() == [0, 1, 1, 0] and len(resumed.ledger) == 1
    assert "middle of epoch 1" in resumed.stop_reason(1)  # the loop stops cleanly before the step
    with pytest.raises(BudgetExhausted, match="middle of epoch 1"):
        resumed.compute(model, Batch([0, 1], ids, torch.ones_like(ids), labels=torch.tensor([0, 1])))


def test_a_local_step_refuses_a_pass_that_skipped_its_noise_layer():
    """A compiled model may run a graph without the noise hook: its embeddings would reach training un-noised while
    the ledger charged a release. The step refuses a compiled model, and a pass that never went through the layer
    (here the hook taken off, as a compiled block's graph would skip it), before any gradient."""
    from raydp.model.batches import Batch
    from raydp.privacy.forward import ForwardLDPStep
    from raydp.privacy.ledger import PrivacyLedger

    def loss(logits, input_ids, attention_mask, labels):
        return per_example_cross_entropy(logits, labels, (7, 11))

    model, _ = tiny_model()
    layer = ForwardNoiseLayer(1.0, noise=PrivateRandomness.fresh().noise("cpu"))
    handle, _ = install_noise_layer(model, 0, layer)
    step = ForwardLDPStep(layer, (2.0, 1.0), 1, PrivacyLedger(delta=1e-5), 3, loss, "ewft")
    ids = torch.randint(1, 50, (2, 8))
    batch = Batch([0, 1], ids, torch.ones_like(ids), labels=torch.tensor([0, 1]))
    step.compute(model, batch)
    assert layer.calls == 1
    handle.remove()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="did not go through the noise layer"):
        step.compute(model, batch)
    assert all(p.grad is None for p in model.parameters())  # refused before the backward pass
    install_noise_layer(model, 0, layer)
    next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).compile()
    with pytest.raises(ValueError, match="torch.compile'd model is refused"):
        step.compute(model, batch)


def test_nothing_trainable_may_sit_before_the_noise_or_outside_the_clipped_pairs(tmp_path):
    model, _ = tiny_model()
    model.get_input_embeddings().weight.requires_grad_(True)  # e.g. LoRA on the embeddings
    layer = ForwardNoiseLayer(1.0, noise=PrivateRandomness.fresh().noise("cpu"))
    with pytest.raises(ConfigError, match="trainable parameters outside the blocks after the noise"):
        install_noise_layer(model, 0, layer)
    # DP-SGD: LoRA on the embeddings would be updated with raw gradients
    with pytest.raises(ConfigError, match="outside the LoRA adapter pairs"):
        train_run(tmp_path / "x", lora={"target_modules": ["c_attn", "wte"]}, strategy="static", epsilon=2,
                  **TINY_LM)
    assert not (tmp_path / "x").exists()


def test_a_local_ledger_alone_gives_the_runs_spend_labels_included(ewft_run):
    from raydp.privacy.ledger import PrivacyLedger
    from raydp.study.results import ORDERS, ledger_curve
    from raydp.privacy.accounting.rdp import ledger_rdp_curve, rdp_epsilon

    privacy = json.loads((ewft_run / "summary.json").read_text())["privacy"]
    ledger = PrivacyLedger.load(ewft_run / "privacy_ledger.parquet")
    assert ledger.metadata["neighbouring_relation"] == "replace_one_local"
    with_labels, rows_only = ledger_curve(ledger), ledger_rdp_curve(ledger)
    k, e = privacy["records_per_unit"], privacy["epsilon_label"]
    assert np.allclose(with_labels - rows_only, k * np.minimum(e, ORDERS * e * e / 2))  # the labels' RDP
    assert rdp_epsilon(with_labels, ORDERS, privacy["delta"]) >= privacy["epsilon"]  # RDP: looser, never below


def test_a_local_run_on_a_from_pretrained_llama_directory(tmp_path, tiny_tokenizer_dir):
    """The real path: any local (or hub) causal LM directory; here a tiny random Llama saved to disk."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "llama"
    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(model_dir)
    shutil.copytree(tiny_tokenizer_dir, model_dir, dirs_exist_ok=True)
    out = tmp_path / "run"
    train_run(out, model=str(model_dir), strategy="ewft", epsilon=8, data={"n_records": 200}, epochs=1,
              max_length=48, task={"kind": "classification"}, settings={"autoencoder": [4], "layer": 1})
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    assert privacy["noise_layer_after_block"] == 1 and privacy["autoencoder"]["dims"] == [4]
    assert privacy["within_budget"] and privacy["neighbouring_relation"].startswith("replace-one")


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random BERT (masked LM) saved with the local tokenizer plus a mask token (no hub)."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    path = tmp_path_factory.mktemp("bert")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    tokenizer.save_pretrained(path)
    BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=2, max_position_embeddings=64,
                               pad_token_id=tokenizer.pad_token_id)).save_pretrained(path)
    return path


@pytest.mark.parametrize("strategy", ["ewft", "static"])
def test_an_encoder_classifies_at_its_mask_token_under_dp_sgd_and_local_dp(tiny_bert_dir, tmp_path, strategy):
    """The paper's model family: an encoder (masked LM) from a local directory, the prompt ending in the
    mask token, the class words' masked-LM logits as the classifier."""
    out = tmp_path / strategy
    train_run(out, model=str(tiny_bert_dir), strategy=strategy, epsilon=8, data={"n_records": 200}, epochs=1,
              max_length=48, task={"kind": "classification"},
              settings={"autoencoder": [4]} if strategy == "ewft" else {"clip": 0.5})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_type"] == "bert" and 0 <= summary["final_eval_accuracy"] <= 1
    assert summary["privacy"]["within_budget"] and summary["n_adapter_pairs"] == 6  # query and value x 3


def test_an_encoder_trains_classification_only(tiny_bert_dir, tmp_path):
    with pytest.raises(ConfigError, match="classification task only"):
        train_run(tmp_path / "x", model=str(tiny_bert_dir), data={"n_records": 200}, epochs=1)
    assert not (tmp_path / "x").exists()
