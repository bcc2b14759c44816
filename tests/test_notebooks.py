"""The course: every notebook runs top to bottom in short mode (OPD_SHORT=1 shrinks steps and probes), and
fails the suite on any cell error, including a failed exercise check."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_course_has_its_notebooks():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names == ["01", "02", "03", "04", "05", "06"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_short_mode(path, tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_SHORT", "1")
    monkeypatch.setenv("OPD_NOTEBOOK_OUT", str(tmp_path))  # runs and figures of the short run go here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    text = "\n".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "Traceback" not in text
