"""raydp's DP step under an unchanged ``transformers.Trainer`` script (raydp.integrations.transformers, issue 15).

The embedded-tiny PEFT model is trained by ``transformers.Trainer`` with ``DPTraining``: epsilon is
recomputed from the saved ledger with Google's dp_accounting (independently of raydp's accountants), the
gradient the Trainer applies is compared with the one raydp's own DP step produces on the same batch and
the same (test-only, unsafe) randomness, and unsafe ``TrainingArguments`` are refused in one line.
"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from transformers import Trainer, TrainerCallback, TrainingArguments

from raydp.control.features import ObservationLayout
from raydp.data import public_corpus
from raydp.errors import ConfigError
from raydp.integrations.transformers import DPTraining
from raydp.model import load_model
from raydp.model.batches import TokenizedSplit
from raydp.privacy.filter import FILTER_NAME
from raydp.runner.privacy_setup import PrivacyUnits, build_strategy, plan_private_run, setup_private_run

N_RECORDS, MAX_LENGTH, BATCH = 200, 64, 8
PRIVACY = dict(strategy="static", epsilon=2.0, delta=1e-4, batch_size=BATCH, epochs=1, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def texts():
    return public_corpus(N_RECORDS, seed=21, progress=False)


def fresh_model():
    torch.manual_seed(0)
    return load_model("embedded-tiny", progress=False)


def tokenised(tokenizer, texts):
    """What a Trainer script feeds its Trainer: tokenised records."""
    return [dict(tokenizer(t, truncation=True, max_length=MAX_LENGTH)) for t in texts]


def training_args(out, max_steps, logging_steps=1000, **extra):
    return TrainingArguments(str(out), max_steps=max_steps, max_grad_norm=0.0, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=logging_steps, save_strategy="no",
                             report_to=[], disable_tqdm=True, **extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, texts):
    """A user's Trainer script plus the integration: static DP-SGD at epsilon 2."""
    out = tmp_path_factory.mktemp("hf-trainer")
    loaded = fresh_model()
    model, tokenizer = loaded.model, loaded.tokenizer
    train_dataset = tokenised(tokenizer, texts)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    dp = DPTraining(model, train_dataset, tokenizer, **PRIVACY, max_steps=6,
                    ledger_path=out / "privacy" / "privacy_ledger.parquet")
    trainer = Trainer(model=model, args=training_args(out / "run", dp.planned_steps, logging_steps=3),
                      train_dataset=train_dataset, processing_class=tokenizer, callbacks=[dp.callback])
    dp.attach(trainer)
    result = trainer.train()
    return {"dp": dp, "trainer": trainer, "result": result, "before": before, "model": model, "out": out}


def test_trainer_run_epsilon_recomputed_independently_from_its_ledger(trained):
    dp, trainer, out = trained["dp"], trained["trainer"], trained["out"]
    summary = json.loads((out / "privacy" / "privacy_summary.json").read_text())
    rows = pq.read_table(out / "privacy" / "privacy_ledger.parquet", columns=["step", "q", "sigma_eff"]).to_pylist()
    assert trainer.state.global_step == dp.planned_steps == 6
    assert [r["step"] for r in rows] == list(range(trainer.state.global_step))  # one row per step run, once
    assert summary["steps_charged"] == summary["steps"] == len(rows)
    accountant = PLDAccountant()  # Google's dp_accounting, composed here from the file
    for row in rows:
        assert row["q"] == pytest.approx(BATCH / N_RECORDS)
        accountant.compose(dp_event.PoissonSampledDpEvent(row["q"], dp_event.GaussianDpEvent(row["sigma_eff"])))
    independent = accountant.get_epsilon(PRIVACY["delta"])
    assert summary["epsilon"] == pytest.approx(independent, rel=0.02)
    assert summary["epsilon"] <= PRIVACY["epsilon"] and summary["within_budget"]
    assert summary["epsilon"] >= 0.9 * PRIVACY["epsilon"]  # calibrated for these 6 steps, not wasted
    assert summary["neighbouring_relation"] == "add_remove_one" and summary["privacy_unit"] == "record"
    assert summary["randomness"] == "os-entropy" and not summary["epsilon_void"] and summary["labels"] == []
    assert summary["stopped_early"] is None and dp.summary()["epsilon"] == summary["epsilon"]


def test_trainer_run_changed_the_lora_weights_with_dropout_off(trained):
    model, before = trained["model"], trained["before"]
    after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert set(after) == set(before) and all("lora_" in n for n in after)
    assert any(not torch.equal(before[n], after[n]) for n in after)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_trainer_logs_no_training_loss_and_no_private_counts(trained):
    trainer, result = trained["trainer"], trained["result"]
    history = trainer.state.log_history
    assert history and not any("loss" in entry or "train_loss" in entry for entry in history)
    steps = [entry for entry in history if "dp_sigma_eff" in entry]
    assert [entry["step"] for entry in steps] == [3, 6, 6]  # every logging step, and the final metrics
    assert all(0 < entry["dp_epsilon_spent"] <= PRIVACY["epsilon"] for entry in steps)
    assert not any("dp_epsilon_void" in entry for entry in history)  # secret randomness: a valid epsilon
    assert result.training_loss == 0.0  # a constant: the DP step computes no reportable loss
    assert trainer.state.total_flos == 0  # flops would count the Poisson sample's (private) tokens
    # timings follow the private batch sizes: labelled in the log AND in what train() returns (save_metrics)
    for entry in [*history, result.metrics]:
        assert not {"train_runtime", "train_samples_per_second", "train_steps_per_second"} & set(entry), entry
    assert "unprotected_train_runtime" in result.metrics


@pytest.fixture(scope="module")
def patient_run(tmp_path_factory, texts):
    """Two records per privacy unit, unsafe fixed randomness, the Trainer's INFO log captured: (DPTraining,
    Trainer, the log's messages)."""
    import logging

    from transformers.utils import logging as hf_logging

    loaded = fresh_model()
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=2, units=np.arange(N_RECORDS) // 2,
                    unsafe_fixed_randomness=True, seed=3)
    args = training_args(tmp_path_factory.mktemp("hf-patients"), dp.planned_steps, logging_steps=1, log_level="info")
    trainer = Trainer(model=loaded.model, args=args, train_dataset=texts, callbacks=[dp.callback])
    dp.attach(trainer)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    verbosity = hf_logging.get_verbosity()
    hf_logging.get_logger().addHandler(handler)  # the "transformers" logger, which the Trainer's logs go through
    try:
        trainer.train()
    finally:
        hf_logging.get_logger().removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    return dp, trainer, messages


def test_the_trainers_info_log_states_the_number_of_units_not_of_records(patient_run):
    """The Trainer logs ``Num examples`` (the length of its train dataloader's dataset) at INFO: it must be the
    released number of privacy units, never the number of records (two per unit here: private, issue 26)."""
    dp, _, messages = patient_run
    examples = [m for m in messages if "Num examples" in m]
    assert examples == [f"  Num examples = {N_RECORDS // 2:,}"], messages  # the units, released as N
    assert dp.summary()["n_units"] == N_RECORDS // 2
    assert not any(str(N_RECORDS) in m for m in messages), messages


def test_an_epsilon_logged_under_fixed_randomness_is_labelled_void(patient_run):
    """Under unsafe fixed randomness every logged ``dp_epsilon_spent`` has ``dp_epsilon_void`` beside it, as the
    summary's epsilon has ``epsilon_void`` (ERRATA E12)."""
    dp, trainer, _ = patient_run
    summary = dp.summary()
    assert summary["epsilon_void"] and any("void" in label for label in summary["labels"])
    logged = [entry for entry in trainer.state.log_history if "dp_epsilon_spent" in entry]
    assert len(logged) == 3 and all(entry["dp_epsilon_void"] == 1 for entry in logged)  # steps 1, 2 and the end


class Capture(TrainerCallback):
    """Records the gradient the Trainer is about to apply (after every other callback has run)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_trainer_applies_exactly_the_gradient_of_raydps_own_dp_step(tmp_path, texts):
    privacy = {**PRIVACY, "max_steps": 1, "unsafe_fixed_randomness": True, "seed": 5}
    # the Trainer path
    loaded = fresh_model()
    train_dataset = tokenised(loaded.tokenizer, texts)
    dp = DPTraining(loaded.model, train_dataset, loaded.tokenizer, **privacy)
    capture = Capture()
    trainer = Trainer(model=loaded.model, args=training_args(tmp_path, dp.planned_steps), train_dataset=train_dataset,
                      callbacks=[dp.callback, capture])
    dp.attach(trainer)
    trainer.train()
    # raydp's own DP step, wired as raydp train wires it, on a second copy of the same model
    own = fresh_model()
    split = TokenizedSplit(texts, own.tokenizer, MAX_LENGTH)
    assert split.sequences == dp.split.sequences  # the same records, tokenised by the user or by raydp
    strategy = build_strategy(dp.config)
    plan = plan_private_run(dp.config, N_RECORDS, strategy)
    from raydp.model import disable_dropout

    disable_dropout(own.model)
    run = setup_private_run(dp.config, plan, own.model, own.pairs, PrivacyUnits("record", N_RECORDS), own.device,
                            strategy=strategy)
    batch = split.collate(run.sampler.next_indices(), own.device)
    assert batch.size > 0
    run.step.compute(own.model, batch)
    expected = {n: p.grad for n, p in own.model.named_parameters() if p.grad is not None}
    assert capture.grads is not None and set(capture.grads) == set(expected) and len(expected) == 4
    for name, grad in expected.items():
        torch.testing.assert_close(capture.grads[name], grad, rtol=0, atol=1e-7)
        assert grad.abs().sum() > 0
    assert dp.ledger.sigma_eff.tolist() == run.ledger.sigma_eff.tolist() and len(dp.ledger) == 1
    summary = dp.summary()
    assert summary["epsilon_void"] and any("void" in label for label in summary["labels"])


@pytest.fixture(scope="module")
def unattached(texts):
    loaded = fresh_model()
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=4)
    return loaded, dp


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_grad_norm": 1.0}, "max_grad_norm=1 would rescale"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"fp16": True}, "fp16/bf16 mixed precision"),
        ({"bf16": True}, "fp16/bf16 mixed precision"),
        ({"max_steps": 5}, "calibrated sigma for exactly 4 steps"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
        ({"include_num_input_tokens_seen": True}, "include_num_input_tokens_seen"),
        ({"torch_compile": True}, "torch_compile"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"load_best_model_at_end": True, "metric_for_best_model": "eval_loss"}, "ERRATA E15"),
        ({"metric_for_best_model": "eval_loss"}, "ERRATA E15"),  # best_model_checkpoint picked on private data
    ],
)
def test_unsafe_training_arguments_are_refused_in_one_line(unattached, tmp_path, change, message):
    loaded, dp = unattached
    args = training_args(tmp_path, dp.planned_steps)
    for key, value in change.items():  # set after construction: some are refused by TrainingArguments on a CPU
        setattr(args, key, value)
    trainer = Trainer(model=loaded.model, args=args, train_dataset=dp.train_dataset, callbacks=[dp.callback])
    with pytest.raises(ConfigError) as refused:
        dp.attach(trainer)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert dp.run is None and dp.trainer is None  # nothing set up, nothing spent


def test_low_precision_trainable_parameters_are_refused(tmp_path, texts):
    """Issue 26: clipping in bf16 let a clipped contribution reach 1.0072 C; a LoRA adapter in bf16 is refused."""
    loaded = fresh_model()
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=4)
    for p in loaded.model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    trainer = Trainer(model=loaded.model, args=training_args(tmp_path, dp.planned_steps), train_dataset=texts,
                      callbacks=[dp.callback])
    with pytest.raises(ConfigError, match="bfloat16: DP clipping needs float32") as refused:
        dp.attach(trainer)
    assert "\n" not in str(refused.value) and dp.run is None


def test_trainers_that_would_bypass_the_dp_step_are_refused(unattached, tmp_path):
    loaded, dp = unattached

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = training_args(tmp_path, dp.planned_steps)
    with pytest.raises(ConfigError, match="has its own loss"):
        dp.attach(OwnLoss(model=loaded.model, args=args, train_dataset=dp.train_dataset))
    with pytest.raises(ConfigError, match="not the one DPTraining samples from"):
        dp.attach(Trainer(model=loaded.model, args=args, train_dataset=list(dp.train_dataset)))
    with pytest.raises(ConfigError, match="not attached"):  # the callback alone refuses to train
        Trainer(model=loaded.model, args=args, train_dataset=dp.train_dataset, callbacks=[dp.callback]).train()
    with pytest.raises(ConfigError, match="no DP strategy|needs a DP strategy"):
        DPTraining(loaded.model, dp.train_dataset, loaded.tokenizer, strategy="nonprivate")


class Halve(TrainerCallback):
    """A user callback that rescales the gradient before the update (as gradient clipping would)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


def test_a_gradient_changed_before_the_update_is_never_applied(tmp_path, texts):
    loaded = fresh_model()
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=2)
    trainer = Trainer(model=loaded.model, args=training_args(tmp_path, dp.planned_steps), train_dataset=texts,
                      callbacks=[dp.callback, Halve()])
    dp.attach(trainer)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    with pytest.raises(ConfigError, match="not the DP step's"):
        trainer.train()
    assert len(dp.ledger) == 1  # the release happened and is charged; the changed gradient was not applied
    assert all(torch.equal(before[n], p) for n, p in loaded.model.named_parameters() if p.requires_grad)


class FakePolicy:
    """RLDP's policy client interface without Ray: a fixed action (zeros: reference clips, sigma_0)."""

    def __init__(self, service=None):
        self.layout = ObservationLayout("shared", 4)
        self.calls, self.latencies, self.weights_seen, self.service = [], [], [], service
        self.saved, self.ended = [], False

    def decide(self, obs, reward):
        self.calls.append(reward)
        return np.zeros(5)

    def end(self):
        self.ended = True

    def save_policy(self, path, trained_on, results, provenance=None):
        assert self.ended  # as raydp's runner: the run has left the decision loop first
        self.saved.append({"trained_on": trained_on, "results": results, "provenance": provenance})


# ~30 s each: other strategies under transformers.Trainer; static under it is the rest of test_hf_trainer.py
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dc-sgd-p", "rldp"])  # declared releases; adaptive sigma, pairwise clips
def test_other_strategies_under_the_trainer(tmp_path, texts, strategy):
    loaded = fresh_model()
    extra = ({"settings": {"t_warm": 1, "t_rl": 2}, "dataset_id": "rdi1:" + "d" * 32} if strategy == "rldp"
             else {"units": np.arange(N_RECORDS) // 2})
    client = FakePolicy(service="a policy that learns") if strategy == "rldp" else None
    if strategy == "rldp":  # a bare dataset_id is accepted where its budget register is found (fail closed)
        from raydp.privacy.lifetime import read_budget, set_budget

        if read_budget(extra["dataset_id"]) is None:
            set_budget(extra["dataset_id"], epsilon=1000.0, delta=1e-3, privacy_unit="record")
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **{**PRIVACY, "strategy": strategy}, max_steps=3,
                    controller=client, **extra)
    trainer = Trainer(model=loaded.model, args=training_args(tmp_path, dp.planned_steps), train_dataset=texts,
                      callbacks=[dp.callback])
    dp.attach(trainer)
    trainer.train()
    summary = dp.summary()
    assert len(dp.ledger) == trainer.state.global_step == 3 and summary["within_budget"]
    assert summary["epsilon"] <= PRIVACY["epsilon"]
    rdp = RdpAccountant()  # the realized ledger, composed independently
    for q, sigma in zip(dp.ledger.q, dp.ledger.sigma_eff):
        rdp.compose(dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(sigma))))
    if strategy == "rldp":  # adaptive sigma: the Renyi filter's guarantee, fixed before training (E13)
        assert summary["guarantee"] == FILTER_NAME and len(client.calls) >= 1
        assert rdp.get_epsilon(PRIVACY["delta"]) <= summary["epsilon"] * 1.01
    else:
        assert summary["guarantee"] == "fixed-schedule"
        assert summary["epsilon"] <= rdp.get_epsilon(PRIVACY["delta"]) * 1.01  # PLD is tighter than RDP
    if strategy == "dc-sgd-p":  # its histogram release is charged with the gradient (ERRATA E3)
        assert summary["releases_per_step"][1:] and summary["sigma_eff_0"] < summary["sigma_0"]
        # two records per unit (a patient, ERRATA E11): units are sampled, q = B / N_units
        assert summary["privacy_unit"] == "patient" and summary["q"] == pytest.approx(BATCH / (N_RECORDS // 2))
    else:
        assert summary["controller"]["decisions"] >= 1 and (tmp_path / "privacy_ledger.parquet").exists()
        # the policy it trained is told which run trained it (ERRATA E14), in the shape a policy stores
        from raydp.control.store import provenance_entry

        assert len(client.saved) == 1
        entry = provenance_entry(client.saved[0]["provenance"])
        assert entry["privacy_mode"] == "strict" and entry["public_data"] is False
        assert entry["epsilon"] == summary["epsilon"] and entry["guarantee"] == FILTER_NAME
        assert entry["dataset_id"] == "rdi1:" + "d" * 32  # the raydp dataset's identity, as the user gave it
        assert len(entry["rdp_curve"]) == len(entry["rdp_orders"]) > 0
        assert client.saved[0]["trained_on"]["steps"] == 3


class Draws:
    def __init__(self, samples):
        self.samples = list(samples)

    def next_indices(self):
        return self.samples.pop(0)


def test_the_trainers_batches_are_opaque_poisson_samples_empty_ones_included(trained):
    dp, trainer = trained["dp"], trained["trainer"]
    sampler = dp.batches.sampler
    dp.batches.sampler = Draws([[], [3, 5, 8]])
    try:
        loader = trainer.get_train_dataloader()
        assert loader.batch_sampler is dp.batches and len(loader) == round(N_RECORDS / BATCH)
        first, second = next(iter(loader)), None
        assert list(first) == ["raydp_poisson_batch"] and first["raydp_poisson_batch"].size == 0
        dp.batches.sampler = Draws([[3, 5, 8]])
        second = next(iter(loader))["raydp_poisson_batch"]
        assert second.indices == [3, 5, 8] and second.input_ids.shape[0] == 3
    finally:
        dp.batches.sampler = sampler


@pytest.mark.parametrize("public", [False, True])
def test_the_trainers_eval_metrics_are_labelled_unprotected_unless_declared_public(tmp_path, texts, public, capsys):
    """ERRATA E15: the Trainer's eval set is covered by no accountant; its metrics reach every log renamed."""
    from transformers import DataCollatorForLanguageModeling

    loaded = fresh_model()
    train_dataset = tokenised(loaded.tokenizer, texts)
    eval_dataset = tokenised(loaded.tokenizer, public_corpus(16, seed=22, progress=False))
    dp = DPTraining(loaded.model, train_dataset, loaded.tokenizer, **PRIVACY, max_steps=2, eval_data_is_public=public,
                    ledger_path=tmp_path / "privacy" / "privacy_ledger.parquet")
    args = training_args(tmp_path / "run", dp.planned_steps, logging_steps=1, eval_strategy="steps", eval_steps=1,
                         per_device_eval_batch_size=8)
    trainer = Trainer(model=loaded.model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      data_collator=DataCollatorForLanguageModeling(loaded.tokenizer, mlm=False),
                      callbacks=[dp.callback])
    seen = SeenByCallbacks()
    trainer.add_callback(seen)  # a user's callback, after DPCallback
    dp.attach(trainer)
    trainer.train()
    returned = trainer.evaluate(eval_dataset, metric_key_prefix="test")  # the same data under another prefix
    keys = {k for entry in trainer.state.log_history for k in entry}
    evaluated = {k for k in keys if k.endswith("_loss")}
    note = capsys.readouterr().err
    if public:
        assert evaluated == {"eval_loss", "test_loss"} and "unprotected" not in note
        assert "test_loss" in returned and "declared public" in dp.summary()["eval_note"]
    else:
        assert evaluated == {"unprotected_eval_loss", "unprotected_test_loss"}
        assert not any(k.startswith(("eval_", "test_")) for k in keys)
        assert set(returned) >= {"unprotected_test_loss", "unprotected_test_runtime"} and "test_loss" not in returned
        assert all(k.startswith("unprotected_") for metrics in seen.metrics for k in metrics)
        assert "ERRATA E15" in note and "ERRATA E15" in dp.summary()["eval_note"]
    runs = [e for e in trainer.state.log_history if any(k.endswith("_loss") for k in e)]
    assert len(runs) == 3 and len(seen.metrics) == 3
    assert all(np.isfinite(v) for e in runs for k, v in e.items() if k.endswith("_loss"))


class SeenByCallbacks(TrainerCallback):
    def __init__(self):
        self.metrics = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))


def test_a_policy_server_whose_policy_may_not_drive_the_run_is_refused(texts):
    """A paper-mode policy saw unprivatized statistics: it may not drive a strict run (ERRATA E3/E14)."""
    from types import SimpleNamespace

    loaded = fresh_model()
    served = SimpleNamespace(env_config={"policy": {"privacy_mode": "paper", "action_decoding": "relative"}})
    client = FakePolicy(service="rllink://127.0.0.1:5555")
    client.config = served
    with pytest.raises(ConfigError, match="strict run may only use a strict one") as refused:
        DPTraining(loaded.model, texts, loaded.tokenizer, **{**PRIVACY, "strategy": "rldp"}, max_steps=3,
                   controller=client)
    assert "\n" not in str(refused.value)
    served.env_config["policy"]["privacy_mode"] = "strict"  # the same server with a strict policy is accepted
    DPTraining(loaded.model, texts, loaded.tokenizer, **{**PRIVACY, "strategy": "rldp"}, max_steps=3, controller=client)
    # ... unless the client declares another run: the server admits and labels its uploads by that declaration
    client.declared = {"privacy_mode": "paper", "action_decoding": "relative"}
    with pytest.raises(ConfigError, match="client declares"):
        DPTraining(loaded.model, texts, loaded.tokenizer, **{**PRIVACY, "strategy": "rldp"}, max_steps=3,
                   controller=client)


def test_common_random_numbers_and_public_ids_are_refused_for_the_trainers_records(texts):
    """Issue 26's second review: the Trainer cannot tell its records public, so fixed randomness and a public id
    are refused."""
    loaded = fresh_model()
    for extra, message in (({"common_random_numbers": True, "data": {"source": "public"}}, "common_random_numbers"),
                           ({"dataset_id": "public:" + "ab" * 32}, "names raydp's public population")):
        with pytest.raises(ConfigError, match=message) as refused:
            DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=4, **extra)
        assert "\n" not in str(refused.value)


def test_the_trainers_memory_metrics_are_labelled_unprotected(tmp_path, texts):
    """skip_memory_metrics=False adds peak-memory deltas, which follow the largest private batch."""
    loaded = fresh_model()
    dp = DPTraining(loaded.model, texts, loaded.tokenizer, **PRIVACY, max_steps=2, log_epsilon=False)
    trainer = Trainer(model=loaded.model, args=training_args(tmp_path, dp.planned_steps, skip_memory_metrics=False),
                      train_dataset=texts, processing_class=loaded.tokenizer, callbacks=[dp.callback])
    dp.attach(trainer)
    metrics = trainer.train().metrics
    memory = [k for k in metrics if "_mem_" in k]
    assert memory and all(k.startswith("unprotected_") for k in memory), metrics


def test_a_recipe_builds_dptraining_and_the_trainers_arguments(tmp_path, texts):
    """TrainerRecipe splits a recipe entry between DPTraining (batch, epochs, clip) and TrainingArguments (lr, its
    schedule, warm-up, weight decay; max_steps from the plan; no Trainer clipping), a keyword winning over either
    half; the Trainer's learning rate after the warm-up follows raydp's own schedule (lr_multiplier)."""
    from raydp.integrations.trainer_recipe import TrainerRecipe
    from raydp.runner.loop import OptimizerSettings, lr_multiplier

    recipe = TrainerRecipe.of("embedded", "static-pairwise", epsilon=2.0)
    s = recipe.settings
    fields = recipe.dp_fields(epochs=1, max_steps=4)
    assert fields["batch_size"] == s["batch_size"] and fields["clip"] == s["clip"] and fields["epochs"] == 1
    loaded = fresh_model()
    train_dataset = tokenised(loaded.tokenizer, texts)
    dp = DPTraining(loaded.model, train_dataset, loaded.tokenizer, strategy="static-pairwise", epsilon=2.0,
                    delta=1e-4, max_length=MAX_LENGTH, **fields)
    assert dp.config.clip == s["clip"] and dp.config.batch_size == s["batch_size"]
    args = recipe.training_arguments(dp, str(tmp_path / "run"), warmup_steps=1, save_strategy="no", report_to=[],
                                     disable_tqdm=True)
    assert args.max_steps == dp.planned_steps == 4 and args.max_grad_norm == 0.0
    assert args.learning_rate == s["lr"] and args.lr_scheduler_type.value == "cosine" and args.warmup_steps == 1
    trainer = Trainer(model=loaded.model, args=args, train_dataset=train_dataset, callbacks=[dp.callback])
    dp.attach(trainer)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    seen = [s["lr"] * trainer.lr_scheduler.lr_lambdas[0](step) for step in range(args.max_steps)]  # update step
    ours = lr_multiplier(OptimizerSettings(lr=s["lr"], warmup_steps=1, decay="cosine", lr_end=s.get("lr_end", 0.0),
                                           total_steps=4))
    assert seen[1:] == pytest.approx([s["lr"] * ours(step) for step in range(1, 4)], rel=1e-6)
    with pytest.raises(ConfigError, match="no entry for model 'gpt2'"):
        TrainerRecipe.of("gpt2", "static-pairwise", 2.0)
