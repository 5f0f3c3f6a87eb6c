"""Private data stays the owner's on the owner's machine: what raydp writes is owner-only from the moment it exists
(datasets, studies, Tune's storage, trial folders, temporary copies, what Ray keeps of a study), durable writes
replace a file whole or not at all, and a Ray that other local users can reach is refused for private work.

Tests run as root, who reads everything: the modes are checked, and where ``su`` exists another local user
(``nobody``) tries to read."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raydp import files
from raydp.errors import ConfigError

NOBODY = shutil.which("su") is not None and os.getuid() == 0 and subprocess.run(
    ["id", "nobody"], capture_output=True).returncode == 0


def as_nobody(command: str) -> subprocess.CompletedProcess:
    """``command`` run by the local user ``nobody`` (another user of this machine)."""
    return subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c", command], capture_output=True, text=True,
                          timeout=30)


def test_private_umask_makes_new_files_and_folders_owner_only(tmp_path):
    previous = os.umask(0o022)
    try:
        with files.private_umask():
            (tmp_path / "d").mkdir()
            (tmp_path / "d" / "f").write_text("private")
        (tmp_path / "after").write_text("x")  # the mask is restored after the block
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "d" / "f").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "after").stat().st_mode) == 0o644


def test_atomic_write_is_owner_only_and_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "state.json"
    files.atomic_write(target, '{"v": 1}')
    assert target.read_text() == '{"v": 1}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and stat.S_IMODE(target.parent.stat().st_mode) == 0o700

    def crash(tmp):  # a writer that dies half-way (a crash, a full disk)
        Path(tmp).write_bytes(b'{"v": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_replace(target, crash)
    assert target.read_text() == '{"v": 1}'  # the previous file, whole
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]  # no partial file left behind
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("killed before the rename")))
    with pytest.raises(OSError, match="killed"):
        files.atomic_write(target, '{"v": 2}')
    monkeypatch.setattr(os, "replace", real_replace)
    assert target.read_text() == '{"v": 1}' and len(list(target.parent.iterdir())) == 1


def test_a_ledger_save_neither_uses_a_shared_temporary_name_nor_leaves_one(tmp_path):
    """Before, the ledger wrote '<name>.tmp' and renamed it: two writers shared that file, and another process's
    half-written '.tmp' was renamed into place."""
    from raydp.privacy.ledger import PrivacyLedger

    target = tmp_path / "privacy_ledger.parquet"
    stale = tmp_path / "privacy_ledger.parquet.tmp"
    stale.write_bytes(b"another writer's half-written ledger")
    path = PrivacyLedger(delta=1e-5).save(tmp_path)
    assert path == target and stale.read_bytes() == b"another writer's half-written ledger"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert PrivacyLedger.load(target).delta == 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.parquet", "privacy_ledger.parquet.tmp"]


def test_locked_excludes_a_second_holder(tmp_path):
    lock = tmp_path / "x.lock"
    with files.locked(lock):
        with pytest.raises(BlockingIOError):  # flock locks are per open file: a second open cannot take it
            with files.locked(lock, blocking=False):
                pass
    with files.locked(lock, blocking=False):
        pass
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_private_dir_refuses_a_link_and_another_users_folder_and_closes_an_open_one(tmp_path):
    open_one = tmp_path / "open"
    open_one.mkdir(mode=0o755)
    os.chmod(open_one, 0o755)
    assert stat.S_IMODE(files.private_dir(open_one).stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(open_one)
    with pytest.raises(ConfigError, match="not a link"):
        files.private_dir(tmp_path / "link")
    if os.getuid() == 0:  # planted by another user under a predictable name
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ConfigError, match="belongs to another user"):
            files.private_dir(theirs)
    scratch = files.user_scratch("datasets")
    assert scratch.parent.name == f"raydp-{os.getuid()}"
    assert stat.S_IMODE(scratch.parent.stat().st_mode) == stat.S_IMODE(scratch.stat().st_mode) == 0o700


def test_a_built_dataset_is_owner_only(tmp_path):
    """The build replaced the folder with a fresh one in the default mode (0755, files 0644)."""
    from raydp.data.splits import build_dataset

    previous = os.umask(0o022)  # a user's usual mask
    try:
        build_dataset(tmp_path / "ds", n_records=300, progress=False)
    finally:
        os.umask(previous)
    assert files.open_to_others(tmp_path / "ds") == []
    assert {p.name for p in (tmp_path / "ds").iterdir()} >= {"train.parquet", "manifest.json"}


def test_a_ray_started_with_a_folder_others_can_enter_is_refused_for_private_work(monkeypatch):
    import raydp.runner.launch as launch

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # as /tmp/ray: every folder up to / open to others
    try:
        shared = base / "ray"
        shared.mkdir()
        os.chmod(base, 0o755)
        os.chmod(shared, 0o777)
        monkeypatch.setattr(launch, "ray_temp_dir", lambda: shared)
        with pytest.raises(ConfigError, match="open to other local users"):
            launch.check_ray_temp_dir()
        os.chmod(base, 0o700)  # an owner-only folder above it keeps everyone else out
        launch.check_ray_temp_dir()
    finally:
        shutil.rmtree(base)


# --- a grid study and a private selection of two cells on private data, then every file's mode --------------------

STUDY = {
    "models": ["embedded-tiny"], "epsilons": [4.0], "seeds": [0], "wandb": {"mode": "disabled"},
    "resources": {"cpus_per_trial": 1},
    "base": {"data": {"n_records": 400, "n_audit": 20}, "max_steps": 4, "eval_every": 4, "eval_max_records": 16,
             "public_eval_records": 16, "warmup_steps": 1},
}
GRID = {**STUDY, "name": "owner-grid", "strategies": ["static-pairwise"],
        "evaluate": {"generations": 4, "exposure_candidates": 20, "membership_records": 8}}
SELECTION = {**STUDY, "name": "owner-select", "epsilons": [4.0, 8.0], "strategies": ["static-pairwise"],
             "search": "random", "selection": "private-dp",
             "search_space": {"static-pairwise": {"clip": {"low": 0.01, "high": 1.0, "log": True}}},
             "private_selection": {"distribution": "poisson", "mean": 2.0, "score_noise": 6.0}}


def _readable_mentions(roots: list[Path], needles: tuple[str, ...], since: float) -> list[str]:
    """Files under ``roots`` written at or after ``since`` (not another run's leftovers) that another local user could
    read (every folder on the way open to them and the file readable by others) and whose path or content names one
    of ``needles``."""
    found = []
    for root in roots:
        if not root.exists():
            continue
        for folder, dirs, names in os.walk(root):
            if not all(os.stat(p).st_mode & 0o005 == 0o005 for p in [Path(folder), *Path(folder).parents]
                       if p.exists()):
                dirs[:] = []  # another user cannot enter this folder, nor anything below it
                continue
            for name in names:
                path = Path(folder, name)
                try:
                    info = os.lstat(path)
                    if info.st_mode & 0o004 == 0 or stat.S_ISLNK(info.st_mode) or info.st_mtime < since:
                        continue
                    text = path.read_bytes()[:1_000_000].decode("utf-8", "replace")
                except OSError:
                    continue
                if any(n in str(path) or n in text for n in needles):
                    found.append(str(path))
    return found


def test_a_grid_study_and_a_private_selection_on_private_data_leave_nothing_other_users_can_read(
        local_ray, tmp_path, monkeypatch):
    import raydp.study.private_selection as ps
    import ray

    from raydp.report.page import write_report
    from raydp.study.runner import run_study

    from raydp.cli import main
    from raydp.data import load_manifest, manifest_id
    from raydp.privacy.lifetime import read_budget

    started = time.time() - 1
    previous = os.umask(0o022)  # a user's usual mask: what raydp writes must not depend on it
    try:
        # the grid study on a dataset with a lifetime budget: charged before it runs, its trial holds the receipt
        data = tmp_path / "data"
        assert main(["data", "build", "--output", str(data), "--n-records", "400", "--n-audit", "20"]) == 0
        assert main(["data", "budget", str(data), "--epsilon", "20", "--delta", "1e-5"]) == 0
        grid_path, selection_path = tmp_path / "owner-grid.yaml", tmp_path / "owner-select.yaml"
        grid_path.write_text(yaml.safe_dump({**GRID, "base": {**GRID["base"], "data": {"source": str(data), "n_audit": 20}}}))
        selection_path.write_text(yaml.safe_dump(SELECTION))
        runs = tmp_path / "runs"
        grid = run_study(grid_path, runs, progress=False)
        monkeypatch.setattr(ps, "draw_count", lambda distribution: 2)  # the one secret draw fixed: two trials a cell
        selection = run_study(selection_path, runs, progress=False)
        report = write_report(grid)  # its attack and audit sections are the owner's
    finally:
        os.umask(previous)
    assert json.loads((grid / "study_summary.json").read_text())["trials"] == 1
    assert pd.read_parquet(grid / "results.parquet")["status"].tolist() == ["TERMINATED"]
    # the budget follows the source: the private selection built the same synthetic records, so its two cells are
    # charged to it too, beside the grid's trial
    charges = read_budget(manifest_id(load_manifest(data)))["charges"]
    assert sorted(label.split("/")[-1] for label in charges) == [
        "embedded-tiny_eps4_seed0", "embedded-tiny_eps8_seed0", "static-pairwise_embedded-tiny_eps4_seed0"]
    assert len(json.loads((selection / "study_summary.json").read_text())["released"]) == 2
    ray_tmp = Path(ray._private.worker._global_node.get_temp_dir_path())  # the Ray the studies ran on
    for root in (data, runs, grid, selection, ray_tmp, files.user_scratch()):
        assert files.open_to_others(root) == [], root
    assert (grid / "tune").is_dir() and stat.S_IMODE(report.stat().st_mode) == 0o600
    # Tune's staging in Ray's temporary folder is gone after the study (the study keeps its own copy)
    assert not [p for p in ray_tmp.glob("session_*/artifacts/*/*") if p.name.startswith("owner-")]
    trial_names = tuple(p.name for p in (grid / "trials").iterdir()) + \
        tuple(p.name for p in (selection / "work" / "trials").iterdir())
    shared = [Path("/tmp/ray"), *Path("/tmp").glob("raydp-*"), Path(tempfile.gettempdir()),
              Path("~/ray_results").expanduser()]
    assert _readable_mentions(shared, ("owner-grid", "owner-select", *trial_names), since=started) == []
    if NOBODY:  # another local user tries
        for path in (grid / "results.parquet", selection / "work" / "private-selection.json",
                     grid / "dataset" / "manifest.json", selection / "released"):
            result = as_nobody(f"cat '{path}' || ls '{path}'")
            assert result.returncode != 0 and "Permission denied" in result.stderr, (path, result)
        result = as_nobody(f"ls -R '{ray_tmp}'")
        assert result.returncode != 0 and "Permission denied" in result.stderr


def test_every_command_writes_owner_only_files(tmp_path):
    """A command's files are owner-only whatever the user's umask, and the user's mask is back afterwards."""
    from raydp.cli import main

    previous = os.umask(0o022)
    try:
        assert main(["data", "build", "--out", str(tmp_path / "ds"), "--n-records", "300"]) == 0
        assert os.umask(0o022) == 0o022  # the user's mask is the user's again after the command
    finally:
        os.umask(previous)
    assert files.open_to_others(tmp_path / "ds") == []


def test_a_place_another_user_could_swap_is_refused_before_anything_is_written(tmp_path):
    """A folder writable by others above a study, a run or a dataset let another local user rename the study away
    while it ran and put their own folder in its place, which the study then filled (results, private figures)."""
    from raydp.data.splits import build_dataset
    from raydp.errors import RaydpError
    from raydp.runner.output import staged_output

    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(shared, 0o777)  # writable by everyone, not sticky
        with pytest.raises(ConfigError, match="writable by group or others"):
            files.private_dir(shared / "runs" / "study")
        with pytest.raises(RaydpError, match="writable by group or others"):
            build_dataset(shared / "data" / "ds", n_records=300, progress=False)
        with pytest.raises(ConfigError, match="writable by group or others"):
            with staged_output(shared / "runs" / "dp"):
                pass
        assert list(shared.iterdir()) == []  # nothing was written there
        os.chmod(shared, 0o1777)  # sticky, as /tmp: only an entry's owner may rename it
        assert stat.S_IMODE(files.private_dir(shared / "runs" / "study").stat().st_mode) == 0o700
    finally:
        shutil.rmtree(shared)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_a_private_selection_refuses_a_study_folder_another_user_made_first(tmp_path):
    """The private selection's study folder was created with mkdir(exist_ok=True): a folder another user made first
    (with their own work/ and tune.log in it) was used, and Tune's log, which counts the trials, went to them."""
    from raydp.study.runner import run_study

    path = tmp_path / "owner-select.yaml"
    path.write_text(yaml.safe_dump(SELECTION))
    planted = tmp_path / "runs" / "owner-select"
    (planted / "work").mkdir(parents=True)
    for folder in (planted, planted / "work"):
        os.chown(folder, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to another user"):
        run_study(path, tmp_path / "runs", progress=False)
    assert list((planted / "work").iterdir()) == []
