"""``raydp report DIR`` HTML page (raydp.report): a study directory and a single run directory.

Inputs. The run directories are REAL: three tiny in-process DP runs (``run_training``: static seeds 0 and
1, static-pairwise seed 0; embedded-tiny, a few steps), with their real summary.json, eval_metrics,
privacy_ledger and train_metrics. CONSTRUCTED here, and only these:

* a fourth, RLDP trial: a copy of the static-pairwise run directory whose results row says ``rldp`` (SAC
  cell T_RL=4 B_SAC=4 K=2), with a hand-made ``control_trace.parquet`` (RLDP runs need Ray actors: too slow
  for this file; tests/test_study.py runs real ones);
* ``results.parquet``: one row per trial, columns as documented in raydp/study/results.py, filled from each
  run's summary.json; steps_to_target by the real :func:`raydp.study.results.steps_to_target`;
* ``study_summary.json``: the selection block, and the tuning-aware figure computed by the real
  :func:`raydp.study.results.compose_dataset` from the runs' ledgers (plus one constructed warning), and a
  constructed PBT population line;
* ``evaluation.json`` files in the format of the evaluation (see ``evaluation()`` below): static seed 0
  consistent, static seed 1 with an audit lower bound ABOVE its claimed epsilon (must show as a violation),
  the RLDP trial with null membership/extraction sections, static-pairwise without one.

The wide study (``wide_study``): the study as a searched campaign names its arms (experiments/residual-rldp's
deciding studies): a copy of it plus a fifth, REAL trial, clip-schedule with a searched schedule and learning rate
(its results row carries the searched values as ``variant``, the label raydp.study.trial.Trial.variant writes), and
the RLDP row marked as driven by a frozen policy with the schedule's learning rate as its variant. Its long arm
labels are what a new user's page had to lay out.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from raydp.errors import ConfigError

LABEL = ("attack and audit metrics are computed from private records (train, attack split, canaries): not a DP "
         "release, not covered by any accountant; for the data owner only, never for selection (ERRATA E15)")
MODEL = "embedded-tiny"


# -- inputs -----------------------------------------------------------------------------------------
def _train(out: Path, strategy: str, seed: int, **more) -> dict:
    from raydp.config import TrainConfig
    from raydp.runner.run import run_training

    config = TrainConfig(model=MODEL, strategy=strategy, epsilon=2.0, seed=seed, data={"n_records": 400},
                         max_steps=4, eval_every=2, eval_max_records=16, public_eval_records=16, warmup_steps=2,
                         cpus=1, **more)
    return run_training(config, out, progress=False)


def _row(trial: str, run_dir: Path, strategy: str, seed: int, cell: tuple | None = None) -> dict:
    """A results.parquet row (raydp/study/results.py's columns) from a run's summary.json."""
    from raydp.study.results import trial_labels

    s = json.loads((run_dir / "summary.json").read_text())
    p = s["privacy"]
    eps = p["epsilon_by_accountant"]
    t_rl, b_sac, k = cell or (None, None, None)
    return {
        "trial": trial, "status": "TERMINATED", "model": MODEL, "strategy": strategy, "epsilon_target": 2.0,
        "seed": seed, "t_rl": t_rl, "b_sac": b_sac, "k": k, "frozen_policy": False, "run_dir": str(run_dir),
        "trial_seconds": s["wall_seconds"], "config": (run_dir / "config.json").read_text(),
        **{f"{w}_{split}_perplexity": s[f"{w}_{split}_perplexity"]
           for w in ("initial", "final", "best") for split in ("eval", "public")},
        "steps": s["steps"], "planned_steps": p["planned_steps"],
        **{f"epsilon_{a}": eps[a] for a in ("pld", "prv", "rdp", "gdp", "edgeworth")},
        "enforcing_accountant": p["enforcing_accountant"], "within_budget": p["within_budget"],
        "verdict": p["verdict"], "privacy_mode": p.get("privacy_mode") or "strict",
        "privacy_label": None, "privacy_labels": "; ".join(trial_labels(s)) or None,
        "epsilon": p["epsilon"], "guarantee": p["guarantee"], "privacy_unit": p["privacy_unit"],
        "dataset_id": s["dataset_id"], "rdp_curve_source": "ledger", "wall_seconds": s["wall_seconds"],
    }


def evaluation(run_dir: Path, claimed: float, auc: float | None, cp_bound: float, with_extraction: bool = True) -> dict:
    """An evaluation.json in the evaluation's format (/tmp/evaluation_schema.json at the time of writing)."""
    membership = None if auc is None else {
        "n_members": 100, "n_nonmembers": 100, "prompt_fraction": 0.5,
        "loss": {"member_mean_logp": -0.3, "nonmember_mean_logp": -0.31, "member_mean_ppl": 1.35,
                 "nonmember_mean_ppl": 1.36, "auc": auc, "tpr_at_fpr_0.001": 0.002, "tpr_at_fpr_0.01": 0.012,
                 "roc": {"fpr": [0.0, 0.01, 0.1, 0.5, 1.0], "tpr": [0.0, 0.02, 0.15, 0.55, 1.0]}},
        "calibrated": {"reference": "the base model with the adapters disabled", "auc": auc + 0.01,
                       "tpr_at_fpr_0.001": 0.001, "tpr_at_fpr_0.01": 0.011}}
    extraction = None if not with_extraction else {
        "generations": 400, "max_new_tokens": 10, "temperature": 0.7, "top_p": 0.95, "top_k": 50, "prompt": "paper",
        "n_valid": 390, "n_canary": 10, "exact_matches": 0,
        "jaccard": {"1": {"mean": 0.12, "std": 0.08}, "2": {"mean": 0.01, "std": 0.02},
                    "3": {"mean": 0.0005, "std": 0.005}, "4": {"mean": 0.0, "std": 0.0}}}
    return {
        "format": 1, "label": LABEL, "run_dir": str(run_dir),
        "claimed": {"strategy": "static", "epsilon": claimed, "epsilon_target": 2.0, "delta": 1e-5,
                    "accountant": "pld", "privacy_unit": "patient", "labels": [], "within_budget": True},
        "membership": membership, "extraction": extraction,
        "exposure": {"candidates": 1000, "space_bits": 51.7, "max_measurable_bits": 9.97, "per_canary": [1.2, 0.4],
                     "mean": 0.8, "max": 1.2},
        "audit": {"m": 200, "n_included": 97, "delta": 1e-5, "confidence": 0.95, "score": "log p difference",
                  "epsilon_one_run": cp_bound, "one_run_guesses": 20, "one_run_correct": 11,
                  "epsilon_clopper_pearson": cp_bound / 2, "claimed_epsilon": claimed,
                  "consistent": cp_bound <= claimed},
        "seconds": {"membership": 1.0, "extraction": 2.0, "exposure": 1.0, "audit": 1.0, "total": 5.0},
        "train_loop_seconds": 10.0, "cost_ratio": 0.5,
    }


@pytest.fixture(scope="module")
def study(tmp_path_factory, raydp_cache) -> Path:
    from raydp.privacy.ledger import PrivacyLedger
    from raydp.study.results import compose_dataset, run_rdp_curve, steps_to_target

    root = tmp_path_factory.mktemp("report") / "teststudy"
    trials = root / "trials"
    names = {"static0": f"static_{MODEL}_eps2_seed0", "static1": f"static_{MODEL}_eps2_seed1",
             "pairwise": f"static-pairwise_{MODEL}_eps2_seed0", "rldp": f"rldp_{MODEL}_eps2_seed0_trl4-b4-k2"}
    _train(trials / names["static0"], "static", 0)
    _train(trials / names["static1"], "static", 1)
    _train(trials / names["pairwise"], "static-pairwise", 0)
    # constructed RLDP trial (see the module docstring)
    rldp_dir = trials / names["rldp"]
    shutil.copytree(trials / names["pairwise"], rldp_dir)
    ledger = pd.read_parquet(rldp_dir / "privacy_ledger.parquet", columns=["step", "sigma_eff", "clip"])
    clips = np.stack(ledger["clip"].to_numpy())
    pd.DataFrame({"step": ledger["step"] + 1, "sigma": ledger["sigma_eff"], "sigma_eff": ledger["sigma_eff"],
                  "clamped": False, "decision": [False, True, False, True][: len(ledger)],
                  **{f"clip_{j}": clips[:, j] for j in range(clips.shape[1])}}).to_parquet(
        rldp_dir / "control_trace.parquet")

    rows = [_row(names["static0"], trials / names["static0"], "static", 0),
            _row(names["static1"], trials / names["static1"], "static", 1),
            _row(names["pairwise"], trials / names["pairwise"], "static-pairwise", 0),
            _row(names["rldp"], rldp_dir, "rldp", 0, (4.0, 4.0, 2.0))]
    table = pd.DataFrame(rows)
    table["steps_to_target"] = steps_to_target(table, "public")
    table["selection_split"] = "public"
    table.to_parquet(root / "results.parquet")

    runs = []
    for name in names.values():
        summary = json.loads((trials / name / "summary.json").read_text())
        curve, source = run_rdp_curve(summary, PrivacyLedger.load(trials / name / "privacy_ledger.parquet"))
        runs.append({"name": name, "kind": "trial", "curve_source": source, "curve": curve, "epsilon_target": 2.0,
                     "labels": [], "privacy_unit": summary["privacy"]["privacy_unit"]})
    sha = rows[0]["dataset_id"]
    figure = compose_dataset(sha, runs, 1e-5, warnings=["constructed warning: shown on the page"])
    (root / "study_summary.json").write_text(json.dumps({
        "study": "teststudy", "trials": 4, "wall_seconds": 12.0,
        "selection": {"requested": "public", "split": "public",
                      "note": "selection used the public validation split (E15)"},
        "tuning_aware_epsilon": {sha: figure},
        "pbt_population": {"members": 4, "exploits": 2, "population_epsilon": 1.875, "delta": 1e-5,
                           "within_budget": True}}))

    claimed = {k: json.loads((trials / n / "summary.json").read_text())["privacy"]["epsilon"] for k, n in names.items()}
    for key, auc, bound, extraction in (("static0", 0.51, 0.0, True), ("static1", 0.55, claimed["static1"] + 1.0, True),
                                        ("rldp", None, 0.1, False)):
        (trials / names[key] / "evaluation.json").write_text(
            json.dumps(evaluation(trials / names[key], claimed[key], auc, bound, extraction)))
    return root


#: a searched clip schedule and learning rate, as trials/tuned/schedule-search.json records them (rounded)
SCHEDULE = {"clip": 0.014422366502531475, "clip_end": 0.0708851658645352, "depth_tilt": 1.8224239591076814}
SEARCHED_LR = 0.009049911227773816


@pytest.fixture(scope="module")
def wide_study(study, tmp_path_factory) -> Path:
    """The study with a campaign's long arm labels (see the module docstring)."""
    from raydp.study.results import steps_to_target

    root = tmp_path_factory.mktemp("wide") / "widestudy"
    shutil.copytree(study, root)
    name = f"clip-schedule_{MODEL}_eps2_seed0_clip0.0144-clipend0.0709-depthtilt1.82"
    run = root / "trials" / name
    _train(run, "clip-schedule", 0, settings=SCHEDULE, lr=SEARCHED_LR, lr_decay="cosine")
    table = pd.read_parquet(root / "results.parquet")
    table["run_dir"] = [str(root / "trials" / t) for t in table["trial"]]  # this copy's trials
    table["variant"] = None
    lr = f"lr={SEARCHED_LR:.4g}, lr_decay=cosine"
    rldp = table["strategy"] == "rldp"
    table.loc[rldp, "variant"], table.loc[rldp, "frozen_policy"] = lr, True
    row = {**_row(name, run, "clip-schedule", 0), "selection_split": "public",
           "variant": ", ".join(f"{k}={v:.4g}" for k, v in SCHEDULE.items()) + ", " + lr}
    table = pd.concat([table, pd.DataFrame([row])], ignore_index=True)
    table["steps_to_target"] = steps_to_target(table, "public")
    table.to_parquet(root / "results.parquet")
    return root


# -- reading the page -------------------------------------------------------------------------------
class Page(HTMLParser):
    """The page's ids, tables (id -> rows of cell texts and classes), figures and visible text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.ids: dict[str, str] = {}
        self.tables: dict[str, list[list[tuple[str, str]]]] = {}
        self.figures: dict[str, dict] = {}
        self.paragraphs: list[tuple[str, str]] = []  # (class, text)
        self._table = self._row = self._cell = self._figure = self._p = None
        self._caption = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a and self._figure is None:
            assert a["id"] not in self.ids, f"duplicate id {a['id']}"
            self.ids[a["id"]] = tag
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
            self.tables[self._table].append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ([], a.get("class") or "")
        elif tag == "figure":
            self._figure = a["id"]
            self.figures[self._figure] = {"svg": 0, "data_paths": 0, "caption": ""}
        elif self._figure is not None:
            f = self.figures[self._figure]
            if tag == "svg":
                f["svg"] += 1
            elif tag == "path" and len(re.findall(r"\bL\b", a.get("d", ""))) >= 2:
                f["data_paths"] += 1  # a polyline of 3+ points: a plotted curve, a band or a bar outline
            elif tag == "figcaption":
                self._caption = True
        elif tag == "p":
            self._p = ([], a.get("class") or "")

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(("".join(self._cell[0]).strip(), self._cell[1]))
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "figcaption":
            self._caption = False
        elif tag == "figure":
            self._figure = None
        elif tag == "p" and self._p is not None:
            self.paragraphs.append((self._p[1], "".join(self._p[0]).strip()))
            self._p = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0].append(data)
        if self._p is not None:
            self._p[0].append(data)
        if self._caption:
            self.figures[self._figure]["caption"] += data

    def rows(self, table_id: str) -> list[list[str]]:
        return [[text for text, _ in row] for row in self.tables[table_id]]

    def row_of(self, table_id: str, first: str) -> list[tuple[str, str]]:
        matches = [row for row in self.tables[table_id] if row and row[0][0] == first]
        assert len(matches) == 1, (table_id, first, self.rows(table_id))
        return matches[0]

    def text(self, cls: str) -> list[str]:
        return [t for c, t in self.paragraphs if cls in c.split()]


def _self_contained(text: str) -> None:
    assert "<script" not in text and "<link" not in text and "<img" not in text and "<?xml" not in text
    assert "http://" not in text and "https://" not in text and "src=" not in text


def _data_figure(page: Page, fid: str) -> None:
    f = page.figures[fid]
    assert f["svg"] == 1 and f["data_paths"] >= 1 and f["caption"].strip(), (fid, f)


# -- tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study_page(study) -> tuple[Path, str]:
    from raydp.report import write_report

    out = write_report(study)
    assert out == study / "report.html"
    return out, out.read_text()


def test_study_page_has_every_section_with_real_numbers(study, study_page):
    out, text = study_page
    _self_contained(text)
    assert str(study.parent) not in text  # no absolute path of the machine that ran it
    for summary in study.glob("trials/*/summary.json"):
        assert str(study.parent) not in summary.read_text() and "/.cache/" not in summary.read_text()
    page = Page(text)
    for sid in ("sec-overview", "sec-utility", "sec-dials", "sec-tables", "sec-privacy", "sec-attacks", "sec-audit"):
        assert page.ids[sid] == "section"
    for tid in ("table-overview", "table-seeds", "table2", "table3", "table-privacy", "table-tuning",
                "table-membership", "table-extraction", "table-audit"):
        assert page.ids[tid] == "table" and len(page.tables[tid]) >= 2, tid
    for fid in ("fig-utility", "fig-dials-1", "fig-dials-2", "fig-dials-3", "fig-tuning-1", "fig-attacks", "fig-roc",
                "fig-audit"):
        assert page.ids[fid] == "figure"
        _data_figure(page, fid)
    assert "fig-dials-4" not in page.ids  # one dial per (epsilon, strategy): static, static-pairwise, rldp
    assert len(re.findall(r"How to read this:", text)) >= 7

    results = pd.read_parquet(study / "results.parquet").set_index("trial")
    static = results[results["strategy"] == "static"]["final_public_perplexity"].to_numpy()
    seeds = {row[2]: row for row in page.rows("table-seeds")[1:]}
    assert seeds["static"][3] == "2/2"
    assert seeds["static"][4] == f"{static.mean():.4f} ± {static.std(ddof=1):.4f}"
    pairwise = results[results["strategy"] == "static-pairwise"].iloc[0]
    assert seeds["static-pairwise"][4] == f"{pairwise['final_public_perplexity']:.4f}"
    assert "rldp T_RL=4 B_SAC=4 K=2" in seeds
    assert page.rows("table2")[1][3] == "T_RL=4 B_SAC=4 K=2"

    for trial, row in results.iterrows():  # every accountant's epsilon, 3 decimals
        cells = [c for c, _ in page.row_of("table-privacy", trial)]
        for a in ("pld", "prv", "rdp", "gdp", "edgeworth"):
            assert f"{row[f'epsilon_{a}']:.3f}" in cells
        assert "yes" in cells and "patient" in cells
    summary = json.loads((study / "study_summary.json").read_text())
    tuning = next(iter(summary["tuning_aware_epsilon"].values()))
    assert f"{tuning['tuning_aware_epsilon']:.3f}" in page.rows("table-tuning")[1]
    assert any("constructed warning: shown on the page" in t for t in page.text("warn"))
    assert any(t.startswith("PBT population: 4 members") and "1.875" in t for c, t in page.paragraphs)
    assert "selection used the public validation split (E15)" in page.rows("table-overview")[-2]


def test_attacks_are_summarised_over_seeds_with_the_label(study_page):
    page = Page(study_page[1])
    assert LABEL in page.text("label-box")
    membership = {row[2]: row for row in page.rows("table-membership")[1:]}
    assert set(membership) == {"static"}  # the RLDP evaluation has no membership section
    assert membership["static"][3] == "2"
    assert membership["static"][4] == f"{np.mean([0.51, 0.55]):.3f} ± {np.std([0.51, 0.55], ddof=1):.3f}"
    assert membership["static"][7] == f"{np.mean([0.52, 0.56]):.3f} ± {np.std([0.52, 0.56], ddof=1):.3f}"
    extraction = {row[2]: row for row in page.rows("table-extraction")[1:]}
    assert extraction["static"][6] == "0.1200 ± 0.0000" and extraction["static"][12] == "9.97"
    assert extraction["rldp T_RL=4 B_SAC=4 K=2"][6] == "n/a"  # extraction null: exposure only
    assert extraction["rldp T_RL=4 B_SAC=4 K=2"][10] == "0.80"
    assert any("1 of 4 trials have no evaluation.json" in t for t in page.text("missing"))


def test_an_audit_bound_above_the_claim_is_a_violation_for_that_trial_only(study, study_page):
    page = Page(study_page[1])
    verdicts = {row[0][0]: row[-1] for row in page.tables["table-audit"][1:]}
    bad = "static_embedded-tiny_eps2_seed1"
    assert verdicts[bad] == ("VIOLATION: bug", "violation")
    assert all(v == ("not refuted", "ok") for t, v in verdicts.items() if t != bad) and len(verdicts) == 3
    claimed = json.loads((study / "trials" / bad / "summary.json").read_text())["privacy"]["epsilon"]
    row = [c for c, _ in page.row_of("table-audit", bad)]
    assert row[3] == f"{claimed:.3f}" and row[4].startswith(f"{claimed + 1.0:.3f}")  # the one-run bound
    assert row[5] == f"{(claimed + 1.0) / 2:.3f}"  # Clopper-Pearson, for comparison only
    assert sum("VIOLATION: bug" in t for t in page.text("violation")) == 1
    assert ">VIOLATION: bug</text>" in study_page[1]  # annotated in the audit figure too


def test_single_run_page_and_missing_evaluation(study):
    from raydp.report import write_report

    run = study / "trials" / "static-pairwise_embedded-tiny_eps2_seed0"
    out = write_report(run)
    assert out == run / "report.html"
    text = out.read_text()
    _self_contained(text)
    page = Page(text)
    summary = json.loads((run / "summary.json").read_text())
    for fid in ("fig-utility", "fig-dials-1"):
        _data_figure(page, fid)
    assert "fig-dials-2" not in page.ids and "table3" not in page.ids and "table-audit" not in page.ids
    # the benchmark's metric: the value-token NLL (nats per record) where the run reports it
    assert page.rows("table-seeds")[1][4] == f"{summary.get('final_public_value_nll', summary['final_public_perplexity']):.4f}"
    assert f"{summary['privacy']['epsilon_by_accountant']['pld']:.3f}" in page.rows("table-privacy")[1]
    missing = page.text("missing")
    assert sum("no trial has an evaluation: run `raydp eval RUN_DIR` or set `evaluate:` in the study file" in t
               for t in missing) == 2  # attacks and audit
    assert any("single run" in t for t in missing)  # no tuning-aware figure
    assert "2 clip radius(es)" in page.figures["fig-dials-1"]["caption"]  # one per adapter pair
    # the privacy spent over steps, at the delta of the run's summary (a lone run's row has no config)
    assert (f"privacy spent over steps: the enforcing accountant's (PLD) epsilon, {summary['privacy']['epsilon']:.3f}"
            in page.figures["fig-dials-1"]["caption"])
    assert "value-token NLL (nats/record) vs step" in page.figures["fig-utility"]["caption"]


def test_a_directory_that_is_neither_raises_one_line_and_writes_nothing(tmp_path):
    from raydp.report import write_report

    (tmp_path / "some.txt").write_text("x")
    for bad in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ConfigError) as info:
            write_report(bad)
        assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["some.txt"]


def test_a_failed_write_leaves_nothing_behind(study, tmp_path, monkeypatch):
    import raydp.report.page as page

    out = tmp_path / "r.html"
    out.write_text("previous report")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)  # the one durable-write helper renames (raydp.files)
    with pytest.raises(OSError, match="disk full"):
        page.write_report(study, out)
    assert out.read_text() == "previous report"  # the old page survives, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temp file left

    monkeypatch.undo()
    monkeypatch.setattr(page, "render", lambda r: (_ for _ in ()).throw(RuntimeError("render failed")))
    with pytest.raises(RuntimeError):
        page.write_report(study, tmp_path / "new.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def _chromium() -> str | None:
    return shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


#: run in the browser after the page loads: per figure, whether it is laid out visibly and how many of its data
#: paths (3+ points, as :class:`Page` counts them) the browser drew with a non-empty box
BROWSER_CHECK = """<script>
window.addEventListener('load', () => {
  const out = {};
  for (const id of %s) {
    const fig = document.getElementById(id);
    if (!fig) { out[id] = null; continue; }
    const box = fig.getBoundingClientRect();
    const drawn = [...fig.querySelectorAll('svg path')].filter(p => {
      if ((p.getAttribute('d') || '').split(/\\bL\\b/).length < 3) return false;
      const b = p.getBBox(); return (b.width > 1 || b.height > 1) && getComputedStyle(p).visibility !== 'hidden';
    }).length;
    out[id] = {visible: getComputedStyle(fig).display !== 'none' && box.width > 100 && box.height > 50, drawn};
  }
  const pre = document.createElement('pre'); pre.id = 'browser-check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _in_browser(text: str, script: str, tmp_path: Path, width: int = 1400) -> dict:
    """What ``script`` measured in a COPY of the page as headless Chromium lays it out at ``width`` px (the page
    itself has no script): the script writes JSON into ``<pre id="browser-check">``, read back from the DOM
    Chromium dumps. Skips without Chromium."""
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed: the page was not checked in a browser")
    page = tmp_path / "checked.html"
    page.write_text(text.replace("</body>", script + "</body>"))
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--hide-scrollbars", f"--user-data-dir={tmp_path / 'dom-profile'}",
                          f"--window-size={width},4000", "--virtual-time-budget=5000", "--dump-dom",
                          page.resolve().as_uri()],
                         timeout=120, capture_output=True, text=True, check=False).stdout
    found = re.search(r'<pre id="browser-check">(.*?)</pre>', dom, re.S)
    assert found, "the browser did not run the page's check"
    return json.loads(html.unescape(found.group(1)))


def _drawn_in_browser(text: str, ids: list[str], tmp_path: Path) -> dict:
    """Each figure's layout and drawn paths as headless Chromium renders the page (skips without Chromium)."""
    return _in_browser(text, BROWSER_CHECK % json.dumps(ids), tmp_path)


#: run in the browser after the page loads: per figure, the boxes (left, top, right, bottom in CSS px) of its SVG,
#: of every legend entry's text (matplotlib's legend groups, a figure's or an axes') and of every panel title (a
#: text of an axes group itself, not of its axis, legend or lines, that lies above the axes' plotting area:
#: matplotlib draws the title there), and every other text of it (tick labels, axis labels, a figure's title);
#: per table, its box and the width of the box it sits in; the page's width
GEOMETRY_CHECK = """<script>
window.addEventListener('load', () => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const out = {page: document.documentElement.clientWidth, figures: {}, tables: {}};
  for (const fig of document.querySelectorAll('figure')) {
    const svg = fig.querySelector('svg');
    if (!svg) continue;
    const titles = [];
    for (const axes of svg.querySelectorAll('g[id*="-axes_"]')) {
      const patch = axes.querySelector(':scope > g[id*="-patch_"]');
      if (!patch) continue;
      const top = patch.getBoundingClientRect().top;
      for (const t of axes.querySelectorAll(':scope > g[id*="-text_"] text')) {
        const b = box(t);
        if (t.textContent.trim() && b[3] <= top + 1) titles.push({text: t.textContent, box: b});
      }
    }
    out.figures[fig.id] = {svg: box(svg), titles,
      legend: [...svg.querySelectorAll('g[id*="-legend_"] text')].map(t => ({text: t.textContent, box: box(t)})),
      texts: [...svg.querySelectorAll('text')].map(t => ({text: t.textContent, box: box(t)}))};
  }
  for (const table of document.querySelectorAll('table')) {
    out.tables[table.id || table.parentElement.id] = {box: box(table), container: table.parentElement.clientWidth};
  }
  const pre = document.createElement('pre'); pre.id = 'browser-check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _inside(inner: list[float], outer: list[float], slack: float = 1.0) -> bool:
    return (inner[0] >= outer[0] - slack and inner[1] >= outer[1] - slack and inner[2] <= outer[2] + slack
            and inner[3] <= outer[3] + slack)


def _overlap(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    return min(a[2], b[2]) - max(a[0], b[0]) > slack and min(a[3], b[3]) - max(a[1], b[1]) > slack


def test_the_page_renders_in_a_browser(study_page, tmp_path):
    """The page as a browser shows it: a screenshot that is not blank, and the figures (ROC, the dials with the
    privacy spent over steps, utility) laid out and drawn."""
    figures, source = ("fig-utility", "fig-roc", "fig-dials-1", "fig-attacks"), Page(study_page[1])
    for fid, state in _drawn_in_browser(study_page[1], list(figures), tmp_path).items():
        # every curve, band and bar outline in the page's source is drawn by the browser
        assert state is not None and state["visible"] and state["drawn"] == source.figures[fid]["data_paths"] >= 1, \
            (fid, state)
    chromium = _chromium()
    import matplotlib.image

    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,4000", f"--screenshot={shot}",
                    study_page[0].resolve().as_uri()], timeout=60, capture_output=True, check=False)
    assert shot.exists() and shot.stat().st_size > 10_000
    image = matplotlib.image.imread(shot)[::4, ::4, :3]
    colours = np.unique((image.reshape(-1, 3) * 255).astype(np.uint8), axis=0)
    assert len(colours) > 50  # text, tables, coloured curves: not a blank page
    assert (image.min(axis=2) < 0.9).mean() > 0.02  # a fair share of non-white pixels


def test_frontier_figure_and_privacy_spent_over_steps(study, tmp_path):
    """The frontier (a second epsilon added to a copy of the study) and, in each dials figure, the epsilon spent over
    steps: the enforcing accountant's (PLD), which ends at the run's enforced figure, beside the RDP bound of the same
    ledger, which ends at the run's own RDP figure."""
    from raydp.report import write_report
    from raydp.report.curves import _enforced_over_steps
    from raydp.report.page import _epsilon_over_steps

    copy = tmp_path / "teststudy"
    shutil.copytree(study, copy)
    table = pd.read_parquet(copy / "results.parquet")
    more = table[table["strategy"] == "static"].copy()
    more["epsilon_target"] = 8.0
    more["trial"] = more["trial"].str.replace("eps2", "eps8")
    pd.concat([table, more], ignore_index=True).to_parquet(copy / "results.parquet")
    page = Page(write_report(copy).read_text())
    _data_figure(page, "fig-frontier-1")
    assert "against the target epsilon" in page.figures["fig-frontier-1"]["caption"]
    if _chromium() is not None:  # and drawn, as a browser shows it
        state = _drawn_in_browser((copy / "report.html").read_text(), ["fig-frontier-1"], tmp_path)["fig-frontier-1"]
        assert state is not None and state["visible"], state
        assert state["drawn"] == page.figures["fig-frontier-1"]["data_paths"] >= 2, state

    run = study / "trials" / f"static_{MODEL}_eps2_seed0"
    summary = json.loads((run / "summary.json").read_text())
    ledger = pd.read_parquet(run / "privacy_ledger.parquet").sort_values("step")
    steps, spent = _epsilon_over_steps(ledger, {"delta": summary["privacy"]["delta"]})
    assert steps[-1] == len(ledger) and (np.diff(spent) >= 0).all()
    assert spent[-1] == pytest.approx(summary["privacy"]["epsilon_by_accountant"]["rdp"], rel=1e-3)
    privacy = summary["privacy"]
    assert privacy["enforcing_accountant"] == "pld"
    steps, enforced = _enforced_over_steps(ledger, "pld", privacy["epsilon_target"], privacy["delta"])
    assert steps[-1] == len(ledger) and (np.diff(enforced) >= 0).all()
    assert enforced[-1] == pytest.approx(privacy["epsilon"], rel=1e-9)  # the run's guarantee, as its guard computed it
    assert enforced[-1] <= privacy["epsilon_target"] < spent[-1]  # within budget; the RDP bound alone reads as over
    caption = page.figures["fig-dials-1"]["caption"]
    assert (f"privacy spent over steps: the enforcing accountant's (PLD) epsilon, {privacy['epsilon']:.3f} at the end"
            in caption and f"the RDP upper bound of the same ledger, {spent[-1]:.3f}" in caption)


def test_legends_titles_and_tables_fit_at_1280_px(wide_study, tmp_path):
    """The page of a campaign with long arm labels as a new user's browser lays it out at 1,280 px: every legend
    entry lies inside its figure's SVG (an entry outside it is cut off), no two panel titles of a figure overlap and
    none leaves its SVG (nor any other text of a figure), and no table is wider than the box it sits in or the page
    (it would scroll, and print cut)."""
    from raydp.report import write_report

    text = write_report(wide_study).read_text()
    found = _in_browser(text, GEOMETRY_CHECK, tmp_path, width=1280)
    page, figures, tables = found["page"], found["figures"], found["tables"]
    assert 1200 <= page <= 1280 and {"fig-utility", "fig-dials-1", "fig-audit"} <= set(figures), found
    assert len(figures["fig-utility"]["legend"]) >= 4  # static, static-pairwise, rldp, clip-schedule
    cut, titled = [], 0
    for fid, f in figures.items():
        cut += [(fid, "legend", e["text"], e["box"], f["svg"]) for e in f["legend"] if not _inside(e["box"], f["svg"])]
        cut += [(fid, "title", t["text"], t["box"], f["svg"]) for t in f["titles"] if not _inside(t["box"], f["svg"])]
        cut += [(fid, "titles overlap", a["text"], b["text"]) for i, a in enumerate(f["titles"])
                for b in f["titles"][i + 1:] if _overlap(a["box"], b["box"])]
        cut += [(fid, "text", t["text"], t["box"], f["svg"]) for t in f["texts"] if not _inside(t["box"], f["svg"])]
        titled += bool(f["titles"])
    assert titled == len(figures), {fid: f["titles"] for fid, f in figures.items()}  # every figure's titles found
    assert not cut, cut
    wide = {tid: t for tid, t in tables.items() if t["box"][2] - t["box"][0] > t["container"] + 1 or t["box"][2] > page}
    assert len(tables) >= 9 and not wide, (page, wide)


def test_a_campaigns_page_names_arms_short_and_says_what_it_draws(wide_study):
    """The wide study's page: short arm names in the legend and the tables, each arm's settings in the arms table;
    the utility caption names the frozen-policy RLDP arm it draws; the clip schedule's dials say that its settings
    are relative to each pair's public median norm (and what they are in absolute radii)."""
    from raydp.report import write_report

    text = write_report(wide_study).read_text()
    page = Page(text)
    schedule = next(row for row in page.rows("table-arms")[1:] if row[0] == "clip-schedule")
    assert schedule[2] == "clip=0.01442, clip_end=0.07089, depth_tilt=1.822, lr=0.00905, lr_decay=cosine"
    assert schedule[5].startswith("relative: clip and clip_end multiply r_i")
    rldp = next(row for row in page.rows("table-arms")[1:] if row[1] == "rldp")
    assert rldp[0] == "rldp T_RL=4 B_SAC=4 K=2 (frozen policy)" and rldp[2] == "lr=0.00905, lr_decay=cosine"
    assert {row[2] for row in page.rows("table-seeds")[1:]} == {"static", "static-pairwise", "clip-schedule",
                                                                  "rldp T_RL=4 B_SAC=4 K=2 (frozen policy)"}
    legend = re.search(r'<figure id="fig-utility">.*?</figure>', text, re.S).group(0)
    assert "clip-schedule</text>" in legend and "lr_decay" not in legend  # short names; settings stay out
    caption = page.figures["fig-utility"]["caption"]
    assert "No RLDP trials" not in caption and "frozen policy" in caption and "arms table" in caption

    dials = next(f["caption"] for f in page.figures.values() if "· clip-schedule [clip=0.01442" in f["caption"])
    summary = json.loads(next(wide_study.glob("trials/clip-schedule_*/summary.json")).read_text())
    norms = summary["privacy"]["strategy"]["public_reference_norms"]
    assert "clip and clip_end multiply r_i, each adapter pair's median per-sample gradient norm on public records" \
        in dials and f"r_i here: {norms[0]:.4g}, {norms[1]:.4g}" in dials
    ledger = pd.read_parquet(next(wide_study.glob("trials/clip-schedule_*/privacy_ledger.parquet")))
    clips = np.stack(ledger["clip"].to_numpy())
    assert f"clip radii (absolute) {clips.min():.4f} to {clips.max():.4f}" in dials
    assert clips.max() < SCHEDULE["clip"]  # the radii are r_i times the settings, not the settings


def test_the_audit_says_how_many_canaries_could_show_anything(study_page):
    """The audit's power table: for the fixture's setting (claimed epsilon, 200 canaries), the best one-run bound
    with every guess right and with the strongest attack the claim allows, and the canaries each needs for half the
    claimed epsilon, checked against the audit's own bound (raydp.evaluation.audit): reached there, not one
    canary before."""
    from raydp.evaluation.audit import _one_run_bound, one_run_guess_grid
    from raydp.report.audit import audit_power

    page = Page(study_page[1])
    rows = page.rows("table-audit-power")
    assert len(rows) == 2, rows  # one setting: every audited trial claims the same epsilon with 200 canaries
    claimed, m, delta, confidence, zero = rows[1][:5]
    assert (m, delta, confidence, zero) == ("200", "1e-05", "0.95", "1 of 3")  # static seed 0's bound is 0

    def bound(m: int, eps: float, rate: float) -> float:  # the audit's own: max over its grid, Bonferroni
        grid = one_run_guess_grid(m)
        return max(_one_run_bound(m, kp + km, int((kp + km) * rate + 1e-12), 0.05 / len(grid), 1e-5) for kp, km in grid)

    eps = float(claimed)
    power = audit_power(eps, 200, 1e-5, 0.95)
    strongest = np.exp(eps) / (1 + np.exp(eps))
    assert rows[1][5:] == [f"{power.perfect:.3f}", f"{power.strongest:.3f}", f"{power.canaries_perfect:,}",
                           f"{power.canaries_strongest:,}"]
    assert power.perfect == pytest.approx(bound(200, eps, 1.0), abs=1e-5)
    assert power.strongest == pytest.approx(bound(200, eps, strongest), abs=1e-5)
    for n, rate in ((power.canaries_perfect, 1.0), (power.canaries_strongest, strongest)):
        assert bound(n, eps, rate) >= eps / 2 > bound(n - 1, eps, rate), (n, rate)


def test_a_stopped_studys_page_says_it_is_partial(study, tmp_path):
    """A stopped study's page showed its finished trials without saying the study was partial."""
    from raydp.report import write_report

    stopped = tmp_path / "stopped"
    shutil.copytree(study, stopped)
    summary = json.loads((stopped / "study_summary.json").read_text())
    (stopped / "study_summary.json").write_text(json.dumps({**summary, "unfinished_trials": 2}))
    assert "PARTIAL: the study was stopped" in write_report(stopped).read_text()
    assert "PARTIAL" not in write_report(study, tmp_path / "whole.html").read_text()
