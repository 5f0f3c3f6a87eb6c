"""RLDP's paper modes are one explicit setting read in one place (issue 30): ``paper_mode: true`` selects the
published RLDP (raw statistics, Eq. 10, Eq. 22-27) for every mode setting left unset, and
:mod:`raydp.control.modes` is the only module that compares a mode with ``"paper"``; components receive
resolved booleans and bounds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raydp.control.decoding import CAPPED_BOUNDS, RELATIVE_BOUNDS
from raydp.control.modes import PAPER_MODE_LABEL, apply_paper_mode, resolve_values, unprotected
from raydp.errors import ConfigError
from raydp.strategies.registry import strategy_settings

PACKAGE = Path(__file__).resolve().parents[1] / "raydp"
#: where "paper" may be compared: the modes' one reader, and the attacks' prompt style (another vocabulary)
READERS = ("control/modes.py", "evaluation/")


def _settings(**values):
    return strategy_settings("rldp", values)


def test_paper_mode_selects_every_paper_value_left_unset():
    s = _settings(paper_mode=True)
    assert (s.privacy_mode, s.action_decoding, s.architecture) == ("paper", "paper", "paper")
    m = s.modes
    assert m.raw_statistics and m.clip_bounds is None and m.fixed_pairs and m.label == PAPER_MODE_LABEL
    assert m.privacy_mode == "paper"


def test_an_explicit_mode_setting_wins_over_paper_mode():
    s = _settings(paper_mode=True, privacy_mode="strict")  # the paper's decoding and architecture, strict statistics
    assert not s.modes.raw_statistics and s.modes.label is None and s.modes.fixed_pairs
    assert s.modes.clip_bounds is None and s.modes.privacy_mode == "strict"
    assert _settings(paper_mode=True, action_decoding="relative-capped").modes.clip_bounds == CAPPED_BOUNDS


def test_without_paper_mode_the_defaults_are_raydps():
    m = _settings().modes
    assert not m.raw_statistics and m.clip_bounds == RELATIVE_BOUNDS and not m.fixed_pairs and m.label is None
    assert _settings(privacy_mode="paper").modes.raw_statistics  # each setting still works on its own
    with pytest.raises(ConfigError, match=r"^invalid config: settings\.paper_mode: "):
        _settings(paper_mode="sometimes")


def test_a_study_arms_unvalidated_settings_resolve_the_same_way():
    assert resolve_values({"paper_mode": True}).raw_statistics
    assert not resolve_values({"paper_mode": True, "privacy_mode": "strict"}).raw_statistics
    assert not resolve_values(None).raw_statistics and resolve_values({"architecture": "paper"}).fixed_pairs
    assert apply_paper_mode({"paper_mode": False, "t_rl": 3}) == {"paper_mode": False, "t_rl": 3}


def test_a_recorded_mode_is_unprotected_unless_it_says_strict():
    """Stored manifests and provenance entries keep the strings: a missing or unknown one is never strict."""
    assert not unprotected("strict")
    assert unprotected("paper") and unprotected(None) and unprotected("")


def test_a_paper_mode_rldp_strategy_carries_the_label():
    from raydp.strategies.rldp import RLDPStrategy

    strategy = RLDPStrategy(_settings(paper_mode=True))
    assert strategy.raw_statistics and strategy.privacy_mode == "paper"
    assert strategy.labels() == (PAPER_MODE_LABEL,) and strategy.releases() == ()
    strict = RLDPStrategy(_settings())
    assert not strict.raw_statistics and strict.privacy_mode == "strict" and strict.labels() == ()
    assert len(strict.releases()) == 2  # the DP histogram and the loss sum


def paper_comparisons(package: Path = PACKAGE) -> list[str]:
    """``path:line`` of every comparison (==, !=, in) with the string "paper" outside :data:`READERS`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if any(rel == r or rel.startswith(r) for r in READERS if r.endswith("/")) or rel in READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    values = [operand] if isinstance(operand, ast.Constant) else \
                        list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
                    if any(isinstance(v, ast.Constant) and v.value == "paper" for v in values):
                        found.append(f"{rel}:{node.lineno}")
    return found


def test_no_component_compares_a_mode_with_paper():
    assert paper_comparisons() == [], "read the mode through raydp.control.modes instead"


def test_the_check_finds_a_planted_comparison(tmp_path):
    fake = tmp_path / "raydp"
    (fake / "control").mkdir(parents=True)
    (fake / "evaluation").mkdir()
    (fake / "control" / "modes.py").write_text("def f(m):\n    return m == 'paper'\n")  # the reader: fine
    (fake / "evaluation" / "attacks.py").write_text("def f(style):\n    return style == 'paper'\n")  # prompts
    (fake / "control" / "x.py").write_text("def f(s):\n    return s.privacy_mode == 'paper' or s.a in ('paper',)\n")
    assert paper_comparisons(fake) == ["control/x.py:2", "control/x.py:2"]
