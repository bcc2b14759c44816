"""The module graph points down, and the code stays readable: an AST scan of every project module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each module may import (anywhere in it) only modules of a lower layer. The core is the top-level modules;
# the harness packages lab/ and port/ group modules by what they hold, each module keeping its own layer; the
# modules of study/ and tools/ share their package's layer and may import each other. DESIGN.md explains it.
LAYERS = {
    "cli": 0,  # errors, exit codes, argparse converters, logger setup
    "config": 0,  # every default, as plain data: the pairs table, the study's settings, probe counts
    "models": 1,  # pairs, prompts, devices, the output head
    "budget": 1,  # the budget file: schema, reading, the loss it holds for
    "lab.runfiles": 1,  # the run folder: atomic writes, checkpoints, the lock, the resume diff
    "port.dumps": 1,  # the log-dump format
    "quant": 2,  # FP8 primitives, the FP8 KV cache, torchao weights
    "kl": 2,  # the formulas of the one scale: pure functions of log-probs
    "cpu_decode": 2,  # the CPU decode fast path, beside the reference sampler
    "port.native": 2,  # other systems' exports, read into port.dumps.Dump
    "rollout": 3,  # the sampler and the engine
    "port.estimate": 3,  # the one scale estimated from a dump
    "mismatch": 4,  # measuring a configuration (never trains)
    "loss": 5,
    "rl": 5,
    "batches": 5,  # the OPD loss; the RL baseline; where a step's batch comes from
    "port.audit": 5,  # the audit page of an export
    "evaluate": 6,
    "train": 7,  # the OPD loop (the only module besides tools/build_tiny.py that changes weights)
    "admit": 8,  # the admission check
    "lab.calibrate": 9,  # budgets from short training runs
    "opd_minimal": 9,  # the whole method in one file, for reading
    "study": 10,  # the study's experiments (a package)
    "tools": 11,  # benchmarks, the tiny-pair builder, the GPU check (a package)
}
PACKAGES = ("study", "tools")  # one layer per package
HARNESS = ("lab", "port")  # one layer per module
TRAINING = {"loss", "rl", "batches", "evaluate", "train", "admit", "lab.calibrate", "study", "tools"}
MEASUREMENT = ("models", "quant", "kl", "cpu_decode", "rollout", "mismatch", "port.dumps")


def layer_name(path: Path) -> str:
    """A module's key in LAYERS: its name (core), package.name (lab/, port/) or its package (study/, tools/)."""
    if path.parent.name in PACKAGES:
        return path.parent.name
    if path.parent.name in HARNESS:
        return f"{path.parent.name}.{path.stem}"
    return path.stem


def modules():
    return sorted(
        p
        for p in [*ROOT.glob("*.py"), *(q for pkg in PACKAGES + HARNESS for q in (ROOT / pkg).glob("*.py"))]
        if p.name != "__init__.py" or p.parent.name in PACKAGES
    )


def imported_names(node) -> list[str]:
    """The LAYERS keys an import statement names: `import x`, `from x import y`, `from lab import calibrate`."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return []
    keys = []
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in HARNESS else parts[0]
        if key in LAYERS and key not in keys:
            keys.append(key)
    return keys


def project_imports(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function?) for every import in the tree."""
    out, in_function = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        out += [(n, node.lineno, id(node) in in_function) for n in imported_names(node)]
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
                problems.append(f"{path.name}:{line} imports {name} (layer {LAYERS[name]} >= {LAYERS[me]})")
            if nested:
                problems.append(f"{path.name}:{line} imports {name} inside a function")
            if me in MEASUREMENT and name in TRAINING:
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
