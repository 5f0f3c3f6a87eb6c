"""Saved policies (``policies/NAME``): the RLlib module checkpoint, the replay buffer and a manifest.

Layout of a policy directory::

    manifest.json   format, architecture, observation layout (versioned), SAC settings, what it was
                    trained on (model, adapter pairs, epsilon, steps, decisions), results, provenance, the
                    saving session's transitions and SAC updates, and ``lifetime`` (runs, transitions and SAC
                    updates over the policy's whole training, inherited ones included: :func:`continue_lifetime`;
                    absent from a manifest written before it existed, :func:`lifetime_of`)
    module.safetensors  the SAC module's state (actor, twin critics and their targets) as named arrays; the
                    module is rebuilt from the manifest's layout and SAC settings (raydp.control.sac.module_spec),
                    so nothing is unpickled and the directory loads wherever raydp's classes have moved
    replay.npz      the replay buffer's transitions (RLlib's new stack does not checkpoint it); absent from a copy
                    made to run frozen (:func:`copy_policy_without_replay`: its manifest says
                    ``"replay_buffer": "removed"``), which loads as the full policy does and acts the same

A policy is found by name under the policy directory (``--policy-dir``, default ``policies``) or by path.

Provenance (ERRATA E14). A policy is a function of the releases its training runs saw, so every one of
those runs' privacy spend stays attached to it: ``manifest["provenance"]`` is a list with one entry per
run that trained the policy (a policy continued from a saved one inherits the earlier list and appends;
:func:`copy_policy` keeps it)::

    {"dataset_id": str | None,            # the dataset's keyed id (raydp.data.identity): never a plain hash
     "privacy_mode": "strict" | "paper",  # paper: the controller saw unprivatized statistics (E3)
     "privacy_unit": str | None,          # "record" / "patient" (E11)
     "epsilon": float | None, "delta": float | None,
     "guarantee": str | None,             # e.g. "renyi_filter" or "ledger" (how rdp_curve is justified)
     "rdp_orders": [float, ...] | None,   # the RDP curve of the run: (alpha, rdp_curve[i])-RDP at
     "rdp_curve": [float, ...] | None,    # each order alpha = rdp_orders[i]
     "entry_id": str}                     # added when the entry is recorded (de-duplication)

A study composes the entries whose ``dataset_id`` is its own dataset's with its trials (RDP
composition, Mironov 2017, Prop. 1; see :mod:`raydp.study.results`). A strict-mode policy is
post-processing of DP releases: reusing it costs nothing more. A paper-mode policy saw unprivatized
statistics of private data: it may not drive a strict run (:func:`check_policy_privacy_mode`), whatever it
touches inherits the paper-mode label, and its replay buffer is private data (:func:`export_policy`
refuses it unless asked explicitly). Manifests written before provenance existed are read as one legacy
entry built from ``trained_on`` (dataset unknown).

Versions: ``raydp-policy-v3`` keeps the module as a state file (above). ``raydp-policy-v2`` kept RLlib's module
checkpoint (``module/``, whose ``class_and_ctor_args.pkl`` pickles classes by module path: moving a file broke
it); it is still read, and ``raydp migrate`` converts it. ``raydp-policy-v2`` and later name datasets by their
keyed ``dataset_id``. A ``raydp-policy-v1`` manifest
named them by a plain content hash (``dataset_sha256``), which lets anyone who knows all records but one
recover the last one; it is still read (each entry's hash converted to the owner's id, so old and new runs on
the same data compose) and ``raydp migrate`` rewrites it as v2.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
import uuid
from pathlib import Path

import numpy as np

from raydp import __version__
from raydp.control.features import LAYOUT_VERSION, ObservationLayout
from raydp.control.modes import PAPER, PRIVACY_MODES, recorded_privacy_mode, unprotected
from raydp.data.identity import identity_of
from raydp.errors import ConfigError
from raydp.files import atomic_replace, atomic_write

POLICY_FORMAT = "raydp-policy-v3"
HASH_FORMATS = ("raydp-policy-v1",)  # read (dataset hashes converted to ids); `raydp migrate` rewrites them
PICKLE_FORMATS = ("raydp-policy-v2",)  # read (an RLlib module checkpoint); `raydp migrate` converts them
LEGACY_FORMATS = (*HASH_FORMATS, *PICKLE_FORMATS)
MANIFEST = "manifest.json"
MODULE_DIR = "module"  # v1/v2: RLlib's module checkpoint
MODULE_FILE = "module.safetensors"  # v3
REPLAY_FILE = "replay.npz"


def shipped_policy_dir() -> Path | None:
    """The policies shipped with raydp: ``raydp/shipped_policies`` in an installed wheel (copied there from the
    repository's ``policies/`` at build time, ``setup.py``), else the source checkout's ``policies/``."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "shipped_policies", package.parent / "policies"):
        if candidate.is_dir():
            return candidate
    return None


def _policy_dirs(policy_dir: str | Path) -> list[Path]:
    """Where a policy name is looked up: ``policy_dir`` (relative to the working directory), then the shipped
    policies (so the quickstart runs from any directory and from a non-editable install)."""
    dirs = [Path(policy_dir).expanduser()]
    shipped = shipped_policy_dir()
    if shipped is not None and shipped.resolve() != dirs[0].resolve():
        dirs.append(shipped)
    return dirs


def resolve_policy(name_or_path: str, policy_dir: str | Path = "policies") -> Path:
    """The directory of a saved policy, absolute (Ray actors run elsewhere and RLlib reads a relative path
    as a URI): a path, or a name under ``policy_dir`` or among the shipped policies; ConfigError if absent."""
    dirs = _policy_dirs(policy_dir)
    for candidate in (Path(name_or_path).expanduser(), *(d / name_or_path for d in dirs)):
        if (candidate / MANIFEST).is_file():
            return candidate.resolve()
    known = ", ".join(p["name"] for p in list_policies(policy_dir)) or "none"
    raise ConfigError(f"no saved policy {name_or_path!r} (looked for {name_or_path}/{MANIFEST} and NAME/{MANIFEST} "
                      f"in {', '.join(str(d) for d in dirs)}); known policies: {known}")


def load_manifest(path: str | Path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable policy manifest ({exc})") from None
    if manifest.get("format") not in (POLICY_FORMAT, *LEGACY_FORMATS):
        raise ConfigError(f"{path}: unknown policy format {manifest.get('format')!r} (expected {POLICY_FORMAT})")
    if manifest["layout"].get("version") != LAYOUT_VERSION:
        raise ConfigError(f"{path}: observation layout {manifest['layout'].get('version')!r} is not "
                          f"{LAYOUT_VERSION!r}; this raydp cannot drive it")
    return manifest


def policy_layout(manifest: dict) -> ObservationLayout:
    return ObservationLayout(**manifest["layout"])


def list_policies(policy_dir: str | Path = "policies") -> list[dict]:
    """The saved policies in ``policy_dir`` and the shipped ones (a name in ``policy_dir`` hides a shipped one)."""
    out, seen = [], set()
    for root in _policy_dirs(policy_dir):
        if root.is_dir():
            out += [p for p in _list_dir(root) if p["name"] not in seen]
            seen |= {p["name"] for p in out}
    return out


def _list_dir(root: Path) -> list[dict]:
    out = []
    for child in sorted(root.iterdir()):
        if (child / MANIFEST).is_file():
            try:
                m = load_manifest(child)
            except ConfigError:
                continue
            out.append({"name": child.name, "path": str(child), **{k: m.get(k) for k in
                        ("architecture", "created", "trained_on", "results", "transitions")},
                        "totals": training_totals(m),
                        "provenance": provenance_of(m), "privacy_mode": policy_privacy_mode(m)})
    return out


#: what a policy's training cost, summed over every study that trained it (a continued policy inherits the
#: earlier studies' figures: :func:`training_totals`)
TOTAL_KEYS = ("episodes", "transitions", "sac_updates", "wall_seconds", "cpu_seconds", "gpu_seconds")
#: a manifest's ``lifetime`` field, written by every save (study, single run, policy server, snapshot): the runs
#: that trained the policy (its provenance entries) and the transitions and SAC updates it trained on, over its
#: whole life (the restored policy's figures plus this session's); ``transitions`` and ``sac_updates`` at the
#: manifest's top level are the saving session's only
LIFETIME_KEYS = ("runs", "transitions", "sac_updates")


def training_totals(manifest: dict) -> dict:
    """A policy's whole training record, summed over everything that trained it: its ``lifetime`` field (every
    save writes it; episodes are its runs), with the wall, CPU and GPU seconds of its study record (that record's
    ``totals`` when the study continued a policy; None when no study saved it); for a manifest written before
    that field existed, its pretraining record's ``totals`` (written when a study continues a saved policy), else
    its own figures (one study, or a policy saved before totals existed: its episodes counted from its provenance,
    one entry per run)."""
    record = (manifest.get("trained_on") or {}).get("pretraining") or {}
    lifetime = manifest.get("lifetime")
    if lifetime:
        seconds = record.get("totals") or record
        return {"episodes": lifetime.get("runs"), "transitions": lifetime.get("transitions"),
                "sac_updates": lifetime.get("sac_updates"), **{k: seconds.get(k) for k in TOTAL_KEYS[3:]}}
    if record.get("totals"):
        return {k: record["totals"].get(k) for k in TOTAL_KEYS}
    return {"episodes": len(provenance_of(manifest)), "transitions": manifest.get("transitions"),
            "sac_updates": manifest.get("sac_updates"), **{k: record.get(k) for k in TOTAL_KEYS[3:]}}


def lifetime_of(manifest: dict) -> dict:
    """What a saved policy was trained on over its whole life (``LIFETIME_KEYS``): the runs (its provenance
    entries) and the transitions and SAC updates of :func:`training_totals`, which reads the manifest's
    ``lifetime`` field, or, for a manifest written before it existed, the study record's totals or the manifest's
    own counts. A service that restores the policy continues from these figures."""
    totals = training_totals(manifest)
    return {"runs": len(provenance_of(manifest)), "transitions": totals["transitions"],
            "sac_updates": totals["sac_updates"]}


#: a fresh policy's lifetime: nothing trained it yet
NO_LIFETIME = {"runs": 0, "transitions": 0, "sac_updates": 0}


def continue_lifetime(inherited: dict | None, *, runs: int, transitions: int | None, sac_updates: int | None) -> dict:
    """The ``lifetime`` field of a save: ``runs`` (the saved provenance's length: a snapshot adds no run), and the
    ``inherited`` transitions and SAC updates (the restored policy's :func:`lifetime_of`; None: a fresh policy)
    plus this session's (None where either is unknown). The session's counters are cumulative, so a checkpoint
    snapshot and a later save of the same session each add the session's figures to the same inherited ones:
    nothing is counted twice."""
    inherited = NO_LIFETIME if inherited is None else inherited

    def plus(earlier, this):
        return None if earlier is None or this is None else int(earlier) + int(this)

    return {"runs": int(runs), "transitions": plus(inherited.get("transitions"), transitions),
            "sac_updates": plus(inherited.get("sac_updates"), sac_updates)}


def add_totals(earlier: dict, this: dict) -> dict:
    """``earlier``'s totals plus one study's figures (None where either is unknown)."""
    return {k: None if earlier.get(k) is None or this.get(k) is None else
            round(earlier[k] + this[k], 1) if isinstance(earlier[k] + this[k], float) else earlier[k] + this[k]
            for k in TOTAL_KEYS}


PROVENANCE_KEYS = ("dataset_id", "privacy_mode", "privacy_unit", "epsilon", "delta", "guarantee",
                   "rdp_orders", "rdp_curve")


def _jsonable(value):
    """numpy scalars/arrays (an RDP curve) as plain JSON values."""
    if isinstance(value, np.ndarray):
        return [float(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def provenance_entry(entry: dict) -> dict:
    """Validate one provenance entry (the dict a run passes to ``save_policy(..., provenance=entry)``;
    shape in the module docstring) and return it JSON-ready, with an ``entry_id`` (kept if present) that
    identifies the run across copies and continuations, so a study never composes one run twice."""
    if not isinstance(entry, dict):
        raise ValueError(f"a policy provenance entry is a dict, not {type(entry).__name__}")
    if entry.get("privacy_mode") not in PRIVACY_MODES and not entry.get("legacy"):
        raise ValueError(f"provenance privacy_mode must be one of {PRIVACY_MODES}, not {entry.get('privacy_mode')!r}")
    orders, curve = entry.get("rdp_orders"), entry.get("rdp_curve")
    if (orders is None) != (curve is None) or (orders is not None and len(orders) != len(curve)):
        raise ValueError("provenance rdp_orders and rdp_curve must both be given, with the same length")
    entry = _with_dataset_id(entry)
    out = {k: _jsonable(entry.get(k)) for k in PROVENANCE_KEYS}
    out.update({k: _jsonable(v) for k, v in entry.items() if k not in out})
    out["entry_id"] = str(entry.get("entry_id") or uuid.uuid4().hex)
    for key, value in out.items():  # a manifest is JSON: what would not survive the save is refused here
        if not isinstance(key, str) or not _round_trips(value):
            raise ValueError(f"provenance field {str(key)[:40]!r} is not a JSON value ({type(value).__name__})")
    return out


def _round_trips(value) -> bool:
    """True when ``json.loads(json.dumps(value)) == value`` (no bytes, sets, NaN or non-string keys)."""
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError, RecursionError):
        return False


def append_provenance(provenance: list[dict], entry: dict) -> bool:
    """Append a validated entry (:func:`provenance_entry`) to a policy's list unless its ``entry_id`` is
    already there (one run is composed once). True if it was appended."""
    if entry["entry_id"] in {e.get("entry_id") for e in provenance}:
        return False
    provenance.append(entry)
    return True


def provenance_of(manifest: dict) -> list[dict]:
    """The runs that trained a policy (ERRATA E14): ``manifest["provenance"]``; a manifest written before
    provenance existed gives one legacy entry from its ``trained_on`` (dataset and RDP curve unknown)."""
    if manifest.get("provenance") is not None:
        return [_with_dataset_id(e) for e in manifest["provenance"]]
    trained = manifest.get("trained_on") or {}
    if not trained:
        return []
    return [{"legacy": True, "dataset_id": None, "privacy_mode": trained.get("privacy_mode"),
             "privacy_unit": None, "epsilon": trained.get("epsilon"), "delta": None, "guarantee": None,
             "rdp_orders": None, "rdp_curve": None, "model": trained.get("model"),
             "entry_id": f"legacy:{manifest.get('name')}:{manifest.get('created')}"}]


def _with_dataset_id(entry: dict) -> dict:
    """An entry naming its dataset by ``dataset_id``: a v1 entry's plain ``dataset_sha256`` is converted for
    the owner (:func:`raydp.data.identity.identity_of`) and dropped."""
    entry = dict(entry)
    if "dataset_sha256" in entry:
        legacy = entry.pop("dataset_sha256")
        if entry.get("dataset_id") is None:
            entry["dataset_id"] = identity_of({"dataset_sha256": legacy, "public_data": entry.get("public_data")})
    return entry


def _declared_modes(manifest: dict) -> list:
    """The privacy modes a manifest declares: each provenance entry's (None where an entry has none), and
    ``trained_on.privacy_mode`` when it is there."""
    modes = [e.get("privacy_mode") for e in provenance_of(manifest)]
    trained = (manifest.get("trained_on") or {}).get("privacy_mode")
    if trained is not None:
        modes.append(trained)
    return modes


def policy_privacy_mode(manifest: dict) -> str:
    """'strict' only if every run that trained the policy is declared strict (each provenance entry, the
    legacy entry from ``trained_on`` included, and ``trained_on.privacy_mode`` if present), else 'paper'
    (ERRATA E3/E14): a paper-mode run, or a mode that is unknown (a manifest that declares none, an
    entry without one), may have shown the policy unprivatized statistics."""
    modes = _declared_modes(manifest)
    return recorded_privacy_mode(not modes or any(unprotected(mode) for mode in modes))


def policy_action_decoding(manifest: dict) -> str:
    """The clip decoding a saved policy acts in (``trained_on.action_decoding``; a manifest written before
    the option existed acts in the paper's Eq. 10, 'paper')."""
    return (manifest.get("trained_on") or {}).get("action_decoding", PAPER)


def check_policy_privacy_mode(manifest: dict, privacy_mode: str, name: str) -> None:
    """A paper-mode policy saw unprivatized statistics of private data (ERRATA E3/E14): driving a strict
    run with it would make that run's strict guarantee false. ConfigError (one line) in that case; a policy
    whose manifest declares no privacy mode counts as paper mode (:func:`policy_privacy_mode`)."""
    if not unprotected(privacy_mode) and unprotected(policy_privacy_mode(manifest)):
        if PAPER not in _declared_modes(manifest):
            raise ConfigError(f"policy {name}'s manifest declares no privacy mode (for some or all of the runs that "
                              "trained it), so it counts as paper mode (it may have seen unprivatized statistics); "
                              "use settings.privacy_mode=paper or a strict policy")
        raise ConfigError(f"policy {name} was trained in paper mode (it saw unprivatized statistics); "
                          "use settings.privacy_mode=paper or a strict policy")


def provenance_summary(manifest: dict) -> list[str]:
    """One short line per provenance entry: mode, dataset id, epsilon, guarantee."""
    lines = []
    for e in provenance_of(manifest):
        sha, eps, guarantee = e.get("dataset_id"), e.get("epsilon"), e.get("guarantee")
        line = f"{e.get('privacy_mode') or 'unknown mode'} on dataset {sha or 'unknown'}"
        if e.get("public_data"):
            line += " (public data: no private budget)"
        if eps is not None:
            line += f", eps {eps:g}"
        if guarantee:
            line += f" ({guarantee})"
        if e.get("legacy"):
            line += " [legacy manifest]"
        lines.append(line)
    return lines


def write_replay(path: Path, transitions: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **transitions)


def read_replay(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        return {}
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def save_module_state(state: dict, path: Path) -> None:
    """The module's state (name -> array) as ``path/module.safetensors``."""
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in state.items()}
    # a policy converted in place: the file is whole or absent (raydp.files.atomic_replace)
    atomic_replace(Path(path) / MODULE_FILE, lambda tmp: save_file(arrays, str(tmp)))


def load_module_state(path: Path) -> dict:
    """A saved policy's module state (name -> array): its ``module.safetensors``, or, for a v1/v2 directory, the
    state of its RLlib module checkpoint (which unpickles classes by module path)."""
    path = Path(path).resolve()
    if (path / MODULE_FILE).is_file():
        from safetensors.numpy import load_file

        return dict(load_file(str(path / MODULE_FILE)))
    if (path / MODULE_DIR).is_dir():
        from ray.rllib.core.rl_module.rl_module import RLModule

        return dict(RLModule.from_checkpoint(str(path / MODULE_DIR)).get_state())
    raise ConfigError(f"{path}: no module state ({MODULE_FILE}) in this policy directory")


def build_module(manifest: dict, state: dict | None = None):
    """The policy's SAC module, built from the manifest's layout and SAC settings (no pickle), with ``state``."""
    from raydp.control.sac import SACSettings, module_spec

    module = module_spec(policy_layout(manifest), SACSettings(**manifest["sac"])).build()
    if state is not None:
        module.set_state(state)
    return module


def convert_policy_module(path: Path) -> None:
    """A v2 policy directory as v3: its module checkpoint's state written as ``module.safetensors`` (checked to
    rebuild the same module from the manifest), the manifest's format updated, the pickled checkpoint removed.
    Atomic per file; a directory already converted is left alone."""
    path = Path(path).resolve()
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") not in PICKLE_FORMATS or not (path / MODULE_DIR).is_dir():
        return
    state = load_module_state(path)
    rebuilt = build_module(manifest, state).get_state()
    if sorted(rebuilt) != sorted(state):
        raise ConfigError(f"{path}: its module does not match the one its manifest describes; not converted")
    save_module_state(state, path)
    manifest["format"] = POLICY_FORMAT
    atomic_write(path / MANIFEST, json.dumps(manifest, indent=2))
    shutil.rmtree(path / MODULE_DIR)


def write_manifest(path: Path, *, layout: ObservationLayout, sac: dict, trained_on: dict, results: dict,
                   transitions: int, updates: int, name: str | None = None,
                   provenance: list[dict] | None = None, lifetime: dict | None = None) -> dict:
    """Write ``manifest.json``; ``provenance``: one entry per run that trained the policy (module
    docstring; ERRATA E14), inherited entries first; ``transitions`` and ``updates``: the saving session's;
    ``lifetime``: the policy's whole training (:func:`continue_lifetime`; None: the field is left out, as in a
    manifest written before it existed)."""
    manifest = {
        "format": POLICY_FORMAT,
        "name": name or path.name,
        "architecture": layout.architecture,
        "layout": layout.as_dict(),
        "sac": sac,
        "trained_on": trained_on,
        "results": results,
        "transitions": transitions,
        "sac_updates": updates,
        **({} if lifetime is None else {"lifetime": {k: lifetime.get(k) for k in LIFETIME_KEYS}}),
        "provenance": [provenance_entry(e) for e in (provenance or [])],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # timing: unprotected, like a run's wall_seconds
        "raydp_version": __version__,
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def copy_policy(source: Path, dest: Path, overwrite: bool = False) -> Path:
    """Copy a policy directory (atomically: a temporary sibling renamed into place). The copy keeps the
    manifest, provenance included (ERRATA E14); only its name changes."""
    return _copy_policy(Path(source), Path(dest), overwrite)


#: a manifest's ``replay_buffer`` field in a copy made by :func:`copy_policy_without_replay`
REPLAY_REMOVED = "removed"


def copy_policy_without_replay(source: Path, dest: Path, overwrite: bool = False) -> Path:
    """A copy of a policy directory without its replay buffer (``replay.npz``): what a policy shipped to run frozen
    carries. A frozen run acts with the actor's weights alone (the broker is built from the module's inference
    state, :func:`build_module`), so it reads the manifest and the module and never the replay buffer (for the
    quickstart's policy, 1.9 of its 4.4 MB). The module is kept whole, critics included: the copy can still be
    continued, but from an empty replay buffer (the transitions it trained on stay in the full policy's directory).
    The manifest keeps everything else, provenance and lifetime included, and says ``"replay_buffer": "removed"``.
    No optimizer state is saved in any policy directory, so there is none to remove."""
    return _copy_policy(Path(source), Path(dest), overwrite, without_replay=True)


def _copy_policy(source: Path, dest: Path, overwrite: bool, without_replay: bool = False) -> Path:
    if dest.exists():
        if not overwrite:
            raise ConfigError(f"policy {dest} already exists (pass --overwrite to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # a directory publish (the whole policy appears at once), not a file write: atomic_write replaces one file
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(REPLAY_FILE) if without_replay else None)
    manifest = json.loads((tmp / MANIFEST).read_text())
    manifest["name"] = dest.name
    if without_replay:
        manifest["replay_buffer"] = REPLAY_REMOVED
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def export_policy(source: Path, archive: Path, overwrite: bool = False,
                  include_private_replay: bool = False) -> Path:
    """A portable ``.tar.gz`` of a policy directory.

    A paper-mode policy's replay buffer holds the unprivatized statistics its runs observed (per-sample
    gradient-norm quartiles, batch losses...: private data, ERRATA E3/E14): exporting it is refused
    unless ``include_private_replay`` says the caller knows."""
    source = Path(source)
    manifest = json.loads((source / MANIFEST).read_text())
    if manifest.get("format") in HASH_FORMATS or '"dataset_sha256"' in (source / MANIFEST).read_text():
        # an old manifest names its datasets by a plain hash of their records: it must not leave
        raise ConfigError(f"policy {source.name} is in the old format ({manifest.get('format')}), whose provenance names "
                          "datasets by a plain hash of their records: run `raydp migrate` on it before exporting")
    if unprotected(policy_privacy_mode(manifest)) and not include_private_replay:
        raise ConfigError(f"policy {source.name} was trained in paper mode: its replay buffer holds unprivatized "
                          "statistics of private data (ERRATA E14); pass --include-private-replay to export it anyway")
    if archive.exists() and not overwrite:
        raise ConfigError(f"{archive} already exists (pass --overwrite to replace it)")
    archive.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(source, arcname=source.name)

    return atomic_replace(archive, write)
