"""Benchmark: cost of the pairwise DP step (issue 3 targets; issue 28 on a GPU).

Prints, per model, from one run:
  * pairwise DP step time / non-private LoRA step time          (target <= 1.05)
  * pairwise DP step time / Opacus flat DP step time             (target <= 1.0)
  * accountant time per step / DP step time                      (target <= 1%)
Each "step" is sampling-free: the same batch goes through gradient computation and the AdamW update; times
are medians over interleaved rounds after a warm-up, the device synchronised around each step (a CUDA step
is timed to its end, not to its last launch). The accounting cost per step is the ledger append plus the
guard calls and the final epsilon spread over a 3,600-step run. The epsilon error of the fast ledger versus
exact per-step PLD is printed by bench/bench_accounting.py.

Models: ``embedded`` (the default: its narratives, ~50 tokens); ``gpt2-small-config`` (GPT-2 small's width
and depth, 12 LoRA pairs) and ``llama-1b-config`` (Llama 3.2 1B's shape: 16 layers, width 2048, GQA 32/8
heads, vocabulary 128,256; 32 LoRA pairs on q_proj and v_proj), built from config with random weights (cost,
not utility) on random tokens of ``--length``. On CUDA the frozen base is bf16 and LoRA fp32, as in a run.

``--compare-with DIR`` also runs this bench with the raydp package found in DIR (for example an older
commit: ``git archive REV raydp | tar -x -C DIR``) in a subprocess, and prints both side by side.

Off the CPU the DP step computes records in passes of a fixed shape, on CUDA a graph of ``RECORD_SLOTS`` rows with each
record in a random slot (:class:`raydp.privacy.clipping.RecordGraph`, ERRATA E17); ``--slots 1,16`` also times other
slot counts (1: one record per pass). Opacus's flat step still computes its batch in one pass.
``--profile MODEL`` prints torch.profiler's
tables (host time, and device time on CUDA) to stderr.

Run: python bench/bench_dp_step.py [--models embedded,gpt2-small-config] [--steps 30] [--batch 16] [--length 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's hooks on LoRA layers
CONFIG_MODELS = ("gpt2-small-config", "llama-1b-config")


def interleaved_medians(fns: dict, rounds: int, warmup: int = 3, sync=lambda: None) -> dict:
    """Median time of each step function, measured in interleaved rounds (fair under drifting load)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def config_base(model_name: str, device: torch.device):
    """(base model, model type, vocabulary) of a shape built from config with random weights: GPT-2 small's or Llama
    3.2 1B's; on CUDA the base is bf16, as ``load_model`` loads it (LoRA stays fp32)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        if model_name == "gpt2-small-config":
            base = GPT2LMHeadModel(GPT2Config(vocab_size=50_257, n_positions=1024, n_embd=768, n_layer=12, n_head=12))
            model_type, vocab = "gpt2", 50_257
        elif model_name == "llama-1b-config":
            base = LlamaForCausalLM(LlamaConfig(
                vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True))
            model_type, vocab = "llama", 128_256
        else:
            raise ValueError(f"unknown config-built model {model_name!r}; one of {CONFIG_MODELS}")
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        base = base.to(torch.bfloat16)
    return base, model_type, vocab


def build(model_name: str, texts: list[str], batch_size: int, length: int):
    """(loaded model, batch): an embedded model on its narratives, or a config-built shape on random tokens."""
    from raydp.model import disable_dropout, load_model
    from raydp.model.adapters import discover_adapter_pairs
    from raydp.model.batches import Batch, TokenizedSplit
    from raydp.model.loading import LoraSettings, apply_lora

    torch.manual_seed(0)
    loaded = load_model("embedded" if model_name in CONFIG_MODELS else model_name, device="auto", progress=False)
    if model_name in CONFIG_MODELS:
        device = loaded.device
        base, model_type, vocab = config_base(model_name, device)
        loaded.model = apply_lora(base, model_type, LoraSettings())
        loaded.model.to(device)
        loaded.pairs = discover_adapter_pairs(loaded.model)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
        batch = Batch(list(range(batch_size)), ids.to(device), torch.ones_like(ids).to(device))
    else:
        split = TokenizedSplit(texts, loaded.tokenizer, min(loaded.max_positions, 512))
        batch = split.collate(list(range(batch_size)), loaded.device)
    disable_dropout(loaded.model)  # as every DP run (ERRATA E12)
    loaded.model.train()
    return loaded, batch


def static_dp_step(loaded, batch_size: int, slots: int | None = None):
    """Our pairwise DP step with static clips (0.1) and the PLD-calibrated sigma of epsilon 8 over 3,600 steps at
    q = batch / 20,000; the guard is consulted once (constant sigma). ``slots``: rows of a slotted CUDA pass
    (None: the default, ``RECORD_SLOTS``; 1: one record per pass)."""
    from raydp.privacy.clipping import RECORD_SLOTS, PerSampleGradientComputer
    from raydp.privacy import BudgetGuard, PrivacyLedger, calibrate_sigma
    from raydp.privacy.engine import DPStep
    from raydp.strategies.base import StrategyContext
    from raydp.strategies.static import StaticPairwiseStrategy

    n_pairs, planned, epsilon = len(loaded.pairs), 3_600, 8.0
    q = batch_size / 20_000
    sigma_0 = calibrate_sigma(epsilon, 1e-5, q, planned, "pld").sigma
    strategy = StaticPairwiseStrategy(clip=0.1)
    strategy.setup(StrategyContext(n_pairs, tuple(p.relative_depth for p in loaded.pairs), q, planned, sigma_0,
                                   epsilon, 1e-5))
    ledger = PrivacyLedger(delta=1e-5, epsilon_target=epsilon)
    guard = BudgetGuard("pld", epsilon_target=epsilon, delta=1e-5, planned_steps=planned, q=q)
    gradients = PerSampleGradientComputer(loaded.model, loaded.pairs, slots=slots or RECORD_SLOTS)
    return DPStep(loaded.model, loaded.pairs, strategy, ledger, guard, q=q, expected_batch_size=batch_size,
                  planned_steps=planned + 10_000, device=loaded.device, gradients=gradients)


def bench_model(model_name: str, texts: list[str], args) -> dict:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from raydp.model.loss import per_sequence_nll
    from raydp.runner.gradients import NonPrivateGradient

    def fresh():
        loaded, batch = build(model_name, texts, args.batch, args.length)
        optimizer = torch.optim.AdamW(loaded.trainable_parameters(), lr=5e-4, weight_decay=0.0)
        return loaded, batch, optimizer

    # Non-private LoRA step.
    loaded, batch, optimizer = fresh()
    plain = NonPrivateGradient()
    plain_model = loaded.model

    def nonprivate_step():
        plain.compute(plain_model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Pairwise DP step (ours), sigma fixed, guard consulted once (constant sigma).
    dp_loaded, dp_batch, dp_optimizer_ours = fresh()
    dp = static_dp_step(dp_loaded, args.batch)
    n_pairs, sigma_0 = len(dp_loaded.pairs), dp.sigma_0

    def dp_step():
        dp.compute(dp_loaded.model, dp_batch)
        dp_optimizer_ours.step()
        dp_optimizer_ours.zero_grad(set_to_none=True)
        dp.after_update(dp_loaded.model)

    # Opacus flat DP-SGD (GradSampleModule + DPOptimizer), same model and batch.
    opacus_loaded, opacus_batch, _ = fresh()
    module = GradSampleModule(opacus_loaded.model, batch_first=True, loss_reduction="sum")
    dp_optimizer = DPOptimizer(
        torch.optim.AdamW(opacus_loaded.trainable_parameters(), lr=5e-4, weight_decay=0.0),
        noise_multiplier=sigma_0, max_grad_norm=1.0, expected_batch_size=args.batch,
    )

    extra = {}  # other slot counts (--slots): a DP step each, on a model of its own
    for slots in [int(v) for v in args.slots.split(",") if v.strip()]:
        s_loaded, s_batch, s_optimizer = fresh()
        s_dp = static_dp_step(s_loaded, args.batch, slots)

        def slotted_step(s_loaded=s_loaded, s_batch=s_batch, s_optimizer=s_optimizer, s_dp=s_dp):
            s_dp.compute(s_loaded.model, s_batch)
            s_optimizer.step()
            s_optimizer.zero_grad(set_to_none=True)
            s_dp.after_update(s_loaded.model)
        extra[f"dp_s{slots}"] = (slotted_step, s_dp)

    def opacus_step():
        logits = module(input_ids=opacus_batch.input_ids, attention_mask=opacus_batch.attention_mask).logits
        per_sequence_nll(logits, opacus_batch.input_ids, opacus_batch.attention_mask).sum().backward()
        dp_optimizer.step()
        dp_optimizer.zero_grad(set_to_none=True)

    cuda = dp_loaded.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.profile == model_name:
        profile_steps({"non-private": nonprivate_step, "pairwise DP": dp_step, "Opacus flat": opacus_step}, sync)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    medians = interleaved_medians({"plain": nonprivate_step, "dp": dp_step, "opacus": opacus_step,
                                   **{name: fn for name, (fn, _) in extra.items()}}, args.steps, sync=sync)
    out = {"model": model_name, "pairs": n_pairs, "batch": args.batch, "device": str(dp_loaded.device),
           "device_name": torch.cuda.get_device_name() if cuda else "cpu", "threads": torch.get_num_threads(),
           "tokens": int(dp_batch.input_ids.shape[1]), "sigma_0": sigma_0,
           **{f"ms_{k}": 1e3 * v for k, v in medians.items()},
           # slots in use after the first capture: 1 where the pass's rows moved each other (the check fell back)
           "slots_dp": dp.per_sample.slots,
           **{f"slots_{name}": step.per_sample.slots for name, (_, step) in extra.items()}}
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def profile_steps(fns: dict, sync) -> None:
    """torch.profiler over 5 steps of each: the ops with the most host time, and the launches and syncs per step
    (to stderr, so that --json stays one line)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        sync()
        with profile(activities=activities) as prof:
            for _ in range(5):
                fn()
            sync()
        events = prof.key_averages()
        count = {e.key: e.count for e in events}
        launches = sum(c for k, c in count.items() if k in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
        syncs = sum(c for k, c in count.items() if "Synchronize" in k) + count.get("cudaMemcpyAsync", 0)
        print(f"\n== {name}: per step {launches / 5:.0f} kernel launches, {syncs / 5:.1f} syncs and copies",
              file=sys.stderr)
        print(events.table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr)
        if torch.cuda.is_available():
            print(events.table(sort_by="self_cuda_time_total", row_limit=14), file=sys.stderr)


def accounting_cost(n_pairs: int, t_dp: float) -> dict:
    """The accountant's share of a DP step over a 3,600-step run (issue 3)."""
    from raydp.privacy import BudgetGuard, PrivacyLedger, allocate_noise, calibrate_sigma, get_accountant, gradient_release

    planned, epsilon, q = 3_600, 8.0, 16 / 20_000
    sigma_0 = calibrate_sigma(epsilon, 1e-5, q, planned, "pld").sigma
    bench_ledger = PrivacyLedger(delta=1e-5, epsilon_target=epsilon)
    clips = [0.1] * n_pairs
    started = time.perf_counter()
    for _ in range(planned // 2):
        bench_ledger.record(q, [gradient_release(clips, allocate_noise(sigma_0, clips))], clip=clips,
                            allocation="proportional")
    t_record = (time.perf_counter() - started) / (planned // 2)
    bench_guard = BudgetGuard("pld", epsilon_target=epsilon, delta=1e-5, planned_steps=planned, q=q,
                              sigma_hint=sigma_0)
    guard_times = []
    for factor in (0.8, 1.3, 0.9, 1.1, 0.7):
        started = time.perf_counter()
        bench_guard.clamp(sigma_0 * factor, bench_ledger, planned - len(bench_ledger))
        guard_times.append(time.perf_counter() - started)
        bench_ledger.record(q, [gradient_release(clips, allocate_noise(sigma_0 * factor, clips))])
    t_guard = statistics.median(guard_times)
    full = PrivacyLedger(delta=1e-5, epsilon_target=epsilon)
    for t in range(planned):
        full.record(q, [gradient_release(clips, allocate_noise(sigma_0 * (0.8 + 0.4 * ((t // 112) % 2)), clips))])
    started = time.perf_counter()
    get_accountant("pld").epsilon(full, 1e-5)
    t_final = time.perf_counter() - started
    return {"us_record": 1e6 * t_record, "ms_guard": 1e3 * t_guard, "ms_final": 1e3 * t_final,
            "static_share": (t_record + (t_guard + t_final) / planned) / t_dp,
            "rldp_share": (t_record + t_guard / 112 + t_final / planned) / t_dp}


def measure(args) -> list[dict]:
    from raydp.data import build_dataset, load_texts

    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(f"{tmp}/data", n_records=400, seed=0, progress=False)
        texts = load_texts(f"{tmp}/data", "train")
    rows = []
    for name in args.models.split(","):
        rows.append(bench_model(name, texts, args))
        gc.collect()  # the three copies of this model go before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence of the config-built models")
    parser.add_argument("--models", "--model", default="embedded")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--compare-with", default=None, help="a directory holding another raydp package to time too")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line (no table)")
    parser.add_argument("--no-accounting", action="store_true")
    parser.add_argument("--slots", default="", help="other slot counts of the CUDA pass to time as DP steps of their "
                        "own (comma-separated; 1: one record per pass)")
    parser.add_argument("--profile", default=None, help="a model of --models to profile (torch.profiler, to stderr)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from raydp.runner.allocator import keep_freed_memory

    keep_freed_memory()  # as a run does (raydp.runner.run.run_training); RAYDP_KEEP_FREED_MEMORY=0 turns it off

    rows = measure(args)
    if args.json:
        print(json.dumps(rows))
        return
    other = None
    if args.compare_with:
        argv = [a for a in sys.argv[1:] if not a.startswith("--compare-with")]
        if "--compare-with" in sys.argv:  # its value too
            i = sys.argv.index("--compare-with")
            argv = sys.argv[1:i] + sys.argv[i + 2:]
        path = os.pathsep.join(p for p in (os.path.abspath(args.compare_with), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        result = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json"], env=env,
                                capture_output=True, text=True, check=True)
        other = {r["model"]: r for r in json.loads(result.stdout.strip().splitlines()[-1])}
    for row in rows:
        print(f"model={row['model']} pairs={row['pairs']} batch={row['batch']} tokens={row['tokens']} "
              f"slots={row['slots_dp']} "
              f"device={row['device_name']} threads={row['threads']}"
              + (f" peak={row['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in row else ""))
        columns = [("this code", row)] + ([("--compare-with", other[row["model"]])] if other else [])
        print(f"  {'':28}" + "".join(f"{name:>16}" for name, _ in columns))
        for key, label in (("ms_plain", "non-private LoRA step (ms)"), ("ms_dp", "pairwise DP step (ms)"),
                           ("ms_opacus", "Opacus flat DP step (ms)")):
            print(f"  {label:<28}" + "".join(f"{r[key]:16.2f}" for _, r in columns))
        for key in sorted(k for k in row if k.startswith("ms_dp_s")):
            name = key[3:]
            print(f"  {'DP step, ' + str(row['slots_' + name]) + ' slots (ms)':<28}{row[key]:16.2f}"
                  f"   DP / non-private {row[key] / row['ms_plain']:.3f}, "
                  f"DP / Opacus {row[key] / row['ms_opacus']:.3f}")
        print(f"  {'ratio DP / non-private':<28}" + "".join(f"{r['ms_dp'] / r['ms_plain']:16.3f}" for _, r in columns)
              + "   (target <= 1.05)")
        print(f"  {'ratio DP / Opacus flat':<28}" + "".join(f"{r['ms_dp'] / r['ms_opacus']:16.3f}" for _, r in columns)
              + "   (target <= 1.0)")
        if other:
            print(f"  {'DP step, this / compared':<28}{row['ms_dp'] / other[row['model']]['ms_dp']:16.3f}")
    if not args.no_accounting:
        acc = accounting_cost(rows[0]["pairs"], rows[0]["ms_dp"] / 1e3)
        print(f"ledger append {acc['us_record']:.1f} us per step; guard call (PLD, new sigma) {acc['ms_guard']:.1f} ms; "
              f"final PLD epsilon {acc['ms_final']:.1f} ms (3,600 steps)")
        print(f"accountant / DP step ({rows[0]['model']}): {100 * acc['static_share']:.3f} % static, "
              f"{100 * acc['rldp_share']:.3f} % sigma changing every 112 steps   (target <= 1%)")


if __name__ == "__main__":
    main()
