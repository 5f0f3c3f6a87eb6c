"""Benchmark of the privacy-accounting layer (raydp.privacy).

Setting: q = 16/19,200 (Poisson rate), 3 epochs -> 3,600 planned steps, delta = 1e-5, epsilon target 2,
sigma_0 calibrated with the PLD accountant. Two ledgers of 3,600 steps with sigma drawn log-uniformly
in [0.5, 2] x sigma_0: A changes sigma every 112 steps, B at every step. Each step records the gradient
release of 8 LoRA pairs with per-pair clips and 'proportional' noise (sigma_eff = sigma).

Printed:
  1. time per step of appending to the ledger;
  2. time and value of a full epsilon computation with each accountant (fresh, from the whole ledger);
  3. the epsilon error of the grid-compressed PLD versus exact per-step PLD (same discretisation);
  4. time of a guard call, in a guarded replay of A and B (the strategy proposes the ledger's sigmas,
     the guard is consulted every 112 steps; in B each step then uses max(proposal, guard's sigma));
     rdp and pld guards on both, prv on A only (its calls cost ~3x pld's).

Run: python bench/bench_accounting.py   (about 3-5 minutes on 2 cores)
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raydp.privacy import (  # noqa: E402
    BudgetGuard,
    PrivacyLedger,
    allocate_noise,
    calibrate_sigma,
    get_accountant,
    gradient_release,
    planned_steps,
)
from raydp.privacy.accounting import DEFAULT_GRID  # noqa: E402

DELTA = 1e-5
EPS_TARGET = 2.0
Q = 16 / 19_200
T_RL = 112


def build_ledger(sigmas: np.ndarray, clips: np.ndarray) -> tuple[PrivacyLedger, float]:
    led = PrivacyLedger(delta=DELTA, epsilon_target=EPS_TARGET, accountant="pld")
    t = time.perf_counter()
    for s in sigmas:
        stds = allocate_noise(float(s), clips, "proportional")
        led.record(Q, [gradient_release(clips, stds)], clip=clips, allocation="proportional")
    return led, (time.perf_counter() - t) / len(sigmas)


def _single_pld(args):
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    q, s, vdi = args
    return pldlib.from_gaussian_mechanism(standard_deviation=s, value_discretization_interval=vdi,
                                          sampling_prob=q)


def exact_per_step_pld(led: PrivacyLedger, vdi: float, pool) -> float:
    """dp_accounting PLD composed one step at a time (single-step PLDs built in parallel, cached)."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    q, sig = led.arrays()
    keys = sorted({(float(a), float(b)) for a, b in zip(q, sig)})
    singles = dict(zip(keys, pool.map(_single_pld, [(a, b, vdi) for a, b in keys], chunksize=8)))
    pld = pldlib.identity(value_discretization_interval=vdi)
    for a, b in zip(q, sig):
        pld = pld.compose(singles[(float(a), float(b))])
    return pld.get_epsilon_for_delta(DELTA)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def guarded_replay(name: str, schedule: np.ndarray, every_step: bool, sigma0: float) -> dict:
    guard = BudgetGuard(name, epsilon_target=EPS_TARGET, delta=DELTA, planned_steps=len(schedule), q=Q,
                        sigma_hint=sigma0)
    led = PrivacyLedger(delta=DELTA, epsilon_target=EPS_TARGET, accountant=name)
    calls, clamped = [], 0
    sigma = None
    for t, proposal in enumerate(schedule):
        if t % T_RL == 0:
            t0 = time.perf_counter()
            sigma, c = guard.clamp(float(proposal), led)
            calls.append(time.perf_counter() - t0)
            clamped += c
        led.record_gaussian(Q, max(float(proposal), sigma) if every_step else sigma)
    check, t_final = timed(lambda: guard.final_check(led))
    return {"calls": calls, "clamped": clamped, "final": check, "t_final": t_final,
            "evals": guard.evaluations}


def main() -> None:
    t_start = time.perf_counter()
    steps = planned_steps(3, Q)
    cal, t_cal = timed(lambda: calibrate_sigma(EPS_TARGET, DELTA, Q, steps, "pld"))
    sigma0 = cal.sigma
    print(f"q = 16/19200 = {Q:.6g}, 3 epochs -> {steps} planned steps; delta = {DELTA:g}; "
          f"epsilon target {EPS_TARGET}")
    print(f"sigma_0 = {sigma0:.5f} (PLD calibration: epsilon {cal.epsilon:.4f}, {cal.evaluations} evaluations, "
          f"{t_cal:.2f} s)")
    print(f"grid: sigma ratio {DEFAULT_GRID.sigma_ratio} (rounded down), q ratio {DEFAULT_GRID.q_ratio} "
          f"(rounded up), values seen >= {DEFAULT_GRID.exact_min_count} times kept exact\n")

    rng = np.random.default_rng(0)
    clips = rng.uniform(0.05, 1.0, 8)
    lo, hi = math.log(0.5 * sigma0), math.log(2.0 * sigma0)
    sched_a = np.repeat(np.exp(rng.uniform(lo, hi, math.ceil(steps / T_RL))), T_RL)[:steps]
    sched_b = np.exp(rng.uniform(lo, hi, steps))
    ledgers = {}
    print("1. appending (gradient release of 8 pairs: allocation + sigma_eff + record)")
    for label, sched in (("A (sigma every 112 steps)", sched_a), ("B (sigma every step)", sched_b)):
        led, per_step = build_ledger(sched, clips)
        ledgers[label] = led
        print(f"   {label:28s} {per_step * 1e6:7.1f} us/step")
    big = PrivacyLedger()
    t0 = time.perf_counter()
    for i in range(100_000):
        big.record_gaussian(Q, 1.0 + (i % 5) * 0.1)
    print(f"   100,000 appends                {(time.perf_counter() - t0) / 1e5 * 1e6:7.1f} us/step (amortised O(1))")

    print("\n2. full epsilon computation (fresh, whole ledger, default grid)")
    print(f"   {'ledger':28s} {'accountant':10s} {'epsilon':>9s} {'time':>9s} {'groups':>7s}")
    results, pld_runs = {}, {}
    for label, led in ledgers.items():
        hist = led.to_histogram()
        for name in ("rdp", "prv", "pld", "gdp"):
            acc = get_accountant(name)
            eps, dt = timed(lambda: acc.epsilon(led, DELTA))
            results[(label, name)] = eps
            if name == "pld":  # the interval it chose, to compare with exact per-step at the same one
                pld_runs[label] = (acc._interval(hist.groups(acc.grid), DELTA), eps, dt)
            ngroups = len(hist.groups(acc.grid))
            print(f"   {label:28s} {name:10s} {eps:9.4f} {dt:8.2f}s {ngroups:7d}"
                  + ("   (approximation, not a bound)" if name == "gdp" else ""))

    print("\n3. grid-compressed PLD (section 2) vs exact per-step PLD at the same loss discretisation")
    with mp.get_context("fork").Pool(2) as pool:
        for label, led in ledgers.items():
            vdi, fast, t_fast = pld_runs[label]
            exact, t_exact = timed(lambda: exact_per_step_pld(led, vdi, pool))
            print(f"   {label:28s} interval {vdi:.1e}: grid {fast:.4f} ({t_fast:.1f} s)  exact per-step "
                  f"{exact:.4f} ({t_exact:.1f} s)  error {100 * (fast / exact - 1):+.3f}%  "
                  f"(speed-up x{t_exact / t_fast:.1f})")

    print("\n4. budget guard (consulted every 112 steps; proposals = the schedule's sigmas)")
    print(f"   {'schedule':28s} {'acct':5s} {'call median':>11s} {'p90':>8s} {'max':>8s} {'evals/call':>10s} "
          f"{'clamped':>7s} {'final eps':>9s} {'final check':>11s}")
    for label, sched, every in (("A (sigma every 112 steps)", sched_a, False),
                                ("B (sigma every step)", sched_b, True)):
        for name in ("rdp", "pld", "prv") if not every else ("rdp", "pld"):  # PRV: A only (bench time)
            r = guarded_replay(name, sched, every, sigma0)
            c = sorted(r["calls"])
            print(f"   {label:28s} {name:5s} {statistics.median(c) * 1e3:9.0f}ms "
                  f"{c[int(0.9 * (len(c) - 1))] * 1e3:6.0f}ms {c[-1] * 1e3:6.0f}ms "
                  f"{r['evals'] / len(c):10.1f} {r['clamped']:7d} {r['final'].epsilon:9.4f} "
                  f"{r['t_final']:9.2f}s " + ("OK" if r["final"].within_budget else "OVER"))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
