import os
import tempfile
import time
from pathlib import Path

import pytest

# Never reach a model hub from tests; keep Ray and wandb quiet and local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The dataset owner's key (raydp.data.identity) of this test session: never the user's own key file.
os.environ.setdefault("RAYDP_OWNER_KEY", str(Path(tempfile.mkdtemp(prefix="raydp-owner-")) / "owner.key"))


@pytest.fixture(scope="session", autouse=True)
def raydp_cache(tmp_path_factory) -> Path:
    """One model cache for the whole test session (embedded models are built once)."""
    cache = Path(os.environ.get("RAYDP_TEST_CACHE") or tmp_path_factory.mktemp("raydp-cache"))
    os.environ["RAYDP_CACHE"] = str(cache)
    return cache


@pytest.fixture(autouse=True)
def _torch_threads():
    """Every test starts with the session's torch thread count: a test that sets one thread (to measure bit-exact
    kernels) must not change the rounding of a model built by a later test."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_ray(raydp_cache):
    """A local Ray (2 CPUs) for the module, started unless one runs; its workers see the model cache and stay
    offline. Started as :func:`raydp.runner.launch.ensure_ray` starts a local cluster (an owner-only temporary
    folder, metrics collection off). Shut down at the module's end."""
    import ray

    from raydp.runner.launch import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=2, log_to_driver=False,
                        runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYDP_CACHE", "RAYDP_OWNER_KEY",
                                                                            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                                                  if k in os.environ}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A locally trained BPE tokenizer saved with save_pretrained (for tiny random Llama/Mistral/GPT-2)."""
    from raydp.data import public_corpus
    from raydp.model.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(public_corpus(200, seed=1), vocab_size=300).save_pretrained(path)
    return path


#: the wall-clock budget of each tier on CI's 2 cores: the fast tier (`-m "not slow"`, what CI runs) must finish well
#: inside 20 minutes (issue 30); the slow tier (`-m slow`, long tests whose features the fast tier covers too) within
#: an hour. Slow tests are marked one way, `@pytest.mark.slow` (pyproject's --strict-markers refuses any other
#: marker name). Checked at the end of the session, never per test: a test asserts no time.
TIER_BUDGETS_S = {"not slow": 20 * 60, "slow": 60 * 60}
FAST_TIER_BUDGET_S = TIER_BUDGETS_S["not slow"]


def pytest_sessionstart(session):
    session.config._raydp_started = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    started = getattr(session.config, "_raydp_started", None)
    tier = (session.config.getoption("markexpr") or "").strip()
    if started is None or tier not in TIER_BUDGETS_S or session.testscollected < 100:  # a whole tier, not a file of it
        return
    elapsed, budget = time.monotonic() - started, TIER_BUDGETS_S[tier]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    name = "fast" if tier == "not slow" else "slow"
    if reporter is not None:
        reporter.write_line(f"{name} tier: {elapsed:.0f} s of its {budget} s budget")
    if elapsed > budget and session.exitstatus == 0:
        if reporter is not None:
            reporter.write_line(f"FAIL: the {name} tier is over its budget: move a test to the slow tier or make it "
                                "cheaper")
        session.exitstatus = 1
