"""raydp: differentially private LLM fine-tuning on Ray, with an RL controller for the privacy dials.

Subpackages mirror the concepts (imports run down this list's dependencies, never back up):
  data       records, verbaliser, splits, canaries, public corpus (RLDP Sec. 2.1)
  model      tokenizer, embedded model, Hugging Face loading, LoRA and adapter pairs, tokenised batches
  privacy    the mechanism a strategy describes, the DP step, releases, ledger, accountants, plans, guards
  control    RLDP's controller: state, reward, action decoding, the RLlib SAC policy and its store
  strategies what chooses each step's mechanism (registry, static, adaptive baselines, PBT, RLDP)
  evaluation perplexity and the value-token NLL, privacy attacks and the one-run epsilon audit
  runner     the fine-tuning loop: sampling, gradients, update, evaluation as separate steps; DP wiring
  study      study files on Ray Tune: grid, Optuna, PBT, results and reports
  report     the HTML report of a study or a run
  integrations  raydp's DP step under a transformers.Trainer script

"ERRATA En" (and a bare "En", e.g. "E15" or "E11-E15") in the code refers to docs/errata.md#en.
"""

__version__ = "0.1.0"
