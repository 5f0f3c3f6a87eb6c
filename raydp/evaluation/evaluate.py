"""``raydp eval RUN_DIR``: attack a finished run and audit its epsilon; writes ``RUN_DIR/evaluation.json`` (for a
released cell of a private selection, whose folder holds releasable files only, the study's private
``work/evaluations/CELL/evaluation.json``: :func:`evaluation_path`).

What it loads: the run's ``config.json`` (model, LoRA, delta), its adapter (``adapter/``) on the base model,
its ``summary.json`` (the claimed epsilon, unit and labels) and its private dataset (``private/dataset``, or
the dataset directory the run read: a study's shared one). What it runs (:mod:`raydp.evaluation.attacks`):
membership inference on train records against the attack split (other patients, ERRATA E11), canary
extraction from public profiles, the secret canaries' exposure, and the audit canaries' scores turned into
lower bounds on epsilon (:mod:`raydp.evaluation.audit`) that are compared with the claimed epsilon.

Every figure here is computed from private records (train texts, the attack split, the canaries and the
audit coins) and is not a DP release: it is for the data owner, and nothing in raydp selects on it
(ERRATA E15). ``evaluation.json`` says so in its ``label``.

A one-run lower bound above the claimed epsilon means the mechanism leaks more than its accounting says: a bug to
fix, never a number to hide: ``audit.consistent`` is False when the one-run bound exceeds the claim, and
``raydp eval`` exits with status 3.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from raydp.errors import ConfigError
from raydp.files import atomic_write
from raydp.evaluation.base import AttackContext
from raydp.evaluation.registry import ATTACKS
from raydp.evaluation.results import EVALUATION_FORMAT, LABEL, EvalConfig, summary_line
from raydp.run_directory import RunDirectory



def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path.parent} has no {path.name}: is it a finished run directory ({what})?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {' '.join(str(exc).split())}") from None


def run_dataset_dir(run_dir: Path, config, summary: dict) -> Path:
    """The dataset a run trained on: the one it built under ``private/``, or the directory it read; refused
    when its dataset id is not the run's (a rebuilt directory would give the wrong members and coins)."""
    from raydp.data import identity_of, load_manifest, manifest_id

    own = RunDirectory(run_dir).private_dataset
    source = Path(config.data.source).expanduser()
    if (own / "manifest.json").is_file():
        found = own
    elif config.data.source != "synthetic" and (source / "manifest.json").is_file():
        found = source
    else:
        raise ConfigError(f"the dataset of run {run_dir} is not available (neither {own} nor a dataset directory in "
                          f"its config): the attacks need the private splits")
    expected, actual = identity_of(summary), manifest_id(load_manifest(found))
    if expected is not None and actual != expected:
        raise ConfigError(f"dataset {found} is not the one run {run_dir.name} trained on (dataset id "
                          f"{actual} != {expected})")
    return found


def load_trained_model(run_dir: Path, config, device: str):
    """The run's base model with its trained adapter loaded (PEFT's ``set_peft_model_state_dict``)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from raydp.model import LoraSettings, disable_dropout, load_model

    adapter = RunDirectory(run_dir).adapter / "adapter_model.safetensors"
    if not adapter.is_file():
        raise ConfigError(f"run {run_dir} has no trained adapter ({adapter})")
    loaded = load_model(config.model, device=device, lora=LoraSettings(**config.lora.model_dump()), progress=False)
    if loaded.is_encoder:  # the attacks score narrative likelihoods under a causal LM
        raise ConfigError(f"the attacks score a causal language model; {config.model!r} is an encoder")
    result = set_peft_model_state_dict(loaded.model, load_file(str(adapter), device=str(loaded.device)))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if getattr(result, "unexpected_keys", None) or missing:  # a partial load would score the base model
        raise ConfigError(f"the adapter in {adapter} does not fit model {config.model!r} "
                          f"({len(missing)} LoRA weights missing)")
    disable_dropout(loaded.model)
    loaded.model.eval()
    return loaded


def _claimed(summary: dict, config) -> dict:
    privacy = summary.get("privacy") or {}
    labels = list(privacy.get("labels") or [])
    claimed = {"strategy": summary.get("strategy"), "epsilon": privacy.get("epsilon"),
               "epsilon_target": privacy.get("epsilon_target"), "delta": privacy.get("delta", config.delta),
               "accountant": privacy.get("enforcing_accountant"), "privacy_unit": privacy.get("privacy_unit"),
               "labels": labels, "within_budget": privacy.get("within_budget"), "comparable": True, "note": None}
    if claimed["epsilon"] is None:
        claimed.update(comparable=False, note="non-private run: no claimed epsilon")
    elif privacy.get("guarantee") == "local":
        claimed.update(comparable=False, note="a local mechanism's epsilon is replace-one per unit; the audit is an "
                       "add/remove membership game: the two cannot be compared")
    elif any("void" in label.lower() or "paper mode" in label.lower() for label in labels):
        claimed.update(comparable=False, note="the claimed epsilon is labelled (void or paper mode): the audit "
                       "cannot confirm or refute it")
    elif any("epsilon covers phase 2 only" in label for label in labels):
        claimed.update(comparable=False, note="phase 1 trained non-privately on redacted private records (ERRATA E16): "
                       "the audit tests the whole pipeline, the claimed epsilon covers phase 2 only")
    elif config.is_controlled and config.strategy_settings().policy:
        claimed.update(comparable=False, note="the run's dials came from a saved policy trained on other runs: its "
                       "model's epsilon composes theirs (ERRATA E14; the study's tuning-aware figure), not this run's")
    return claimed


#: a released cell of a private selection holds this file (raydp.study.private_selection: released/CELL/)
SELECTION_FILE = "selection.json"
#: where a released cell's evaluation goes in its study directory (private, like everything under work/)
RELEASED_EVALUATIONS = Path("work") / "evaluations"


def is_released_cell(folder: Path) -> bool:
    """Whether ``folder`` is a released cell of a private selection (``released/CELL`` of a private-dp study): its
    PRIVACY.txt calls everything in it releasable."""
    return (Path(folder) / SELECTION_FILE).is_file()


def evaluation_path(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Where the evaluation of ``run_dir`` is written: ``out`` when given, else ``run_dir/evaluation.json``; for a
    released cell of a private selection, the study's private ``work/evaluations/CELL/evaluation.json``. The
    evaluation holds attacks on private records (member counts, scores, timings): never in a folder whose files are
    all releasable, so a released cell without its study around it (``released/`` copied elsewhere), or an ``out``
    inside a released cell, is refused (one line)."""
    run_dir = Path(run_dir).expanduser().absolute()
    if out is not None:
        out = Path(out).expanduser().absolute()
        if any(is_released_cell(folder) for folder in (out.parent, *out.parent.parents)):
            raise ConfigError(f"{out} is inside a released cell of a private selection, whose files are all "
                              "releasable: write the evaluation (private) elsewhere")
        return out
    if not is_released_cell(run_dir):
        return RunDirectory(run_dir).evaluation
    study = run_dir.parent.parent
    if run_dir.parent.name != "released" or not (study / "work").is_dir():
        raise ConfigError(f"{run_dir} is a released cell of a private selection without its study directory around "
                          "it: its evaluation (private) has no private place to go; evaluate the cell inside its "
                          "study directory (it goes to the study's work/evaluations/), or give it one (out=)")
    return RunDirectory(study / RELEASED_EVALUATIONS / run_dir.name).evaluation


class _Progress:
    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name = enabled, name

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[eval {self.name}] {message}", file=sys.stderr, flush=True)


def evaluate_run(run_dir: str | Path, settings: EvalConfig | None = None, progress: bool = True,
                 audits_in_family: int = 1, out: str | Path | None = None) -> dict:
    """Attack and audit the finished run in ``run_dir``; write and return its ``evaluation.json`` content, to
    :func:`evaluation_path` (``out``, else the run directory; a released cell's goes to its study's private
    ``work/evaluations/``, and the terminal says so).

    ``audits_in_family``: how many runs are audited together (a study's trials): each bound is then taken
    at confidence ``1 - (1 - confidence) / audits_in_family`` (Bonferroni), so that the chance of any false
    VIOLATION among them stays within ``1 - confidence``."""
    from raydp.config import TrainConfig

    settings = settings or EvalConfig()
    confidence = 1.0 - (1.0 - settings.confidence) / max(1, audits_in_family)
    run_dir = Path(run_dir).expanduser().absolute()
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    target = evaluation_path(run_dir, out)  # before anything runs: a released cell without a private place is refused
    run = RunDirectory(run_dir)
    summary = _read_json(run.summary, run.summary.name)
    config = TrainConfig.model_validate(_read_json(run.config, run.config.name))
    dataset = run_dataset_dir(run_dir, config, summary)
    say = _Progress(progress, run_dir.name)
    loaded = load_trained_model(run_dir, config, settings.device)
    rng = np.random.default_rng(np.random.SeedSequence([settings.seed, 0x4D494131]))  # "MIA1"
    seconds: dict[str, float] = {}
    result: dict = {"format": EVALUATION_FORMAT, "label": LABEL, "run_dir": str(run_dir),
                    "claimed": _claimed(summary, config), "settings": settings.model_dump(mode="json")}

    context = AttackContext(run_dir=run_dir, config=config, summary=summary, dataset=dataset, settings=settings,
                            loaded=loaded, rng=rng, confidence=confidence, result=result, say=say)
    for spec in ATTACKS:  # each registered attack, in order (raydp.evaluation.registry)
        started = time.perf_counter()
        result[spec.key] = spec.run(context)
        if result[spec.key] is not None:
            seconds[spec.key] = time.perf_counter() - started
    seconds["total"] = sum(seconds.values())
    result["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
    train_seconds = summary.get("train_loop_seconds")
    result["train_loop_seconds"] = train_seconds
    result["cost_ratio"] = round(seconds["total"] / train_seconds, 3) if train_seconds else None
    _write_json(target, result)
    if target.parent != run_dir:
        print(f"raydp: the evaluation of {run_dir.name} (private: attacks on private records) is in {target}",
              file=sys.stderr, flush=True)
    say(summary_line(result))
    return result


def _json_safe(value):
    """NaN and infinities become null (standard JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_json(path: Path, value: dict) -> None:
    """Write the evaluation owner-only and in one step (:func:`raydp.files.atomic_write`; its folder is created
    0700 if missing)."""
    try:
        atomic_write(path, json.dumps(_json_safe(value), indent=1, allow_nan=False))
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
