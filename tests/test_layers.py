"""The module graph points down, and the code stays readable: an AST scan of every project module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each module may import (anywhere in it) only modules of a lower layer; the modules of a package (study/,
# tools/) share the package's layer and may import each other. DESIGN.md explains each layer.
LAYERS = {
    "cli": 0,  # errors, exit codes, argparse converters, logger setup
    "models": 1,
    "dumps": 1,
    "runfiles": 1,  # pairs and prompts; the log-dump format; the run folder
    "budget": 1,  # the budget file: schema, reading, the loss it holds for
    "quant": 2,  # FP8 primitives, the FP8 KV cache, torchao weights
    "kl": 2,  # the formulas of the one scale: pure functions of log-probs
    "native": 2,  # other systems' exports, read into dumps.Dump
    "rollout": 3,  # the sampler and the engine
    "mismatch": 4,  # measuring a configuration (never trains)
    "loss": 5,
    "rl": 5,
    "batches": 5,  # the OPD loss; the RL baseline; where a step's batch comes from
    "audit": 5,  # the audit page of an export (above mismatch)
    "evaluate": 6,
    "train": 7,  # the OPD loop (the only module besides tools/build_tiny.py that changes weights)
    "admit": 8,  # the admission check
    "calibrate": 9,  # budgets from short training runs
    "opd_minimal": 9,  # the whole method in one file, for reading
    "study": 10,  # the study's experiments (a package)
    "tools": 11,  # benchmarks, the tiny-pair builder, the GPU check (a package)
}
PACKAGES = ("study", "tools")
TRAINING = {"loss", "rl", "batches", "evaluate", "train", "admit", "calibrate", "study", "tools"}


def layer_name(path: Path) -> str:
    """A top-level module's name, or its package's for a module inside study/ or tools/."""
    return path.parent.name if path.parent.name in PACKAGES else path.stem


def modules():
    return sorted([*ROOT.glob("*.py"), *(p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py"))])


def project_imports(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function?) for every import in the tree."""
    out, in_function = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module.split(".")[0]]
        out += [(n, node.lineno, id(node) in in_function) for n in names if n in LAYERS]
    return out


def test_every_module_has_a_layer():
    names = {layer_name(p) for p in modules()}
    assert names <= LAYERS.keys(), names - LAYERS.keys()


def test_imports_only_point_down_and_never_hide_in_functions():
    problems = []
    for path in modules():
        me = layer_name(path)
        for name, line, nested in project_imports(ast.parse(path.read_text())):
            if LAYERS[name] >= LAYERS[me] and not (name == me and me in PACKAGES):
                problems.append(
                    f"{path.name}:{line} imports {name} (layer {LAYERS[name]} >= {LAYERS[me]})"
                )
            if nested:
                problems.append(f"{path.name}:{line} imports {name} inside a function")
            if me in ("models", "quant", "kl", "rollout", "mismatch", "dumps") and name in TRAINING:
                problems.append(
                    f"{path.name}:{line}: measurement and precision modules import nothing that trains"
                )
    assert not problems, "\n".join(problems)


def test_lines_functions_and_train_py_stay_readable():
    problems = []
    for path in modules():
        text = path.read_text()
        for i, line in enumerate(text.splitlines(), start=1):
            if len(line) > 110:
                problems.append(f"{path.name}:{i}: {len(line)} characters")
            if "fmt: skip" in line or "noqa: E731" in line:
                problems.append(f"{path.name}:{i}: formatting switched off or a lambda assigned")
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > 60
            ):
                problems.append(
                    f"{path.name}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
                )
    assert len((ROOT / "train.py").read_text().splitlines()) <= 450, "train.py grew past 450 lines"
    assert not problems, "\n".join(problems)


def test_calls_with_more_than_three_arguments_use_keywords():
    """A call to a project function passes its 4th and later arguments by keyword, never positionally."""
    trees = {path.name: ast.parse(path.read_text()) for path in modules()}
    defined = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    problems = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= 3:
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called in defined:
                problems.append(f"{name}:{node.lineno} {called} ({len(node.args)} positional)")
    assert not problems, "\n".join(problems)
