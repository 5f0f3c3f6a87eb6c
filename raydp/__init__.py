"""raydp: differentially private LLM fine-tuning on Ray, with an RL controller for the privacy dials.

Subpackages mirror the concepts:
  data       records, verbaliser, splits, canaries, public corpus (RLDP Sec. 2.1)
  model      tokenizer, embedded model, Hugging Face loading, LoRA and adapter pairs (Sec. 2.2)
  runner     the fine-tuning loop: sampling, gradients, update, evaluation as separate steps
  evaluation perplexity and, later, privacy attacks
"""

__version__ = "0.1.0"
