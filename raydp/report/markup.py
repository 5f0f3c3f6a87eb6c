"""The report page's HTML pieces: number formatting, table cells, tables, figures, paragraphs and the inline CSS
(:mod:`raydp.report.page` assembles them; no script, no external resource)."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd


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


def trial_cell(name) -> Cell:
    """A trial's name (one long word: ``static-pairwise_embedded_eps2_seed0_...``) that may wrap after each ``_``
    in a narrow column instead of widening its table."""
    return Cell("<wbr>".join(_e(part) + "_" for part in str(name).split("_"))[:-1], "trial", raw=True)


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
    return (f'<div class="table-box"><table id="{_e(table_id)}">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>\n{body}\n</tbody></table></div>")


def figure(fig_id: str, svg: str, caption: str) -> str:
    return f'<figure id="{_e(fig_id)}">{svg}<figcaption>{_e(caption)}</figcaption></figure>'


def para(text: str, cls: str | None = None) -> str:
    return f'<p class="{cls}">{_e(text)}</p>' if cls else f"<p>{_e(text)}</p>"


def how(text: str) -> str:
    return f'<p class="how"><strong>How to read this:</strong> {_e(text)}</p>'




def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n{body}\n</section>'



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
.table-box { margin: 8px 0 16px; }
table { border-collapse: collapse; font-size: 12.5px; min-width: 40%; max-width: 100%; }
caption { text-align: left; color: var(--muted); padding: 4px 0; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--alt); font-weight: 600; max-width: 180px; }
td.arm { min-width: 7em; }
td.trial { min-width: 9em; }
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
