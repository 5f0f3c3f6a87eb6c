"""``raydp report DIR``: one self-contained HTML page for a study directory or a single run directory.

The page has no script, no stylesheet link and no external URL: CSS is inline and every figure is an
inline SVG drawn by matplotlib (:mod:`raydp.report.figures`). Sections (ids in brackets; a test finds them):

1. overview [``table-overview``, ``table-arms``]: name, trials and statuses, dataset identity, privacy units,
   labels and the selection note (ERRATA E15); the arms: the short name every figure and table gives an arm, and
   the settings it leaves out.
2. utility curves [``fig-utility``]: RLDP paper Fig. 1-4 analogues; per (model, epsilon) the selection
   split's perplexity over steps, mean over seeds with a min-max band per strategy.
3. dials [``fig-dials-N``]: Fig. 5-8 analogues; per (model, epsilon, strategy), first seed: clip radius
   per adapter pair and sigma_eff from the privacy ledger, and the privacy spent over steps as the run's enforcing
   accountant counts it (at most :data:`raydp.report.curves.MAX_DIALS` figures).
4. tables [``table-seeds``, ``table2``, ``table3``]: final perplexity mean +- std over seeds, and the
   paper's Table 2 / Table 3 analogues (:func:`raydp.study.statistics.table2` / ``table3``).
5. privacy [``table-privacy``, ``table-tuning``, ``fig-tuning-N``]: every accountant's epsilon per trial,
   the tuning-aware epsilon per dataset (ERRATA E7/E14), the PBT population's figure.
6. attacks [``table-membership``, ``table-extraction``, ``fig-attacks``]: Tables 4-9 analogues from each
   trial's ``evaluation.json`` (computed from private records: not a DP release).
7. audit [``table-audit``, ``fig-audit``, ``table-audit-power``]: claimed epsilon beside the empirical lower
   bounds; a lower bound above the claim is a bug and is shown as "VIOLATION: bug"; what an audit of as many
   canaries could show at that epsilon at best, and how many canaries it would need to show half of it.

Inputs are read, never changed; the page is written atomically (temp file + rename).

Modules: :mod:`raydp.report.load` (the inputs), :mod:`raydp.report.markup` (HTML pieces and the CSS),
:mod:`raydp.report.curves` (utility, dials, frontier), :mod:`raydp.report.sections` (overview, tables, privacy,
attacks), :mod:`raydp.report.audit` (the audit section) and :mod:`raydp.report.figures` (the SVGs); this module
assembles the page and writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from raydp.files import PRIVATE_FILE, atomic_write
from raydp.report import figures
from raydp.report.audit import audit
from raydp.report.curves import _epsilon_over_steps, dials, utility
from raydp.report.load import Report, _single_run, _with_arms, load_report
from raydp.report.markup import CSS, _e
from raydp.report.sections import attacks, overview, privacy, tables
from raydp.study.results import CONTROLLERS, NONPRIVATE_ARMS

#: importable from here as before the page was split into modules
__all__ = ["Report", "load_report", "render", "write_report", "_epsilon_over_steps", "_single_run", "_with_arms"]


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
