"""What the report page is drawn from: a study directory's results table and summary, or a single run directory
read as a study of one, and each trial's files (eval metrics, privacy ledger, control trace, evaluation), read
lazily and never changed."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from raydp.data.identity import identity_of
from raydp.data.public_records import SYNTHETIC_PUBLIC
from raydp.errors import ConfigError
from raydp.privacy.accounting import REPORTED_ACCOUNTANTS
from raydp.report.markup import _missing
from raydp.run_directory import EVALUATION, RunDirectory
from raydp.study.arms import Arm, arms
from raydp.study.statistics import _final_column, column_split, load_results, metric_label
from raydp.study.results import CONTROLLERS, METRIC_COLUMNS
from raydp.study.trial import Trial

NO_EVALUATION = ("no trial has an evaluation: run `raydp eval RUN_DIR` or set `evaluate:` in the study file")


@dataclass
class Report:
    """What the page is drawn from: one row per trial (a single run is a study of one)."""

    kind: str  # 'study' | 'run'
    name: str
    root: Path
    results: pd.DataFrame
    summary: dict
    column: str  # the selection split's final column of the study's metric (results.parquet)
    eval_column: str  # the same split's column in eval_metrics.parquet
    note: str
    cache: dict = field(default_factory=dict)

    @property
    def public(self) -> bool:
        return column_split(self.column) == "public"

    @property
    def metric(self) -> str:
        """What the selection column measures: 'value-token NLL (nats/record)' or 'perplexity'."""
        return metric_label(self.column)

    @property
    def private_column(self) -> str:
        return self.column.replace("_public_", "_eval_")

    @property
    def public_records(self) -> str | None:
        """The user's public records the trials validated on (their file names), None for raydp's synthetic ones."""
        if "public_validation" not in self.results:
            return None
        names = [str(n) for n in self.results["public_validation"].dropna().unique() if n != SYNTHETIC_PUBLIC]
        return ", ".join(names) or None

    @property
    def split_label(self) -> str:
        """The selection split's short name, naming the user's public records where they were used."""
        if not self.public:
            return "private eval"
        return f"public validation ({self.public_records})" if self.public_records else "public validation"

    @property
    def split_name(self) -> str:
        return self.split_label if self.public else "private eval (unprotected, E15)"

    def run_dir(self, row) -> Path | None:
        if self.kind == "run":
            return self.root
        candidates = []
        if not _missing(row.get("run_dir")):
            candidates.append(Path(str(row["run_dir"])))
        candidates.append(self.root / "trials" / str(row["trial"]))  # a study directory moved elsewhere
        return next((p for p in candidates if p.is_dir()), None)

    def _load(self, row, key: str, loader: Callable[[Path], object]):
        cache_key = (str(row["trial"]), key)
        if cache_key not in self.cache:
            run = self.run_dir(row)
            try:
                self.cache[cache_key] = None if run is None else loader(run)
            except (OSError, ValueError, KeyError):  # unreadable file: treated as absent (the page says so)
                self.cache[cache_key] = None
        return self.cache[cache_key]

    def evals(self, row) -> pd.DataFrame | None:
        return self._load(row, "evals", lambda d: _parquet(RunDirectory(d).eval_metrics))

    def ledger(self, row) -> pd.DataFrame | None:
        columns = ["step", "q", "sigma_eff", "clip"]
        return self._load(row, "ledger", lambda d: _parquet(RunDirectory(d).ledger, columns))

    def trace(self, row) -> pd.DataFrame | None:
        return self._load(row, "trace", lambda d: _parquet(RunDirectory(d).control_trace))

    def evaluation(self, row) -> dict | None:
        def read(d: Path):
            path = RunDirectory(d).evaluation
            return json.loads(path.read_text()) if path.exists() else None
        return self._load(row, "evaluation", read)

    def run_summary(self, row) -> dict | None:
        """The trial's own summary.json (its privacy block: the enforcing accountant, a Renyi filter's orders, the
        strategy's resolved settings and public reference norms)."""
        def read(d: Path):
            run = RunDirectory(d)
            return run.read_summary().raw if run.summary.exists() else None
        return self._load(row, "summary", read)

    @property
    def short_of(self) -> dict[str, str]:
        """Every arm label of the page (with and without its SAC cell) -> its short name (:func:`short_names`)."""
        if "short_of" not in self.cache:
            self.cache["short_of"] = short_names(self.results)
        return self.cache["short_of"]

    def short(self, label) -> str:
        """The short name of an arm label (the label itself when it is not one of the study's arms)."""
        return self.short_of.get(str(label), str(label))


def _parquet(path: Path, columns: list[str] | None = None) -> pd.DataFrame | None:
    if not path.exists():
        return None
    if columns is not None:
        import pyarrow.parquet as pq

        available = set(pq.read_schema(path).names)
        columns = [c for c in columns if c in available]
    return pd.read_parquet(path, columns=columns)


def _eval_column(final_column: str) -> str:
    """The eval_metrics.parquet column of a results column (``final_public_value_nll`` -> ``public_value_nll``)."""
    for columns in METRIC_COLUMNS.values():
        for final, evals in columns.values():
            if final == final_column:
                return evals
    raise KeyError(final_column)


def load_report(path: str | Path) -> Report:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory (raydp report needs a study or a run directory)")
    if (root / "results.parquet").exists():
        results, summary = load_results(root)
        column = _final_column(results, summary)
        selection = summary.get("selection") or {}
        public = column_split(column) == "public"
        note = selection.get("note") or ("selection used the public validation split (E15)" if public
                                         else "selection used the private eval split: unprotected (E15)")
        return Report("study", str(summary.get("study") or root.name), root, _with_arms(results), summary,
                      column, _eval_column(column), note)
    if RunDirectory(root).summary.exists():
        return _single_run(root)
    raise ConfigError(f"{root} is neither a study directory (results.parquet) nor a run directory (summary.json)")


def _single_run(root: Path) -> Report:
    from raydp.study.trial_rows import _phase_one_columns, trial_labels

    try:
        run = RunDirectory(root)
        s = run.read_summary().raw
        config = run.read_config() or {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{root}: cannot read the run's summary.json/config.json ({exc})") from None
    privacy = s.get("privacy") or {}
    strategy = privacy.get("strategy") if isinstance(privacy.get("strategy"), dict) else {}
    eps = privacy.get("epsilon_by_accountant") or {}
    rldp = s.get("strategy") in CONTROLLERS
    try:  # the run as a trial: its identity columns are a study row's (Trial.row)
        trial = Trial(name=root.name, model=s.get("model"), strategy=s.get("strategy"), seed=config.get("seed"),
                      epsilon=privacy.get("epsilon_target"),
                      **{k: (strategy.get(k) if rldp else None) for k in ("t_rl", "b_sac", "k")},
                      frozen=bool(strategy.get("frozen")) if rldp else False)
    except ConfigError as exc:
        raise ConfigError(f"{root}: summary.json/config.json do not describe a run ({exc})") from None
    identity = trial.row()
    row = {
        "trial": identity.pop("trial"), "status": "STOPPED EARLY" if s.get("stopped_early") else "FINISHED",
        **identity,
        **{f"{w}_{split}_perplexity": s.get(f"{w}_{split}_perplexity")
           for w in ("initial", "final", "best") for split in ("eval", "public")},
        **{f"{w}_{split}_value_nll": s[f"{w}_{split}_value_nll"]
           for w in ("initial", "final", "best") for split in ("eval", "public") if f"{w}_{split}_value_nll" in s},
        "steps": s.get("steps"), "planned_steps": privacy.get("planned_steps", s.get("steps")),
        **{f"epsilon_{a}": eps.get(a) for a in REPORTED_ACCOUNTANTS},
        "enforcing_accountant": privacy.get("enforcing_accountant"), "within_budget": privacy.get("within_budget"),
        "verdict": privacy.get("verdict"), "privacy_mode": privacy.get("privacy_mode"),
        "privacy_labels": "; ".join(trial_labels(s)) or None, "epsilon": privacy.get("epsilon"),
        "guarantee": privacy.get("guarantee"), "privacy_unit": privacy.get("privacy_unit"),
        "dataset_id": identity_of(s), "steps_to_target": None, "run_dir": str(root),
        **_phase_one_columns(s.get("phase_one")),
    }
    results = pd.DataFrame([row])
    for col in ("epsilon_target", "t_rl", "b_sac", "k", "steps_to_target") + tuple(
            c for c in row if c.endswith(("_perplexity", "_value_nll")) or c.startswith("epsilon_")):
        results[col] = pd.to_numeric(results[col], errors="coerce").astype(float)
    public = not _missing(row["final_public_perplexity"])
    column = _final_column(results, {"selection": {"split": "public" if public else "private"}})
    note = ("single run: curves and tables use the public validation split (E15)" if public else
            "single run without public validation figures: the private eval split is shown, unprotected (E15)")
    return Report("run", root.name, root, _with_arms(results), {}, column, _eval_column(column), note)


def short_names(results: pd.DataFrame) -> dict[str, str]:
    """A short name per arm, for legends, panel titles and tables: its label (:class:`raydp.study.arms.Arm`) without
    the settings in brackets (a searched, grid or tuned variant, often longer than a legend or a title has room for);
    arms of one strategy that differ only in those settings are told apart by ``v1``, ``v2``... in order of
    appearance. Maps both labels of each arm (with and without its SAC cell) to the matching short name; the
    overview's arms table gives each short name its settings."""
    out: dict[str, str] = {}
    variants: dict[str, list] = {}
    rows = [Arm.from_row(row) for row in results.to_dict("records")]
    for arm in rows:  # the distinct settings behind each short name, in order of appearance
        base = dataclasses.replace(arm, variant=None).label(cell=False)
        seen = variants.setdefault(base, [])
        if arm.variant not in seen:
            seen.append(arm.variant)
    for arm in rows:
        base = dataclasses.replace(arm, variant=None)
        seen = variants[base.label(cell=False)]
        suffix = f" v{seen.index(arm.variant) + 1}" if len(seen) > 1 else ""
        for cell in (False, True):
            short = base.label(cell=cell)
            if suffix:  # after the strategy's name: 'static-pairwise v2', 'rldp v2 T_RL=4 B_SAC=4 K=2'
                head, _, tail = short.partition(" ")
                short = f"{head}{suffix}" + (f" {tail}" if tail else "")
            out[arm.label(cell=cell)] = short
    return out


def _with_arms(results: pd.DataFrame) -> pd.DataFrame:
    """Adds ``arm`` (:func:`raydp.study.arms.arms`: the strategy, its variant, a controller's SAC cell and
    'frozen policy' for transferred ones)."""
    results = results.copy()
    results["arm"] = arms(results) if len(results) else pd.Series(dtype=str)
    if "seed" in results:
        results = results.sort_values(["seed"], kind="stable", na_position="last")
    return results.reset_index(drop=True)


def _groups(results: pd.DataFrame):
    """(model, epsilon) groups in order, non-private (epsilon NaN) last."""
    keys = results[["model", "epsilon_target"]].drop_duplicates()
    keys = keys.assign(_np=keys["epsilon_target"].isna()).sort_values(["model", "_np", "epsilon_target"])
    for model, eps in zip(keys["model"], keys["epsilon_target"]):
        mask = (results["model"] == model) & (results["epsilon_target"].isna() if _missing(eps)
                                              else results["epsilon_target"] == eps)
        yield model, eps, results[mask]


def _controller_cells(rows: pd.DataFrame) -> pd.Series:
    """Per row: whether it is a controller's SAC cell trained in its trials (not a frozen policy's), read from the
    row's strategy and ``frozen_policy`` columns (:class:`raydp.study.arms.Arm`'s fields), not from its label."""
    frozen = rows["frozen_policy"].fillna(False).astype(bool) if "frozen_policy" in rows else False
    return rows["strategy"].isin(CONTROLLERS) & ~frozen


def _best_rldp_cell(group: pd.DataFrame, column: str) -> tuple[str | None, int]:
    """The RLDP arm (SAC cell, not frozen) with the lowest mean final selection perplexity, and the
    number of RLDP cells (the same choice as Table 2: :func:`raydp.study.statistics.table2`)."""
    rldp = group[_controller_cells(group)]
    if rldp.empty:
        return None, 0
    means = rldp.groupby("arm")[column].mean()
    cells = rldp["arm"].nunique()
    return (str(means.idxmin()) if means.notna().any() else str(rldp["arm"].iloc[0])), cells



def _dig(d: dict | None, *keys):
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _evaluated(r: Report) -> list[tuple[pd.Series, dict]]:
    out = []
    for _, row in r.results.iterrows():
        ev = r.evaluation(row)
        if isinstance(ev, dict):
            out.append((row, ev))
    return out


def _missing_evaluation_note(r: Report, evaluated: list) -> str | None:
    missing = len(r.results) - len(evaluated)
    attacked = (r.summary or {}).get("attacked") or {}
    if not evaluated:
        return NO_EVALUATION
    if attacked.get("rule") == "released":
        also = attacked.get("strategies") or []
        return (f"attacked: the trial this study would release in each (model, epsilon) cell"
                + (f" and every {', '.join(also)} trial" if also else "")
                + f" ({len(evaluated)} of {len(r.results)} trials; attack: released, the default; attack: all "
                  "attacks every trial)")
    if missing:
        return f"{missing} of {len(r.results)} trials have no {EVALUATION} (not shown)"
    return None
