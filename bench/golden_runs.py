"""Golden runs: the same short, fully pinned runs with two raydp source trees, compared bit for bit.

    python bench/golden_runs.py --against /path/to/other/checkout
    python bench/golden_runs.py --against-commit HEAD          # makes (and removes) a git worktree of that commit

Each config under ``bench/golden/`` (every field of the run config and of its strategy's settings written out, so a
later change of a default cannot move them silently: tests/test_golden_runs.py) is run twice with ``raydp train``:
once with this tree's raydp and once with the other tree's, each in a subprocess whose working directory and
``PYTHONPATH`` are that tree (so its ``policies/`` and, for RLDP, its Ray actor's code are that tree's too), with the
same interpreter, one torch thread, its own embedded-model cache (built by that tree's code) and the same dataset
owner key. Then it compares, per config:

* the adapter: every tensor of ``adapter/adapter_model.safetensors`` with ``torch.equal``, and
  ``adapter/adapter_config.json``;
* the privacy ledger (``privacy_ledger.parquet``): every row and column;
* the run's other tables (train and eval metrics, RLDP's controller trace and decisions): every row and column but
  :data:`EXCLUDED_TABLE_COLUMNS`;
* the run summary (``summary.json``): every field but :data:`EXCLUDED_SUMMARY_KEYS` (timings and paths).

It prints one line per config and exits 0 when every config is identical, 1 when one differs, 2 when a run failed.
Nothing is compared against stored numbers (they would break across CPUs and torch builds): both trees run here,
now. ``--margin M`` accepts float differences within a declared tolerance (``|a - b| <= M * max(1, |a|, |b|)``, on
tensors and on float fields alike; integers and strings stay exact), for changes that legitimately reorder float
operations; such a config is reported "within margin", never "identical". docs/golden-runs.md says more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "bench" / "golden"
#: torch (and BLAS) threads of every run: one, for bit-exactness (the configs pin ``cpus: 1`` too)
THREADS = 1

#: summary.json fields (dotted paths; a list's items by index) that are not compared, and why
EXCLUDED_SUMMARY_KEYS: dict[str, str] = {
    "wall_seconds": "timing",
    "train_loop_seconds": "timing",
    "saved_policy": "a path (where a trained policy was saved; no golden run saves one)",
    "controller_transport.address": "an address (a policy server's; no golden run reaches one)",
}
#: the run's tables besides the ledger, and their columns that are not compared
TABLES = ("train_metrics.parquet", "eval_metrics.parquet", "control_trace.parquet", "controller_decisions.parquet")
EXCLUDED_TABLE_COLUMNS: dict[str, dict[str, str]] = {
    "train_metrics.parquet": {"seconds": "timing (a non-private step's)"},
}
LEDGER = "privacy_ledger.parquet"
ADAPTER_TENSORS = "adapter/adapter_model.safetensors"
ADAPTER_CONFIG = "adapter/adapter_config.json"
#: the dataset owner key both trees use (a fixed one in the work dir: dataset ids then match, and the user's own key
#: is neither read nor created)
OWNER_KEY = hashlib.sha256(b"raydp golden runs").hexdigest()

#: what a run's subprocess executes (``python -c``; its working directory is the tree): raydp must come from the tree
LAUNCHER = """\
import sys
from pathlib import Path
tree, config, output, threads = sys.argv[1:5]
import raydp
found = Path(raydp.__file__).resolve().parent
if found != Path(tree).resolve() / "raydp":
    sys.exit(f"golden run: raydp was imported from {found}, not from {tree}")
import torch
torch.set_num_threads(int(threads))
from raydp.cli import main
sys.exit(main(["train", "--config", config, "--output", output, "--quiet"]))
"""


# -- running ---------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    config: str
    side: str  # "this" or "other"
    output: Path
    seconds: float = 0.0
    error: str | None = None


def run_env(tree: Path, work: Path, side: str) -> dict:
    """The subprocess environment: the tree first on the path, one thread, this side's model cache, the golden owner
    key; no inherited raydp or Ray settings (a ``RAY_ADDRESS`` would send an RLDP run to another cluster's code)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAYDP_", "RAY_")) and k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    threads = str(THREADS)
    env.update(PYTHONPATH=str(tree), RAYDP_CACHE=str(work / side / "cache"), RAYDP_OWNER_KEY=str(work / "owner.key"),
               OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="")
    return env


def run_one(tree: Path, config: Path, work: Path, side: str) -> Run:
    out = work / side / "runs" / config.stem
    run = Run(config.stem, side, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = work / side / f"{config.stem}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(tree), str(config), str(out), str(THREADS)],
                              cwd=tree, env=run_env(tree, work, side), stdout=handle, stderr=subprocess.STDOUT)
    run.seconds = time.perf_counter() - started
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        run.error = f"exit {proc.returncode} ({log}): " + " | ".join(line.strip() for line in tail)
    return run


# -- comparing -------------------------------------------------------------------------------------------------------

@dataclass
class Tally:
    """How two values compare: exactly, within the margin, and the largest absolute difference of their floats."""

    margin: float = 0.0
    exact: bool = True
    within: bool = True
    max_abs: float = 0.0

    def number(self, x: float, y: float) -> None:
        if x == y or (math.isnan(x) and math.isnan(y)):
            return
        self.exact = False
        d = abs(x - y)
        self.max_abs = max(self.max_abs, d) if not math.isnan(d) else math.inf
        if not d <= self.margin * max(1.0, abs(x), abs(y)):
            self.within = False

    def mismatch(self) -> None:
        self.exact = self.within = False


def plain(value):
    """numpy arrays and scalars as Python lists and numbers."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def walk(a, b, tally: Tally) -> None:
    """Compare two JSON-like values (dicts, lists, numbers, strings, None) into ``tally``."""
    a, b = plain(a), plain(b)
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            tally.mismatch()
        for key in set(a) & set(b):
            walk(a[key], b[key], tally)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            tally.mismatch()
        for x, y in zip(a, b):
            walk(x, y, tally)
    elif isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool):
            tally.number(float(a), float(b))
        else:
            tally.mismatch()
    elif type(a) is not type(b) or a != b:
        tally.mismatch()


def flatten(value, prefix: str = "") -> dict:
    """A summary as {dotted path: leaf} (dicts by key, lists by index; an empty dict or list is a leaf)."""
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and any(isinstance(item, (dict, list)) for item in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


@dataclass
class Part:
    """One compared part of a run (the adapter, the ledger, a table, the summary)."""

    name: str
    exact: bool = True
    within: bool = True
    max_abs: float = 0.0
    differing: list[str] = field(default_factory=list)  # tensors, columns or keys that are not exactly equal
    total: int = 0  # tensors, columns or keys compared
    note: str = ""  # what was compared

    def add(self, item: str, tally: Tally) -> None:
        if not tally.exact:
            self.differing.append(item)
            self.exact = False
            self.within = self.within and tally.within
            self.max_abs = max(self.max_abs, tally.max_abs)

    def missing(self, what: str) -> None:
        self.differing.append(what)
        self.exact = self.within = False
        self.max_abs = math.inf


def compare_adapter(a: Path, b: Path, margin: float) -> list[Part]:
    """The adapter's tensors (``torch.equal``; NaN equal to NaN) and its adapter_config.json."""
    import torch
    from safetensors.torch import load_file

    part, config = Part("tensors"), Part("adapter_config")
    files = [run / ADAPTER_TENSORS for run in (a, b)]
    if not all(f.is_file() for f in files):
        part.missing("adapter missing")
        return [part]
    ta, tb = (load_file(str(f)) for f in files)
    for name in sorted(set(ta) | set(tb)):
        short = name.removeprefix("base_model.model.").removeprefix("transformer.")
        if name not in ta or name not in tb or ta[name].shape != tb[name].shape or ta[name].dtype != tb[name].dtype:
            part.missing(f"{short} (only one side, or shape/dtype)")
            continue
        x, y = ta[name], tb[name]
        tally = Tally(margin)
        if not torch.equal(x, y):
            x64, y64 = x.double(), y.double()
            both_nan = torch.isnan(x64) & torch.isnan(y64)
            diff = (x64 - y64).abs().masked_fill(both_nan, 0.0)
            if bool(diff.gt(0).any()) or bool(torch.isnan(diff).any()):
                tally.exact = False
                tally.max_abs = float(diff.max()) if not bool(torch.isnan(diff).any()) else math.inf
                bound = margin * torch.maximum(x64.abs(), y64.abs()).clamp_min(1.0)
                tally.within = bool((diff <= bound).all())
        part.add(short, tally)
    part.total, part.note = len(set(ta) | set(tb)), f"{len(ta)} tensors"
    files = [run / ADAPTER_CONFIG for run in (a, b)]
    if all(f.is_file() for f in files):
        values = [json.loads(f.read_text()) for f in files]
        for key in sorted(set(values[0]) | set(values[1])):
            tally = Tally(0.0)  # settings, not floats computed: exact
            if key in values[0] and key in values[1]:
                walk(values[0][key], values[1][key], tally)
            else:
                tally.mismatch()
            config.add(key, tally)
        config.total = len(set(values[0]) | set(values[1]))
    else:
        config.missing("adapter_config.json missing")
    return [part, config]


def compare_table(name: str, a: Path, b: Path, margin: float, excluded=()) -> Part | None:
    """Every row and column of table ``name`` in both runs (None: in neither)."""
    import pandas as pd

    part = Part(name.removesuffix(".parquet"))
    fa, fb = a / name, b / name
    if not fa.exists() and not fb.exists():
        return None
    if not (fa.exists() and fb.exists()):
        part.missing(f"only in {'this' if fa.exists() else 'other'} run")
        return part
    da, db = pd.read_parquet(fa), pd.read_parquet(fb)
    columns = [c for c in dict.fromkeys([*da.columns, *db.columns]) if c not in excluded]
    if len(da) != len(db):
        part.missing(f"rows {len(da)} vs {len(db)}")
    for column in columns:
        if column not in da or column not in db:
            part.missing(f"{column} (one side only)")
            continue
        tally = Tally(margin)
        first = None
        for row, (x, y) in enumerate(zip(da[column].tolist(), db[column].tolist())):
            before = tally.exact
            walk(x, y, tally)
            if before and not tally.exact:
                first = row
        part.add(column if first is None else f"{column} (from row {first})", tally)
    part.total, part.note = len(columns), f"{len(da)} rows x {len(columns)} columns"
    return part


def excluded_key(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") or key.startswith(k + "[") for k in EXCLUDED_SUMMARY_KEYS)


def compare_summary(a: Path, b: Path, margin: float) -> Part:
    part = Part("summary")
    files = [run / "summary.json" for run in (a, b)]
    if not all(f.is_file() for f in files):
        part.missing("summary.json missing")
        return part
    sa, sb = ({k: v for k, v in flatten(json.loads(f.read_text())).items() if not excluded_key(k)} for f in files)
    for key in sorted(set(sa) | set(sb)):
        if key not in sa or key not in sb:
            part.missing(f"{key} (only in {'this' if key in sa else 'other'})")
            continue
        tally = Tally(margin)
        walk(sa[key], sb[key], tally)
        part.add(key, tally)
    part.total, part.note = len(set(sa) | set(sb)), f"{len(sa)} fields"
    return part


def compare_runs(a: Path, b: Path, margin: float) -> list[Part]:
    parts = compare_adapter(a, b, margin)
    ledger = compare_table(LEDGER, a, b, margin)
    parts.append(ledger if ledger is not None else Part("ledger", note="none in either (non-private)"))
    parts[-1].name = "ledger"
    for table in TABLES:
        found = compare_table(table, a, b, margin, excluded=EXCLUDED_TABLE_COLUMNS.get(table, {}))
        if found is not None:
            parts.append(found)
    parts.append(compare_summary(a, b, margin))
    return parts


def listed(items: list[str], most: int = 3) -> str:
    return ", ".join(items[:most]) + (f", +{len(items) - most} more" if len(items) > most else "")


def verdict(parts: list[Part], margin: float) -> tuple[str, str]:
    """("identical" | "within margin" | "differs", the line's detail)."""
    if all(p.exact for p in parts):
        tables = [p for p in parts if p.name not in ("tensors", "adapter_config", "ledger", "summary")]
        by = {p.name: p for p in parts}
        return "identical", (f"{by['tensors'].note} and adapter_config bit for bit; ledger {by['ledger'].note}; "
                             f"{len(tables)} other tables; summary {by['summary'].note}")
    shown = []
    for p in parts:
        if p.exact:
            continue
        size = "" if p.max_abs in (0.0, math.inf) else f"; max abs diff {p.max_abs:.3g}"
        label = {"tensors": "tensors", "adapter_config": "adapter_config.json keys", "ledger": "ledger columns",
                 "summary": "summary keys"}.get(p.name, f"{p.name} columns")
        count = f" {len(p.differing)} of {p.total}" if p.total else ""
        shown.append(f"{label}{count} ({listed(p.differing)}{size})")
    status = "within margin" if margin > 0 and all(p.within for p in parts) else "differs"
    return status, "; ".join(shown)


# -- the trees ---------------------------------------------------------------------------------------------------------

def git(tree: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"golden runs: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def describe(tree: Path) -> str:
    head = git(tree, "rev-parse", "--short=12", "HEAD", check=False)
    if not head:
        return "not a git checkout"
    dirty = git(tree, "status", "--porcelain", "--untracked-files=no", check=False)
    return head + (", with uncommitted changes" if dirty else "")


def make_worktree(commit: str) -> tuple[Path, bool]:
    """A clean worktree of ``commit`` in the temporary folder (an existing one at that commit is reused); returns it
    and whether this call made it."""
    sha = git(ROOT, "rev-parse", "--verify", f"{commit}^{{commit}}")
    path = Path(tempfile.gettempdir()) / f"raydp-golden-{sha[:12]}"
    if path.exists():
        if git(path, "rev-parse", "HEAD", check=False) != sha or git(path, "status", "--porcelain", check=False):
            raise SystemExit(f"golden runs: {path} exists but is not a clean checkout of {sha[:12]}; remove it "
                             f"(git worktree remove --force {path})")
        return path, False
    git(ROOT, "worktree", "add", "--detach", str(path), sha)
    return path, True


# -- main --------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--against", metavar="DIR", help="the other raydp source tree (a checkout or a worktree)")
    other.add_argument("--against-commit", metavar="REV", help="a commit of this repository: a worktree of it is made "
                       "in the temporary folder (and removed afterwards, unless --keep)")
    parser.add_argument("--configs", metavar="DIR", default=str(CONFIGS),
                        help="the golden configs (default bench/golden/ of this tree)")
    parser.add_argument("--only", metavar="NAME", action="append", help="run only this config (repeatable)")
    parser.add_argument("--margin", type=float, default=0.0, metavar="FLOAT",
                        help="accept float differences up to FLOAT * max(1, |a|, |b|) in tensors and metrics "
                             "(reported 'within margin'; default 0: bit for bit)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2: both trees of a config side "
                        "by side; every run has one thread either way)")
    parser.add_argument("--work", metavar="DIR", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the runs (and a worktree this made)")
    args = parser.parse_args(argv)
    if args.margin < 0 or not math.isfinite(args.margin):
        parser.error("--margin must be a finite number >= 0")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = sorted(Path(args.configs).glob("*.yaml"))
    if args.only:
        unknown = sorted(set(args.only) - {c.stem for c in configs})
        if unknown:
            raise SystemExit(f"golden runs: no config {', '.join(unknown)} in {args.configs} "
                             f"(known: {', '.join(c.stem for c in configs)})")
        configs = [c for c in configs if c.stem in args.only]
    if not configs:
        raise SystemExit(f"golden runs: no *.yaml in {args.configs}")
    made = None
    if args.against_commit:
        other, created = make_worktree(args.against_commit)
        made = other if created else None
    else:
        other = Path(args.against).expanduser().resolve()
    if not (other / "raydp" / "__init__.py").is_file():
        raise SystemExit(f"golden runs: {other} is not a raydp source tree (no raydp/__init__.py)")
    work = Path(args.work).expanduser().resolve() if args.work else Path(tempfile.mkdtemp(prefix="raydp-golden-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    key = work / "owner.key"
    key.write_text(OWNER_KEY + "\n")
    key.chmod(0o600)
    trees = {"this": ROOT, "other": other}
    margin = f", margin {args.margin:g}" if args.margin else ", bit for bit"
    plural = "s" if len(configs) != 1 else ""
    print(f"golden runs: {len(configs)} config{plural} from {args.configs}, torch threads {THREADS}{margin}, "
          f"work {work}")
    print(f"  this:  {ROOT} ({describe(ROOT)})")
    print(f"  other: {other} ({describe(other)})", flush=True)
    started = time.perf_counter()
    worst = 0
    width = max(len(c.stem) for c in configs)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {(c.stem, side): pool.submit(run_one, trees[side], c.resolve(), work, side)
                   for c in configs for side in ("this", "other")}
        for config in configs:
            runs = {side: futures[(config.stem, side)].result() for side in ("this", "other")}
            seconds = f"({runs['this'].seconds:.0f} s + {runs['other'].seconds:.0f} s)"
            failed = [f"{side} run failed: {r.error}" for side, r in runs.items() if r.error]
            if failed:
                print(f"{config.stem:<{width}}  FAILED {seconds}: {'; '.join(failed)}", flush=True)
                worst = 2
                continue
            status, detail = verdict(compare_runs(runs["this"].output, runs["other"].output, args.margin),
                                     args.margin)
            if status == "within margin":
                status = f"within margin {args.margin:g}, not identical"
            print(f"{config.stem:<{width}}  {status} {seconds}: {detail}", flush=True)
            if status != "identical" and not status.startswith("within margin"):
                worst = max(worst, 1)
    print(f"golden runs: {time.perf_counter() - started:.0f} s; "
          + {0: "all identical" if not args.margin else "all identical or within the margin",
             1: "DIFFERENCES", 2: "a run FAILED"}[worst])
    if args.keep or worst == 2:
        print(f"  runs kept in {work}" + (f"; worktree kept at {made}" if made and args.keep else ""))
    else:
        shutil.rmtree(work, ignore_errors=True)
    if made is not None and not args.keep:
        git(ROOT, "worktree", "remove", "--force", str(made), check=False)
    return worst


if __name__ == "__main__":
    sys.exit(main())
