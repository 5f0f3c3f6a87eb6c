"""Code outside a strategy's own module asks the registry for a capability, never compares a strategy's name
(issue 30): the check below reads every module's syntax tree, and is shown to find a planted comparison."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raydp.strategies.registry import SPECS, STRATEGY_CHOICES, get_spec, is_private, with_capability

PACKAGE = Path(__file__).resolve().parents[1] / "raydp"
#: where a strategy's name may be spelled out in a comparison: the strategies themselves and their registry
OWNERS = ("strategies",)
#: "pbt" is also a search mode (``search: pbt``) and a trial's stage: comparisons with those are not on a strategy
OTHER_VOCABULARIES = ("search", "stage")


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def name_branches(package: Path = PACKAGE) -> list[str]:
    """``path:line: source`` of every comparison (``==``, ``!=``, ``in``, ``startswith``) of an expression
    with a registered strategy's name, outside :data:`OWNERS`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in OWNERS:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("startswith", "endswith"):
                operands = [node.func.value, *node.args]
            else:
                continue
            if not any(s in STRATEGY_CHOICES for o in operands for s in _strings(o)):
                continue
            # get_source_segment splits the whole file at every call: only for the few comparisons with a name
            others = " ".join(ast.get_source_segment(text, o) or "" for o in operands if not _strings(o))
            if not any(word in others for word in OTHER_VOCABULARIES):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_code_outside_the_strategies_compares_a_strategy_name():
    found = name_branches()
    assert not found, "ask the registry for a capability instead:\n" + "\n".join(found)


def test_the_check_finds_a_planted_comparison(tmp_path):
    fake = tmp_path / "raydp"
    (fake / "study").mkdir(parents=True)
    (fake / "strategies").mkdir()
    (fake / "strategies" / "mine.py").write_text("def f(s):\n    return s == 'rldp'\n")  # its own module: fine
    (fake / "study" / "r.py").write_text(
        "def f(t, arm, study):\n"
        "    if t['strategy'] == 'rldp':\n"
        "        return 1\n"
        "    if study.search == 'pbt' or t.get('stage') == 'pbt':\n"  # other vocabularies: fine
        "        return 2\n"
        "    return arm.startswith('rldp') or t['strategy'] in ('nonprivate', 'static')\n")
    assert name_branches(fake) == ["raydp/study/r.py:2: t['strategy'] == 'rldp'",
                                   "raydp/study/r.py:6: arm.startswith('rldp')",
                                   "raydp/study/r.py:6: t['strategy'] in ('nonprivate', 'static')"]


def test_the_registry_declares_every_capability_code_asks_for():
    assert STRATEGY_CHOICES[0] == "nonprivate" and set(STRATEGY_CHOICES) == set(SPECS)
    assert [n for n in STRATEGY_CHOICES if not is_private(n)] == ["nonprivate"]
    assert with_capability(STRATEGY_CHOICES, "controller") == ["rldp"]
    assert with_capability(STRATEGY_CHOICES, "population") == ["pbt"]
    assert set(with_capability(STRATEGY_CHOICES, "challenger")) == {"rldp", "clip-schedule"}
    assert get_spec("rldp").legacy_block == "rldp"  # read only to migrate old configs
    with pytest.raises(Exception, match="no strategy class"):
        get_spec("nonprivate").load()


def test_a_config_asks_its_strategy_for_its_capabilities():
    from raydp.config import TrainConfig
    from raydp.settings import validate_config

    plain = validate_config(TrainConfig, {})
    assert not plain.is_private and not plain.is_controlled
    rldp = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0})
    assert rldp.is_private and rldp.is_controlled and rldp.strategy_settings().t_rl == 112
    static = validate_config(TrainConfig, {"strategy": "static", "epsilon": 2.0, "clip": 0.5})
    assert static.is_private and not static.is_controlled and static.strategy_settings().clip == 0.5


def test_one_arm_label_for_tables_reports_and_pages():
    """An arm is built in one place (raydp.study.arms): the study report's keys and the page's column agree."""
    import pandas as pd

    from raydp.report.page import _with_arms
    from raydp.study.arms import arm_label
    from raydp.study.statistics import arm_keys, cell_arm_keys

    rows = pd.DataFrame({"strategy": ["rldp", "rldp", "static-pairwise", "nonprivate"],
                         "variant": [None, "action_decoding=paper", "clip=0.03", None],
                         "t_rl": [16.0, 112.0, float("nan"), float("nan")], "b_sac": [4.0, 8.0, None, None],
                         "k": [1.0, 2.0, None, None], "frozen_policy": [False, True, False, False], "seed": [0, 0, 0, 0]})
    expected = ["rldp T_RL=16 B_SAC=4 K=1", "rldp [action_decoding=paper] T_RL=112 B_SAC=8 K=2 (frozen policy)",
                "static-pairwise [clip=0.03]", "nonprivate"]
    assert list(cell_arm_keys(rows)) == expected == list(_with_arms(rows)["arm"])
    assert list(arm_keys(rows)) == ["rldp", "rldp [action_decoding=paper]", "static-pairwise [clip=0.03]", "nonprivate"]
    assert arm_label("rldp", t_rl=16, b_sac=None, k=2) == "rldp T_RL=16 B_SAC=? K=2"
