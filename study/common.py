"""What every experiment of the study shares: its results folder, sweeps of short runs, plots."""

import json
import re
import statistics
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from lab.atomic import atomic_write_text
from lab.calibrate import short_run
from lab.runfiles import atomic_savefig, drop_checkpoint

RESULTS = Path("results")


def slug(label: str) -> str:
    """A run-folder name for a label: "sampled+TIS noise 0.1" -> "sampled_TIS_noise_0.1"."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", label)


def sweep(
    out: Path,
    pair: str,
    plan: list[tuple[str, dict, dict]],
    seeds: int,
    device: str,
    desc: str,
    recorded: dict | None = None,
    **common,
) -> list[dict]:
    """Run (or reuse) every (label, TrainConfig overrides, RolloutConfig overrides) × seed; one point each.
    A (label, seed) in `recorded` (a committed result's points, same settings) is taken from it, marked
    "reused", instead of trained again. A finished run keeps its record, not its checkpoint
    (lab.runfiles.drop_checkpoint): a resumed sweep reuses it from the record."""
    jobs = [
        (label, train_over, roll_over, seed) for label, train_over, roll_over in plan for seed in range(seeds)
    ]
    points = []
    for label, train_over, roll_over, seed in tqdm(jobs, desc=desc, unit="run"):
        if old := (recorded or {}).get((label, seed)):
            points.append({**old, "reused": True})
            continue
        name = f"{slug(label)}-seed{seed}"
        run = short_run(
            out, pair, name, seed=seed, device=device, rollout_over=roll_over, **{**common, **train_over}
        )
        drop_checkpoint(out / name)
        points.append({"label": label, "seed": seed, **train_over, **roll_over, **run})
    return points


def paired(points: list[dict], key: str, baseline_of) -> None:
    """Adds Δkey = point[key] − the same-seed baseline point's key (baseline_of(point) -> baseline label)."""
    base = {(p["label"], p["seed"]): p for p in points}
    for p in points:
        b = base[(baseline_of(p), p["seed"])]
        p[f"delta_{key}"] = p[key] - b[key] if p[key] is not None else None


def values_by(points: list[dict], label: str, key: str) -> list[float]:
    """key of every point (one per seed) of a label."""
    return [p[key] for p in points if p["label"] == label]


def mean_by(points: list[dict], label: str, key: str) -> float:
    vals = values_by(points, label, key)
    return sum(vals) / len(vals)


def mean_sd(vals: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation across seeds; 0 for one seed)."""
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def write(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return path


def plt_axes(ncols: int, width: float = 5.0):
    """A bare Figure with `ncols` axes (no pyplot: no global backend change). Returns (None, fig, axes)."""
    fig = Figure(figsize=(width * ncols, 4))
    return None, fig, fig.subplots(1, ncols, squeeze=False)[0]


def save_figure(_, fig, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path)
