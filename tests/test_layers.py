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
    "lab.atomic": 1,  # atomic writes: a full disk is one line and nothing half-written
    "lab.hf_pairs": 1,  # Hugging Face pairs: the GGUF teachers converted once, layer-dropped students
    "lab.budget_schema": 1,  # the schema of a budget.json: typed fields, finite numbers, the interval
    "models": 2,  # pairs, prompts, devices, the output head
    "budget": 2,  # the budget file: schema, reading, the loss it holds for
    "lab.runfiles": 2,  # the run folder: checkpoints, the lock, the resume diff
    "port.dumps": 2,  # the log-dump format
    "quant": 3,  # FP8 primitives, the FP8 KV cache, torchao weights
    "kl": 3,  # the formulas of the one scale: pure functions of log-probs
    "cpu_decode": 3,  # the CPU decode fast path, beside the reference sampler
    "port.native": 3,  # other systems' exports, read into port.dumps.Dump
    "verdict": 3,  # the verdict: a measured mismatch interval against a budget's interval (pure)
    "rollout": 4,  # the sampler: the sampling loop and what it returns
    "port.estimate": 4,  # the one scale estimated from a dump
    "lab.kv_capacity": 4,  # the KV-capacity table (python -m lab.kv_capacity)
    "engine": 5,  # the rollout engine: its own changed copy of the student
    "lab.rollout_args": 5,  # the engine's command-line flags, shared by every command that samples
    "lab.sample": 5,  # a few samples printed with their log-probs (python -m lab.sample)
    "mismatch": 6,  # measuring a configuration (never trains)
    "loss": 7,
    "rl": 7,
    "batches": 7,  # the OPD loss; the RL baseline; where a step's batch comes from
    "port.audit": 7,  # the audit page of an export
    "evaluate": 8,
    "lab.train_args": 8,  # one run's settings (TrainConfig, pair_config) and train.py's command line
    "lab.watch": 9,  # the mismatch budget inside a training run
    "port.judge": 9,  # judging an export: per step, its worst step, its blind spot; the audit command
    "train": 10,  # the OPD loop (the only module besides tools/build_tiny.py that changes weights)
    "admit": 11,  # the admission check
    "lab.calibrate": 12,  # budgets from short training runs
    "opd_minimal": 12,  # the whole method in one file, for reading
    "study": 13,  # the study's experiments (a package)
    "tools": 14,  # benchmarks, the tiny-pair builder, the GPU check (a package)
}
PACKAGES = ("study", "tools")  # one layer per package
HARNESS = ("lab", "port")  # one layer per module
TRAINING = {"loss", "rl", "batches", "evaluate", "train", "admit", "lab.calibrate", "study", "tools"}
MEASUREMENT = ("models", "quant", "kl", "cpu_decode", "rollout", "engine", "mismatch", "port.dumps")


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
