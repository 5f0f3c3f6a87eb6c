"""Privacy check: does one record move the OTHER records' per-sample gradients on this device?

The clipped sum's sensitivity is C only if adding or removing one privacy unit leaves every other unit's
contribution unchanged. Floating-point kernels can break that: a matrix library may choose its algorithm (tile
shape, split-K, stream-K) by the matrix's shape, so a batch one row larger can round every row differently, and
a kernel may reduce in an order that depends on a row's position. On this project's CPU a fixed batch width was
enough (docs/privacy.md); this bench measures the same on whatever device torch sees (a GPU: bf16 base weights and
fp32 LoRA, as in a run). Three ways to compute a batch (``--modes``):

* ``batch``: the batch in one pass at its natural shape [B, width] (what a run did before on every device, and does
  on a CPU);
* ``chunked``: fixed chunks of ``--chunk`` rows, the last one filled with empty rows (one token, no target, loss 0),
  so every matrix has the same shape;
* ``isolated``: each record in a pass of its own with deterministic kernels, eagerly (what a DP run does off the
  CPU where no CUDA graph can be used: :func:`raydp.privacy.clipping.isolates_records`);
* ``graphed`` (CUDA only): the same pass captured once in a CUDA graph and replayed per record (a DP run of a
  decoder on CUDA with ``slots=1``: :class:`raydp.privacy.clipping.RecordGraph`); its extra case ``vs isolated``
  compares it with the eager isolated rows;
* ``slotted`` (CUDA only): a CUDA graph of a pass of ``--slots`` rows with deterministic kernels, each record in a
  slot of its own drawn once per record (what a DP run of a decoder does on CUDA by default); records that share a
  slot go to different passes. A record keeps its slot in every case below, so a change is the other records'
  doing; ``vs isolated`` gives how far the slotted rows are from the records computed alone (rounding, not
  privacy).

and, for each, the situations a Poisson batch meets:

* ``insert front`` / ``insert back``: B records against the same records plus one (at the front every other record
  moves down one position; at the back none moves);
* ``repeat``: the same batch twice (run-to-run determinism);
* ``reversed``: the same records in reverse order (does a record's position matter?);
* ``width N`` (batch mode, a control): the batch at its natural width N instead of the run's fixed one, where a
  change is known on this project's 2-core CPU (64 tokens or more run other kernels): the bench can see one.

For the rows the two batches share it prints the largest relative change of a row's per-sample gradient and the
change of their clipped sum (every row clipped to C = the smallest row norm, so each contributes exactly C) in
units of C. Zero means the sensitivity is exactly C; the DP step's noise margin (``NOISE_ROUNDING_MARGIN``, 1e-6)
covers a few 1e-7 of C; more is a privacy hole on that device.

Run: python bench/bench_row_independence.py [--models embedded,gpt2-small-config] [--sizes 8,16,17,32,64]
     [--modes batch,chunked,isolated] [--fp32-base] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

CONFIG_MODELS = ("gpt2-small-config", "llama-1b-config")


def build(model_name: str, texts: list[str], n_rows: int, width: int, base_dtype: str):
    """(model, pairs, input_ids [n_rows, width], attention_mask): the embedded model on its narratives padded to
    ``width``, or GPT-2 small's or Llama 3.2 1B's shape from config on random tokens of random lengths (right
    padding)."""
    from raydp.model import disable_dropout, load_model
    from raydp.model.adapters import discover_adapter_pairs
    from raydp.model.batches import TokenizedSplit
    from raydp.model.loading import LoraSettings, apply_lora

    torch.manual_seed(0)
    loaded = load_model("embedded", device="auto", progress=False)
    device = loaded.device
    if model_name in CONFIG_MODELS:
        from bench_dp_step import config_base  # this directory's DP-step bench: the same shapes

        base, model_type, vocab = config_base(model_name, device)
        loaded.model = apply_lora(base, model_type, LoraSettings()).to(device)
        loaded.pairs = discover_adapter_pairs(loaded.model)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (n_rows, width), generator=generator)
        lengths = torch.randint(width // 2, width + 1, (n_rows,), generator=generator)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
        ids, mask = ids.to(device), mask.to(device)
    else:
        split = TokenizedSplit(texts[:n_rows], loaded.tokenizer, width)
        batch = split.collate(list(range(n_rows)), device, width=width)
        ids, mask = batch.input_ids, batch.attention_mask
    if base_dtype == "fp32":
        for name, p in loaded.model.named_parameters():
            if not p.requires_grad:
                p.data = p.data.float()
    with torch.no_grad():  # LoRA B starts at zero: give every pair a gradient through both matrices
        for pair in loaded.pairs:
            pair.b.normal_(0.0, 0.02)
    disable_dropout(loaded.model)
    loaded.model.train()
    return loaded.model, loaded.pairs, ids, mask


def per_sample(computers: dict, ids, mask, mode: str, chunk: int, records=None) -> torch.Tensor:
    """Per-sample gradients [rows, D] in float64: ``batch`` (the batch's natural shape), ``chunked`` (fixed chunks of
    ``chunk`` rows, the last one filled with empty rows: one token, no target, loss 0, dropped afterwards) or
    ``isolated`` (each record alone with deterministic kernels, eagerly) or ``graphed`` (the same, replayed from a
    CUDA graph: what a DP run of a decoder does on CUDA)."""
    computer = computers["isolated"]
    if mode == "slotted":
        slotted = computers["slotted"]
        graph = slotted._record_graph(ids, None)
        if graph.rows == 1:  # the capture's check found rows that move each other: records alone
            return slotted.compute(ids, mask).flat.double()
        return graph.run(ids, mask, computers["slot_of"][list(records)]).flat.double()
    if mode == "graphed":
        return computers["graphed"].compute(ids, mask).flat.double()
    if mode == "isolated":
        return computer.compute(ids, mask).flat.double()
    if mode == "batch":
        return computer._compute(ids, mask, None).flat.double()  # the batched pass, as a run made it before
    out = []
    for start in range(0, ids.shape[0], chunk):
        part_ids, part_mask = ids[start:start + chunk], mask[start:start + chunk]
        real = part_ids.shape[0]
        if real < chunk:
            fill_ids = torch.zeros((chunk - real, ids.shape[1]), dtype=ids.dtype, device=ids.device)
            fill_mask = torch.zeros_like(fill_ids)
            fill_mask[:, 0] = 1
            part_ids, part_mask = torch.cat([part_ids, fill_ids]), torch.cat([part_mask, fill_mask])
        out.append(computer._compute(part_ids, part_mask, None).flat.double()[:real])
    return torch.cat(out)


def compare(g: torch.Tensor, h: torch.Tensor) -> dict:
    """Rows of g and h are the same records. Largest relative row change, and the clipped sums' difference in C."""
    norms = g.norm(dim=1)
    c = float(norms.min())
    factors_g = (c / norms).clamp(max=1.0)
    factors_h = (c / h.norm(dim=1)).clamp(max=1.0)
    drift = float(((g * factors_g[:, None]).sum(0) - (h * factors_h[:, None]).sum(0)).norm()) / c
    rel = float(((g - h).norm(dim=1) / norms).max())
    changed = int(((g - h).abs().amax(dim=1) > 0).sum())
    return {"rows": int(g.shape[0]), "rows_changed": changed, "max_rel_row_change": rel, "clipped_sum_drift_C": drift}


def measure(model_name: str, texts: list[str], args, base_dtype: str) -> list[dict]:
    from raydp.privacy.clipping import PerSampleGradientComputer

    sizes = [int(s) for s in args.sizes.split(",")]
    n_rows = max(sizes) + 1
    width = 64 if model_name == "embedded" else args.length
    model, pairs, ids, mask = build(model_name, texts, n_rows, width, base_dtype)
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    computers = {"isolated": PerSampleGradientComputer(model, pairs, isolate=True, graphs=False)}
    modes = args.modes.split(",")
    for name in ("graphed", "slotted"):
        if name in modes and ids.device.type != "cuda":
            modes.remove(name)
    if "graphed" in modes:
        computers["graphed"] = PerSampleGradientComputer(model, pairs, isolate=True, slots=1)
    if "slotted" in modes:
        import numpy as np

        computers["slotted"] = PerSampleGradientComputer(model, pairs, isolate=True, slots=args.slots)  # a run's
        computers["slot_of"] = np.random.default_rng(2).integers(0, args.slots, size=n_rows)  # one slot per record
    extra = n_rows - 1  # the inserted record: never among the B shared ones
    rows = []
    for mode in modes:
        for b in sizes:
            shared = list(range(b))
            def rows_of(records, how=mode):
                return per_sample(computers, ids[records], mask[records], how, args.chunk, records)

            rows_of(shared)  # warm-up
            sync()
            started = time.perf_counter()
            base = rows_of(shared)
            sync()
            elapsed_ms = 1e3 * (time.perf_counter() - started)
            cases = {
                "insert front": rows_of([extra] + shared)[1:],
                "insert back": rows_of(shared + [extra])[:-1],
                "repeat": rows_of(shared),
                "reversed": rows_of(shared[::-1]).flip(0),
            }
            if mode == "graphed" and not computers["graphed"]._graphs:
                print(f"graphed mode on {model_name}: the capture failed and the records ran eagerly")
            if mode == "slotted" and computers["slotted"].slots == 1:
                print(f"slotted mode on {model_name}: the capture's check fell back to one record per pass")
            if mode in ("graphed", "slotted"):
                cases["vs isolated"] = rows_of(shared, "isolated")
            if mode == "batch":  # control: the batch at its natural width, as before the fixed width
                natural = int(mask[shared].sum(1).max())
                cases[f"width {natural}"] = per_sample(computers, ids[shared, :natural], mask[shared, :natural], mode,
                                                       args.chunk)
            for case, other in cases.items():
                rows.append({"mode": mode, "case": case, "B": b, "ms": elapsed_ms, **compare(base, other)})
    device = next(model.parameters()).device
    for row in rows:
        row.update(model=model_name, base=base_dtype, width=width, chunk=args.chunk, slots=args.slots,
                   device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="embedded")
    parser.add_argument("--sizes", default="8,16,17,32,64", help="batch sizes B (records shared by both batches)")
    parser.add_argument("--chunk", type=int, default=32, help="rows per fixed chunk in the chunked cases")
    parser.add_argument("--slots", type=int, default=8,
                        help="rows of a slotted pass (slotted mode; a run's default: RECORD_SLOTS)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence of the config-built model")
    parser.add_argument("--fp32-base", action="store_true", help="also with fp32 base weights (a GPU run loads bf16)")
    parser.add_argument("--json", default=None, help="also write every row to this JSON file")
    parser.add_argument("--modes", default="batch,chunked,isolated",
                        help="batch (natural shape), chunked (fixed chunks of --chunk rows), isolated (one record per "
                             "pass, deterministic kernels: a DP run off the CPU)")
    args = parser.parse_args()
    if torch.cuda.is_available():
        from raydp.model.loading import resolve_device

        resolve_device("cuda")  # cuBLAS's fixed workspace before any CUDA work, as a run

    from raydp.data import build_dataset, load_texts

    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(f"{tmp}/data", n_records=400, seed=0, progress=False)
        texts = load_texts(f"{tmp}/data", "train")
    rows = []
    for name in args.models.split(","):
        for dtype in (["run"] + (["fp32"] if args.fp32_base else [])):
            rows += measure(name, texts, args, dtype)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(f"{'model':<18} {'base':<5} {'mode':<9} {'case':<13} {'B':>4} {'changed':>9} {'max rel. row change':>20} "
          f"{'clipped-sum drift (C)':>22} {'ms':>8}")
    for r in rows:
        print(f"{r['model']:<18} {r['base']:<5} {r['mode']:<9} {r['case']:<13} {r['B']:>4} {r['rows_changed']:>4}/{r['rows']:<4} "
              f"{r['max_rel_row_change']:>20.2e} {r['clipped_sum_drift_C']:>22.2e}"
              + (f" {r['ms']:8.1f}" if "ms" in r else ""))
    print(f"device: {rows[0]['device']}; torch {torch.__version__}; chunk {args.chunk} rows; ms: computing B records")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
