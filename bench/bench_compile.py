"""Benchmark: does torch.compile (inductor, CPU) make the embedded model's step cheaper? (issue 47, decision 3)

Prints, from one process at ``--threads`` torch threads (a study gives each trial 1):
  * the first call of each compiled step (compile time, cold unless TORCHINDUCTOR_CACHE_DIR holds it);
  * the median time of the non-private step and of the DP step's per-sample gradients, eager against compiled,
    measured in interleaved rounds on one batch of the embedded default (``--batch`` records at its public width);
  * the graph breaks dynamo met (``torch._dynamo.utils.counters``): a step that breaks its graph runs partly or wholly
    eager;
  * the largest difference of the compiled step's gradients from the eager ones (float order changes under inductor).
The compiled models are compiled with static shapes (``dynamic=False``) on this one batch; for the DP kind the bench
turns off the DP step's refusal of a compiled model (:func:`raydp.privacy.clipping.refuse_compiled`), which a run
never does. Keep any inductor cache
owner-only (TORCHINDUCTOR_CACHE_DIR in a directory of yours, never a shared /tmp): its kernels carry the shapes they
were compiled for, and a DP batch's row count is secret.

Run: TORCHINDUCTOR_CACHE_DIR=~/.cache/raydp-inductor python bench/bench_compile.py [--threads 1] [--batch 23] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore", message="Full backward hook is firing")


def medians(fns: dict, rounds: int, warmup: int = 3) -> dict:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved: fair under drifting load
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


def measure(kind: str, args) -> dict:
    """Eager against compiled for one kind of step (``nonprivate`` or ``DP``), in this process."""
    from torch._dynamo.utils import counters

    from bench_dp_step import build
    from raydp.data import build_dataset, load_texts
    from raydp.privacy.clipping import PerSampleGradientComputer
    from raydp.runner.gradients import NonPrivateGradient

    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(f"{tmp}/data", n_records=400, seed=0, progress=False)
        texts = load_texts(f"{tmp}/data", "train")
    if kind == "DP":  # the DP step refuses a compiled model (a compiled graph may skip its hooks); this bench times
        import raydp.privacy.clipping as clipping  # one anyway, and checks its gradients against the eager ones below

        clipping.refuse_compiled = lambda model: None
    models = {name: build("embedded", texts, args.batch, 64) for name in ("eager", "compiled")}
    models["compiled"][0].model.compile(dynamic=False)
    plain = NonPrivateGradient()

    def step(loaded, batch):
        if kind == "DP":  # the hooks are on before the first compiled call: dynamo sees them
            computer = PerSampleGradientComputer(loaded.model, loaded.pairs)
            return lambda: computer.compute(batch.input_ids, batch.attention_mask)
        return lambda: (plain.compute(loaded.model, batch), {p.data_ptr(): p.grad for p in loaded.trainable_parameters()})

    fns = {name: step(*pair) for name, pair in models.items()}
    started = time.perf_counter()
    fns["compiled"]()
    compile_seconds = time.perf_counter() - started
    times = medians(fns, args.rounds)
    if kind == "DP":
        eager, compiled = fns["eager"]().flat, fns["compiled"]().flat
    else:
        for loaded, _ in models.values():
            loaded.model.zero_grad(set_to_none=True)
        eager, compiled = (torch.cat([g.flatten() for g in fns[n]()[1].values()]) for n in ("eager", "compiled"))
    return {"kind": kind, "width": int(models["eager"][1].input_ids.shape[1]), "compile_seconds": compile_seconds,
            **{f"ms_{k}": v for k, v in times.items()}, "graph_breaks": sum(counters["graph_break"].values()),
            "largest_difference": (compiled - eager).abs().max().item(), "largest_entry": eager.abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=23, help="records per step (a DP step of the default: about 23)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--only", choices=("nonprivate", "DP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only:
        print(json.dumps(measure(args.only, args)))
        return
    print(f"the embedded model, {args.batch} records, {args.threads} thread(s); each kind in a fresh process (dynamo "
          f"caches code objects across models); median of {args.rounds} interleaved rounds")
    for kind in ("nonprivate", "DP"):  # a process each: one kind's compiled frames must not serve the other
        out = subprocess.run([sys.executable, __file__, "--only", kind, "--threads", str(args.threads), "--batch",
                              str(args.batch), "--rounds", str(args.rounds)], check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"  {kind:<11} eager {r['ms_eager']:6.1f} ms   compiled {r['ms_compiled']:6.1f} ms   compiled / eager "
              f"{r['ms_compiled'] / r['ms_eager']:.2f}   first compiled call {r['compile_seconds']:.1f} s   graph breaks "
              f"{r['graph_breaks']}   gradients: largest difference {r['largest_difference']:.1e} of "
              f"{r['largest_entry']:.1e}   (width {r['width']})", flush=True)


if __name__ == "__main__":
    main()
