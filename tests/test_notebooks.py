"""The course: every notebook runs top to bottom in short mode (OPD_SHORT=1 shrinks steps and probes) with
the exercise answers filled in (OPD_SOLUTIONS=1), and fails the suite on any cell error: a failed exercise
check, or a failed assert behind a sentence of the prose. Then every exercise is left as its stub, and each
check must say "not written yet" instead of raising."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STUB_TAGS = {"setup", "exercise", "check"}  # the cells the stub run executes


def execute(nb, path: Path, tmp_path: Path, monkeypatch, solutions: bool) -> str:
    monkeypatch.setenv("OPD_SHORT", "1")
    monkeypatch.setenv("OPD_NOTEBOOK_OUT", str(tmp_path))  # runs and figures of the short run go here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if solutions:
        monkeypatch.setenv("OPD_SOLUTIONS", "1")
    else:
        monkeypatch.delenv("OPD_SOLUTIONS", raising=False)
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources)
    client.execute()
    return "\n".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))


def tagged(cell, tags) -> bool:
    return bool(tags & set(cell.get("metadata", {}).get("tags", [])))


def test_the_course_has_its_notebooks():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names == ["00", "01", "02", "03", "04", "05", "06"], names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_short_mode_with_the_answers(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    text = execute(nb, path, tmp_path, monkeypatch, solutions=True)
    assert "Traceback" not in text
    checks = sum(tagged(c, {"check"}) for c in nb.cells)
    assert text.count(": correct") == checks, f"{text.count(': correct')} checks passed of {checks}"


@pytest.mark.slow
def test_every_stub_fails_its_check_with_a_message(tmp_path, monkeypatch):
    """All notebooks' setup, exercise and check cells, in one kernel, with the stubs left as they ship."""
    merged = nbformat.v4.new_notebook()
    for path in NOTEBOOKS:
        merged.cells += [c for c in nbformat.read(path, as_version=4).cells if tagged(c, STUB_TAGS)]
    checks = sum(tagged(c, {"check"}) for c in merged.cells)
    exercises = sum(tagged(c, {"exercise"}) for c in merged.cells)
    assert checks >= exercises >= 17, (checks, exercises)
    text = execute(merged, NOTEBOOKS[0], tmp_path, monkeypatch, solutions=False)
    assert "Traceback" not in text
    assert text.count("not written yet") == checks, text
    assert ": correct" not in text and "wrong." not in text
