"""``raydp report DIR``: one self-contained HTML page for a study directory or a single run directory.

The page has no script, no stylesheet link and no external URL: CSS is inline and every figure is an
inline SVG drawn by matplotlib (:mod:`raydp.report.figures`). Sections (ids in brackets; a test finds them):

1. overview [``table-overview``]: name, trials and statuses, dataset identity, privacy units, labels and
   the selection note (ERRATA E15).
2. utility curves [``fig-utility``]: RLDP paper Fig. 1-4 analogues; per (model, epsilon) the selection
   split's perplexity over steps, mean over seeds with a min-max band per strategy.
3. dials [``fig-dials-N``]: Fig. 5-8 analogues; per (model, epsilon, strategy), first seed: clip radius
   per adapter pair and sigma_eff from the privacy ledger (at most :data:`MAX_DIALS` figures).
4. tables [``table-seeds``, ``table2``, ``table3``]: final perplexity mean +- std over seeds, and the
   paper's Table 2 / Table 3 analogues (:func:`raydp.study.report.table2` / ``table3``).
5. privacy [``table-privacy``, ``table-tuning``, ``fig-tuning-N``]: every accountant's epsilon per trial,
   the tuning-aware epsilon per dataset (ERRATA E7/E14), the PBT population's figure.
6. attacks [``table-membership``, ``table-extraction``, ``fig-attacks``]: Tables 4-9 analogues from each
   trial's ``evaluation.json`` (computed from private records: not a DP release).
7. audit [``table-audit``, ``fig-audit``]: claimed epsilon beside the empirical lower bounds; a lower
   bound above the claim is a bug and is shown as "VIOLATION: bug".

Inputs are read, never changed; the page is written atomically (temp file + rename).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from raydp.data.identity import frame_ids as dataset_ids, identity_of
from raydp.errors import ConfigError
from raydp.files import PRIVATE_FILE, atomic_write
from raydp.privacy.accounting import REPORTED_ACCOUNTANTS
from raydp.evaluation.base import Column
from raydp.evaluation.registry import ATTACKS
from raydp.report import figures
from raydp.study.arms import arms
from raydp.study.report import (
    VERDICT_ALPHA,
    _final_column,
    column_split,
    gates,
    headroom,
    load_results,
    metric_label,
    table2,
    table3,
    verdicts,
)
from raydp.study.results import CONTROLLERS, METRIC_COLUMNS, NONPRIVATE_ARMS
from raydp.study.trial import Trial

MAX_DIALS = 24
EVALUATION_FILE = "evaluation.json"
NO_EVALUATION = ("no trial has an evaluation: run `raydp eval RUN_DIR` or set `evaluate:` in the study file")
PRIVATE_SPLIT_WARNING = "private eval split: unprotected (ERRATA E15): these perplexities are not a DP release"
ATTACK_LABEL_FALLBACK = ("attack and audit metrics are computed from private records: not a DP release, "
                         "not covered by any accountant (ERRATA E15)")
AUDIT_TOLERANCE = 1e-9


# -- formatting -------------------------------------------------------------------------------------
def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _missing(x) -> bool:
    if x is None:
        return True
    try:
        return bool(pd.isna(x))
    except (TypeError, ValueError):
        return False


def num(x, digits: int = 4) -> str:
    """A number with ``digits`` decimals; 'n/a' for a missing one, 'inf' for an infinite one."""
    if _missing(x):
        return "n/a"
    x = float(x)
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}f}"


def mean_std(values: Iterable, digits: int = 4) -> str:
    """'mean ± std' over seeds (sample std); the mean alone for one value; 'n/a' for none."""
    v = np.array([float(x) for x in values if not _missing(x)], dtype=float)
    if v.size == 0:
        return "n/a"
    if v.size == 1:
        return num(v[0], digits)
    return f"{num(v.mean(), digits)} ± {num(v.std(ddof=1), digits)}"


def pm_cell(values: Iterable, digits: int = 4, cls: str = "num") -> Cell:
    """A 'mean ± std' cell that may wrap before '±' (narrow tables), never inside a number."""
    text = mean_std(values, digits)
    parts = text.split(" ± ")
    body = f"<span>{_e(parts[0])}</span>"
    if len(parts) > 1:
        body += f' <span class="sd">± {_e(parts[1])}</span>'
    return Cell(body, f"{cls} pm", raw=True)


def _eps(x) -> str:
    return "non-private" if _missing(x) else f"{float(x):g}"


@dataclass
class Cell:
    text: str
    cls: str | None = None
    title: str | None = None
    raw: bool = False  # text is already HTML

    def render(self, tag: str = "td") -> str:
        attrs = (f' class="{_e(self.cls)}"' if self.cls else "") + (f' title="{_e(self.title)}"' if self.title else "")
        return f"<{tag}{attrs}>{self.text if self.raw else _e(self.text)}</{tag}>"


def _cell(value) -> Cell:
    if isinstance(value, Cell):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return Cell(str(value), "num")
    return Cell("n/a" if _missing(value) else str(value))


def table(table_id: str, columns: Sequence[str], rows: Sequence[Sequence], caption: str | None = None) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "\n".join("<tr>" + "".join(_cell(v).render() for v in row) + "</tr>" for row in rows)
    cap = f"<caption>{_e(caption)}</caption>" if caption else ""
    return (f'<div class="scroll"><table id="{_e(table_id)}">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>\n{body}\n</tbody></table></div>")


def figure(fig_id: str, svg: str, caption: str) -> str:
    return f'<figure id="{_e(fig_id)}">{svg}<figcaption>{_e(caption)}</figcaption></figure>'


def para(text: str, cls: str | None = None) -> str:
    return f'<p class="{cls}">{_e(text)}</p>' if cls else f"<p>{_e(text)}</p>"


def how(text: str) -> str:
    return f'<p class="how"><strong>How to read this:</strong> {_e(text)}</p>'


# -- inputs -----------------------------------------------------------------------------------------
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
    def split_name(self) -> str:
        return "public validation" if self.public else "private eval (unprotected, E15)"

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
        return self._load(row, "evals", lambda d: _parquet(d / "eval_metrics.parquet"))

    def ledger(self, row) -> pd.DataFrame | None:
        columns = ["step", "q", "sigma_eff", "clip"]
        return self._load(row, "ledger", lambda d: _parquet(d / "privacy_ledger.parquet", columns))

    def trace(self, row) -> pd.DataFrame | None:
        return self._load(row, "trace", lambda d: _parquet(d / "control_trace.parquet"))

    def evaluation(self, row) -> dict | None:
        def read(d: Path):
            path = d / EVALUATION_FILE
            return json.loads(path.read_text()) if path.exists() else None
        return self._load(row, "evaluation", read)


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
    if (root / "summary.json").exists():
        return _single_run(root)
    raise ConfigError(f"{root} is neither a study directory (results.parquet) nor a run directory (summary.json)")


def _single_run(root: Path) -> Report:
    from raydp.study.results import _phase_one_columns, trial_labels

    try:
        s = json.loads((root / "summary.json").read_text())
        config = json.loads((root / "config.json").read_text()) if (root / "config.json").exists() else {}
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
    number of RLDP cells (the same choice as Table 2: :func:`raydp.study.report.table2`)."""
    rldp = group[_controller_cells(group)]
    if rldp.empty:
        return None, 0
    means = rldp.groupby("arm")[column].mean()
    cells = rldp["arm"].nunique()
    return (str(means.idxmin()) if means.notna().any() else str(rldp["arm"].iloc[0])), cells


# -- sections ---------------------------------------------------------------------------------------
def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n{body}\n</section>'


def overview(r: Report) -> str:
    res = r.results
    statuses = res["status"].fillna("unknown").value_counts()
    status_text = ", ".join(f"{n} {s}" for s, n in statuses.items())
    datasets = sorted({str(x) for x in dataset_ids(res).dropna()})
    units = sorted({str(x) for x in res.get("privacy_unit", pd.Series(dtype=object)).dropna()})
    eps = sorted({float(x) for x in res["epsilon_target"].dropna()})
    rows = [
        ("kind", "study directory" if r.kind == "study" else "single run directory"),
        ("directory", r.root.name),  # its name only: no absolute path of the machine that ran it
        ("trials", f"{len(res)} ({status_text})"),
        ("models", ", ".join(sorted({str(m) for m in res["model"].dropna()})) or "n/a"),
        ("strategies", ", ".join(dict.fromkeys(res["strategy"].astype(str))) or "n/a"),
        ("target epsilons", ", ".join(f"{e:g}" for e in eps) + (" + non-private" if res["epsilon_target"].isna().any()
                                                                 else "") if eps else "non-private only"),
        ("seeds", ", ".join(str(int(s)) for s in sorted(res["seed"].dropna().unique())) if "seed" in res else "n/a"),
        ("dataset id (keyed: only its owner can compute it)", Cell(", ".join(datasets) or "n/a",
                                                   title=", ".join(datasets) or None)),
        ("privacy unit(s)", ", ".join(units) or "n/a"),
        ("selection", r.note),
    ]
    if r.kind == "study" and r.summary.get("wall_seconds") is not None:
        rows.append(("study wall time (unprotected: timings follow the private batch sizes)",
                     f"{float(r.summary['wall_seconds']):.0f} s"))
    body = [how("what was run: one row per setting. Every figure and table below uses the selection split named "
                "here; the private eval split is never a DP release (ERRATA E15)."),
            table("table-overview", ["", ""], [(Cell(k, "key"), v) for k, v in rows])]
    if not r.public:
        body.append(para(PRIVATE_SPLIT_WARNING, "warn"))
    labels = _labels(res)
    for label in labels:
        body.append(para(f"LABEL: {label}", "warn"))
    if "description" in r.summary:
        body.insert(0, para(str(r.summary["description"])))
    return _section("sec-overview", "Overview", "\n".join(body))


def _labels(res: pd.DataFrame) -> list[str]:
    if "privacy_labels" not in res:
        return []
    return list(dict.fromkeys(label for ls in res["privacy_labels"].dropna() for label in str(ls).split("; ") if label))


def utility(r: Report, colours: dict[str, str]) -> str:
    res = r.results
    ylabel = f"{'public validation' if r.public else 'private eval'} {r.metric}"
    panels, notes = [], []
    nonprivate = res[res["epsilon_target"].isna()]
    only_nonprivate = nonprivate.shape[0] == res.shape[0]
    rldp_notes = []
    for model, eps, group in _groups(res):
        if _missing(eps) and not only_nonprivate:
            continue  # non-private trials are drawn as a dashed reference in their model's panels
        panel = figures.Panel(f"{model} · ε = {_eps(eps)}")
        best, n_cells = _best_rldp_cell(group, r.column)
        if best is not None:
            rldp_notes.append(f"ε={_eps(eps)}: best cell {best.partition(' ')[2]}"
                              + (f" of {n_cells}" if n_cells > 1 else ""))
        for arm in dict.fromkeys(group["arm"]):
            rows = group[group["arm"] == arm]
            is_rldp = bool(_controller_cells(rows).all())
            strategy = str(rows["strategy"].iloc[0])
            if is_rldp and arm != best:
                s = _series(r, rows, f"{strategy} other SAC cells (thin, mean over seeds)", colours[strategy],
                            band=False)
                if s is not None:
                    s.thin = True
                    panel.series.append(s)
                continue
            label = f"{strategy} (best cell {arm.partition(' ')[2]})" if is_rldp and n_cells > 1 else arm
            s = _series(r, rows, label, colours.get(arm, colours.get(strategy, "#333333")))
            if s is not None:
                panel.series.append(s)
        if not _missing(eps):
            for arm in dict.fromkeys(nonprivate[nonprivate["model"] == model]["arm"]):
                rows = nonprivate[(nonprivate["model"] == model) & (nonprivate["arm"] == arm)]
                s = _series(r, rows, "non-private (reference)", colours[str(rows["strategy"].iloc[0])], band=False)
                if s is not None:
                    s.dashed = True
                    panel.series.append(s)
        if panel.series:
            panels.append(panel)
        else:
            notes.append(f"{model} ε={_eps(eps)}: no trial has eval_metrics.parquet with {r.eval_column}")
    body = [how(f"lower is better. Each line is one strategy's {ylabel} over training steps, the mean over "
                "seeds; the shaded band spans the minimum to the maximum over seeds (no band: one seed). "
                "One panel per model and target epsilon (RLDP paper Fig. 1-4).")]
    if panels:
        rldp_text = ("RLDP: its best SAC cell (lowest mean final selection perplexity, as in Table 2) in bold with "
                     "its band; other cells, if any, as thin lines (" + "; ".join(rldp_notes) + ")."
                     if rldp_notes else "No RLDP trials.")
        body.append(figure("fig-utility", figures.utility_figure(panels, ylabel, "fig-utility"),
                           f"{ylabel.capitalize()} vs step, mean over seeds with min-max band. {rldp_text}"))
    else:
        body.append(para("no utility curves: no trial has an eval_metrics.parquet with the selection split's "
                         "perplexity", "missing"))
    body += [para(n, "missing") for n in notes]
    return _section("sec-utility", "Utility over training", "\n".join(body))


def _series(r: Report, rows: pd.DataFrame, label: str, colour: str, band: bool = True):
    curves = []
    for _, row in rows.iterrows():
        evals = r.evals(row)
        if evals is None or r.eval_column not in evals or "step" not in evals:
            continue
        curves.append(evals.groupby("step")[r.eval_column].last().rename(str(row["trial"])))
    if not curves:
        return None
    frame = pd.concat(curves, axis=1).sort_index()
    frame = frame.dropna(how="all")
    steps = frame.index.to_numpy(dtype=float)
    mean = frame.mean(axis=1).to_numpy()
    multi = frame.shape[1] > 1
    return figures.Series(label, steps, mean,
                          frame.min(axis=1).to_numpy() if band and multi else None,
                          frame.max(axis=1).to_numpy() if band and multi else None, colour)


def dials(r: Report) -> str:
    res = r.results
    chosen = []
    for model, eps, group in _groups(res):
        if _missing(eps):
            continue
        best, _ = _best_rldp_cell(group, r.column)
        for arm in dict.fromkeys(group["arm"]):
            rows = group[group["arm"] == arm]
            if bool(_controller_cells(rows).all()) and arm != best:
                continue  # RLDP: its best SAC cell only
            rows = rows.sort_values("seed", kind="stable") if "seed" in rows else rows
            row = next((row for _, row in rows.iterrows() if r.ledger(row) is not None), None)
            if row is not None:
                chosen.append((model, eps, arm, row))
    body = [how("the dials the strategy turned, for the first seed of each (model, epsilon, strategy): left, the "
                "clip radius of each LoRA adapter pair (one line per pair; log scale when the radii span a "
                "factor of 10 or more; one line for a flat clip); right, the effective noise multiplier sigma_eff "
                "charged by the privacy ledger (RLDP paper Fig. 5-8). Steps count from 1, as in the utility "
                "curves. Ticks at the bottom of the right panel mark the RLDP controller's decisions. RLDP: its "
                "best SAC cell only.")]
    if not chosen:
        body.append(para("no dials: no DP trial has a privacy_ledger.parquet" +
                         (" (non-private trials have none)" if res["epsilon_target"].isna().any() else ""),
                         "missing"))
    for i, (model, eps, arm, row) in enumerate(chosen[:MAX_DIALS], start=1):
        ledger = r.ledger(row).sort_values("step")
        clips = _clip_matrix(ledger["clip"]) if "clip" in ledger else np.full((len(ledger), 1), np.nan)
        trace = r.trace(row)
        decisions = None
        if trace is not None and "decision" in trace and "step" in trace:
            decisions = trace.loc[trace["decision"].fillna(False).astype(bool), "step"].to_numpy()
        seed = "?" if _missing(row.get("seed")) else int(row["seed"])
        title = f"{model} ε={_eps(eps)} · {arm} · seed {seed}"
        fid = f"fig-dials-{i}"
        # the ledger's step i is the (i+1)-th step: drawn at i+1, the step count of evaluations and the trace
        spent = _epsilon_over_steps(ledger, row)
        svg = figures.dials_figure(title, ledger["step"].to_numpy(float) + 1, clips,
                                   ledger["sigma_eff"].to_numpy(float) if "sigma_eff" in ledger
                                   else np.full(len(ledger), np.nan), decisions, fid, epsilon=spent)
        clip_span = (f"clip range {num(np.nanmin(clips), 4)} to {num(np.nanmax(clips), 4)}; "
                     if np.isfinite(clips).any() else "no gradient clip (a local mechanism); ")
        span = (f"{clip_span}sigma_eff {num(ledger['sigma_eff'].min(), 4)} to {num(ledger['sigma_eff'].max(), 4)}"
                if "sigma_eff" in ledger and len(ledger) else "")
        spent_note = (f"; privacy spent over steps: the RDP upper bound, {num(spent[1][-1], 3)} at the end (the "
                      f"enforcing accountant's figure, {num(row.get('epsilon'), 3)}, is tighter: privacy table)"
                      if spent is not None else "")
        body.append(figure(fid, svg, f"{title} (trial {row['trial']}): {clips.shape[1]} clip radius(es) per step "
                                     f"over {len(ledger)} ledger steps; {span}{spent_note}."))
    if len(chosen) > MAX_DIALS:
        body.append(para(f"{len(chosen) - MAX_DIALS} more dial figures omitted (at most {MAX_DIALS} are drawn).",
                         "missing"))
    return _section("sec-dials", "Dials over steps: clip radii and noise", "\n".join(body))


#: points at which the dials figure's privacy-spent curve is computed
EPSILON_POINTS = 40


def _epsilon_over_steps(ledger: pd.DataFrame, row) -> tuple[np.ndarray, np.ndarray] | None:
    """The epsilon the ledger's first k steps spend, at up to :data:`EPSILON_POINTS` values of k
    (:func:`raydp.privacy.accounting.rdp.epsilon_over_steps`, the RDP bound) at the trial's delta. The enforcing
    accountant's (tighter, PLD) final figure is in the privacy table."""
    from raydp.privacy.accounting.rdp import epsilon_over_steps

    delta = row.get("delta")
    if _missing(delta):
        config = json.loads(row["config"]) if isinstance(row.get("config"), str) else {}
        delta = config.get("delta")
    if _missing(delta) or not {"q", "sigma_eff"} <= set(ledger) or not len(ledger):
        return None
    return epsilon_over_steps(ledger["q"], ledger["sigma_eff"], float(delta), EPSILON_POINTS)


def _clip_matrix(column: pd.Series) -> np.ndarray:
    values = [np.atleast_1d(np.asarray(v, dtype=float)) if v is not None else np.array([np.nan]) for v in column]
    width = max((len(v) for v in values), default=1)
    out = np.full((len(values), width), np.nan)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _frontier(r: Report) -> list[str]:
    """The privacy-utility frontier figure (per model with two or more target epsilons): per arm, the final
    selection-split metric against epsilon, mean ± sd over seeds; non-private as a line."""
    res, out = r.results, []
    if r.column not in res or "epsilon_target" not in res:
        return out
    for model, group in res.dropna(subset=[r.column]).groupby("model"):
        dp = group[group["epsilon_target"].notna()]
        if dp["epsilon_target"].nunique() < 2:
            continue
        series = []
        for arm, g in dp.groupby("arm", sort=False):
            cells = g.groupby("epsilon_target")[r.column].agg(["mean", "std"]).sort_index()
            series.append((arm, cells.index.to_numpy(float), cells["mean"].to_numpy(float), cells["std"].to_numpy(float)))
        nonprivate = group[group["epsilon_target"].isna()][r.column]
        np_line = (float(nonprivate.mean()), float(nonprivate.std(ddof=1)) if len(nonprivate) > 1 else float("nan")) \
            if len(nonprivate) else None
        fid = f"fig-frontier-{len(out) + 1}"
        out.append(figure(fid, figures.frontier_figure(series, np_line, f"final {r.split_name} {r.metric}", fid),
                          f"{model}: the privacy-utility frontier, final {r.split_name} {r.metric} per arm against the "
                          f"target epsilon (mean ± sd over seeds; {len(series)} arms)" +
                          ("; dashed: non-private (band: ± sd)." if np_line else ".")))
    return out


def tables(r: Report) -> str:
    res = r.results
    split = r.split_name
    rows = []
    for model, eps, group in _groups(res):
        for arm in dict.fromkeys(group["arm"]):
            g = group[group["arm"] == arm]
            finished = g[g[r.column].notna()] if r.column in g else g.iloc[0:0]
            stt = g["steps_to_target"].dropna() if "steps_to_target" in g else pd.Series(dtype=float)
            row = [model, _eps(eps), Cell(arm, "arm"), Cell(f"{len(finished)}/{len(g)}", "num"),
                   pm_cell(g.get(r.column, []), 4),
                   pm_cell(g.get(r.column.replace("final", "best"), []), 4),
                   pm_cell(g.get(r.column.replace("final", "initial"), []), 4),
                   Cell(f"{mean_std(100 * stt, 1)} ({len(stt)}/{len(g)})" if len(stt) else "not reached / n/a", "num")]
            if r.public:
                row.append(pm_cell(g.get(r.private_column, []), 4, "num private"))
            rows.append(row)
    columns = ["model", "ε target", "strategy", "seeds", f"final {split} {r.metric}", "best", "initial",
               "steps to target, % (seeds reaching)"]
    if r.public:
        columns.append(f"final private-eval {r.metric} (not a DP release)")
    body = [how(f"per (model, epsilon, strategy): the {split} {r.metric} at the end of training, mean ± sample "
                "std over seeds (one seed: the value alone); 'seeds' counts seeds with a final value / trials. "
                "Steps to target: the first evaluation at which a trial reached the best baseline's final "
                f"{r.metric}, in % of its planned steps (RLDP paper Sec. 4.2)."),
            table("table-seeds", columns, rows)]
    body.extend(_frontier(r))
    head = headroom(res, r.column)
    if len(head):
        body.append(how(f"The DP gap: per model, epsilon and arm, the final {r.metric} on both splits (mean ± sd over "
                        "seeds); 'recovered' is the share of the non-private arm's gain over the untrained model, "
                        "'sd from non-private' the distance in pooled seed standard deviations. The private eval "
                        "split is unprotected (E15) and shown for reference; the gates are the benchmark's (issue 27)."))
        cols = ["model", "ε", "arm", "seeds", "public", "public recovered", "public sd from non-private",
                "private eval", "private recovered", "private sd from non-private"]
        body.append(table("table-headroom", cols, [
            [rec["model"], _eps(rec["epsilon"]) if rec["epsilon"] != float("inf") else "∞ (non-private)",
             Cell(rec["arm"], "arm"), Cell(str(rec["seeds"]), "num"),
             Cell(f"{num(rec['public_mean'], 3)} ± {num(rec['public_sd'], 3)}", "num"),
             Cell(num(rec["public_recovered"], 3), "num"), Cell(num(rec["public_sd_from_nonprivate"], 1), "num"),
             Cell(f"{num(rec['eval_mean'], 3)} ± {num(rec['eval_sd'], 3)}", "num private"),
             Cell(num(rec["eval_recovered"], 3), "num private"),
             Cell(num(rec["eval_sd_from_nonprivate"], 1), "num private")] for rec in head.to_dict("records")],
            caption=f"the DP gap: final {r.metric}, mean ± sd over seeds"))
        body.extend(para(g, "gate-pass" if g.startswith("PASS") else "gate-fail") for g in gates(res, r.column))
    t2 = table2(res, r.column)
    body.append(how("Table 2 analogue: RLDP's best SAC cell (mean over seeds) against the best baseline (the "
                    f"DP strategy with the lowest mean final {r.metric}); change < 0 means RLDP is better."))
    if len(t2):
        cols = [("model", "model", str), ("epsilon", "ε", _eps), ("rldp_final", "RLDP", lambda x: num(x, 4)),
                ("rldp_cell", "RLDP cell", str), ("rldp_frozen_final", "RLDP frozen policy", lambda x: num(x, 4)),
                ("best_baseline", "best baseline", str), ("baseline_final", "baseline", lambda x: num(x, 4)),
                ("change_pct", "change", lambda x: "n/a" if _missing(x) else f"{x:+.1f}%")]
        cols = [c for c in cols if c[0] in t2]
        body.append(table("table2", [c[1] for c in cols],
                          [[Cell(f(rec[k]) if not _missing(rec[k]) else "n/a",
                                 "num" if k.endswith(("final", "pct")) else None) for k, _, f in cols]
                           for rec in t2.to_dict("records")],
                          caption=f"final {split} {r.metric}, mean over seeds"))
    else:
        body.append(para(f"Table 2: no DP trials with a final {r.metric}", "missing"))
    v = verdicts(res, r.column)
    if len(v):
        body.append(how("RLDP against the best baseline, per model and epsilon: RLDP's best arm and the baseline arm "
                        "with the lowest mean, both chosen after the fact; Welch's t-test over seeds (two-sided, "
                        f"{VERDICT_ALPHA:g}): wins or loses when the difference is significant, ties otherwise."))
        body.append(table("table-verdicts", ["model", "ε", "RLDP arm", "RLDP", "best baseline", "baseline",
                                             "change", "p", "seeds (RLDP/baseline)", "verdict"],
                          [[rec["model"], _eps(rec["epsilon"]), Cell(rec["rldp_arm"], "arm"),
                            Cell(f"{num(rec['rldp_mean'], 4)} ± {num(rec['rldp_sd'], 4)}", "num"),
                            Cell(rec["best_baseline"], "arm"),
                            Cell(f"{num(rec['baseline_mean'], 4)} ± {num(rec['baseline_sd'], 4)}", "num"),
                            Cell(f"{rec['change_pct']:+.2f}%", "num"),
                            Cell("n/a" if rec["p_value"] is None else f"{rec['p_value']:.3g}", "num"),
                            Cell(rec["seeds"], "num"), Cell(rec["verdict"], "verdict")]
                           for rec in v.to_dict("records")],
                          caption=f"final {split} {r.metric}, mean ± sd over seeds"))
    t3 = table3(res, r.column)
    if len(t3):
        body.append(table("table3", ["model", "ε", "RLDP steps to target (% of steps)", "seeds reaching target"],
                          [[rec["model"], _eps(rec["epsilon"]), Cell(num(rec["steps_to_target_pct"], 1), "num"),
                            Cell(rec["seeds_reaching_target"], "num")] for rec in t3.to_dict("records")],
                          caption="Table 3 analogue: RLDP's best cell, steps to reach the best baseline's "
                                  f"final {split} {r.metric}"))
    else:
        body.append(para("Table 3: no RLDP trials", "missing"))
    return _section("sec-tables", "Final utility (Tables 2 and 3)", "\n".join(body))


def privacy(r: Report) -> str:
    res = r.results
    rows = []
    for _, row in res.iterrows():
        within = row.get("within_budget")
        within_cell = (Cell("n/a") if _missing(within) else Cell("yes", "ok") if bool(within) else Cell("NO", "bad"))
        rows.append([row["trial"], row["strategy"], _eps(row.get("epsilon_target")),
                     Cell(num(row.get("epsilon"), 3), "num"),
                     *(Cell(num(row.get(f"epsilon_{a}"), 3), "num") for a in REPORTED_ACCOUNTANTS),
                     row.get("enforcing_accountant"), row.get("guarantee"), within_cell,
                     row.get("privacy_unit"), row.get("privacy_mode"),
                     Cell(str(row.get("privacy_labels")), "warn-text") if not _missing(row.get("privacy_labels"))
                     else "none"])
    body = [how("one row per trial. ε (enforced) is the figure of the enforcing accountant, the run's guarantee; "
                "the other columns compose the same ledger with each accountant (PLD, PRV, RDP upper bounds; GDP "
                "(a CLT) and Edgeworth (the accountant of EW-Tune and DualTune-GhostDP) are approximations and "
                "enforce nothing, ERRATA E9; under adaptive sigma they are not a guarantee, "
                "ERRATA E13). 'within budget' is the enforcing accountant's verdict; labels qualify the epsilon."),
            table("table-privacy", ["trial", "strategy", "ε target", "ε (enforced)", "ε PLD", "ε PRV", "ε RDP",
                                    "ε GDP (approx.)", "ε Edgeworth (approx.)", "enforcing accountant", "guarantee", "within budget",
                                    "privacy unit", "mode", "labels"], rows)]
    tuning = r.summary.get("tuning_aware_epsilon")
    body.append(how("tuning-aware epsilon (ERRATA E7/E14): every run on the same private dataset spends its "
                    "people's budget, whatever its target; the composition of all of them (RDP) is what releasing "
                    "the best of the study costs. Repeat-and-select holds only if the number of trials were "
                    "Poisson(K)."))
    if isinstance(tuning, dict) and tuning:
        trows, extras = [], []
        for i, (sha, t) in enumerate(tuning.items(), start=1):
            if not isinstance(t, dict):
                continue
            targets = ", ".join(f"{e:g}" for e in t.get("target_epsilons") or []) or (sha if "runs" not in t else "n/a")
            trows.append([Cell(sha[:16] + ("…" if len(sha) > 16 else ""), title=sha),
                          Cell(str(t.get("runs", t.get("trials", "n/a"))), "num"),
                          Cell(str(t.get("trials", "n/a")), "num"), targets,
                          Cell(num(t.get("tuning_aware_epsilon"), 3), "num strong"),
                          Cell("n/a" if t.get("delta") is None else f"{t['delta']:g}", "num"),
                          Cell(num(t.get("max_single_trial_epsilon_rdp"), 3), "num"),
                          Cell(num(t.get("repeat_and_select_epsilon_rdp"), 3), "num"),
                          ", ".join(t.get("privacy_units") or []) or "n/a"])
            for label in t.get("labels") or []:
                extras.append(para(f"LABEL ({sha[:16]}): {label}", "warn"))
            for warning in t.get("warnings") or []:
                extras.append(para(f"WARNING ({sha[:16]}): {warning}", "warn"))
            composed = [c for c in t.get("composed") or [] if isinstance(c, dict)]
            if composed:
                fid = f"fig-tuning-{i}"
                svg = figures.tuning_figure([(str(c.get("name")), c.get("epsilon_rdp")) for c in composed],
                                            t.get("tuning_aware_epsilon"), t.get("max_single_trial_epsilon_rdp"),
                                            f"dataset {sha[:16]}: every run composed", fid)
                extras.append(figure(fid, svg, f"Dataset {sha[:16]}: each composed run's own RDP epsilon (bars) "
                                               f"and the tuning-aware composition of all {len(composed)} "
                                               "(red line)."))
        body.append(table("table-tuning", ["dataset (sha256)", "runs", "trials", "target ε", "tuning-aware ε",
                                           "δ", "largest single trial ε", "repeat-and-select ε", "privacy units"],
                          trows))
        body += extras
    elif tuning:
        body.append(para(f"tuning-aware epsilon: {tuning}"))
    else:
        body.append(para("no tuning-aware epsilon: " + ("a single run (a study composes its trials)" if r.kind == "run"
                                                         else "the study summary has none (public data?)"),
                         "missing"))
    body += _phase_one(res)
    pbt = r.summary.get("pbt_population")
    if isinstance(pbt, dict) and pbt:
        verdict = "within" if pbt.get("within_budget") else "OVER"
        body.append(para(f"PBT population: {pbt.get('members')} members, {pbt.get('exploits')} exploits; population "
                         f"epsilon {num(pbt.get('population_epsilon'), 3)} at delta {pbt.get('delta')} (Renyi filter "
                         f"over every member's steps, discarded ones included): {verdict} its budget",
                         None if pbt.get("within_budget") else "bad"))
    return _section("sec-privacy", "Privacy", "\n".join(body))


def _phase_one(res: pd.DataFrame) -> list[str]:
    """Trials with a non-private phase 1 (DualTune-GhostDP): what it trained on, whether any epsilon covers
    it (ERRATA E16) and the secret detector's recall."""
    if "phase1_data" not in res.columns or res["phase1_data"].isna().all():
        return []
    rows = []
    for _, row in res[res["phase1_data"].notna()].iterrows():
        redacted = row["phase1_data"] == "redacted"
        rows.append([row["trial"], row["phase1_data"], Cell(num(row.get("phase1_steps"), 0), "num"),
                     Cell(num(row.get("phase1_public_perplexity"), 4), "num"),
                     Cell("NO: epsilon covers phase 2 only", "bad") if redacted else Cell("yes (public data)", "ok"),
                     Cell(num(row.get("detector_canary_recall"), 3), "num"),
                     Cell(num(row.get("detector_field_recall"), 3), "num")])
    return [how("a non-private phase 1 before DP-SGD (DualTune-GhostDP). On the public corpus it needs no epsilon; "
                "on the redacted private records no epsilon covers it: a secret detector is a deterministic function "
                "of the records and gives no DP guarantee (ERRATA E16). Detector recall: on the run's canaries "
                "(computed on private records, not a DP release) and on the sensitive fields of public records."),
            table("table-phase1", ["trial", "phase 1 data", "phase 1 steps", "public perplexity after phase 1",
                                   "covered by epsilon", "detector canary recall", "detector field recall"], rows)]


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
    if not evaluated:
        return NO_EVALUATION
    if missing:
        return f"{missing} of {len(r.results)} trials have no {EVALUATION_FILE} (not shown)"
    return None


def attacks(r: Report) -> str:
    evaluated = _evaluated(r)
    body = [how("attacks on the trained model, mean ± std over seeds per (model, epsilon, strategy) (RLDP paper "
                "Tables 4-9). Membership inference: AUC 0.5 and TPR equal to the FPR mean the attacker cannot tell "
                "members from non-members; 'calibrated' subtracts the base model's loss; the null AUC is the loss "
                "attack on the base model, which saw no private record (members and non-members are different "
                "people, so on a finite sample it is not exactly 0.5). Canary extraction: "
                "Jaccard similarity of n-grams between generations and canary secrets (0 = nothing leaked). "
                "Exposure in bits (Carlini et al.), at most the measurable maximum.")]
    note = _missing_evaluation_note(r, evaluated)
    labels = list(dict.fromkeys(str(ev.get("label")) for _, ev in evaluated if ev.get("label")))
    if evaluated:
        for label in labels or [ATTACK_LABEL_FALLBACK]:
            body.append(f'<p class="label-box"><strong>{_e(label)}</strong></p>')
    if note:
        body.append(para(note, "missing"))
    if not evaluated:
        return _section("sec-attacks", "Attacks: membership inference, extraction, exposure", "\n".join(body))
    groups: dict[tuple, list[dict]] = {}
    for row, ev in evaluated:
        groups.setdefault((row["model"], row.get("epsilon_target"), row["arm"]), []).append(ev)
    order = {arm: i for i, arm in enumerate(dict.fromkeys(r.results["arm"]))}  # strategies in the study's order
    keys = sorted(groups, key=lambda k: (str(k[0]), _missing(k[1]), 0 if _missing(k[1]) else float(k[1]),
                                         order.get(k[2], len(order))))

    def cell(evs, column: Column):
        values = [_dig(ev, *column.path) for ev in evs]
        return Cell(_span(values, column.digits), "num") if column.span else pm_cell(values, column.digits)

    evaluations = [ev for _, ev in evaluated]
    for spec in ATTACKS:  # each registered attack's table (raydp.evaluation.registry)
        t = spec.table
        if t is None:
            continue
        rows = []
        for key in keys:
            evs = [ev for ev in groups[key] if any(isinstance(ev.get(k), dict) for k in t.keys)]
            if evs:
                rows.append([key[0], _eps(key[1]), Cell(key[2], "arm"), Cell(str(len(evs)), "num"),
                             *(cell(evs, c) for c in t.columns)])
        body.append(table(t.id, ["model", "ε", "strategy", "trials", *(c.header for c in t.columns)], rows,
                          caption=t.caption(evaluations)) if rows else para(t.missing, "missing"))
    auc = []
    for key in keys:  # membership inference's figures: AUC per arm, and ROC curves
        with_m = [ev for ev in groups[key] if isinstance(ev.get("membership"), dict)]
        if with_m:
            vals = lambda *p: [v for v in (_dig(ev, *p) for ev in with_m) if not _missing(v)]  # noqa: E731
            la, ca = vals("membership", "loss", "auc"), vals("membership", "calibrated", "auc")
            auc.append((f"ε={_eps(key[1])} · {key[2]}" + (f" · {key[0]}" if len({k[0] for k in keys}) > 1 else ""),
                        float(np.mean(la)) if la else np.nan, float(np.std(la, ddof=1)) if len(la) > 1 else np.nan,
                        float(np.mean(ca)) if ca else np.nan, float(np.std(ca, ddof=1)) if len(ca) > 1 else np.nan))
    if auc:
        body.append(figure("fig-attacks", figures.auc_figure(auc, "fig-attacks"),
                           "Membership-inference AUC per (epsilon, strategy), mean ± std over seeds: the loss attack "
                           "(circles) and the calibrated attack (squares); 0.5 is chance."))
    roc = []  # first seed of each (model, epsilon, strategy) whose evaluation kept its ROC curve
    for key in keys:
        ev = next((ev for ev in groups[key] if isinstance(_dig(ev, "membership", "loss", "roc"), dict)), None)
        if ev is not None:
            curve = ev["membership"]["loss"]["roc"]
            roc.append((f"ε={_eps(key[1])} · {key[2]}", curve["fpr"], curve["tpr"]))
    if roc:
        floor = min(float(_dig(ev, "membership", "fpr_resolution") or 1e-3) for _, ev in evaluated
                    if isinstance(ev.get("membership"), dict))
        body.append(figure("fig-roc", figures.roc_figure(roc, floor, "fig-roc"),
                           f"Membership-inference ROC of the loss attack on log-log axes, first seed of each (epsilon, "
                           f"strategy); the dashed diagonal is chance; below FPR {floor:.2g} (one non-member) nothing "
                           "is resolved."))
    return _section("sec-attacks", "Attacks: membership inference, extraction, exposure", "\n".join(body))


def _span(values: Iterable, digits: int) -> str:
    """One value, or 'min–max' when the trials differ (e.g. a different number of exposure candidates)."""
    v = [float(x) for x in values if not _missing(x)]
    if not v:
        return "n/a"
    low, high = num(min(v), digits), num(max(v), digits)
    return low if low == high else f"{low}–{high}"


def _violation(audit: dict, claimed) -> bool:
    """The verdict rests on the one-run bound (the one with a theorem for a single run); Clopper-Pearson
    across one run's canaries is shown for comparison only (raydp.evaluation.audit)."""
    if audit.get("consistent") is False:
        return True
    if _missing(claimed) or audit.get("consistent") is None and "consistent" in audit:
        return False
    b = audit.get("epsilon_one_run")
    return not _missing(b) and float(b) > float(claimed) + AUDIT_TOLERANCE


def _verdict(audit: dict, claimed, bad: bool) -> Cell:
    if bad:
        return Cell("VIOLATION: bug", "violation")
    if _missing(claimed) or audit.get("consistent") is None and "consistent" in audit:
        return Cell("not compared" + (f": {audit['note']}" if audit.get("note") else " (no claimed epsilon)"))
    return Cell("not refuted", "ok")


def audit(r: Report) -> str:
    evaluated = _evaluated(r)
    body = [how("an empirical privacy audit inserts m canaries, trains, and guesses which were included: the "
                "guesses give a statistical LOWER bound on epsilon at the stated confidence (the one-run bound of "
                "Steinke et al. 2023, Thm 5.2; beside it, for comparison only, the Clopper-Pearson estimator, "
                "which has no theorem for one run). An audit can refute a claim, never prove it: a one-run bound "
                "above the claimed epsilon means the implementation or accounting is wrong and is shown as "
                "VIOLATION: bug; a bound below it means only \"not refuted\".")]
    rows, fig_rows = [], []
    for row, ev in evaluated:
        a = ev.get("audit")
        if not isinstance(a, dict):
            continue
        claimed = a.get("claimed_epsilon", _dig(ev, "claimed", "epsilon"))
        bad = _violation(a, claimed)
        one_run_detail = (f" ({a.get('one_run_correct')}/{a.get('one_run_guesses')} correct)"
                          if a.get("one_run_guesses") is not None else "")
        rows.append([row["trial"], row["strategy"], _eps(row.get("epsilon_target")), Cell(num(claimed, 3), "num"),
                     Cell(num(a.get("epsilon_one_run"), 3) + one_run_detail,
                          "num bad" if _above(a.get("epsilon_one_run"), claimed) else "num"),
                     Cell(num(a.get("epsilon_clopper_pearson"), 3), "num"),
                     Cell(str(a.get("m", "n/a")), "num"), Cell(str(a.get("n_included", "n/a")), "num"),
                     Cell("n/a" if a.get("confidence") is None else f"{a['confidence']:.4g}", "num"),
                     Cell("n/a" if a.get("delta") is None else f"{a['delta']:g}", "num"),
                     _verdict(a, claimed, bad)])
        fig_rows.append((str(row["trial"]), None if _missing(claimed) else float(claimed),
                         a.get("epsilon_one_run"), a.get("epsilon_clopper_pearson"), bad))
    if rows:
        n_bad = sum(1 for f in fig_rows if f[4])
        if n_bad:
            body.append(f'<p class="violation">VIOLATION: bug: {n_bad} trial(s) have an audit lower bound above '
                        "their claimed epsilon; the epsilon of these runs cannot be trusted.</p>")
        body.append(table("table-audit", ["trial", "strategy", "ε target", "claimed ε", "one-run lower bound",
                                          "Clopper-Pearson (comparison only)", "m (canaries)", "included", "confidence",
                                          "δ", "verdict"], rows))
        body.append(figure("fig-audit", figures.audit_figure(fig_rows, "fig-audit"),
                           "Claimed epsilon per trial (bars) beside the audit's lower bounds (dots); a trial whose "
                           "lower bound exceeds its claim is drawn in red."))
    note = _missing_evaluation_note(r, evaluated)
    if note:
        body.append(para(note, "missing"))
    unaudited = [ev for _, ev in evaluated if not isinstance(ev.get("audit"), dict)]
    if unaudited:
        body.append(para("no evaluation has an audit section (the audit was not run)" if not rows else
                         f"{len(unaudited)} evaluated trial(s) have no audit section", "missing"))
    for why in dict.fromkeys(str(ev["audit_note"]) for ev in unaudited if ev.get("audit_note")):
        body.append(para(f"not audited: {why}", "missing"))
    return _section("sec-audit", "Empirical privacy audit", "\n".join(body))


def _above(bound, claimed) -> bool:
    return not _missing(bound) and not _missing(claimed) and float(bound) > float(claimed) + AUDIT_TOLERANCE


# -- the page ---------------------------------------------------------------------------------------
CSS = """
:root { --fg:#1d1d1f; --muted:#5f6368; --line:#d9dce1; --bg:#ffffff; --alt:#f6f7f9; --bad:#b00020; --ok:#1b7a3a; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--fg);
       background: var(--bg); margin: 0 auto; max-width: 1320px; padding: 24px 32px 64px; line-height: 1.45; }
header h1 { margin: 0 0 4px; font-size: 26px; }
header .sub { color: var(--muted); margin: 0 0 12px; }
nav { margin: 8px 0 16px; padding: 8px 12px; background: var(--alt); border-radius: 6px; font-size: 14px; }
nav a { margin-right: 14px; color: #1a5fb4; text-decoration: none; }
section { margin-top: 28px; padding-top: 8px; border-top: 2px solid var(--line); }
h2 { font-size: 20px; margin: 8px 0; }
p.how { color: var(--muted); font-size: 14px; margin: 4px 0 12px; }
p.missing { color: var(--muted); font-style: italic; font-size: 14px; }
p.warn { background: #fff4e5; border-left: 4px solid #f0a020; padding: 6px 10px; margin: 6px 0; }
p.label-box { background: #fdecec; border: 2px solid var(--bad); color: #6b0010; padding: 10px 14px;
              border-radius: 6px; font-size: 15px; }
p.violation, td.violation, .bad { color: var(--bad); font-weight: 700; }
td.ok { color: var(--ok); }
td.strong { font-weight: 700; }
td.private { color: var(--muted); }
td.key { font-weight: 600; white-space: nowrap; }
td.warn-text { color: #8a5300; }
.scroll { overflow-x: auto; margin: 8px 0 16px; }
table { border-collapse: collapse; font-size: 12.5px; min-width: 40%; }
caption { text-align: left; color: var(--muted); padding: 4px 0; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--alt); font-weight: 600; max-width: 180px; }
td.arm { white-space: nowrap; }
tbody tr:nth-child(even) { background: #fafbfc; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.pm { white-space: normal; }
td.pm span { white-space: nowrap; }
td.pm span.sd { color: var(--muted); }
figure { margin: 12px 0 20px; }
figure svg { max-width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 4px; }
footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
"""

SECTIONS = [("sec-overview", "Overview"), ("sec-utility", "Utility curves"), ("sec-dials", "Dials"),
            ("sec-tables", "Tables 2 & 3"), ("sec-privacy", "Privacy"), ("sec-attacks", "Attacks"),
            ("sec-audit", "Audit")]


def render(r: Report) -> str:
    """The whole page as one HTML string."""
    from raydp import __version__

    strategies = list(dict.fromkeys([*CONTROLLERS, *NONPRIVATE_ARMS, *r.results["arm"].astype(str),
                                     *r.results["strategy"].astype(str)]))
    colours = figures.strategy_colours(strategies, dict(zip(r.results["arm"].astype(str),
                                                            r.results["strategy"].astype(str))))
    title = f"raydp {'study' if r.kind == 'study' else 'run'} report: {r.name}"
    parts = [overview(r), utility(r, colours), dials(r), tables(r), privacy(r), attacks(r), audit(r)]
    nav = "".join(f'<a href="#{sid}">{_e(label)}</a>' for sid, label in SECTIONS)
    sub = (f"{len(r.results)} trial(s) · selection: {r.split_name} split · "
           "differentially private LoRA fine-tuning (RLDP paper analogues)")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<header><h1>{_e(title)}</h1><p class=\"sub\">{_e(sub)}</p><nav>{nav}</nav></header>\n"
            + "\n".join(parts) +
            f"\n<footer>written by raydp {_e(__version__)} from {_e(r.root.name)}; self-contained (no scripts, no external "
            "resources).</footer>\n</body>\n</html>\n")


def _carries_private_data(r: Report) -> bool:
    """Whether the page shows figures computed from private records (attacks, the audit, private eval figures):
    every page but that of a study that declares its data public (``private_data: false``)."""
    try:
        study = json.loads((r.root / "study.json").read_text()) if r.kind == "study" else {}
    except (OSError, ValueError):
        return True
    return study.get("private_data") is not False


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Render DIR (a study directory or a single run directory) to one self-contained HTML file
    (default DIR/report.html); returns its path. Raises :class:`raydp.errors.ConfigError` (one line) if
    DIR is neither. Written atomically (temp file + rename): never half-written; owner-only (0600) unless the
    study declares its data public."""
    report = load_report(path)
    text = render(report)
    target = Path(out).expanduser() if out is not None else report.root / "report.html"
    # owner-only where it carries private figures (its attack and audit sections are for the data owner)
    atomic_write(target, text, mode=PRIVATE_FILE if _carries_private_data(report) else 0o644)
    return target
