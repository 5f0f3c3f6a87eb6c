import os
import tempfile
from pathlib import Path

import pytest

# Never reach a model hub from tests; keep Ray and wandb quiet and local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The dataset owner's key (raydp.data.identity) of this test session: never the user's own key file.
os.environ.setdefault("RAYDP_OWNER_KEY", str(Path(tempfile.mkdtemp(prefix="raydp-owner-")) / "owner.key"))


#: Slow tests in files whose owners mark them here (CI runs ``-m "not slow"``: a fast tier on 2 cores),
#: each with the faster tests that cover its feature in that tier.
SLOW = {
    # ~2.5-5 min: two Ray actor runs sharing one policy service is test_study.py::
    # test_rldp_trials_can_share_one_policy; a run killed mid-training is test_study.py::
    # test_a_killed_trial_resumes_with_exactly_the_planned_ledger; a dead run's open decision (kept, never
    # a transition) is test_broker.py::test_a_run_that_dies_leaves_only_an_open_decision
    "tests/test_rldp.py::test_two_runs_share_a_policy_and_one_can_die",
    # ~80 s: Optuna over the SAC grid; the same study runner, trial grid and results table with grid
    # search are test_study.py::test_study_results_table (tiny_study)
    "tests/test_study.py::test_optuna_chooses_the_sac_cells",
    # ~50 s: a frozen saved policy driving a larger model in paper mode; frozen actions are
    # test_rldp.py::test_saved_policy_reloads_and_gives_identical_actions, a saved policy's reuse by a later
    # study test_study.py::test_rldp_trials_can_share_one_policy, the paper-mode label test_policy_provenance.py
    "tests/test_rldp.py::test_frozen_policy_controls_a_model_with_more_adapters_in_paper_mode",
    # ~105 s: `ray job submit` of a study to a local head (cluster/submit.sh); the study it submits is the
    # runner of test_study.py (tiny_study), started in-process
    "tests/test_study_job.py::test_ray_job_submit_runs_a_study_on_a_local_head",
    # ~100 s: the one-run audit of a ghost-clipped run; the ghost-clipped release equals the per-sample one
    # (test_ghost_clipping.py::test_a_dp_step_with_ghost_clipping_releases_what_per_sample_clipping_releases),
    # whose audit is test_evaluation.py::test_the_correct_mechanism_passes_its_audit_and_reports
    "tests/test_dualtune.py::test_the_epsilon_audit_is_consistent_with_a_ghost_clipped_run",
    # ~60 s: both dualtune variants in a Ray study, attacked and reported; each variant end to end is
    # test_dualtune.py's CLI tests, a study with a non-DP-SGD strategy attacked and reported is
    # test_forward_ldp.py::test_a_classification_study_runs_a_local_strategy_beside_dp_sgd_on_ray
    "tests/test_dualtune.py::test_a_study_runs_both_dualtune_variants_beside_static_dp_sgd_on_ray",
    # ~70 s: an RLDP run driven over RLlink (issue 15); the handshake and refusals, the loopback-only rule,
    # the one run actor's client factory, the shared training loop and the server's restore/freeze/save with
    # the runs' provenance are the other tests of test_rllink.py, an RLDP run through the broker test_rldp.py
    "tests/test_rllink.py::test_an_rldp_run_driven_over_rllink",
    # ~30 s: other strategies under transformers.Trainer; static under it is the rest of test_hf_trainer.py
    "tests/test_hf_trainer.py::test_other_strategies_under_the_trainer[dc-sgd-p]",
    "tests/test_hf_trainer.py::test_other_strategies_under_the_trainer[rldp]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def raydp_cache(tmp_path_factory) -> Path:
    """One model cache for the whole test session (embedded models are built once)."""
    cache = Path(os.environ.get("RAYDP_TEST_CACHE") or tmp_path_factory.mktemp("raydp-cache"))
    os.environ["RAYDP_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="module")
def local_ray(raydp_cache):
    """A local Ray (2 CPUs) for the module, started unless one runs; its workers see the model cache and stay
    offline. Shut down at the module's end."""
    import ray

    from raydp.runner.launch import RAY_NAMESPACE

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False,
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
