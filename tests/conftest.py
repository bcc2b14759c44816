"""Shared fixtures: the committed tiny pair, a random tiny model, an assert_close that reports sizes, and
run_cli, a project command run in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Under pytest-xdist each worker gets its share of the cores, and so do the subprocesses and notebook kernels
# it starts (they inherit OMP_NUM_THREADS): more compute threads than cores make every one of them wait.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

from models import load_pair, tiny_config, tiny_tokenizer  # noqa: E402


def run_cli(*args, cwd, entry: str = "admit.py") -> subprocess.CompletedProcess:
    """Run a project command from `cwd`: a script (admit.py) or a module (lab.calibrate, run with -m), offline,
    with the repository on the path."""
    command = ["-m", entry] if not entry.endswith(".py") else [str(ROOT / entry)]
    return subprocess.run(
        [sys.executable, *command, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """Fail with the max and mean absolute difference, not just 'not close'."""
    diff = (actual.float() - expected.float()).abs()
    assert diff.max().item() <= atol, (
        f"{what}: max |diff| {diff.max().item():.3g} > {atol:g} (mean {diff.mean().item():.3g})"
    )


@pytest.fixture(scope="session")
def tiny_pair():
    return load_pair("tiny")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def random_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("student")).eval()
