"""Benchmark: raydp's DP step under transformers.Trainer (raydp.integrations.transformers) vs raydp's own loop.

Both paths train the same model (a fresh copy each) with the same strategy, expected batch size, plan
and optimizer (AdamW, constant learning rate), and draw the SAME Poisson batches and noise: both use the
same test-only randomness (``unsafe_fixed_randomness``, one seed per round; never for a real run, its
epsilon is void), so their steps do equal work. The two run in lockstep in one process, so that a
drifting machine load hits both alike: transformers.Trainer trains, and at each of its ``on_step_end``
callbacks raydp's own loop (:class:`raydp.runner.loop.Trainer`) runs one ``train_step`` (sampling, the DP
step, the update). A Trainer step's time is the wall time from the end of one such callback to the start
of the next (log/save/eval checks, batch fetch, the DP step, the optimizer hook and the update, the DP
callback); a raydp step's time is its ``train_step``. Medians over all steps but each run's first.

Prints the median step time of each path and the ratio Trainer / raydp.

Run: python bench/bench_hf_trainer.py [--model embedded] [--steps 20] [--batch 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--strategy", default="static")
    parser.add_argument("--steps", type=int, default=20, help="DP steps per run")
    parser.add_argument("--batch", type=int, default=16, help="expected Poisson batch size (units per step)")
    parser.add_argument("--records", type=int, default=400, help="synthetic records built (train split of them)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="lockstep runs (each a fresh pair of models and its own seed)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    from raydp.config import TrainConfig
    from raydp.data import build_dataset, load_texts
    from raydp.integrations.transformers import DPTraining
    from raydp.model import disable_dropout, load_model
    from raydp.model.batches import TokenizedSplit
    from raydp.runner.loop import OptimizerSettings, Trainer
    from raydp.runner.privacy_setup import PrivacyUnits, build_strategy, plan_private_run, setup_private_run

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(f"{tmp}/data", n_records=args.records, seed=0, progress=False)
        texts = load_texts(f"{tmp}/data", "train")
        eval_texts = load_texts(f"{tmp}/data", "eval")[:4]
    lr = 5e-4

    def config(seed: int) -> TrainConfig:
        return TrainConfig(strategy=args.strategy, epsilon=8.0, delta=1e-5 if len(texts) > 1e5 else 0.1 / len(texts),
                           batch_size=args.batch, epochs=1000, max_steps=args.steps, max_length=args.max_length,
                           unsafe_fixed_randomness=True, seed=seed)

    def fresh():
        torch.manual_seed(0)
        return load_model(args.model, progress=False)

    def own_loop(seed: int):
        """raydp's own loop on a fresh model, wired as ``raydp train`` wires it, ready to step."""
        loaded = fresh()
        disable_dropout(loaded.model)
        cfg = config(seed)
        strategy = build_strategy(cfg)
        plan = plan_private_run(cfg, len(texts), strategy)
        run = setup_private_run(cfg, plan, loaded.model, loaded.pairs, PrivacyUnits("record", len(texts)),
                                loaded.device, strategy=strategy)
        split = TokenizedSplit(texts, loaded.tokenizer, args.max_length)
        evaluation = TokenizedSplit(eval_texts, loaded.tokenizer, args.max_length)
        loop = Trainer(loaded.model, split, evaluation, run.sampler, run.step, loaded.device,
                       optimizer=OptimizerSettings(lr=lr, warmup_steps=0), eval_every=10**9, progress=False)
        loaded.model.train()
        return loop

    class Lockstep(TrainerCallback):
        """Times the Trainer's steps and runs one step of raydp's loop between them."""

        def __init__(self, loop):
            self.loop, self.hf, self.own, self._left = loop, [], [], None

        def on_step_end(self, *_, **__):
            entered = time.perf_counter()
            if self._left is not None:
                self.hf.append(entered - self._left)
            started = time.perf_counter()
            self.loop.train_step()
            self.own.append(time.perf_counter() - started)
            self._left = time.perf_counter()

    own, hf = [], []
    for r in range(args.rounds):
        seed = 100 + r
        lockstep = Lockstep(own_loop(seed))
        loaded = fresh()
        dp = DPTraining(loaded.model, texts, loaded.tokenizer, config(seed))
        with tempfile.TemporaryDirectory() as out:
            hf_args = TrainingArguments(out, max_steps=dp.planned_steps, max_grad_norm=0.0, learning_rate=lr,
                                        lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
                                        save_strategy="no", report_to=[], disable_tqdm=True)
            trainer = HFTrainer(model=loaded.model, args=hf_args, train_dataset=texts,
                                callbacks=[dp.callback, lockstep])
            dp.attach(trainer)
            trainer.train()
        # the same batches and noise: after the same steps the two models' LoRA weights agree
        own_weights = [p.detach() for p in lockstep.loop.model.parameters() if p.requires_grad]
        hf_weights = [p.detach() for p in loaded.model.parameters() if p.requires_grad]
        drift = max(float((a - b).abs().max()) for a, b in zip(own_weights, hf_weights))
        own += lockstep.own[1:]
        hf += lockstep.hf  # from the end of step 1's callback on
    t_own, t_hf = statistics.median(own), statistics.median(hf)
    print(f"model={args.model} strategy={args.strategy} expected batch={args.batch} train records={len(texts)} "
          f"steps/run={args.steps} rounds={args.rounds} device={'cuda' if torch.cuda.is_available() else 'cpu'} "
          f"threads={torch.get_num_threads()} transformers={transformers.__version__}")
    print(f"raydp's own loop            {t_own * 1e3:8.1f} ms per DP step (median of {len(own)})")
    print(f"transformers.Trainer + hook {t_hf * 1e3:8.1f} ms per DP step (median of {len(hf)})")
    print(f"ratio Trainer / raydp loop  {t_hf / t_own:8.3f}")
    print(f"max |LoRA weight difference| between the paths after the last round: {drift:.2e} (same batches/noise)")


if __name__ == "__main__":
    main()
