"""The package layers (issue 30): every import of a raydp module, at module top or inside a function, runs from
a higher layer to a lower one (or within one package). A new arrow that runs back up fails here, naming the
file, the line and both packages."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raydp"

#: lowest first; a package imports only from lower layers (and within itself)
LAYERS = [
    ["errors", "(init)"],                # one-line errors, the version
    ["settings", "files", "run_directory", "notices"],  # pydantic models; durable writes; a run's file names; notices
    ["data"],                            # records, splits, canaries, identities
    ["model"],                           # the embedded model, tokenizers, LoRA, loss
    ["privacy"],                         # the DP step, ledger, accountants, randomness
    ["control"],                         # the RLDP controller's pieces: decoding, features, SAC, transports
    ["strategies"],                      # what each strategy chooses
    ["recipe"],                          # the public recipe table: the settings a run leaves unset
    ["config"],                          # TrainConfig: validates strategies' settings and controller addresses
    ["evaluation"],                      # attacks, audit, metrics
    ["runner"],                          # one run: setup, loop, Ray actors, the policy server
    ["integrations", "study"],           # transformers.Trainer; Tune studies
    ["report"],                          # the HTML report (reads studies' results)
    ["migrate"],                         # rewriting old files
    ["cli_flags"],                       # the commands' flags, generated from the config models
    ["cli"],                             # the commands
    ["__main__"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _package_of(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package)
    if len(rel.parts) == 1:
        return "(init)" if rel.stem == "__init__" else rel.stem
    return rel.parts[0]


def _imported(node) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        return []
    out = []
    for name in names:
        parts = name.split(".")
        if parts[0] != "raydp":
            continue
        out.append(parts[1] if len(parts) > 1 else "(init)")
    return out


def _arrows(package: Path = PACKAGE):
    for path in sorted(package.rglob("*.py")):
        source = _package_of(path, package)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported(node):
                if target != source:
                    yield path.relative_to(package.parent), node.lineno, source, target


def _upward(package: Path = PACKAGE) -> list[str]:
    return [f"{path}:{line}: {source} (layer {LAYER[source]}) imports {target} (layer {LAYER[target]})"
            for path, line, source, target in _arrows(package) if LAYER[target] >= LAYER[source]]


def test_every_package_is_in_a_layer():
    packages = {_package_of(p) for p in PACKAGE.rglob("*.py")}
    assert packages <= set(LAYER), f"add {sorted(packages - set(LAYER))} to LAYERS"


def test_imports_run_down_the_layers():
    upward = _upward()
    assert not upward, "imports that run up (or across) the layers:\n" + "\n".join(upward)


def test_the_check_finds_an_import_that_runs_up_even_inside_a_function(tmp_path):
    fake = tmp_path / "raydp"
    (fake / "data").mkdir(parents=True)
    (fake / "model").mkdir()
    (fake / "model" / "m.py").write_text("from raydp.data import load_texts\n")  # down: fine
    (fake / "data" / "d.py").write_text("def f():\n    from raydp.model.m import x\n    import raydp.privacy\n")
    assert _upward(fake) == ["raydp/data/d.py:2: data (layer 2) imports model (layer 3)",
                             "raydp/data/d.py:3: data (layer 2) imports privacy (layer 4)"]
