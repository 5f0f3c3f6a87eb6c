"""Tests of raydp.privacy.ledger against hand calculations, plain pyarrow and independent accountants."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants.analysis import rdp as opacus_rdp

from raydp.errors import ConfigError, DataError
from raydp.privacy import (
    NEIGHBOURING_RELATION,
    PLDAccountant,
    PrivacyLedger,
    RDPAccountant,
    Release,
    allocate_noise,
    combine_sigma_eff,
    gradient_release,
    gradient_sigma_eff,
)
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS

# -- sigma_eff (ERRATA E1, E3) -----------------------------------------------------------------------


def test_gradient_sigma_eff_hand_calculation():
    clips = [0.5, 1.0, 2.0, 4.0]
    stds = [1.0, 2.0, 3.0, 4.0]
    # sum C_i^2 / s_i^2 = 0.25 + 0.25 + 4/9 + 1 = 35/18
    assert gradient_sigma_eff(clips, stds) == pytest.approx(math.sqrt(18 / 35), rel=1e-14)
    r = gradient_release(clips, stds)
    assert (r.name, r.sensitivity) == ("gradient", 1.0)
    assert r.noise_std == pytest.approx(math.sqrt(18 / 35), rel=1e-14)


def test_paper_eq6_noise_undercounts_by_sqrt_n():
    # RLDP Eq. 6: s_i = sigma * C_i for each of n pairs -> true multiplier sigma / sqrt(n) (ERRATA E1)
    sigma, clips = 1.3, [0.2, 0.7, 1.1, 3.0, 0.05]
    stds = [sigma * c for c in clips]
    assert gradient_sigma_eff(clips, stds) == pytest.approx(sigma / math.sqrt(5), rel=1e-13)


@pytest.mark.parametrize("allocation", ["proportional", "uniform"])
def test_allocations_keep_sigma_true(allocation):
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 64):
        clips = rng.uniform(0.01, 5.0, n)
        for sigma in (0.3, 1.0, 4.2):
            stds = allocate_noise(sigma, clips, allocation)
            assert gradient_sigma_eff(clips, stds) == pytest.approx(sigma, rel=1e-12)
    clips = [3.0, 4.0]
    if allocation == "uniform":
        assert list(allocate_noise(2.0, clips, allocation)) == pytest.approx([10.0, 10.0])  # 2 * ||C|| = 10
    else:
        expected = [2 * math.sqrt(2) * 3, 2 * math.sqrt(2) * 4]  # sigma * sqrt(n) * C_i
        assert list(allocate_noise(2.0, clips, allocation)) == pytest.approx(expected)


def test_flat_allocation_is_single_clip_only():
    assert list(allocate_noise(1.5, [2.0], "flat")) == [3.0]
    with pytest.raises(ConfigError):
        allocate_noise(1.5, [2.0, 1.0], "flat")
    with pytest.raises(ConfigError):
        allocate_noise(1.5, [2.0], "whatever")
    with pytest.raises(ConfigError):
        allocate_noise(0.0, [2.0], "uniform")


def test_releases_on_one_sample_compose_as_one_gaussian():
    rel = [Release("gradient", 1.0, 1.0), Release("norm_histogram", 0.5, 2.0), Release("loss", 1.0, math.inf)]
    # 1/sigma^2 = 1 + (0.5/2)^2 + 0 = 1.0625
    assert combine_sigma_eff(rel) == pytest.approx(1 / math.sqrt(1.0625), rel=1e-14)
    assert combine_sigma_eff([]) == math.inf
    assert combine_sigma_eff([Release("loss", 0.0, 0.0)]) == math.inf  # sensitivity 0 reveals nothing
    assert combine_sigma_eff([Release("raw", 1.0, 0.0)]) == 0.0  # noiseless: not private


# -- recording ---------------------------------------------------------------------------------------


def test_record_and_free_steps():
    led = PrivacyLedger(delta=1e-5, epsilon_target=3.0, accountant="pld")
    s = led.record(0.01, [Release("gradient", 1.0, 2.0), Release("loss", 0.25, 1.0)],
                   clip=[1.0, 0.5], allocation="uniform")
    assert s == pytest.approx((0.25 + 0.0625) ** -0.5)
    assert led.record(0.01, []) == math.inf  # nothing released: a step that costs nothing
    assert led.record_gaussian(0.01, math.inf) == math.inf
    assert len(led) == 3 and list(led.steps) == [0, 1, 2]
    rec = led[0]
    assert rec.clip == (1.0, 0.5) and rec.allocation == "uniform" and rec.q == 0.01
    # free steps do not change epsilon; an independent RDP over the private steps only agrees
    only_private = PrivacyLedger()
    only_private.record_gaussian(0.01, s)
    acc = RDPAccountant(grid=None)
    assert acc.epsilon(led, 1e-5) == acc.epsilon(only_private, 1e-5)
    direct = opacus_rdp.compute_rdp(q=0.01, noise_multiplier=s, steps=1, orders=list(DEFAULT_ORDERS))
    assert acc.epsilon(led, 1e-5) == pytest.approx(
        opacus_rdp.get_privacy_spent(orders=list(DEFAULT_ORDERS), rdp=direct, delta=1e-5)[0], rel=1e-12)
    empty = PrivacyLedger()
    empty.record(0.5, [])
    assert PLDAccountant().epsilon(empty, 1e-5) == 0.0
    noiseless = PrivacyLedger()
    noiseless.record(0.5, [Release("raw", 1.0, 0.0)])
    assert PLDAccountant().epsilon(noiseless, 1e-5) == math.inf


@pytest.mark.parametrize("bad", [
    lambda led: led.record_gaussian(0.0, 1.0),
    lambda led: led.record_gaussian(1.5, 1.0),
    lambda led: led.record_gaussian(float("nan"), 1.0),
    lambda led: led.record(0.1, [Release("g", 1.0, float("nan"))]),
    lambda led: led.record(0.1, [Release("g", -1.0, 1.0)]),
    lambda led: led.record(0.1, [("g", 1.0, 1.0)]),
    lambda led: led.record_gaussian(0.1, 1.0, allocation="random"),
    lambda led: (led.record_gaussian(0.1, 1.0, step=5), led.record_gaussian(0.1, 1.0, step=5)),
    lambda led: PrivacyLedger(delta=1.0),
    lambda led: PrivacyLedger(epsilon_target=-1.0),
])
def test_bad_input_is_config_error(bad):
    with pytest.raises(ConfigError):
        bad(PrivacyLedger())


# -- persistence ---------------------------------------------------------------------------------------


def _mixed_ledger() -> PrivacyLedger:
    rng = np.random.default_rng(11)
    led = PrivacyLedger(delta=1e-5, epsilon_target=4.0, accountant="pld", metadata={"run": "t1"})
    clips = [1.0, 0.5, 2.0]
    for block in range(10):
        sigma = float(rng.uniform(0.7, 2.0))
        stds = allocate_noise(sigma, clips, "proportional")
        for _ in range(30):
            led.record(0.02, [gradient_release(clips, stds), Release("norm_histogram", 0.5, 8.0)],
                       clip=clips, allocation="proportional")
        led.record(0.02, [])  # a step that released nothing private
    return led


def test_parquet_roundtrip_and_plain_pyarrow(tmp_path):
    led = _mixed_ledger()
    path = led.save(tmp_path)
    assert "ledger" in path.name and path.exists()
    table = pq.read_table(path)
    for col in ("step", "q", "sigma_eff", "clip", "allocation", "releases"):
        assert col in table.column_names
    assert table.num_rows == len(led)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert json.loads(meta["neighbouring_relation"]) == NEIGHBOURING_RELATION == "add_remove_one"
    assert json.loads(meta["delta"]) == 1e-5
    assert json.loads(meta["epsilon_target"]) == 4.0
    assert json.loads(meta["accountant"]) == "pld"
    rows = table.to_pylist()
    assert rows[0]["releases"][1] == {"name": "norm_histogram", "sensitivity": 0.5, "noise_std": 8.0}
    assert math.isinf(rows[30]["sigma_eff"]) and rows[30]["releases"] == []

    back = PrivacyLedger.load(path)
    assert len(back) == len(led)
    assert [r for r in back] == [r for r in led]
    assert back.metadata["run"] == "t1" and back.delta == 1e-5 and back.accountant == "pld"
    led.save(tmp_path / "run7_ledger.parquet")
    with pytest.raises(ConfigError):
        led.save(tmp_path / "run7.parquet")


def test_persisted_ledger_matches_independent_accountants(tmp_path):
    led = _mixed_ledger()
    table = pq.read_table(led.save(tmp_path / "x_ledger.parquet"))
    q = table.column("q").to_numpy()
    sigma = table.column("sigma_eff").to_numpy()
    delta = json.loads(table.schema.metadata[b"delta"])

    # dp_accounting directly: one event per step, consecutive equal steps merged by hand
    events, prev, count = [], None, 0
    for qq, ss in zip(q, sigma):
        if math.isinf(ss):
            continue
        if prev == (qq, ss):
            count += 1
            continue
        if prev is not None:
            events.append(dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(prev[0], dp_event.GaussianDpEvent(prev[1])), count))
        prev, count = (qq, ss), 1
    events.append(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(prev[0], dp_event.GaussianDpEvent(prev[1])), count))
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=3e-4)
    pld.compose(dp_event.ComposedDpEvent(events))
    eps_direct = pld.get_epsilon(delta)
    ours = PLDAccountant().epsilon(PrivacyLedger.load(tmp_path / "x_ledger.parquet"), delta)
    assert ours == pytest.approx(eps_direct, rel=0.02)
    assert ours >= eps_direct * (1 - 1e-3)

    # opacus RDP directly, step by step
    orders = list(DEFAULT_ORDERS)
    per_value = {}
    rdp = np.zeros(len(orders))
    for qq, ss in zip(q, sigma):
        if not math.isinf(ss):
            if (qq, ss) not in per_value:
                per_value[(qq, ss)] = opacus_rdp.compute_rdp(q=float(qq), noise_multiplier=float(ss), steps=1,
                                                             orders=orders)
            rdp += per_value[(qq, ss)]
    eps_rdp = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0]
    assert RDPAccountant(grid=None).epsilon(led, delta) == pytest.approx(eps_rdp, rel=1e-9)
    assert eps_rdp <= RDPAccountant().epsilon(led, delta) <= eps_rdp * 1.02  # grid: conservative, close


def test_tampered_ledger_is_data_error(tmp_path):
    led = _mixed_ledger()
    path = led.save(tmp_path)
    table = pq.read_table(path)
    sig = table.column("sigma_eff").to_numpy().copy()
    sig[3] *= 2.0
    import pyarrow as pa

    bad = table.set_column(table.column_names.index("sigma_eff"), "sigma_eff", pa.array(sig))
    pq.write_table(bad, tmp_path / "bad_ledger.parquet")
    with pytest.raises(DataError):
        PrivacyLedger.load(tmp_path / "bad_ledger.parquet")
    with pytest.raises(DataError):
        PrivacyLedger.load(tmp_path / "missing_ledger.parquet")


def test_allocated_noise_gives_at_least_the_multiplier_in_exact_arithmetic():
    """Checked with exact rationals here (not the library's check): sum_i C_i^2 / s_i^2 <= 1 / sigma^2 for clips
    spread over six decades, and the stds are at most a few ulps above sigma's allocation."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        clips = 10 ** rng.uniform(-4, 2, size=n)
        sigma = float(10 ** rng.uniform(-0.5, 1))
        for allocation in ("proportional", "uniform") if n > 1 else ("proportional", "uniform", "flat"):
            stds = allocate_noise(sigma, clips, allocation)
            exact = sum((Fraction(float(c)) / Fraction(float(s))) ** 2 for c, s in zip(clips, stds))
            assert exact * Fraction(sigma) ** 2 <= 1
            assert gradient_sigma_eff(clips, stds) == pytest.approx(sigma, rel=1e-13)


def test_a_plan_whose_clips_change_every_step_charges_one_sigma():
    """Clips that change every step (a clip schedule, a residual controller) at one planned sigma: every step is
    charged exactly sigma, so the accountant composes one value (16 steps of ulp-level variants were each a rare
    value on the accountants' grid, charged up to 0.5% less noise: epsilon 2.0046 on a target of 2)."""
    rng = np.random.default_rng(3)
    sigma, q = 1.4116350084967546, 0.10457516339869281
    changing, constant = PrivacyLedger(), PrivacyLedger()
    for _ in range(16):  # two pairs: sqrt(2) in the allocation rounds (four, with sqrt(4) = 2, would not here)
        clips = 10 ** rng.uniform(-2.5, -0.5, size=2)
        changing.record(q, [gradient_release(clips, allocate_noise(sigma, clips), sigma=sigma)], clip=clips)
        constant.record(q, [gradient_release([0.1] * 2, allocate_noise(sigma, [0.1] * 2), sigma=sigma)],
                        clip=[0.1] * 2)
    assert set(changing.sigma_eff.tolist()) == {sigma}
    assert PLDAccountant().epsilon(changing, 1e-5) == PLDAccountant().epsilon(constant, 1e-5)
