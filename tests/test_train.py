"""End-to-end: a short non-private run through the CLI, and bad input that must leave nothing behind."""

import json

import pyarrow.parquet as pq
import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from raydp.cli import main
from raydp.model.embedded import EMBEDDED_PRESETS, MARKER_FILE, ensure_embedded_model
from raydp.runner.loop import evaluation_steps


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, raydp_cache):
    out = tmp_path_factory.mktemp("runs") / "short"
    code = main(["train", "--output", str(out), "--quiet", "--n-records", "600", "--epochs", "2",
                 "--eval-every", "16", "--warmup-steps", "10", "--lr", "2e-3"])
    assert code == 0
    return out


def test_short_run_lowers_eval_perplexity(short_run):
    summary = json.loads((short_run / "summary.json").read_text())
    evals = pq.read_table(short_run / "eval_metrics.parquet").to_pylist()
    assert evals[0]["step"] == 0 and evals[-1]["step"] == summary["steps"]
    assert summary["final_eval_perplexity"] < 0.99 * summary["initial_eval_perplexity"]
    assert "truncated_train_sequences" not in summary and "mean_train_tokens" not in summary  # private stats
    assert summary["final_public_perplexity"] < summary["initial_public_perplexity"]
    assert all(row["public_perplexity"] > 1 for row in evals)
    train = pq.read_table(short_run / "train_metrics.parquet").to_pylist()
    assert len(train) == summary["steps"] and train[0]["lr"] == pytest.approx(2e-3 / 10)


def test_outputs_are_complete_and_adapters_reload(short_run):
    for name in ("config.json", "summary.json", "train_metrics.parquet", "eval_metrics.parquet",
                 "private/dataset/manifest.json", "private/README", "adapter/adapter_config.json"):
        assert (short_run / name).exists(), name
    assert not list(short_run.parent.glob(".short.partial-*"))
    base = AutoModelForCausalLM.from_pretrained(ensure_embedded_model("embedded"))
    reloaded = PeftModel.from_pretrained(base, short_run / "adapter")
    assert sum(p.numel() for n, p in reloaded.named_parameters() if "lora_" in n) > 0


def test_embedded_model_is_cached_and_deterministic(raydp_cache, tmp_path):
    first = ensure_embedded_model("embedded-tiny", progress=False)  # the session's cache: built once for all tests
    built_at = (first / MARKER_FILE).stat().st_mtime_ns
    again = ensure_embedded_model("embedded-tiny", progress=False)
    other = ensure_embedded_model("embedded-tiny", cache_dir=tmp_path / "b", progress=False)  # a second build
    assert first == again and (again / MARKER_FILE).stat().st_mtime_ns == built_at  # not rebuilt
    assert first.is_relative_to(raydp_cache) and other != first
    a = AutoModelForCausalLM.from_pretrained(first).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert all((a[k] == b[k]).all() for k in a)
    assert EMBEDDED_PRESETS["embedded-deep"].n_layer > EMBEDDED_PRESETS["embedded"].n_layer


def test_evaluation_schedule_every_48_and_epoch_ends():
    assert evaluation_steps(200, 90.0, 48) == {48, 90, 96, 144, 180, 192, 200}
    # an epoch ends at the first step by which its batches are drawn: 3 epochs of 234.07 steps end at 235, 469 and
    # 703 (the last step: evaluated once, not at 702 and 703)
    assert evaluation_steps(703, 234.07, 0) == {235, 469, 703}
    assert evaluation_steps(993, 331.0, 0) == {331, 662, 993}


def test_the_loop_stops_cleanly_on_the_gradient_computations_stop_reason(tiny_tokenizer_dir, capsys):
    """``stop_reason`` is asked before every step; on a reason the loop stops, evaluates the last step
    done, checkpoints it before announcing it, and (off a terminal) logs plain lines."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from raydp.data import public_corpus
    from raydp.model.batches import TokenizedSplit
    from raydp.runner import NonPrivateGradient, OptimizerSettings, ShuffledBatchSampler, Trainer

    class StopsAfterThree(NonPrivateGradient):
        asked = []

        def stop_reason(self, step):
            self.asked.append(step)
            return "budget spent" if step >= 3 else None

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2))
    texts = public_corpus(24, seed=3, progress=False)
    train, evaluation = TokenizedSplit(texts[:20], tokenizer, 64), TokenizedSplit(texts[20:], tokenizer, 64)
    events = []
    trainer = Trainer(model, train, evaluation, ShuffledBatchSampler(len(train), 4, seed=0), StopsAfterThree(),
                      torch.device("cpu"), OptimizerSettings(warmup_steps=0), eval_every=100, progress="lines",
                      on_evaluation=lambda step, row: events.append(("eval", step)),
                      on_checkpoint=lambda t: events.append(("checkpoint", t.step_count)))
    trainer.run(10)
    assert trainer.step_count == 3 and trainer.stopped_early == "budget spent"
    assert StopsAfterThree.asked == [0, 1, 2, 3]
    assert [row["step"] for row in trainer.history.eval_rows] == [0, 3]
    assert events == [("eval", 0), ("checkpoint", 3), ("eval", 3)]
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split(":")[1].split()[:2] for line in err.splitlines()] == [
        ["step", "0/10"], ["step", "3/10"], ["stopped", "early"]]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "embedded-huge"], "unknown embedded model"),
        (["--model", "./no/such/model"], "not a model directory"),
        (["--n-records", "0"], "n_records"),
        (["--batch-size", "-3"], "batch_size"),
        (["--epochs", "0"], "epochs"),
        (["--source", "/no/such/diabetic_data.csv"], "diabetic_data.csv"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(extra, message, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--output", str(out), "--quiet", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("raydp: error:") and message in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_broken_csv_fails_before_training(tmp_path, capsys):
    csv = tmp_path / "diabetic_data.csv"
    csv.write_text("encounter_id,race\n1,Caucasian\n")
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), "--quiet", "--source", str(csv)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing column" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diabetic_data.csv"]


def test_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["train", "--output", str(blocker / "run"), "--quiet"]) == 2
    assert "cannot write output directory" in capsys.readouterr().err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert main(["train", "--output", str(occupied), "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]


def test_a_runs_cpus_sets_its_threads_in_process(small_dataset, tmp_path):
    """`raydp train --cpus N` runs an uncontrolled strategy in this process: the run takes N threads while it runs (it
    ignored them, so two runs side by side on 2 cores each ran torch's 2 threads and took about 10x longer per step),
    and gives the caller back its own count."""
    import torch

    from raydp.config import TrainConfig
    from raydp.runner.run import run_training

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen = []
        config = TrainConfig(model="embedded-tiny", strategy="nonprivate", cpus=1, max_steps=1, eval_max_records=4,
                             public_eval_records=4, data={"source": str(small_dataset)}, recipe="none")
        run_training(config, tmp_path / "run", progress=False,
                     on_evaluation=lambda *a, **k: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {1}  # the run's threads while it ran
        assert torch.get_num_threads() == 2  # and the caller's again after it (later work's float order unchanged)
    finally:
        torch.set_num_threads(before)
