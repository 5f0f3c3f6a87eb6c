"""Benchmark: ghost clipping versus per-sample clipping in the DP step (DualTune-GhostDP Tables 1-2 analogue).

For each model and sequence length, one DP step's gradient work (forward, per-unit norms, clip, clipped
sum; noise and the update are the same for both and left out) is timed and its peak memory measured:

  * per_sample: Opacus's GradSampleModule hooks materialise every unit's LoRA gradient, then clip and sum
    (raydp.privacy.clipping);
  * ghost: Opacus's ghost norms (two T x T Gram matrices per LoRA layer), then a second backward pass of
    the loss reweighted by the clip factors (raydp.privacy.ghost).

Each configuration runs in a fresh process. Memory: on CUDA, torch.cuda.max_memory_allocated over the
steps minus the allocation before them; on CPU, the peak resident set size during the steps (sampled
every 2 ms) minus the size before them. Times are medians after a warm-up. Printed: a table and the
ghost / per-sample ratios. The paper's savings (Li et al. 2022: ghost clipping avoids the d_out x d_in
per-sample gradients of FULL fine-tuning) do not carry over to LoRA as such: a rank-r adapter's per-sample
gradient is r x (d_in + d_out) per example, while ghost norms cost T x T per example and layer.

Run: python bench/bench_ghost_clipping.py [--models embedded gpt2-small-config] [--lengths 128 512] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
GPT2_SMALL = "gpt2-small-config"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _PeakRSS:
    """Peak resident set size while the block runs (a sampling thread)."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def one(model_name: str, source: str, length: int, batch_size: int, steps: int, records_per_unit: int) -> dict:
    import torch

    from raydp.data import public_corpus
    from raydp.model import disable_dropout, load_model
    from raydp.model.batches import TokenizedSplit
    from raydp.privacy.clipping import PerSampleGradientComputer, combine_units, zero_nonfinite
    from raydp.privacy.ghost import GhostClippingComputer

    torch.manual_seed(0)
    if model_name == GPT2_SMALL:  # GPT-2 small's shape, built from config (random weights: cost, not utility)
        from transformers import GPT2Config, GPT2LMHeadModel

        from raydp.model.adapters import discover_adapter_pairs
        from raydp.model.loading import LoraSettings, apply_lora

        loaded = load_model("embedded", device="auto", progress=False)  # for its tokenizer and device
        base = GPT2LMHeadModel(GPT2Config(vocab_size=len(loaded.tokenizer), n_positions=1024, n_embd=768,
                                          n_layer=12, n_head=12)).to(loaded.device)
        loaded.model = apply_lora(base, "gpt2", LoraSettings())
        loaded.pairs = discover_adapter_pairs(loaded.model)
        loaded.max_positions = 1024
    else:
        loaded = load_model(model_name, device="auto", progress=False)
    disable_dropout(loaded.model)  # as in every DP run (ERRATA E12)
    loaded.model.train()
    texts = public_corpus(batch_size, seed=3, progress=False)
    split = TokenizedSplit(texts, loaded.tokenizer, min(loaded.max_positions, length))
    batch = split.collate(list(range(batch_size)), loaded.device)
    batch.input_ids = batch.input_ids[:, :length]
    batch.attention_mask = batch.attention_mask[:, :length]
    if records_per_unit > 1:
        batch.unit_index = torch.arange(batch_size, device=loaded.device) // records_per_unit
    cuda = loaded.device.type == "cuda"

    if source == "ghost":
        computer = GhostClippingComputer(loaded.model, loaded.pairs)

        def work():
            contributions = computer.contributions(batch)
            norms = contributions.pair_norms().pow(2).sum(1, keepdim=True).sqrt()
            return contributions.clipped_sums(torch.clamp(1.0 / (norms + 1e-6), max=1.0), "flat")
    else:
        computer = PerSampleGradientComputer(loaded.model, loaded.pairs)

        def work():
            grads = computer.compute(batch.input_ids, batch.attention_mask)
            grads = zero_nonfinite(combine_units(zero_nonfinite(grads), batch.unit_index))
            norms = grads.pair_norms().pow(2).sum(1, keepdim=True).sqrt()
            return grads.clipped_sums(torch.clamp(1.0 / (norms + 1e-6), max=1.0), "flat")

    def timed():
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    # peak memory from before the first step (the warm-up steps' allocations count: the allocator keeps them)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        times = [timed() for _ in range(steps + 2)][2:]
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with _PeakRSS() as rss:
            times = [timed() for _ in range(steps + 2)][2:]
        peak = rss.peak - rss.start
    return {"model": model_name, "source": source, "length": int(batch.input_ids.shape[1]), "batch": batch_size,
            "units": int(batch.n_units), "device": str(loaded.device), "lora_pairs": len(loaded.pairs),
            "lora_params": sum(p.num_params for p in loaded.pairs),
            "seconds": statistics.median(times), "peak_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["embedded", GPT2_SMALL],
                        help=f"embedded presets, or {GPT2_SMALL} (GPT-2 small's shape from config, random weights)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--records-per-unit", type=int, default=1, help="rows per privacy unit (patients)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "SOURCE"), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.length, args.batch, args.steps, args.records_per_unit)))
        return
    rows = []
    print(f"{'model':<16}{'T':>5}{'B':>4} {'source':<11}{'s/step':>9}{'peak MiB':>10}", flush=True)
    for model in args.models:
        for length in args.lengths:
            pair = {}
            for source in ("per_sample", "ghost"):
                out = subprocess.run([sys.executable, __file__, "--one", model, source, "--length", str(length),
                                      "--batch", str(args.batch), "--steps", str(args.steps),
                                      "--records-per-unit", str(args.records_per_unit)],
                                     capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                pair[source] = row
                print(f"{model:<16}{row['length']:>5}{row['batch']:>4} {source:<11}{row['seconds']:>9.3f}"
                      f"{row['peak_mib']:>10.1f}", flush=True)
            g, p = pair["ghost"], pair["per_sample"]
            print(f"{'':<25} ghost/per_sample: time {g['seconds'] / p['seconds']:.2f}x, "
                  f"memory {g['peak_mib'] / max(p['peak_mib'], 1e-9):.2f}x  ({g['device']}, {g['lora_pairs']} LoRA "
                  f"pairs, {g['lora_params']} LoRA parameters)", flush=True)


if __name__ == "__main__":
    main()
