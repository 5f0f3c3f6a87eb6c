"""A dataset's lifetime privacy budget: the data owner sets it once; every DP run and study on the dataset is
charged its planned RDP curve, and one that would take the composed spend past the budget is refused before it
starts.

Composition: the RDP curves of all runs on the dataset add up, order by order, also when each run was chosen
after seeing the earlier ones' outputs (Mironov 2017, "Renyi Differential Privacy", Prop. 1, adaptive
sequential composition); the sum converts to (epsilon, delta) at the budget's delta as the accountants do
(:func:`raydp.privacy.accounting.rdp.rdp_epsilon`). A run is charged what its plan allows it to spend, fixed
before it starts: a fixed schedule's RDP curve over its planned steps, or an adaptive run's Renyi-filter budget
(ERRATA E13). A run that stops early has still spent no more than that, so the charge is an upper bound.

The register is the owner's, kept beside the owner key (``budgets/<dataset id>.json``; never in a releasable
file): the budget, and one charge per run or study trial under a label (a fresh run's output directory and a
random tag, as every fresh run spends anew; a study directory and trial name, so that resuming a study does not
charge it twice; a resumed run is not charged again). Only the machine that
starts a run or a study reads and writes it: a study charges all its trials on the driver before any starts.
Public datasets (``public:`` ids) have no budget.

The budget follows the records, not the key: a dataset's id is keyed with the owner key, so the same source
rebuilt under another owner key has another id. The register therefore also keeps the source file's fingerprint,
salted (``source_tag``: HMAC-SHA256 of the manifest's private ``source_sha256`` under a random salt kept in the
register, never in a releasable file), and a dataset whose id has no register is charged to the register whose
tag its source matches (:func:`register_for`), which then keeps its id as an alias (:func:`adopt`). It matches a
rebuild of the same source file, byte for byte; a different file (one record edited) is another dataset, as it
would be under one key.

Local-DP runs (EW-FT, DP-Forward) are accounted otherwise and are refused on a dataset with a budget; a
non-private run releases nothing and is not charged.

A run is charged by whoever starts it (:func:`raydp.runner.run.run_training`), unless its caller charged it first
and proves it with a :class:`LifetimeReceipt` (a study for its trials, a private selection for its cells'
trials): that is the only way to skip a run's own charge (:func:`check_receipt`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raydp.data.identity import PUBLIC_PREFIX, is_dataset_id, manifest_id, owner_key_path
from raydp.data.splits import MANIFEST, load_manifest
from raydp.errors import ConfigError
from raydp.files import atomic_write, locked
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon

FORMAT = "raydp-lifetime-budget-v1"


def register_path(dataset_id: str) -> Path:
    """Where the owner keeps the budget of ``dataset_id``: ``budgets/`` beside the owner key."""
    if not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        raise ConfigError(f"{dataset_id!r} is not a private dataset id: public data has no lifetime budget")
    return owner_key_path().parent / "budgets" / f"{dataset_id.replace(':', '_')}.json"


def _source_tag(salt: str, source_sha256: str) -> str:
    return hmac.new(bytes.fromhex(salt), b"raydp lifetime source v1" + source_sha256.encode(),
                    hashlib.sha256).hexdigest()


def register_for(dataset_id: str, source_sha256: str | None = None) -> Path:
    """The register that budgets ``dataset_id``: its own; else the register that lists it among its ``aliases``
    (a rebuild of its source, adopted: :func:`adopt`); else the register whose ``source_tag`` its source
    fingerprint (the manifest's private ``source_sha256``) matches: the same source built under another owner key.
    Else its own path (which does not exist). A register that cannot be read while looking is an error (fail
    closed): skipping it could leave a budgeted dataset's run uncharged."""
    path = register_path(dataset_id)
    if path.is_file() or not os.path.lexists(path.parent):
        return path
    try:  # listed with errors raised: a budgets/ that cannot be listed is not an empty one
        names = sorted(entry.name for entry in os.scandir(path.parent) if entry.name.endswith(".json"))
    except OSError as exc:
        raise ConfigError(f"{path.parent}: the lifetime budget registers cannot be listed ({exc.strerror or exc}); "
                          "nothing was started") from None
    for other in (path.parent / name for name in names):
        try:
            if other.is_symlink():
                raise ValueError("a register must not be a link")
            register = json.loads(other.read_text())
            if not isinstance(register, dict) or register.get("format") != FORMAT:
                raise ValueError("not a register")
            aliases = register.get("aliases", [])
            if not isinstance(aliases, list) or not all(is_dataset_id(a) for a in aliases):
                raise ValueError("aliases must be a list of dataset ids")
            if dataset_id in aliases:
                return other
            tag = register.get("source_tag") or {}
            if source_sha256 and tag and hmac.compare_digest(
                    str(tag["hmac"]), _source_tag(str(tag["salt"]), source_sha256)):
                return other
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{other}: a lifetime budget register cannot be read ({exc}); nothing was started") \
                from None
    return path


def adopt(dataset_id: str, source_sha256: str | None) -> Path | None:
    """:func:`register_for`, and when that is another dataset's register (its source matched: a rebuild under
    another owner key), ``dataset_id`` recorded among its aliases, so that the id alone finds the budget from then
    on. None for a public or malformed id."""
    if not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        return None
    path = register_for(dataset_id, source_sha256)
    if not path.is_file() or path == register_path(dataset_id):
        return path
    with _locked(path):
        register = _read(path)
        aliases = list(register.get("aliases") or [])
        if dataset_id not in aliases:
            register["aliases"] = aliases + [dataset_id]
            _write(path, register)
    return path


def _flock(lock_file: Path):
    """An exclusive lock held on ``lock_file`` for the block (its directory made owner-only if new)."""
    return locked(lock_file)


def _locked(path: Path):
    """An exclusive lock on the register while it is read and rewritten (runs started side by side)."""
    return _flock(path.with_suffix(".lock"))


def _directory_locked(budgets: Path):
    """An exclusive lock on the whole ``budgets/`` directory (set_budget: finding a source's register and creating
    one must be one step)."""
    return _flock(budgets / ".budgets.lock")


def _read(path: Path) -> dict | None:
    if path.is_symlink():  # a write would replace the link, not the register it points at
        raise ConfigError(f"{path}: a lifetime budget register must not be a link; nothing was started")
    if not path.is_file():
        return None
    try:
        register = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: the lifetime budget register cannot be read ({exc}); nothing was started") from None
    if not isinstance(register, dict) or register.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a raydp lifetime budget register; nothing was started")
    return register


def _write(path: Path, register: dict) -> None:
    atomic_write(path, json.dumps(register, indent=1))  # owner-only, fsync, rename: never half-written


def set_budget(dataset_id: str, epsilon: float, delta: float, privacy_unit: str = "patient",
               max_delta: float = 1.0, source_sha256: str | None = None) -> dict:
    """Set the dataset's lifetime (epsilon, delta) for one privacy unit, once: setting it again to other values is
    refused (a budget that can be raised bounds nothing). Runs charged before it was set are not in it.
    ``max_delta``: delta must be below it (1/N units: a larger delta allows releasing a unit outright).
    ``source_sha256``: the manifest's source fingerprint, kept salted so that a rebuild of the same source under
    another owner key finds this budget (:func:`register_for`)."""
    if not (0 < epsilon < math.inf) or not (0 < delta < min(1.0, max_delta)):
        raise ConfigError(f"a lifetime budget needs 0 < epsilon < inf and 0 < delta < {min(1.0, max_delta):.3g} "
                          f"(1/N units), got ({epsilon}, {delta})")
    with _directory_locked(register_path(dataset_id).parent):  # the lookup and the creation together: two
        # budgets set at once on two builds of one source would otherwise both find none and create two registers
        path = register_for(dataset_id, source_sha256)
        return _set_budget_in(path, dataset_id, epsilon, delta, privacy_unit, source_sha256)


def set_dataset_budget(directory: str | os.PathLike, epsilon: float, delta: float,
                       privacy_unit: str = "patient") -> dict:
    """Put a lifetime budget on the dataset in ``directory``: set its register (:func:`set_budget`, once; delta
    below 1/N, N its train split's size) and write ``lifetime_budget`` (epsilon, delta, privacy unit) into its
    manifest.json, so that the dataset itself says it is budgeted: a run that cannot find the register is refused
    (fail closed). Returns the register."""
    manifest = load_manifest(directory)
    register = set_budget(manifest_id(manifest), epsilon, delta, privacy_unit,
                          max_delta=1.0 / max(int(manifest["sizes"].get("train", 1)), 1),
                          source_sha256=manifest.get("source_sha256"))
    manifest["lifetime_budget"] = {k: register[k] for k in ("epsilon", "delta", "privacy_unit")}
    atomic_write(Path(directory) / MANIFEST, json.dumps(manifest, indent=2))
    return register


def _set_budget_in(path: Path, dataset_id: str, epsilon: float, delta: float, privacy_unit: str,
                   source_sha256: str | None) -> dict:
    with _locked(path):
        register = _read(path)
        if register is not None:
            if (register["epsilon"], register["delta"], register["privacy_unit"]) != \
                    (float(epsilon), float(delta), privacy_unit):
                raise ConfigError(f"dataset {dataset_id} already has the lifetime budget epsilon="
                                  f"{register['epsilon']:g}, delta={register['delta']:g} per "
                                  f"{register['privacy_unit']}: it is set once")
            return register
        register = {"format": FORMAT, "dataset_id": dataset_id, "epsilon": float(epsilon), "delta": float(delta),
                    "privacy_unit": privacy_unit, "orders": list(DEFAULT_ORDERS), "charges": {}}
        if source_sha256:
            salt = os.urandom(16).hex()
            register["source_tag"] = {"salt": salt, "hmac": _source_tag(salt, source_sha256)}
        _write(path, register)
        return register


def read_budget(dataset_id: str, source_sha256: str | None = None) -> dict | None:
    """The register, or None when the dataset has no lifetime budget (or is public); ``source_sha256``: see
    :func:`register_for`."""
    if not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        return None
    return _read(register_for(dataset_id, source_sha256))


def spent_epsilon(register: Mapping, extra: Mapping[str, Sequence[float]] | None = None) -> float:
    """Epsilon at the budget's delta of every charge (and ``extra``, replacing charges of the same label)."""
    charges = {**register["charges"], **(extra or {})}
    total = np.zeros(len(register["orders"]))
    for curve in charges.values():
        total = total + np.asarray(curve, dtype=np.float64)
    return 0.0 if not np.any(total) else rdp_epsilon(total, register["orders"], register["delta"])


def charge(dataset_id: str | None, charges: Mapping[str, Sequence[float]], orders: Sequence[float] = DEFAULT_ORDERS,
           commit: bool = True, privacy_unit: str = "patient", required: bool = False,
           source_sha256: str | None = None) -> float | None:
    """Charge runs (label -> planned RDP curve at ``orders``) to the dataset's lifetime budget, or raise a
    one-line ConfigError, writing nothing, if the composition would exceed it. A label already charged is charged
    again only where its new curve is larger (a resumed study whose plan changed pays the difference). Runs of
    another privacy unit than the budget's are refused. ``commit=False`` only checks; ``required``: the dataset
    says it has a budget, so a missing register is refused (fail closed); ``source_sha256``: the manifest's source
    fingerprint, which finds the budget of the same source built under another owner key (:func:`register_for`).
    Returns the composed epsilon after the charge, or None when the dataset has no budget."""
    if dataset_id is None or not charges:
        return None
    if not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        return None
    path = adopt(dataset_id, source_sha256)
    if not path.is_file():
        if required:
            raise ConfigError(f"dataset {dataset_id} has a lifetime budget, but its register is not at {path} (set "
                              f"RAYDP_OWNER_KEY to the owner's key file on this machine); nothing was started")
        if commit:  # no budget to enforce: what the runs spend is still recorded
            record_spend(dataset_id, charges, orders)
        return None
    with _locked(path):
        register = _read(path)
        if [float(a) for a in orders] != [float(a) for a in register["orders"]]:
            raise ConfigError(f"{path}: charges must be RDP curves at the register's orders")
        if privacy_unit != register.get("privacy_unit", "patient"):
            raise ConfigError(f"dataset {dataset_id}'s lifetime budget is per {register.get('privacy_unit')}: a run "
                              f"protecting each {privacy_unit} cannot be charged to it; nothing was started")
        new = {}
        for label, curve in charges.items():
            curve = np.asarray(curve, dtype=np.float64)
            if curve.shape != (len(orders),) or np.isnan(curve).any() or (curve < 0).any():
                raise ConfigError(f"{label}: a charge must be a non-negative RDP curve at every order")
            old = register["charges"].get(label)
            merged = curve if old is None else np.maximum(curve, np.asarray(old, dtype=np.float64))
            if old is None or (merged > np.asarray(old)).any():
                new[label] = merged.tolist()
        before = spent_epsilon(register)
        after = spent_epsilon(register, new)
        if after > register["epsilon"]:
            raise ConfigError(
                f"dataset {dataset_id}: {len(new)} more run(s) would take its lifetime spend to epsilon={after:.3f}, "
                f"past its lifetime budget {register['epsilon']:g} at delta={register['delta']:g} (spent so far "
                f"{before:.3f}); nothing was started")
        if commit and new:
            register["charges"].update(new)
            _write(path, register)
        return after


@dataclass(frozen=True)
class LifetimeReceipt:
    """A caller's proof that it holds a run's lifetime charge: the dataset it charged and the register label it
    charged under (a plan that covers the run: the trial's own, or a private selection's cell, whose end-to-end
    curve covers its every trial). Only a run given one skips its own charge (:func:`check_receipt`)."""

    dataset_id: str
    label: str


def check_receipt(receipt, dataset_id: str | None, source_sha256: str | None = None) -> None:
    """Refuse (one line) a ``receipt`` that does not prove the charge of a run on ``dataset_id``: anything but a
    :class:`LifetimeReceipt`, another dataset's, or, where this machine holds the dataset's register, a label the
    register does not hold. A dataset without a budget needs no charge; where the register is elsewhere (a study's
    trial on another node: the driver charged it there), the receipt is taken as given."""
    if not isinstance(receipt, LifetimeReceipt):
        raise ConfigError(f"a run skips its lifetime charge only with the LifetimeReceipt of the charge its caller "
                          f"holds, got {type(receipt).__name__}")
    if receipt.dataset_id != dataset_id:
        raise ConfigError(f"the lifetime charge held ({receipt.label}) is on dataset {receipt.dataset_id}, not on this "
                          f"run's dataset {dataset_id}; nothing was started")
    register = read_budget(dataset_id, source_sha256) if dataset_id is not None else None
    if register is not None and receipt.label not in register["charges"]:
        raise ConfigError(f"dataset {dataset_id} has a lifetime budget, and its register holds no charge "
                          f"{receipt.label!r}, the one this run's caller says it holds; nothing was started")


#: the owner's record of what DP runs spent on a dataset that has no lifetime budget
SPEND_FORMAT = "raydp-spend-record-v1"


def spend_record_path(dataset_id: str) -> Path:
    """Where the owner keeps the spend of ``dataset_id`` when it has no budget: ``spend/`` beside the owner key."""
    if not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        raise ConfigError(f"{dataset_id!r} is not a private dataset id: public data has no spend to record")
    return owner_key_path().parent / "spend" / f"{dataset_id.replace(':', '_')}.json"


def _read_spend(path: Path) -> dict | None:
    if not path.is_file() or path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == SPEND_FORMAT else None


def record_spend(dataset_id: str | None, charges: Mapping[str, Sequence[float]],
                 orders: Sequence[float] = DEFAULT_ORDERS) -> None:
    """Record the planned RDP curve of runs (label -> curve at ``orders``) on a dataset without a lifetime budget, so
    that what piles up is never silent: an owner-only record beside the owner key (``spend/<dataset id>.json``),
    one curve per label (a label recorded again keeps the larger curve, as :func:`charge` does). Nothing is
    refused: that is what a budget is for (``raydp data budget``). The record follows the dataset id, so the same
    records built under another owner key start a new one; a budget set later does not take it over (the budget
    bounds what runs spend from then on)."""
    if dataset_id is None or not charges or not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        return
    path = spend_record_path(dataset_id)
    with locked(path.with_suffix(".lock")):
        record = _read_spend(path) or {"format": SPEND_FORMAT, "dataset_id": dataset_id,
                                       "orders": [float(a) for a in orders], "charges": {},
                                       "note": "planned RDP curves of the DP runs on this dataset (no lifetime "
                                               "budget): private, the owner's"}
        if [float(a) for a in orders] != record["orders"]:
            return  # curves at other orders cannot be added: the record keeps what it has
        for label, curve in charges.items():
            curve = np.asarray(curve, dtype=np.float64)
            old = record["charges"].get(label)
            record["charges"][label] = (curve if old is None else np.maximum(curve, np.asarray(old))).tolist()
        atomic_write(path, json.dumps(record, indent=1))


def spent_so_far(dataset_id: str | None, delta: float, source_sha256: str | None = None) -> dict | None:
    """What the DP runs charged or recorded on the dataset compose to (RDP curves added order by order, Mironov 2017,
    Prop. 1; converted as the accountants do): ``{"runs", "epsilon", "delta", "budget"}`` with the budget's epsilon
    and delta where the dataset has one (``budget`` None otherwise, the figure then at ``delta``); None where no
    run was recorded."""
    if dataset_id is None or not is_dataset_id(dataset_id) or dataset_id.startswith(PUBLIC_PREFIX):
        return None
    register = read_budget(dataset_id, source_sha256)
    if register is not None:
        return {"runs": len(register["charges"]), "epsilon": spent_epsilon(register), "delta": register["delta"],
                "budget": register["epsilon"]} if register["charges"] else None
    record = _read_spend(spend_record_path(dataset_id))
    if not record or not record["charges"]:
        return None
    total = np.sum([np.asarray(c, dtype=np.float64) for c in record["charges"].values()], axis=0)
    return {"runs": len(record["charges"]), "epsilon": rdp_epsilon(total, record["orders"], delta), "delta": delta,
            "budget": None}


def spend_line(dataset_id: str | None, delta: float, source_sha256: str | None = None) -> str | None:
    """One line for the start of a DP run or study: what earlier runs on the dataset spent (None: nothing yet)."""
    spent = spent_so_far(dataset_id, delta, source_sha256)
    if spent is None:
        return None
    if spent["budget"] is not None:
        return (f"dataset {dataset_id}: {spent['runs']} DP run(s) charged so far compose to epsilon "
                f"{spent['epsilon']:.3g} of its lifetime budget {spent['budget']:g} at delta {spent['delta']:g}")
    return (f"dataset {dataset_id}: {spent['runs']} earlier DP run(s) on it compose to epsilon {spent['epsilon']:.3g} "
            f"at delta {spent['delta']:g}, and it has no lifetime budget (`raydp data budget DATASET --epsilon E "
            f"--delta D` sets one)")
