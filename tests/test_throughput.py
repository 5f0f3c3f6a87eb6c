"""Throughput changes that must keep the arithmetic (issue 28): under the unsafe fixed randomness (replayable), a run
whose evaluations are fewer trains exactly the same adapters and ledger, and its final evaluation is the same."""

from __future__ import annotations

import json

import pytest

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from raydp.config import TrainConfig
from raydp.runner.run import run_training

TINY = {"model": "embedded-tiny", "strategy": "static-pairwise", "epsilon": 2.0, "max_steps": 6, "seed": 3,
        "unsafe_fixed_randomness": True, "data": {"n_records": 300}, "eval_max_records": 16, "public_eval_records": 16}


def test_fewer_evaluations_train_the_same_run(tmp_path, raydp_cache):
    every = run_training(TrainConfig(**TINY, eval_every=2), tmp_path / "every", progress=False)
    ends = run_training(TrainConfig(**TINY), tmp_path / "ends", progress=False)  # step 0, epoch ends, the last
    rows = {name: pq.read_table(tmp_path / name / "eval_metrics.parquet").to_pylist() for name in ("every", "ends")}
    assert [r["step"] for r in rows["every"]] == [0, 2, 4, 6] and [r["step"] for r in rows["ends"]] == [0, 6]
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("every", "ends"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ledgers = [pq.read_table(tmp_path / name / "privacy_ledger.parquet").to_pylist() for name in ("every", "ends")]
    assert ledgers[0] == ledgers[1]
    assert rows["every"][-1] == rows["ends"][-1] and every["final_eval_value_nll"] == ends["final_eval_value_nll"]
    assert json.loads((tmp_path / "ends" / "summary.json").read_text())["privacy"]["epsilon_void"]  # replayable: void


def test_a_cold_model_cache_trains_the_same_run_as_a_warm_one(tmp_path, monkeypatch):
    """Issue 31 (found here): building the embedded model drew from torch's global generator, so a run that built it
    started from other LoRA weights than a run that loaded it. The build now leaves the caller's generator alone."""
    config = TrainConfig(**{**TINY, "strategy": "nonprivate", "epsilon": None})
    monkeypatch.setenv("RAYDP_CACHE", str(tmp_path / "cold-cache"))
    run_training(config, tmp_path / "cold", progress=False)  # builds the model
    run_training(config, tmp_path / "warm", progress=False)  # loads it
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("cold", "warm"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_fused_activation_is_gpt2s_gelu_new_up_to_rounding():
    """``fuse_activations`` swaps GPT-2's ``gelu_new`` for one fused kernel: the same function (checked against the
    formula itself, and the model's logits against the unfused model's), other rounding only."""
    import copy
    import math

    from transformers import GPT2Config, GPT2LMHeadModel

    from raydp.model.loading import fuse_activations

    x = torch.linspace(-8, 8, 10_001)
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=2)).eval()
    fused = copy.deepcopy(model)
    assert fuse_activations(fused) == 3 and fuse_activations(fused) == 0
    assert torch.allclose(fused.transformer.h[0].mlp.act(x), formula, rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 97, (4, 20))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, fused(input_ids=ids).logits
    assert not torch.equal(a, b)  # it is another kernel (if equal, this test no longer says what it claims)
    assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_length_sorted_evaluation_matches_one_sequence_at_a_time(raydp_cache):
    """Evaluation in length-sorted batches (less padding) gives every figure a loop over single sequences (no padding
    at all) gives, up to the order of the additions, and each sequence's value NLL at its own position."""
    import math

    import numpy as np

    from raydp.data.public import public_corpus
    from raydp.evaluation.perplexity import evaluate_perplexity, value_nll_per_sequence
    from raydp.model import load_model
    from raydp.model.batches import TokenizedSplit
    from raydp.model.loss import token_nll

    loaded = load_model("embedded-tiny", device="cpu", progress=False)
    texts, spans = public_corpus(40, seed=11, spans=True)
    texts = [t if i % 3 else t + " and more words" * (i % 5) for i, t in enumerate(texts)]  # lengths that vary
    split = TokenizedSplit(texts, loaded.tokenizer, 128, spans=spans)
    assert len({len(s) for s in split.sequences}) > 5
    loaded.model.eval()
    singles, tokens = [], 0
    with torch.no_grad():
        for i in range(len(split)):
            batch = split.collate([i], loaded.device)
            nll, mask = token_nll(loaded.model(input_ids=batch.input_ids).logits, batch.input_ids,
                                  batch.attention_mask)
            singles.append((float(nll.sum()), float((nll * batch.value_mask[:, 1:]).sum())))
            tokens += int(mask.sum())
    total, value = (np.array(column) for column in zip(*singles))
    whole = evaluate_perplexity(loaded.model, split, loaded.device, batch_size=6)
    assert whole.n_tokens == tokens
    assert whole.nll_per_token == pytest.approx(total.sum() / tokens, rel=1e-5)
    assert whole.perplexity == pytest.approx(math.exp(total.sum() / tokens), rel=1e-5)
    assert whole.value_nll_per_record == pytest.approx(value.mean(), rel=1e-5)
    per = value_nll_per_sequence(loaded.model, split, loaded.device, batch_size=6)
    assert np.allclose(per, value, rtol=1e-5, atol=1e-4)


def test_the_loaded_model_keeps_no_key_value_cache_unless_asked(raydp_cache):
    from raydp.model import load_model

    loaded = load_model("embedded-tiny", device="cpu", progress=False)
    ids = torch.tensor([[2, 3, 4, 5]])
    with torch.no_grad():
        assert loaded.model(input_ids=ids).past_key_values is None
        assert loaded.model(input_ids=ids, use_cache=True).past_key_values is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_token_nll_is_cross_entropy_of_the_shifted_logits_to_the_last_bit(dtype):
    """:func:`token_nll` takes the log-softmax of the whole logits and gathers the shifted targets (no copy of the
    shifted slice); its NLL and the gradient it sends back have the values of ``F.cross_entropy`` of the shifted
    slice, the computation it replaced (``torch.equal``: a zero's sign aside), padded positions and the last
    (unscored) position included."""
    import torch.nn.functional as F

    from raydp.model.loss import per_sequence_nll, token_nll

    generator = torch.Generator().manual_seed(0)
    batch, width, vocab = 6, 17, 211
    logits = (3 * torch.randn(batch, width, vocab, generator=generator)).to(dtype)
    ids = torch.randint(0, vocab, (batch, width), generator=generator)
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[1, 9:] = 0
    mask[4, 2:] = 0
    weights = torch.randn(batch, generator=generator)

    def reference(x):
        shifted = x[:, :-1, :].float()
        nll = F.cross_entropy(shifted.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none").view(batch, -1)
        m = mask[:, 1:].float()
        return nll * m, (nll * m).sum(1) / m.sum(1).clamp_min(1.0)

    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    nll, _ = token_nll(ours, ids, mask)
    ref_nll, ref_seq = reference(theirs)
    assert torch.equal(nll, ref_nll)
    (per_sequence_nll(ours, ids, mask) * weights).sum().backward()
    (ref_seq * weights).sum().backward()
    assert torch.equal(ours.grad, theirs.grad)
    assert ours.grad[:, -1].abs().sum() == 0 and ours.grad[4, 3:].abs().sum() == 0  # unscored rows: no gradient


@pytest.mark.slow  # the fast tier covers its feature elsewhere; CI's 20-minute budget (2026-11-28)
def test_keeping_freed_memory_trains_the_same_run(tmp_path, raydp_cache):
    """The allocator setting (:mod:`raydp.runner.allocator`) changes where memory comes from, not what is computed:
    one process with it and one without train the same adapter and evaluations to the last bit."""
    import os
    import subprocess
    import sys

    script = ("import sys; from raydp.config import TrainConfig; from raydp.runner.run import run_training; "
              "from raydp.runner.allocator import keep_freed_memory; "
              f"run_training(TrainConfig(**{TINY!r}), sys.argv[1], progress=False); print(keep_freed_memory())")
    kept = {}
    for name, setting in (("kept", "1"), ("returned", "0")):
        env = {**os.environ, "RAYDP_KEEP_FREED_MEMORY": setting}
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], env=env, capture_output=True,
                             text=True, check=True).stdout
        kept[name] = out.strip().splitlines()[-1]
    import platform

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"  # elsewhere it is left alone
    assert kept == {"kept": str(glibc), "returned": "False"}
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in kept)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [pq.read_table(tmp_path / name / "eval_metrics.parquet").to_pylist() for name in kept]
    assert rows[0] == rows[1]


def test_a_profiled_trial_leaves_its_statistics_even_when_it_fails(tmp_path, monkeypatch):
    """``RAYDP_PROFILE_DIR`` (bench/bench_episode.py --study): the trainable Tune knows, ``run_trial``, runs its body
    under cProfile and writes the statistics, named by the trial, beside a PRIVACY.txt, also when the trial raises
    (here: a study config that does not validate)."""
    import pstats

    from pydantic import ValidationError

    from raydp.study import trainable as runner

    monkeypatch.setenv(runner.PROFILE_ENV, str(tmp_path / "profiles"))
    with pytest.raises(ValidationError):
        runner.run_trial({"study": {"no_such_field": 1}, "trial": {"name": "static-pairwise_embedded_eps2_seed0"}})
    (written,) = (tmp_path / "profiles").glob("*.prof")
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == ["PRIVACY.txt", written.name]  # nothing partial
    assert written.name.startswith("static-pairwise_embedded_eps2_seed0-")
    assert "_run_trial" in {name for (_, _, name) in pstats.Stats(str(written)).stats}
    assert "Never release" in (tmp_path / "profiles" / "PRIVACY.txt").read_text()


def test_a_profiled_trial_that_cannot_write_its_statistics_still_succeeds(tmp_path, monkeypatch, caplog):
    """Profiling never changes a trial's outcome: the body's return comes back, and an unwritable directory is a
    warning; unset, the body runs unprofiled."""
    from raydp.study import trainable as runner

    calls = []
    monkeypatch.setattr(runner, "_run_trial", lambda params: calls.append(params) or "done")
    monkeypatch.delenv(runner.PROFILE_ENV, raising=False)
    assert runner.run_trial({"n": 1}) == "done"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(runner.PROFILE_ENV, str(blocked / "profiles"))  # below a file: mkdir fails
    with caplog.at_level("WARNING", logger=runner.__name__):
        assert runner.run_trial({"n": 2}) == "done"
    assert calls == [{"n": 1}, {"n": 2}]
    assert "its profile was not written" in caplog.text


def test_every_profiled_phase_names_a_function_of_its_file():
    """bench/bench_episode.py's phases are cProfile entries (file suffix, function name): a renamed function would
    read as 0 s without an error."""
    import ast
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    try:
        import bench_episode
    finally:
        sys.path.remove(str(root / "bench"))
    for phase, (module, function) in {**bench_episode.PHASES, **bench_episode.TRIAL_PHASES}.items():
        if not module.startswith("raydp/"):
            continue  # torch's own
        tree = ast.parse((root / module).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert function in defined, f"{phase}: {module} defines no {function}"


def test_a_study_bench_arm_changes_the_study_file_it_names(tmp_path):
    """bench/bench_study.py's arms: NAME[@DIR][:KEY=VALUE;...] changes top-level keys (an empty value removes one), and
    the written copy resolves the file's relative paths as `raydp study` does, so it runs from any directory."""
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    try:
        import bench_study
    finally:
        sys.path.remove(str(root / "bench"))
    name, changes = bench_study.parse_arm("all@/tmp/old:attack=all;attack_strategies=")
    assert (name, changes) == ("all@/tmp/old", {"attack": "all", "attack_strategies": None})
    assert bench_study.parse_arm("released") == ("released", {})
    written = yaml.safe_load(bench_study.arm_file(root / "trials" / "quickstart.yaml", changes, tmp_path).read_text())
    assert written["attack"] == "all" and "attack_strategies" not in written
    assert written["tuned_from"] == str(root / "trials" / "tuned" / "schedule-search.json")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_study.parse_arm("x:attack")
