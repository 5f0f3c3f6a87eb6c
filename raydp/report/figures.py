"""The report's figures: matplotlib (Agg, no pyplot state) rendered to inline SVG strings.

Each function takes plain data (numbers, labels) prepared by the page's sections (:mod:`raydp.report.page`) and
returns the ``<svg>`` element of one figure: no XML prolog, no metadata, no namespace URL, and element ids prefixed
with the figure's id so that several figures can share one HTML page without id clashes. Text stays text
(``svg.fonttype: none``), so the page is searchable and small.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg", force=False)  # never opens a window; the report is written headless

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator, ScalarFormatter  # noqa: E402

from raydp.strategies.registry import STRATEGY_CHOICES, is_private, with_capability  # noqa: E402

STYLE = {
    "svg.fonttype": "none",
    "svg.hashsalt": "raydp-report",  # stable ids: the same inputs give the same page
    "font.family": ["DejaVu Sans", "sans-serif"],
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "legend.fontsize": 8.5,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
}

#: strategies with a fixed colour, by capability: controllers red, the non-private reference grey (the rest cycle
#: through the palette in order of appearance)
FIXED_COLOURS = {**{name: "#d62728" for name in with_capability(STRATEGY_CHOICES, "controller")},
                 **{name: "#7f7f7f" for name in STRATEGY_CHOICES if not is_private(name)}}
PALETTE = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#393b79", "#637939", "#8c6d31", "#843c39"]


def strategy_colours(strategies: Sequence[str], strategy_of: Mapping[str, str] | None = None) -> dict[str, str]:
    """One colour per strategy or arm, stable across the page's figures; ``strategy_of`` maps an arm's label to
    its strategy (a controller's arms and the non-private arm keep their strategy's fixed colour)."""
    colours, i = {}, 0
    for name in strategies:
        if name in colours:
            continue
        base = (strategy_of or {}).get(name, name)
        if base in FIXED_COLOURS:
            colours[name] = FIXED_COLOURS[base]
        else:
            colours[name] = PALETTE[i % len(PALETTE)]
            i += 1
    return colours


def to_svg(fig: Figure, prefix: str) -> str:
    """The figure as an inline ``<svg>`` element (ids prefixed with ``prefix``)."""
    buffer = io.StringIO()
    with matplotlib.rc_context(STYLE):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]  # strip the XML prolog and DOCTYPE
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    text = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", text)  # inline SVG in HTML needs no namespace URL
    text = text.replace("xlink:href=", "href=")
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', text)
    text = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}-{m.group(1)}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}-{m.group(1)})", text)
    return text.strip()


def _figure(width: float, height: float) -> Figure:
    with matplotlib.rc_context(STYLE):
        return Figure(figsize=(width, height), layout="constrained")


def _plain_y(ax) -> None:
    """Tick labels as plain numbers (perplexities differ in the 3rd decimal: no '+1.39' offset)."""
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)


#: the average advance of a DejaVu Sans character, in ems (digits and lower case; capitals are wider): how the
#: figures estimate a text's width before matplotlib lays it out
CHAR_EM = 0.62


def _fit(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped into lines that fit ``width_in`` inches at ``fontsize`` points (a title or a legend entry
    wider than its room would be cut at the SVG's edge or run into its neighbour)."""
    chars = max(8, int(width_in * 72 / (fontsize * CHAR_EM)))
    return "\n".join(textwrap.wrap(text, chars, break_on_hyphens=False)) or text


def _legend(fig: Figure, handles: list, labels: list[str], width_in: float, fontsize: float) -> None:
    """A figure legend below the axes, inside the figure: as many columns as the longest entry allows across
    ``width_in`` inches, wrapping to more rows (an entry longer than the whole width wraps onto lines of its own)."""
    em = fontsize / 72
    labels = [_fit(label, width_in - 5 * em, fontsize) for label in labels]
    longest = max(max(len(line) for line in label.split("\n")) for label in labels)
    entry = (longest * CHAR_EM + 2.0 + 0.8 + 2.0) * em  # text, handle, handle padding, column spacing
    ncol = max(1, min(len(labels), int(width_in / entry)))
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False, fontsize=fontsize)


# -- utility curves ---------------------------------------------------------------------------------
@dataclass
class Series:
    label: str
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray | None = None  # min over seeds (band), None: no band
    high: np.ndarray | None = None
    colour: str = "#1f77b4"
    thin: bool = False
    dashed: bool = False


@dataclass
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)


def utility_figure(panels: list[Panel], ylabel: str, prefix: str) -> str:
    """One panel per (model, epsilon): mean over seeds with a min-max band per strategy."""
    with matplotlib.rc_context(STYLE):
        ncols = min(3, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        width, height = {1: (7.0, 3.8), 2: (5.6, 3.4)}.get(ncols, (4.4, 3.0))
        fig = _figure(width * ncols + 0.3, height * nrows + 0.7)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        handles: dict[str, object] = {}
        for ax, panel in zip(axes.flat, panels):
            for s in panel.series:
                if s.low is not None and s.high is not None and len(s.steps) > 1:
                    ax.fill_between(s.steps, s.low, s.high, color=s.colour, alpha=0.15, linewidth=0)
                line, = ax.plot(s.steps, s.mean, color=s.colour, linewidth=0.8 if s.thin else 1.8,
                                alpha=0.55 if s.thin else 1.0, linestyle="--" if s.dashed else "-",
                                marker=None if s.thin or len(s.steps) > 12 else "o", markersize=3)
                handles.setdefault(s.label, line)
            ax.set_title(_fit(panel.title, width * 0.85, STYLE["axes.titlesize"]))
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            _plain_y(ax)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        if handles:
            _legend(fig, list(handles.values()), list(handles), width * ncols, STYLE["legend.fontsize"])
        return to_svg(fig, prefix)


# -- dials ------------------------------------------------------------------------------------------
@dataclass
class Spent:
    """The privacy spent over steps: ``epsilon`` after ``steps`` steps as ``label`` counts it (the run's enforcing
    accountant), with the RDP upper bound of the same ledger beside it (``bound``: steps, epsilon; dashed), the
    run's target and a Renyi filter's guarantee fixed before training (horizontal lines)."""

    steps: np.ndarray
    epsilon: np.ndarray
    label: str
    bound: tuple[np.ndarray, np.ndarray] | None = None
    target: float | None = None
    guarantee: float | None = None


def dials_figure(title: str, steps: np.ndarray, clips: np.ndarray, sigma_eff: np.ndarray,
                 decision_steps: Sequence[int] | None, prefix: str, spent: Spent | None = None) -> str:
    """Clip radii per adapter pair (log y, left), the effective noise multiplier (middle) and, given ``spent``, the
    privacy spent (right) over steps; ``title`` (the run) above the three panels.

    ``clips``: steps x radii (one column per adapter pair, or one for a flat clip). ``decision_steps``:
    the controller's decision steps (RLDP), drawn as a rug under the sigma curve."""
    with matplotlib.rc_context(STYLE):
        width = 13.5 if spent is not None else 10.0
        fig = _figure(width, 3.2)
        ratios = [1.35, 1, 1] if spent is not None else [1.35, 1]
        axes = fig.subplots(1, len(ratios), width_ratios=ratios)
        fig.suptitle(_fit(title, width * 0.95, 10), fontsize=10)
        left, right = axes[0], axes[1]
        if spent is not None:
            _spent_panel(axes[2], spent)
        n = clips.shape[1]
        if n == 1:
            left.plot(steps, clips[:, 0], color="#1f77b4", linewidth=1.5, label="flat clip")
        else:
            cmap = matplotlib.colormaps["viridis"]
            for j in range(n):
                left.plot(steps, clips[:, j], color=cmap(j / max(1, n - 1) * 0.9), linewidth=1.1,
                          label=f"pair {j}")
        finite = clips[np.isfinite(clips) & (clips > 0)]
        log = bool(finite.size) and finite.max() / finite.min() >= 10
        if log:
            left.set_yscale("log")
        else:  # a narrow range (e.g. a constant flat clip): a log axis would only crowd its tick labels
            _plain_y(left)
            if finite.size and finite.max() == finite.min():
                left.set_ylim(0, 2 * finite.max())
        left.set_xlabel("step")
        left.set_ylabel("clip radius (log)" if log else "clip radius")
        left.set_title("clip radii" + ("" if n == 1 else f" ({n} adapter pairs)"))
        if n <= 8:
            left.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=7.5)
        right.plot(steps, sigma_eff, color="#d62728", linewidth=1.5, label="sigma_eff")
        right.set_xlabel("step")
        for ax in (left, right):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_ylabel("noise multiplier sigma_eff")
        right.set_title("noise multiplier (effective)")
        _plain_y(right)
        if decision_steps is not None and len(decision_steps):
            low = float(np.nanmin(sigma_eff)) if len(sigma_eff) else 0.0
            right.plot(decision_steps, np.full(len(decision_steps), low), linestyle="none", marker="|",
                       markersize=8, color="#555555", label="controller decision")
            right.legend(loc="best", frameon=False, fontsize=7.5)
        return to_svg(fig, prefix)


def _spent_panel(ax, spent: Spent) -> None:
    ax.plot(spent.steps, spent.epsilon, color="#2ca02c", linewidth=1.6, label=spent.label)
    tops = [float(np.nanmax(spent.epsilon))] if len(spent.epsilon) else [0.0]
    if spent.bound is not None and len(spent.bound[1]):
        ax.plot(spent.bound[0], spent.bound[1], color="#7f7f7f", linewidth=1.1, linestyle="--",
                label="RDP upper bound (looser)")
        tops.append(float(np.nanmax(spent.bound[1])))
    if spent.guarantee is not None and math.isfinite(spent.guarantee):
        ax.axhline(spent.guarantee, color="#2ca02c", linewidth=1.0, linestyle=":", label="filter's guarantee")
        tops.append(spent.guarantee)
    if spent.target is not None and math.isfinite(spent.target):
        ax.axhline(spent.target, color="#d62728", linewidth=1.0, linestyle=":", label=f"target ε = {spent.target:g}")
        tops.append(spent.target)
    top = max(t for t in tops if math.isfinite(t)) if any(math.isfinite(t) for t in tops) else 1.0
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("epsilon spent")
    ax.set_title("privacy spent")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _plain_y(ax)
    ax.legend(loc="lower right", frameon=False, fontsize=7)


# -- privacy ----------------------------------------------------------------------------------------
def tuning_figure(runs: list[tuple[str, float]], composition: float | None, single: float | None,
                  title: str, prefix: str) -> str:
    """Each composed run's own RDP epsilon (bars) against the tuning-aware composition (line)."""
    with matplotlib.rc_context(STYLE):
        names = [_short(name, 46) for name, _ in runs]
        values = [v if v is not None and math.isfinite(v) else np.nan for _, v in runs]
        fig = _figure(8.5, 1.3 + 0.26 * max(1, len(runs)))
        ax = fig.add_subplot()
        y = np.arange(len(runs))
        ax.barh(y, values, color="#9ecae1", edgecolor="#3182bd", height=0.6, label="single run (RDP)")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        if composition is not None and math.isfinite(composition):
            ax.axvline(composition, color="#d62728", linewidth=1.8,
                       label=f"tuning-aware (composition) {composition:.3f}")
        if single is not None and math.isfinite(single):
            ax.axvline(single, color="#555555", linewidth=1.0, linestyle="--",
                       label=f"largest single run {single:.3f}")
        ax.set_xlabel("epsilon (RDP, at the study's delta)")
        ax.set_title(title)
        ax.grid(axis="y", visible=False)
        fig.legend(loc="outside lower center", ncol=3, frameon=False, fontsize=7.5)
        return to_svg(fig, prefix)


# -- attacks and audit ------------------------------------------------------------------------------
def auc_figure(groups: list[tuple[str, float, float, float, float]], prefix: str) -> str:
    """Membership-inference AUC per (epsilon, strategy): loss and calibrated attacks, mean +- std."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(8.5, 1.5 + 0.32 * max(1, len(groups)))
        ax = fig.add_subplot()
        y = np.arange(len(groups))
        labels = [_short(g[0], 50) for g in groups]
        loss_mean = np.array([g[1] for g in groups], float)
        loss_std = np.nan_to_num(np.array([g[2] for g in groups], float))
        cal_mean = np.array([g[3] for g in groups], float)
        cal_std = np.nan_to_num(np.array([g[4] for g in groups], float))
        ax.errorbar(loss_mean, y - 0.12, xerr=loss_std, fmt="o", color="#1f77b4", capsize=3,
                    label="loss attack")
        if np.isfinite(cal_mean).any():
            ax.errorbar(cal_mean, y + 0.12, xerr=cal_std, fmt="s", color="#ff7f0e", capsize=3,
                        label="calibrated (reference model)")
        ax.axvline(0.5, color="#555555", linewidth=1.0, linestyle="--", label="chance (0.5)")
        values = np.concatenate([loss_mean - loss_std, loss_mean + loss_std, cal_mean - cal_std,
                                 cal_mean + cal_std, [0.45, 0.55]])
        values = values[np.isfinite(values)]
        pad = 0.05 * (values.max() - values.min())
        ax.set_xlim(max(0.0, values.min() - pad), min(1.0, values.max() + pad))
        ax.set_ylim(len(groups) - 0.5, -0.5)
        ax.set_yticks(y, labels)
        ax.set_xlabel("membership-inference AUC")
        ax.set_title("membership inference: AUC per (epsilon, strategy)")
        ax.grid(axis="y", visible=False)
        fig.legend(loc="outside lower center", ncol=3, frameon=False, fontsize=7.5)
        return to_svg(fig, prefix)


def roc_figure(curves: list[tuple[str, list[float], list[float]]], fpr_floor: float, prefix: str) -> str:
    """Membership-inference ROC curves on log-log axes (Carlini et al. 2022: the low-FPR region is what matters),
    one per (epsilon, strategy), with the chance diagonal; FPRs below ``fpr_floor`` (1 / non-members) are not
    resolved and are drawn at the floor."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(6.0, 4.6)
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps["tab10"]
        for i, (label, fpr, tpr) in enumerate(curves):
            f, t = np.maximum(np.asarray(fpr, float), fpr_floor), np.maximum(np.asarray(tpr, float), fpr_floor)
            ax.step(f, t, where="post", color=cmap(i % 10), linewidth=1.3, label=_short(label, 40))
        grid = np.logspace(math.log10(fpr_floor), 0, 50)
        ax.plot(grid, grid, color="#555555", linestyle="--", linewidth=1.0, label="chance")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(fpr_floor, 1.0)
        ax.set_ylim(fpr_floor, 1.0)
        ax.set_xlabel("false positive rate (log)")
        ax.set_ylabel("true positive rate (log)")
        ax.set_title("membership inference (loss attack): ROC, first seed")
        ax.legend(loc="lower right", frameon=False, fontsize=7)
        return to_svg(fig, prefix)


def frontier_figure(series: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]],
                    nonprivate: tuple[float, float] | None, ylabel: str, prefix: str) -> str:
    """The privacy-utility frontier: per strategy, the final metric (mean +- sd over seeds) against the target
    epsilon (log x), and the non-private arm's mean as a horizontal line with its sd band."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(7.5, 4.2)
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps["tab10"]
        for i, (label, eps, mean, sd) in enumerate(series):
            ax.errorbar(eps, mean, yerr=np.nan_to_num(sd), marker="o", markersize=4, capsize=3, linewidth=1.3,
                        color=cmap(i % 10), label=_short(label, 40))
        if nonprivate is not None:
            m, sd = nonprivate
            ax.axhline(m, color="#222222", linestyle="--", linewidth=1.0, label="non-private")
            if sd == sd and sd > 0:
                ax.axhspan(m - sd, m + sd, color="#222222", alpha=0.08)
        ax.set_xscale("log")
        ax.set_xlabel("target epsilon (log)")
        ax.set_ylabel(ylabel)
        _plain_y(ax)
        ax.set_title("privacy-utility frontier (mean ± sd over seeds; lower is better)")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=7.5)
        return to_svg(fig, prefix)


def audit_figure(rows: list[tuple[str, float | None, float | None, float | None, bool]], prefix: str) -> str:
    """Per trial: the claimed epsilon (bar) beside the audit's lower bounds (dots); a violating trial in red."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(8.5, 1.5 + 0.32 * max(1, len(rows)))
        ax = fig.add_subplot()
        y = np.arange(len(rows))
        claimed = np.array([np.nan if r[1] is None else r[1] for r in rows], float)
        one_run = np.array([np.nan if r[2] is None else r[2] for r in rows], float)
        cp = np.array([np.nan if r[3] is None else r[3] for r in rows], float)
        colours = ["#f4a6a6" if r[4] else "#c6dbef" for r in rows]
        ax.barh(y, claimed, color=colours, edgecolor=["#b00020" if r[4] else "#3182bd" for r in rows],
                height=0.6, label="claimed epsilon")
        ax.plot(one_run, y - 0.1, linestyle="none", marker="o", color="#2ca02c", label="one-run lower bound")
        ax.plot(cp, y + 0.1, linestyle="none", marker="D", markersize=4.5, color="#9467bd",
                label="Clopper-Pearson lower bound")
        for i, r in enumerate(rows):
            if r[4]:
                x = np.nanmax([claimed[i], one_run[i], cp[i]])
                ax.annotate("VIOLATION: bug", (x, i), xytext=(6, 0), textcoords="offset points",
                            va="center", color="#b00020", fontweight="bold", fontsize=8)
        ax.set_yticks(y, [_short(r[0], 50) for r in rows])
        for tick, r in zip(ax.get_yticklabels(), rows):
            if r[4]:
                tick.set_color("#b00020")
        ax.set_ylim(len(rows) - 0.5, -0.5)
        top = np.nanmax(np.concatenate([claimed, one_run, cp, [0.1]]))
        ax.set_xlim(0, top * 1.35)
        ax.set_xlabel("epsilon")
        ax.set_title("empirical audit: lower bounds must stay below the claimed epsilon")
        ax.grid(axis="y", visible=False)
        fig.legend(loc="outside lower center", ncol=3, frameon=False, fontsize=7.5)
        return to_svg(fig, prefix)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
