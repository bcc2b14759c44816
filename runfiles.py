"""A run folder, runs/<name>/: its lock, config, metrics, checkpoints and plots.

    .lock            {"pid", "host"} of the process that owns the folder; a second process is refused, a lock
                     whose process is gone is taken over (with a note)
    config.json      every setting (train.TrainConfig, RolloutConfig inside)
    metrics.jsonl    one strict-JSON object per step, appended and fsync'ed (a non-finite number is null)
    checkpoint.pt    written to checkpoint.pt.tmp, then renamed: a reader sees the old one or the new one
    curves.png       training curves

Every write here is atomic or append-only, so a kill at any moment leaves a folder `--resume` can continue.
"""

import json
import math
import os
import socket
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

from cli import BadInput, WriteFailed


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename: the old checkpoint or the new one, never half of one."""
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file, then rename: a reader sees the old file or the new one, never half of it."""
    _atomic(path, lambda tmp: tmp.write_text(text))


def _atomic(path: Path, write) -> None:
    """write(tmp), then rename tmp over path. A failed write (a full disk: torch.save raises RuntimeError,
    plain writes OSError) removes tmp, leaves path as it was, and raises WriteFailed naming the file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WriteFailed(
            f"could not write {path} ({reason}); its previous version is intact: free space and resume"
        ) from e
    os.replace(tmp, path)


def strict(value):
    """JSON has no NaN or infinity: they become null (a metric that was not a number is not a number)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps_strict(obj) -> str:
    return json.dumps(strict(obj), allow_nan=False)


def read_metrics(path: Path, upto: int) -> list[dict]:
    """Metric lines with step <= upto; a torn last line from a killed run is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= upto:
            records.append(rec)
    return records


def append_metrics(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(dumps_strict(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(path: Path, device) -> dict:
    """A checkpoint, or one BadInput line saying why it cannot be used."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file: pickle, zip and tensor errors all land here
        raise BadInput(
            f"--resume: {path} cannot be read ({type(e).__name__}); remove it to restart that run from step 0"
        ) from None
    if not isinstance(state, dict) or not {"step", "student", "optimizer"} <= state.keys():
        raise BadInput(f"--resume: {path} is not a checkpoint of train.py (missing step/student/optimizer)")
    return state


def clean_leftovers(run_dir: Path) -> None:
    """Remove *.tmp files a killed save left behind (they are never read), with a note."""
    for tmp in run_dir.glob("*.tmp"):
        print(
            f"note: removing {tmp} ({tmp.stat().st_size / 2**20:.0f} MiB), left by an interrupted save",
            file=sys.stderr,
        )
        tmp.unlink()


def summary(records: list[dict]) -> str:
    evals = [r for r in records if r.get("eval_rkl") is not None]
    first, last = evals[0], evals[-1]
    drop = 1 - last["eval_rkl"] / first["eval_rkl"] if first["eval_rkl"] > 0 else 0.0
    text = f"held-out reverse KL {first['eval_rkl']:.3f} -> {last['eval_rkl']:.3f} nats/token "
    text += f"({drop:.0%} lower)"
    if "eval_acc" in first:
        text += f"; held-out accuracy {first['eval_acc']:.3f} -> {last['eval_acc']:.3f}"
    return text + f"; {run_seconds(records):.0f}s"


def run_seconds(records: list[dict]) -> float:
    """Wall-clock seconds of a run: its training steps and its evaluations."""
    return sum(r["seconds"] + r.get("eval_seconds", 0.0) for r in records)


# ---------------------------------------------------------------------------------------------------
# One process per run folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """runs/<name>/.lock, taken with O_EXCL before anything else is written to the folder."""

    def __init__(self, run_dir: Path):
        self.path, self.held = run_dir / ".lock", False

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
            self.held = True
            return
        raise BadInput(f"{self.path.parent}: could not take the run lock {self.path}")

    def _take_over_if_stale(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = (
                None,
                -1,
                socket.gethostname(),
            )  # unreadable: written by a process killed mid-write
        if host != socket.gethostname():
            raise BadInput(
                f"{self.path.parent} is locked by PID {pid} on host {host}; if that run is dead, "
                f"remove {self.path}"
            )
        if pid != -1 and _alive(pid):
            raise BadInput(
                f"{self.path.parent} is in use by PID {pid} on this host; "
                "wait for it, or choose another --name"
            )
        print(f"note: taking over {self.path} from PID {pid}, which is no longer running", file=sys.stderr)
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


# ---------------------------------------------------------------------------------------------------
# Plots


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    train = [r for r in records if r.get("rkl") is not None]
    evals = [r for r in records if r.get("eval_rkl") is not None]
    has_acc = any("eval_acc" in r for r in evals)
    # A bare Figure (no pyplot): nothing global changes, so a notebook's inline plots keep working.
    fig = Figure(figsize=(10 if has_acc else 5.5, 4))
    axes = fig.subplots(1, 2 if has_acc else 1, squeeze=False)
    ax = axes[0, 0]
    ax.plot(
        [r["step"] for r in train],
        [r["rkl"] for r in train],
        label="train reverse KL (on-policy batch)",
        alpha=0.6,
    )
    ax.plot([r["step"] for r in evals], [r["eval_rkl"] for r in evals], "o-", label="held-out reverse KL")
    ax.set(xlabel="step", ylabel="nats / token", title=title)
    ax.legend()
    if has_acc:
        acc = [r for r in evals if "eval_acc" in r]
        axes[0, 1].plot([r["step"] for r in acc], [r["eval_acc"] for r in acc], "o-", color="C2")
        axes[0, 1].set(
            xlabel="step", ylabel="exact-match accuracy (greedy)", title="held-out accuracy", ylim=(0, 1)
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
