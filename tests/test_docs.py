"""The documents: every command in README.md's code blocks answers --help and knows the flags the README
gives it; the README stays short, shows figures that exist and quotes only numbers RESULTS.md has; the layer
tables of README.md and DESIGN.md are tests/test_layers.py's; no document tells history; nothing tracked
points outside the repository."""

import contextlib
import importlib
import io
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "RESULTS.md", "DESIGN.md")
EXTERNAL = {"pytest"}  # `python -m` modules that are not the project's: not ours to --help
NOT_RESULTS = {"2.13", "8.9"}  # numbers in the README that are not results: the PyTorch version, CUDA sm 8.9
NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?!\w)"


def read(name: str) -> str:
    return (ROOT / name).read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def python_commands(text: str) -> list[list[str]]:
    """argv after `python` of every python command line in the text's code blocks (comments dropped, `&&`
    chains split)."""
    out = []
    for block in code_blocks(text):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            parts, cur = [], []
            for w in words:
                if w in ("&&", "||", ";", "|"):
                    parts, cur = parts + [cur], []
                else:
                    cur.append(w)
            out += [p[1:] for p in parts + [cur] if p[:1] == ["python"]]
    return out


def help_targets(text: str) -> dict[tuple[str, ...], set[str]]:
    """{(script or -m module[, subcommand]): the flags the text passes it}, for the project's own commands.
    A command's first argument that is not a flag is its subcommand."""
    targets: dict[tuple[str, ...], set[str]] = {}
    for argv in python_commands(text):
        if argv[0] == "-m":
            target, rest = argv[:2], argv[2:]
            top = argv[1].split(".")[0]
            if top in EXTERNAL:
                continue
            assert (ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file(), f"no module {argv[1]}: {argv}"
        else:
            target, rest = argv[:1], argv[1:]
            assert (ROOT / argv[0]).is_file(), f"no script {argv[0]}: {argv}"
        if rest and not rest[0].startswith("-"):
            target, rest = target + rest[:1], rest[1:]
        flags = {w.split("=")[0] for w in rest if w.startswith("--")}
        targets.setdefault(tuple(target), set()).update(flags)
    return targets


TARGETS = help_targets(read("README.md"))


def test_the_readme_has_commands_to_check():
    assert len(TARGETS) >= 10, sorted(TARGETS)
    assert ("train.py",) in TARGETS and ("admit.py", "check") in TARGETS


def run_help(target: tuple[str, ...]) -> SimpleNamespace:
    """`python <target> --help` in this process: the entry module's main(argv), its stdout and exit code
    (tests/test_bad_input.py runs every entry point as a real process)."""
    module, rest = (target[1], target[2:]) if target[0] == "-m" else (target[0][: -len(".py")], target[1:])
    module = "study.__main__" if module == "study" else module.replace("/", ".")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main([*rest, "--help"])
    return SimpleNamespace(returncode=stopped.value.code or 0, stdout=out.getvalue(), stderr="")


@pytest.fixture(scope="module")
def helps() -> dict:
    """Every target's --help."""
    return {target: run_help(target) for target in TARGETS}


@pytest.mark.parametrize("target", sorted(TARGETS), ids=" ".join)
def test_readme_command_answers_help_and_knows_its_flags(target, helps):
    done = helps[target]
    assert done.returncode == 0, f"python {' '.join(target)} --help: exit {done.returncode}\n{done.stderr}"
    unknown = [
        f for f in TARGETS[target] if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", done.stdout)
    ]
    assert not unknown, f"python {' '.join(target)}: the README passes {unknown}, which --help does not list"


def test_readme_is_short_and_opens_with_the_title_and_the_setup_commands():
    text = read("README.md")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    assert lines[0].startswith("# ")
    first = code_blocks(text)[0]
    assert "bash setup.sh && python train.py " in first and "bash setup.sh && python -m pytest -q " in first
    for doc in ("RESULTS.md", "DESIGN.md", "PORTING.md"):
        assert f"]({doc})" in text, f"README.md does not link {doc}"


def test_figures_are_embedded_and_exist():
    for doc in DOCS:
        images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", read(doc))
        missing = [p for p in images if not (ROOT / p).is_file()]
        assert not missing, f"{doc} embeds missing files {missing}"
        if doc == "README.md":
            assert len(set(images)) >= 4, f"README.md embeds {len(set(images))} figures"


def test_readme_quotes_only_numbers_results_md_has():
    """One source: a number in the README's prose (code and inline code aside) is one RESULTS.md states."""
    text = re.sub(r"```.*?```", "", read("README.md"), flags=re.DOTALL)
    text = re.sub(r"`[^`]*`|!\[[^\]]*\]\([^)]*\)", "", text)
    results = set(re.findall(NUMBER, read("RESULTS.md")))
    stray = sorted(set(re.findall(NUMBER, text)) - results - NOT_RESULTS)
    assert not stray, f"README.md quotes numbers RESULTS.md does not have: {stray}"


def layer_table(text: str) -> dict[str, int]:
    """{module or package: layer} from the rows `| N | `a.py`, `b/` | ... |` of a document's layer table."""
    table = {}
    for layer, files in re.findall(r"^\| (\d+) \| ([^|]*) \|", text, flags=re.MULTILINE):
        for package, name in re.findall(r"`(?:(lab|port)/)?([\w]+)(?:\.py|/)`", files):
            table[f"{package}.{name}" if package else name] = int(layer)
    return table


@pytest.mark.parametrize("doc", ["README.md", "DESIGN.md"])
def test_layer_tables_are_the_enforced_one(doc):
    table = layer_table(read(doc))
    keys = table.keys() | LAYERS.keys()
    wrong = {k: (table.get(k), LAYERS.get(k)) for k in keys if table.get(k) != LAYERS.get(k)}
    assert not wrong, f"{doc}'s layer table and tests/test_layers.py's LAYERS differ: {wrong}"


@pytest.mark.parametrize("doc", DOCS)
def test_documents_describe_the_code_not_its_history(doc):
    history = r"\bthis version\b|\brenamed in\b|\bissue \d+|\(issue\b|\bwas lent\b|\bnot lent\b|\btarget is missed\b"
    found = re.findall(history, read(doc), flags=re.IGNORECASE)
    assert not found, f"{doc}: {found}"


def tracked_files() -> list[Path]:
    try:
        names = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but hidden ones
        files = [p for p in ROOT.rglob("*") if p.is_file()]
        return [p for p in files if not any(s.startswith(".") for s in p.relative_to(ROOT).parts)]
    return [ROOT / n for n in names]


def test_nothing_tracked_points_outside_the_repository():
    needle = b"../" + b"shared"
    hits = [
        str(p.relative_to(ROOT))
        for p in tracked_files()
        if p.is_file() and b"\0" not in (data := p.read_bytes()) and needle in data
    ]
    assert not hits, f"these files refer to a folder outside the repository: {hits}"
