"""AdaClip and GeoClip: their update rules against hand computations of the papers' formulas, exactness of
their transforms, and the real DP step with them (clip bound in transformed coordinates, sigma charged)."""

import math

import numpy as np
import pytest
import torch

from raydp.errors import ConfigError
from raydp.model.batches import Batch
from raydp.privacy import BudgetGuard, PrivacyLedger
from raydp.privacy.engine import DPStep
from raydp.privacy.mechanism import Dials, StepRelease, flatten_pairs
from raydp.privacy.randomness import PrivateRandomness
from raydp.strategies import make_strategy
from raydp.strategies.adaclip import AdaClipSettings, AdaClipStrategy
from raydp.strategies.base import StrategyContext
from raydp.strategies.geoclip import GeoClipSettings, GeoClipStrategy
from tests.test_dp_engine import padded_batch, tiny_lora_model


def context(tensor_sizes, expected_batch_size=4.0, sigma_0=1.0, q=0.5, planned_steps=10):
    return StrategyContext(n_pairs=len(tensor_sizes) // 2, pair_depths=(0.0,) * (len(tensor_sizes) // 2), q=q,
                           planned_steps=planned_steps, sigma_0=sigma_0, epsilon_target=1e6, delta=1e-5,
                           expected_batch_size=expected_batch_size, tensor_sizes=tuple(tensor_sizes))


def release(gradient, sigma, clip, step=0):
    """A hand-built release: only the noisy gradient (original coordinates, / expected B) and the dials."""
    return StepRelease(step=step, dials=Dials(clip=(clip,), sigma=sigma), sigma_eff=sigma, clamped=False,
                       noisy_sum_a=[], noisy_sum_b=[], noisy_pair_norms=np.zeros(0),
                       noisy_gradient=torch.tensor(gradient, dtype=torch.float32))


# -- (a) the update rules on fixed inputs ---------------------------------------------------------------

def test_adaclip_update_rule_matches_the_paper_by_hand():
    beta1, beta2, h1, h2, clip, sigma, big_b = 0.9, 0.8, 1e-4, 2.0, 1.5, 0.7, 4.0
    strategy = AdaClipStrategy(AdaClipSettings(clip=clip, beta1=beta1, beta2=beta2, h1=h1, h2=h2))
    strategy.setup(context((3, 2), expected_batch_size=big_b))
    dim = 5
    # Before any release: a_0 = 0, b_0 = 1 (plain DP-SGD), s_0 = 1/D.
    assert np.array_equal(strategy.a, np.zeros(dim)) and np.array_equal(strategy.b, np.ones(dim))
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0, 0.0]])
    assert torch.equal(strategy.dials(0).transform.forward(x), x)

    # Exactly representable in float32, so the release carries these values.
    g1 = np.array([0.5, -0.25, 4.0, 0.0625, -1.0])
    g2 = np.array([0.75, 0.5, -2.0, 0.125, 3.0])
    a, s, b = np.zeros(dim), np.full(dim, 1.0 / dim), np.ones(dim)
    for step, g in enumerate((g1, g2)):
        strategy.observe(release(g, sigma, clip, step), ledger=None)
        # The paper's Algorithm 1, written out coordinate by coordinate.
        a_new, s_new = np.empty(dim), np.empty(dim)
        for i in range(dim):
            a_new[i] = beta1 * a[i] + (1 - beta1) * g[i]
            v = (g[i] - a[i]) ** 2 - b[i] ** 2 * sigma ** 2 * clip ** 2 / big_b ** 2
            v = max(min(v, h2), h1)
            s_new[i] = beta2 * s[i] + (1 - beta2) * v
        total = sum(math.sqrt(si) for si in s_new)
        b_new = np.array([si ** 0.25 * math.sqrt(total) for si in s_new])
        a, s, b = a_new, s_new, b_new
        assert np.allclose(strategy.a, a, rtol=1e-12, atol=0)
        assert np.allclose(strategy.s, s, rtol=1e-12, atol=0)
        assert np.allclose(strategy.b, b, rtol=1e-12, atol=0)
        # the closed form meets the paper's constraint sum_i s_i / b_i^2 = 1
        assert float(np.sum(s / b ** 2)) == pytest.approx(1.0, rel=1e-12)
    # the clamps were exercised: coordinate 3 (tiny deviation) hit h1 at the first step, 2 hit h2
    assert (0.0625 ** 2 - sigma ** 2 * clip ** 2 / big_b ** 2) < h1 and 4.0 ** 2 > h2
    # the next step's transform is (g - a) / b with the new estimates
    w = strategy.dials(2).transform.forward(torch.tensor(g1[None, :]))
    assert np.allclose(w.numpy()[0], (g1 - a) / b, rtol=1e-12)
    assert strategy.observed == 2 and strategy.skipped == 0


def test_geoclip_update_rule_matches_the_paper_by_hand():
    beta1, alpha, h1, h2, gamma, k = 0.9, 0.98, 1e-8, 0.5, 1.0, 2
    strategy = GeoClipStrategy(GeoClipSettings(beta1=beta1, alpha=alpha, h1=h1, h2=h2, gamma=gamma, rank=k))
    strategy.setup(context((4, 2)))
    dim = 6
    x0 = torch.tensor([[1.0, -2.0, 0.5, 3.0, 0.0, 7.0]])
    assert torch.equal(strategy.dials(0).transform.forward(x0), x0)  # M_0 = I, a_0 = 0

    g1 = np.array([0.5, -0.25, 2.0, 0.0625, -1.0, 0.75])
    g2 = np.array([0.25, 0.5, -1.5, 0.125, 1.0, -0.5])
    # The sketch as a full matrix: Sigma_0 = V_0 Lambda_0 V_0^T with the first k axes and Lambda_0 = 1.
    a, sigma_mat = np.zeros(dim), np.diag([1.0] * k + [0.0] * (dim - k))
    for step, g in enumerate((g1, g2)):
        strategy.observe(release(g, 0.9, 1.0, step), ledger=None)
        a = beta1 * a + (1 - beta1) * g
        x = g - a
        full = alpha * sigma_mat + (1 - alpha) * np.outer(x, x)
        lam, vec = np.linalg.eigh(full)
        top = np.argsort(lam)[::-1][:k]
        lam, vec = lam[top], vec[:, top]
        sigma_mat = vec @ np.diag(lam) @ vec.T  # truncated to the top k, as the sketch keeps it
        assert np.allclose(strategy.a, a, rtol=1e-12, atol=1e-15)
        assert np.allclose(strategy.eigenvalues, lam, rtol=1e-9, atol=1e-14)
        assert np.allclose(strategy.basis @ strategy.basis.T, vec @ vec.T, atol=1e-9)
        # The paper's closed form M* = sqrt(gamma / Tr(Lambda^1/2)) Lambda^-1/4 U^T on the sketch,
        # eigenvalues clamped to [h1, h2]; identity on the complement.
        clamped = np.minimum(np.maximum(lam, h1), h2)
        d = np.sqrt(gamma / np.sum(np.sqrt(clamped))) * clamped ** -0.25
        m = vec @ np.diag(d) @ vec.T + (np.eye(dim) - vec @ vec.T)
        probe = np.array([[1.0, 2.0, -3.0, 0.5, 0.25, -1.0], [0.0, 1.0, 0.0, -2.0, 4.0, 1.5]])
        got = strategy.dials(step + 1).transform.forward(torch.tensor(probe)).numpy()
        assert np.allclose(got, (probe - a) @ m.T, rtol=1e-9, atol=1e-12)
        # on the sketch the closed form meets E||M x||^2 = gamma for covariance U diag(clamped) U^T
        assert float(np.sum(d ** 2 * clamped)) == pytest.approx(gamma, rel=1e-12)
    assert strategy.eigenvalues.max() > h2  # the upper clamp was exercised
    assert strategy.observed == 2


# -- (b) the transforms are exactly invertible ------------------------------------------------------------

def _trained(strategy, dim, steps=4, seed=0):
    rng = np.random.default_rng(seed)
    strategy.setup(context((dim - dim // 3, dim // 3), expected_batch_size=8.0))
    for t in range(steps):
        strategy.observe(release(rng.normal(size=dim) * rng.uniform(0.1, 3.0, size=dim), 0.8, 1.0, t), None)
    return strategy


@pytest.mark.parametrize("make", [lambda: AdaClipStrategy(), lambda: GeoClipStrategy(GeoClipSettings(rank=5))])
def test_inverse_of_the_summed_forward_is_the_mean(make):
    dim, big_b = 30, 8
    strategy = _trained(make(), dim)
    transform = strategy.dials(4).transform
    assert np.abs(transform.a).sum() > 0  # a non-trivial centre
    rng = np.random.default_rng(1)
    for n in (big_b, 3, 0):
        g = torch.tensor(rng.normal(size=(n, dim)) * 2.0)
        back = transform.inverse_mean(transform.forward(g).sum(0), float(big_b))
        mean_times = g.sum(0) / big_b  # mean * n / B
        if n == big_b:  # batch size == expected: exactly the mean
            assert torch.allclose(back, g.mean(0), rtol=1e-10, atol=1e-10)
        # in general the centre enters as if B units were sampled: (n/B) mean + (1 - n/B) a
        want = mean_times + (1 - n / big_b) * torch.tensor(transform.a)
        assert torch.allclose(back, want, rtol=1e-10, atol=1e-10)
    g32 = torch.tensor(rng.normal(size=(big_b, dim)), dtype=torch.float32)
    back = transform.inverse_mean(transform.forward(g32).sum(0), float(big_b))
    assert back.dtype == torch.float32 and torch.allclose(back, g32.mean(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [lambda: AdaClipStrategy(), lambda: GeoClipStrategy(GeoClipSettings(rank=5))])
def test_resume_from_state_continues_identically(make):
    dim = 30
    first = _trained(make(), dim, steps=3)
    second = make()
    second.setup(context((dim - dim // 3, dim // 3), expected_batch_size=8.0))
    second.load_state_dict(first.state_dict())
    g = release(np.linspace(-1, 1, dim), 0.8, 1.0, 3)
    first.observe(g, None)
    second.observe(g, None)
    probe = torch.tensor(np.random.default_rng(3).normal(size=(2, dim)))
    assert torch.equal(first.dials(4).transform.forward(probe), second.dials(4).transform.forward(probe))
    for key, value in first.state_dict().items():
        assert np.array_equal(value, second.state_dict()[key])


@pytest.mark.parametrize("make", [lambda: AdaClipStrategy(AdaClipSettings(h1=1e-12, h2=1e10)),
                                  lambda: GeoClipStrategy(GeoClipSettings(rank=5))])
def test_non_finite_or_extreme_releases_never_break_the_transform(make):
    dim = 30
    strategy = _trained(make(), dim, steps=2)
    before = {k: np.copy(v) for k, v in strategy.state_dict().items()}
    bad = np.ones(dim)
    bad[3] = np.nan
    strategy.observe(release(bad, 0.8, 1.0, 2), None)
    assert strategy.skipped == 1
    for key, value in before.items():  # every estimate as it was; only the count of skipped releases moved
        if key != "skipped":
            assert np.array_equal(strategy.state_dict()[key], value)
    for t, scale in enumerate((1e30, 0.0, 1e-30, 1e30)):  # huge, zero and tiny releases: clamped, finite
        strategy.observe(release(np.full(dim, scale), 0.8, 1.0, 3 + t), None)
        transform = strategy.dials(4 + t).transform
        g = torch.tensor(np.random.default_rng(t).normal(size=(8, dim)))
        w = transform.forward(g)
        back = transform.inverse_mean(w.sum(0) + torch.randn(dim, dtype=torch.float64), 8.0)
        assert torch.isfinite(w).all() and torch.isfinite(back).all()


def test_settings_come_from_the_registry_and_are_validated():
    assert isinstance(make_strategy("adaclip"), AdaClipStrategy)
    assert isinstance(make_strategy("geoclip", {"rank": 4}), GeoClipStrategy)
    assert make_strategy("adaclip").clip == 1.0 and make_strategy("geoclip").clip == 1.0
    with pytest.raises(ConfigError):
        make_strategy("adaclip", {"h1": 1.0, "h2": 0.5})
    with pytest.raises(ConfigError):
        make_strategy("geoclip", {"unknown": 1})
    described = make_strategy("geoclip").describe()
    assert described["settings"]["alpha"] == 0.98 and described["clip_mode"] == "flat"


# -- (c) the real DP step ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: AdaClipStrategy(AdaClipSettings(clip=0.5)),
                                  lambda: GeoClipStrategy(GeoClipSettings(clip=0.5, rank=8))])
def test_dp_step_with_transform_clips_in_transformed_coordinates(make):
    model, pairs = tiny_lora_model(n_layer=2)
    ids, mask = padded_batch()
    n, sigma_0, q, planned, clip = ids.shape[0], 1.1, 0.5, 10, 0.5
    strategy = make()
    sizes = tuple(t.numel() for p in pairs for t in (p.a, p.b))
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=q, planned_steps=planned, sigma_0=sigma_0,
                                   epsilon_target=1e6, delta=1e-5, expected_batch_size=float(n),
                                   tensor_sizes=sizes))
    ledger = PrivacyLedger(delta=1e-5, epsilon_target=1e6)
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=planned, q=q)
    step = DPStep(model, pairs, strategy, ledger, guard, q=q, expected_batch_size=float(n), planned_steps=planned,
                  randomness=PrivateRandomness.unsafe_from_seed(11), device=torch.device("cpu"))
    optimizer = torch.optim.SGD([t for p in pairs for t in (p.a, p.b)], lr=0.05)
    batch = Batch(list(range(n)), ids, mask)

    captured = {}
    original = step.per_sample_gradients

    def capture(b, dials):  # the per-sample contributions in the transform's coordinates
        grads = original(b, dials)
        captured["w"] = flatten_pairs(grads.a, grads.b, batched=True).detach().clone()
        return grads

    step.per_sample_gradients = capture
    for t in range(6):
        transform = strategy.dials(t).transform
        if t == 5:  # a zero-noise probe: the release is then exactly the clipped sum
            step.add_noise = lambda clipped, *args: clipped.float()
        metrics = step.compute(model, batch)
        flat_grad = flatten_pairs([p.a.grad for p in pairs], [p.b.grad for p in pairs], batched=False)
        assert torch.isfinite(flat_grad).all() and math.isfinite(metrics["noisy_grad_norm"])
        norms = captured["w"].norm(dim=1)
        factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
        assert (factors * norms <= clip * (1 + 1e-5)).all()  # every clipped contribution has norm <= C
        if t == 5:
            released = flatten_pairs(step._pending.noisy_sum_a, step._pending.noisy_sum_b, batched=False)
            want = (factors.unsqueeze(1) * captured["w"]).sum(0)
            assert torch.allclose(released, want, rtol=1e-5, atol=1e-6)
            assert released.norm() <= n * clip * (1 + 1e-5)
            assert torch.allclose(flat_grad, transform.inverse_mean(released, float(n)), rtol=1e-5, atol=1e-6)
        if t >= 1:  # the transform in use is the one fixed from the earlier releases
            assert np.abs(transform.a).sum() > 0
        optimizer.step()
        step.after_update(model)
    assert strategy.observed == 6 and strategy.skipped == 0
    assert len(ledger) == 6
    assert np.allclose(ledger.sigma_eff, sigma_0, rtol=1e-9)  # the plan's sigma, charged every step (E1)
    assert all(r.clip == (clip,) and r.allocation == "flat" for r in ledger)
