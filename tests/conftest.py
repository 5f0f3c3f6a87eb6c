import atexit
import os
import shutil
import sys
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
if "RAYDP_OWNER_KEY" not in os.environ:  # removed when the session's process exits (it holds a key and registers)
    _owner_dir = tempfile.mkdtemp(prefix="raydp-owner-")
    atexit.register(shutil.rmtree, _owner_dir, True)
    os.environ["RAYDP_OWNER_KEY"] = str(Path(_owner_dir) / "owner.key")
SESSION_OWNER_KEY = os.environ["RAYDP_OWNER_KEY"]


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


class _SessionRay:
    """The test session's one local Ray: started once, the first time a test asks for it (:func:`local_ray`), as
    :func:`raydp.runner.launch.ensure_ray` starts a local cluster (:func:`~raydp.runner.launch.start_local_ray`: an
    owner-only temporary folder, metrics collection off), with 2 CPUs; its workers see the model cache and stay
    offline. Shut down at the session's end. Nothing else in the session starts or stops a Ray in this process
    (:func:`_one_ray` fails a test that does), except a test that must test a Ray's startup itself
    (:func:`separate_ray`)."""

    def __init__(self):
        self.started = False

    def start(self) -> None:
        import ray

        from raydp.runner.launch import start_local_ray

        if ray.is_initialized():
            raise RuntimeError("a Ray already runs in this process, not the test session's: a test started it "
                               "itself; request the local_ray fixture instead")
        start_local_ray(num_cpus=2, log_to_driver=False,
                        runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYDP_CACHE", "RAYDP_OWNER_KEY",
                                                                            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                                                  if k in os.environ}})
        self.started = True

    def stop(self) -> None:
        import ray

        ray.shutdown()
        self.started = False


_SESSION_RAY = _SessionRay()


@pytest.fixture(scope="session")
def local_ray(raydp_cache):
    """The test session's one local Ray (:class:`_SessionRay`), started on first use and shared by every test
    after: a test that runs anything on Ray (a study, an RLDP run, a policy service) asks for this fixture, whether
    it starts Ray itself or a library function does (:func:`raydp.runner.launch.ensure_ray` joins the running one)."""
    if not _SESSION_RAY.started:
        _SESSION_RAY.start()
    yield
    if _SESSION_RAY.started:
        _SESSION_RAY.stop()


@pytest.fixture
def separate_ray(raydp_cache):
    """For a test that must start a Ray of its own in this process (a Ray's startup, a two-node cluster): the
    session's Ray is shut down for the test and started again after it, the same way, if it ran; the test's own
    Ray is shut down after it. Its cost (a Ray's startup) is paid only where a test needs it."""
    import ray

    was_running = _SESSION_RAY.started
    if was_running:
        _SESSION_RAY.stop()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if was_running:
        _SESSION_RAY.start()


@pytest.fixture(autouse=True)
def _one_ray(request):
    """Fails a test that leaves Ray's lifecycle other than it found it: one that started a Ray in this process
    without :func:`local_ray` (e.g. a study whose :func:`~raydp.runner.launch.ensure_ray` started one: Ray's
    settings would then depend on which test ran first), or one that shut the session's Ray down. The stray Ray is
    shut down (the session's is started again) so that later tests see what they would have seen."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or "separate_ray" in request.fixturenames:
        return
    running = ray.is_initialized()
    if running and not _SESSION_RAY.started:
        ray.shutdown()
        pytest.fail("this test started a Ray of its own in the test process: request the local_ray fixture (the "
                    "session's one Ray), or separate_ray where it must test a Ray's startup", pytrace=False)
    if _SESSION_RAY.started and not running:
        _SESSION_RAY.start()
        pytest.fail("this test shut the session's Ray down: request separate_ray where it must", pytrace=False)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """A small synthetic dataset (tests._support.SMALL_DATASET_RECORDS records), built once for the session under
    the session's owner key, whichever test asks first (a module that sets an owner key of its own does not change
    its id). Read it only: a test that changes a dataset copies it (tests._support.copy_dataset); the session fails
    at its end if a test changed it."""
    from raydp.data.splits import build_dataset
    from tests._support import SMALL_DATASET_RECORDS, tree_digest

    path = tmp_path_factory.mktemp("small-dataset") / "data"
    key = os.environ.get("RAYDP_OWNER_KEY")
    os.environ["RAYDP_OWNER_KEY"] = SESSION_OWNER_KEY
    try:
        build_dataset(path, n_records=SMALL_DATASET_RECORDS, progress=False)
    finally:
        os.environ["RAYDP_OWNER_KEY"] = key
    digest = tree_digest(path)
    yield path
    assert tree_digest(path) == digest, f"a test changed the session's shared dataset {path}: copy it first"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A locally trained BPE tokenizer saved with save_pretrained (for tiny random Llama/Mistral/GPT-2)."""
    from raydp.data import public_corpus
    from raydp.model.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(public_corpus(200, seed=1), vocab_size=300).save_pretrained(path)
    return path


#: the wall-clock budget of each tier on CI's 2 cores: the fast tier (`-m "not slow"`, what CI runs) is built to run in
#: about 10 minutes (one Ray and one dataset for the session, library logic tested by calling the library,
#: docs/testing.md) and must finish within 12, a fifth above that for a slower or busier machine; the slow tier
#: (`-m slow`, long tests whose features the fast tier covers too) within an hour. Slow tests are marked one way,
#: `@pytest.mark.slow` (pyproject's --strict-markers refuses any other marker name). Checked at the end of the
#: session, never per test: a test asserts no time.
TIER_BUDGETS_S = {"not slow": 12 * 60, "slow": 60 * 60}
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
    measured = os.environ.get("COVERAGE_RUN") == "true"  # under `coverage run` (about 1.5x slower): not a timing
    if reporter is not None:
        reporter.write_line(f"{name} tier: {elapsed:.0f} s of its {budget} s budget"
                            + (" (under coverage: not checked)" if measured else ""))
    if elapsed > budget and session.exitstatus == 0 and not measured:
        if reporter is not None:
            reporter.write_line(f"FAIL: the {name} tier is over its budget: move a test to the slow tier or make it "
                                "cheaper")
        session.exitstatus = 1
