"""config.py is the one home of the defaults: no other module of the project re-states one of the main ones.

The scan reads every module of the core, lab/, port/, study/ and tools/ (not tests/, which pin values on
purpose) and flags, with the line and the rule:
- a name config.py defines, or one it replaced (LAYER_DROPPED, PAIR_DEFAULTS, PROBES), assigned anywhere
  else: a second definition or an alias left behind;
- a pair's response length as a number (`max_new_tokens=48`, `"max_new_tokens": 6`, `max_new=6`), and a
  dict literal that maps pairs to config's response lengths, student sizes or probe counts;
- tiny's training learning rate given to an `lr` keyword, key or parameter; a dict literal or call that
  spells out a whole entry of config.PAIR_TRAIN or config.TINY_EARLY;
- a probe count as a literal default: `--probes` with `default=64`, a `n_probes`/`probes` parameter with
  a number, any other `*PROBES*` name assigned;
- a `--pair` default, or a `pair` field or parameter default, that is a pair's name instead of
  config.DEFAULT_PAIR / config.CHAT_PAIR;
- the KV-scale calibration prompts as a literal slice (`train_prompts[:8]`).
The values the rules look for are read from config.py, so the scan follows it. Each rule is shown firing on
an example line (test_each_rule_catches_a_restated_default), so a clean scan of the real code means something.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import config

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("lab", "port", "study", "tools")
OLD_NAMES = {"LAYER_DROPPED", "PAIR_DEFAULTS", "PROBES"}  # the names config.py's tables had before it
NAMES = {n for n in vars(config) if n.isupper()} | OLD_NAMES
PAIR_NAMES = set(config.PAIRS) | {"custom"}
PER_PAIR = {
    "config.MAX_NEW_TOKENS": config.MAX_NEW_TOKENS,
    "config.STUDENT_LAYERS": config.STUDENT_LAYERS,
    "config.MEASURE_PROBES": config.MEASURE_PROBES,
}
ENTRIES = {
    **{f"config.PAIR_TRAIN[{p!r}]": entry for p, entry in config.PAIR_TRAIN.items()},
    "config.TINY_EARLY": config.TINY_EARLY,
}
TINY_LR = config.PAIR_TRAIN["tiny"]["lr"]
LENGTHS = "|".join(str(n) for n in sorted(set(config.MAX_NEW_TOKENS.values())))
TEXT_RULES = {  # on the code with its comments removed
    "a pair's response length (config.MAX_NEW_TOKENS)": re.compile(
        rf"\bmax_new(?:_tokens)?['\"]?\s*(?::\s*int\s*)?[:=]\s*(?:{LENGTHS})(?![\w.])"
    ),
    "the KV-scale calibration prompts (config.KV_SCALE_PROMPTS)": re.compile(r"train_prompts\[\s*:\s*\d"),
}
PROBE_PARAMETERS = {"n_probes", "probes"}
PAIR_PARAMETERS = {"pair", "pair_name"}


def modules() -> list[Path]:
    top = [p for p in ROOT.glob("*.py") if p.name != "config.py"]
    return sorted(top + [p for folder in FOLDERS for p in (ROOT / folder).glob("*.py")])


def without_comments(text: str) -> str:
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type != tokenize.COMMENT]
    return tokenize.untokenize(tokens)


def constant(node, kind):
    """The node's value when it is a literal of `kind` (bool is not an int here), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, kind) and not isinstance(node.value, bool):
        return node.value
    return None


def flag_name(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for target in targets:
        for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
            if name in NAMES:
                out.append(f"{name} defined again (config.py holds it; import it from there)")
            elif "PROBES" in name:
                out.append(f"{name}: a probe count outside config.py")
    return out


def literal_items(node) -> dict:
    """{key: constant} of a dict literal with string keys, or of a call's keyword arguments (dict(...))."""
    if isinstance(node, ast.Dict):
        pairs = [(k.value, v) for k, v in zip(node.keys, node.values) if constant(k, str) is not None]
    elif isinstance(node, ast.Call):
        pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
    else:
        return {}
    return {k: v.value for k, v in pairs if isinstance(v, ast.Constant)}


def flag_literal(node) -> list[str]:
    items, out = literal_items(node), []
    by_pair = {k: v for k, v in items.items() if k in PAIR_NAMES}
    for name, table in PER_PAIR.items():
        if by_pair and all(table.get(k) == v for k, v in by_pair.items()):
            out.append(f"{by_pair}: re-states {name}")
    for name, entry in ENTRIES.items():
        if all(k in items and items[k] == v for k, v in entry.items()):
            out.append(f"re-states {name}")
    if items.get("lr") == TINY_LR:
        out.append(f"lr {TINY_LR:g}: tiny's learning rate (config.PAIR_TRAIN)")
    return out


def flag_argument(node: ast.Call) -> list[str]:
    flag = constant(node.args[0], str) if node.args else None
    default = next((k.value for k in node.keywords if k.arg == "default"), None)
    if flag == "--probes" and constant(default, int) is not None:
        return [f"--probes default={default.value}: a probe count outside config.py"]
    if flag == "--pair" and constant(default, str) in PAIR_NAMES:
        return [f"--pair default={default.value!r}: use config.DEFAULT_PAIR or config.CHAT_PAIR"]
    return []


def flag_defaults(names: list[str], defaults: list) -> list[str]:
    """Parameters (or a dataclass field) whose default is a literal probe count, pair name or tiny's lr."""
    out = []
    for name, default in zip(names, defaults):
        if name in PROBE_PARAMETERS and constant(default, int) is not None:
            out.append(f"{name}={default.value}: a probe count outside config.py")
        if name in PAIR_PARAMETERS and constant(default, str) in PAIR_NAMES:
            out.append(f"{name}={default.value!r}: use config.DEFAULT_PAIR or config.CHAT_PAIR")
        if name == "lr" and constant(default, float) == TINY_LR:
            out.append(f"lr={TINY_LR:g}: tiny's learning rate (config.PAIR_TRAIN)")
    return out


def parameter_defaults(node) -> list[str]:
    args = node.args
    positional = args.posonlyargs + args.args
    names = [a.arg for a in positional[len(positional) - len(args.defaults) :]]
    names += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return flag_defaults(names, list(args.defaults) + [d for d in args.kw_defaults if d is not None])


def stray_defaults(text: str) -> list[str]:
    """'line N: what' for every re-stated default in one module's source."""
    found = []
    for number, line in enumerate(without_comments(text).splitlines(), start=1):
        found += [f"line {number}: {rule}" for rule, pattern in TEXT_RULES.items() if pattern.search(line)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            hits = flag_name(node)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                hits += flag_defaults([node.target.id], [node.value])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            hits = parameter_defaults(node)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            hits = flag_argument(node) + flag_literal(node)
        else:
            hits = flag_literal(node)
        found += [f"line {node.lineno}: {hit}" for hit in hits]
    return found


def test_the_scan_reads_the_project():
    names = {p.relative_to(ROOT).as_posix() for p in modules()}
    assert {"train.py", "models.py", "lab/calibrate.py", "study/__main__.py", "tools/bench_check.py"} <= names
    assert "config.py" not in names and not any(n.startswith("tests/") for n in names)


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_restates_a_default_of_config(path):
    found = stray_defaults(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


RESTATED = [  # (a line someone could add, what the scan must say)
    ('MAX_NEW_TOKENS = {"tiny": 6, "custom": 48}', "MAX_NEW_TOKENS defined again"),
    ("PAIR_DEFAULTS = {}", "PAIR_DEFAULTS defined again"),
    ("from mismatch import MEASURE_PROBES as PROBES\nPROBES = dict(PROBES)", "PROBES defined again"),
    ("cfg = RolloutConfig(max_new_tokens=48, seed=1)", "response length"),
    ("def sample(pair, max_new_tokens: int = 6):\n    pass", "response length"),
    ('row = {"max_new_tokens": 6}', "response length"),
    ("ids = sample(model, tok, prompts, max_new=6)", "response length"),
    ('LENGTHS = {"tiny": 6, "smollm2": 48}', "re-states config.MAX_NEW_TOKENS"),
    ('KEEP = {"smollm2": 24}', "re-states config.STUDENT_LAYERS"),
    ('cfg = pair_config("tiny", lr=1.5e-3)', "tiny's learning rate"),
    ('SETTINGS = {"lr": 0.0015, "steps": 10}', "tiny's learning rate"),
    ("def run(lr=1.5e-3):\n    pass", "tiny's learning rate"),
    ("EARLY = dict(steps=60, lr=3e-4, warmup=10, schedule='constant')", "re-states config.TINY_EARLY"),
    (
        "SHORT = dict(steps=12, lr=5e-5, eval_every=6, ckpt_every=0, ckpt_minutes=5.0)",
        "re-states config.PAIR_TRAIN['smollm2']",
    ),
    ('p.add_argument("--probes", type=positive_int, default=64)', "--probes default=64"),
    ("def calibrate(pair, n_probes: int = 64):\n    pass", "n_probes=64"),
    ("def check(pair, *, probes=16):\n    pass", "probes=16"),
    ("CHECK_CAP_PROBES = 32", "CHECK_CAP_PROBES: a probe count"),
    ('p.add_argument("--pair", default="tiny", choices=PAIRS)', "--pair default='tiny'"),
    ('sp.add_argument("--pair", default="smollm2", help="the pair")', "--pair default='smollm2'"),
    ('class C:\n    pair: str = "smollm2"', "pair='smollm2'"),
    ('def load(pair_name="gemma3"):\n    pass', "pair_name='gemma3'"),
    ("probes = [p.text for p in pair.train_prompts[:8]]", "KV-scale calibration prompts"),
]
CLEAN = [  # lines that use config or state something else, and must pass
    "from config import CHECK_PROBES, DEFAULT_PAIR, MAX_NEW_TOKENS",
    'p.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)',
    'p.add_argument("--pair", default="both", choices=("tiny", "smollm2", "both"))',
    'p.add_argument("--probes", type=positive_int, default=CHECK_PROBES)',
    "one = replace(cfg, max_new_tokens=1)  # prefill and one sample",
    "cfg = RolloutConfig.for_pair(pair, max_new_tokens=args.max_new_tokens)",
    'LR_GRID = {"tiny": (1e-4, 3e-4, 6e-4, 1.5e-3, 3e-3)}',
    'TOKENS = {"tiny": 16, "smollm2": 16}',
    "n = args.probes or MEASURE_PROBES.get(pair.name, DEFAULT_PROBES)",
    "x = 1  # the demo's rate: lr=1.5e-3, max_new_tokens=6, train_prompts[:8]",
    'PREFIX = dict(**TINY_EARLY, eval_every=0, loss="sampled", tis_cap=2.0)',
    "def check(budget, pair, cap: int, device: str, probes: list | None = None):\n    pass",
]


@pytest.mark.parametrize("line, rule", RESTATED, ids=[r for _, r in RESTATED])
def test_each_rule_catches_a_restated_default(line, rule):
    found = stray_defaults(line)
    assert any(rule in f for f in found), found


@pytest.mark.parametrize("line", CLEAN)
def test_using_config_or_another_setting_is_not_flagged(line):
    assert stray_defaults(line) == []
