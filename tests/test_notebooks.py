"""The course: every notebook runs top to bottom in short mode (OPD_SHORT=1 shrinks steps and probes) with
the exercise answers filled in (OPD_SOLUTIONS=1), and fails the suite on any cell error: a failed exercise
check, or a failed assert behind a sentence of the prose. Then every exercise is left as its stub, and each
check must say "not written yet" instead of raising; and with the planted wrong answers (OPD_MISTAKES=1), each
of their checks must say "wrong." with a message that names the mistake."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STUB_TAGS = {"setup", "exercise", "check"}  # the cells the stub run executes


def execute(nb, path: Path, tmp_path: Path, monkeypatch, solutions: bool, mistakes: bool = False) -> str:
    monkeypatch.setenv("OPD_SHORT", "1")
    monkeypatch.setenv("OPD_NOTEBOOK_OUT", str(tmp_path))  # runs and figures of the short run go here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, on in (("OPD_SOLUTIONS", solutions), ("OPD_MISTAKES", mistakes)):
        if on:
            monkeypatch.setenv(name, "1")
        else:
            monkeypatch.delenv(name, raising=False)
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources)
    client.execute()
    return "\n".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))


def tagged(cell, tags) -> bool:
    return bool(tags & set(cell.get("metadata", {}).get("tags", [])))


def test_the_course_has_its_notebooks():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names == ["00", "01", "02", "03", "04", "05", "06", "07"], names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_short_mode_with_the_answers(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    text = execute(nb, path, tmp_path, monkeypatch, solutions=True)
    assert "Traceback" not in text
    checks = sum(tagged(c, {"check"}) for c in nb.cells)
    assert text.count(": correct") == checks, f"{text.count(': correct')} checks passed of {checks}"


def stub_cells():
    """All notebooks' setup, exercise and check cells, in order, as one notebook."""
    merged = nbformat.v4.new_notebook()
    for path in NOTEBOOKS:
        merged.cells += [c for c in nbformat.read(path, as_version=4).cells if tagged(c, STUB_TAGS)]
    return merged


@pytest.mark.slow
def test_every_stub_fails_its_check_with_a_message(tmp_path, monkeypatch):
    """All notebooks' setup, exercise and check cells, in one kernel, with the stubs left as they ship."""
    merged = stub_cells()
    checks = sum(tagged(c, {"check"}) for c in merged.cells)
    exercises = sum(tagged(c, {"exercise"}) for c in merged.cells)
    assert checks >= exercises >= 17, (checks, exercises)
    text = execute(merged, NOTEBOOKS[0], tmp_path, monkeypatch, solutions=False)
    assert "Traceback" not in text
    assert text.count("not written yet") == checks, text
    assert ": correct" not in text and "wrong." not in text


# The exercises with a planted wrong answer (notebooks/solutions/mistakes.py), by their check's name, and the
# words its message must contain: the name of the classic mistake, not only the failing case.
PLANTED = {
    "Exercise 3, my_opd_loss": "per sequence",  # a mean of per-sequence means, not over all tokens
    "Exercise 4b, my_sampler_loss": "trainer's log-prob",  # the advantage from the trainer, not the sampler
    "Exercise 2, my_bootstrap_ci": "resampled tokens, not sequences",  # a token-level bootstrap
    "Exercise 1, my_verdict": "strict",  # <= where the rule is <
    "Exercise 2, my_budget": "interpolate",  # a grid point, not the crossing
}


@pytest.mark.slow
def test_every_planted_mistake_is_named_by_its_check(tmp_path, monkeypatch):
    """The same cells in one kernel with OPD_MISTAKES=1: each planted wrong answer fails its check with a
    message naming its mistake; every other exercise is still its stub."""
    merged = stub_cells()
    checks = sum(tagged(c, {"check"}) for c in merged.cells)
    text = execute(merged, NOTEBOOKS[0], tmp_path, monkeypatch=monkeypatch, solutions=False, mistakes=True)
    assert "Traceback" not in text
    lines = text.splitlines()
    for what, words in PLANTED.items():
        found = [line for line in lines if line.startswith(f"✗ {what}: wrong.")]
        assert len(found) == 1, f"{what}: no 'wrong.' line\n{text}"
        assert words in found[0], f"{what}: the message does not name the mistake ({words!r}): {found[0]}"
    assert text.count("wrong.") == len(PLANTED), text
    assert text.count("not written yet") == checks - len(PLANTED), text
    assert ": correct" not in text
