"""drift: dumps come from training, budgets from probes; how far apart the two measurements are.

A log dump is written during someone's training run: training prompts, a student that moves every step. The
budget's axis is check's probe measurement: held-out prompts, the untrained student. This reads the
calibration runs a budget was fitted from. Every run logged, at every step, the exact mismatch of its own
training batch (train.py's mismatch_kl: what a perfect dump of that step would estimate). For each
configuration it compares that training mismatch over the first, middle and last tenth of the run with the
probe measurement of the same configuration:

    ratio = mean_{steps in window} mismatch_kl(train batch, step) / probe mismatch_kl,

averaged over the seeds. A ratio near 1 reads a dump's verdict as is; a ratio r far from 1 means a dump
taken in that window reads r times what check would measure for the same engine.

    python -m study drift --budget budgets/tiny/budget.json
"""

import json
import statistics
from pathlib import Path

from budget import loss_label, read_budget
from cli import BadInput
from lab.atomic import atomic_write_text
from lab.calibrate import run_name
from lab.runfiles import read_metrics
from study.common import RESULTS

WINDOWS = ("first", "middle", "last")


def windows(n_steps: int) -> dict[str, range]:
    """The steps of each window: a tenth of the run (at least one step) at its start, middle and end."""
    w = max(1, n_steps // 10)
    mid = max(1, (n_steps + 1) // 2 - (w - 1) // 2)
    return {
        "first": range(1, w + 1),
        "middle": range(mid, mid + w),
        "last": range(n_steps - w + 1, n_steps + 1),
    }


def window_means(metrics_path: Path) -> dict[str, float]:
    """Mean training mismatch_kl of each window of one finished run (its metrics.jsonl)."""
    records = read_metrics(metrics_path, upto=10**9)  # a torn last line from a killed run is dropped
    by_step = {r["step"]: r["mismatch_kl"] for r in records if "mismatch_kl" in r}
    if not by_step:
        raise BadInput(f"{metrics_path}: no step logged mismatch_kl (not a finished training run)")
    spans = windows(max(by_step))
    return {
        name: statistics.fmean(by_step[s] for s in steps if s in by_step) for name, steps in spans.items()
    }


def ratio(values: list[float], probes: list[float]) -> float | None:
    """Mean over seeds of training / probe mismatch; None when every probe measured exactly zero."""
    pairs = [v / p for v, p in zip(values, probes) if p > 0]
    return statistics.fmean(pairs) if pairs else None


def drift(budget_path: Path) -> dict:
    """Per configuration (baseline excluded: no mismatch to compare), the probe mismatch and each window's
    training mismatch and ratio, averaged over the calibration's seeds; written to results/."""
    budget = read_budget(budget_path, None, needs=("pair", "points", "steps", "seeds"))
    runs = budget_path.parent / "runs"
    rows: dict[str, dict] = {}
    for p in budget["points"]:
        if p["source"] == "baseline":
            continue
        metrics = runs / run_name(p["source"], p["seed"]) / "metrics.jsonl"
        if not metrics.is_file():
            raise BadInput(
                f"{metrics}: missing; rerun `{budget.get('command', 'python -m lab.calibrate')}` first"
            )
        row = rows.setdefault(p["source"], {"probe": [], **{w: [] for w in WINDOWS}})
        row["probe"].append(p["mismatch"])
        for name, value in window_means(metrics).items():
            row[name].append(value)
    table = {
        source: {
            "probe": statistics.fmean(r["probe"]),
            **{w: statistics.fmean(r[w]) for w in WINDOWS},
            **{f"{w}_ratio": ratio(r[w], r["probe"]) for w in WINDOWS},
        }
        for source, r in rows.items()
    }
    label = loss_label(budget["loss"], budget["tis_cap"])
    result = {
        "pair": budget["pair"],
        "loss": label,
        "budget": str(budget_path),
        "steps": budget["steps"],
        "seeds": budget["seeds"],
        "rows": table,
    }
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(RESULTS / f"drift_{budget['pair']}_{label}.json", json.dumps(result, indent=1) + "\n")
    return result


def drift_table(result: dict) -> str:
    """Markdown: per configuration, the probe mismatch, the training mismatch per window and its ratio."""
    lines = [
        "| configuration | probe (check) | first tenth | middle | last tenth |",
        "|---|---|---|---|---|",
    ]
    for source, r in result["rows"].items():
        cells = " | ".join(
            f"{r[w]:.3g} (×{r[w + '_ratio']:.2f})" if r[w + "_ratio"] is not None else f"{r[w]:.3g}"
            for w in WINDOWS
        )
        lines.append(f"| {source} | {r['probe']:.3g} | {cells} |")
    return "\n".join(lines) + (
        f"\n\n{result['pair']}, loss {result['loss']}: the calibration runs of `{result['budget']}` "
        f"({result['steps']} steps × {result['seeds']} seeds); training mismatch (× its ratio to the probe "
        "measurement), nats/token."
    )
