"""Saved policies (``policies/NAME``): the RLlib module checkpoint, the replay buffer and a manifest.

Layout of a policy directory::

    manifest.json   format, architecture, observation layout (versioned), SAC settings, what it was
                    trained on (model, adapter pairs, epsilon, steps, decisions), results
    module/         RLModule.save_to_path (actor, twin critics and their targets)
    replay.npz      the replay buffer's transitions (RLlib's new stack does not checkpoint it)

A policy is found by name under the policy directory (``--policy-dir``, default ``policies``) or by path.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np

from raydp import __version__
from raydp.control.features import LAYOUT_VERSION, ObservationLayout
from raydp.errors import ConfigError

POLICY_FORMAT = "raydp-policy-v1"
MANIFEST = "manifest.json"
MODULE_DIR = "module"
REPLAY_FILE = "replay.npz"


def resolve_policy(name_or_path: str, policy_dir: str | Path = "policies") -> Path:
    """The directory of a saved policy: a path, or a name under ``policy_dir``; ConfigError if absent."""
    for candidate in (Path(name_or_path).expanduser(), Path(policy_dir).expanduser() / name_or_path):
        if (candidate / MANIFEST).is_file():
            return candidate
    known = ", ".join(p["name"] for p in list_policies(policy_dir)) or "none"
    raise ConfigError(f"no saved policy {name_or_path!r} (looked for {name_or_path}/{MANIFEST} and "
                      f"{Path(policy_dir) / name_or_path}/{MANIFEST}); policies in {policy_dir}: {known}")


def load_manifest(path: str | Path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable policy manifest ({exc})") from None
    if manifest.get("format") != POLICY_FORMAT:
        raise ConfigError(f"{path}: unknown policy format {manifest.get('format')!r} (expected {POLICY_FORMAT})")
    if manifest["layout"].get("version") != LAYOUT_VERSION:
        raise ConfigError(f"{path}: observation layout {manifest['layout'].get('version')!r} is not "
                          f"{LAYOUT_VERSION!r}; this raydp cannot drive it")
    return manifest


def policy_layout(manifest: dict) -> ObservationLayout:
    return ObservationLayout(**manifest["layout"])


def list_policies(policy_dir: str | Path = "policies") -> list[dict]:
    root = Path(policy_dir).expanduser()
    if not root.is_dir():
        return []
    out = []
    for child in sorted(root.iterdir()):
        if (child / MANIFEST).is_file():
            try:
                m = load_manifest(child)
            except ConfigError:
                continue
            out.append({"name": child.name, "path": str(child), **{k: m.get(k) for k in
                        ("architecture", "created", "trained_on", "results", "transitions")}})
    return out


def write_replay(path: Path, transitions: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **transitions)


def read_replay(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        return {}
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def write_manifest(path: Path, *, layout: ObservationLayout, sac: dict, trained_on: dict, results: dict,
                   transitions: int, updates: int, name: str | None = None) -> dict:
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
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "raydp_version": __version__,
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def copy_policy(source: Path, dest: Path, overwrite: bool = False) -> Path:
    """Copy a policy directory (atomically: a temporary sibling renamed into place)."""
    if dest.exists():
        if not overwrite:
            raise ConfigError(f"policy {dest} already exists (pass --overwrite to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    manifest = json.loads((tmp / MANIFEST).read_text())
    manifest["name"] = dest.name
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def export_policy(source: Path, archive: Path, overwrite: bool = False) -> Path:
    """A portable ``.tar.gz`` of a policy directory."""
    if archive.exists() and not overwrite:
        raise ConfigError(f"{archive} already exists (pass --overwrite to replace it)")
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.parent / f".{archive.name}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(source, arcname=source.name)
    tmp.replace(archive)
    return archive
