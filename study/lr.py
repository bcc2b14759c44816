"""lr: each loss's clean baseline at several learning rates, and the rate each loss trains at in the study.

Every loss of the study (config.STUDY_LOSSES) trains its clean baseline (the fp32 engine, fresh
weights: no mismatch source) at every rate of LR_GRID[pair], `seeds` seeds each, at the study's schedule
otherwise (config.STUDY_TRAIN). A run *diverged* when its final held-out reverse KL is above its
step-0 value, or when training stopped on a non-finite loss. Each loss's rate is chosen in the open:

    rate(loss) = the rate with the lowest mean final held-out reverse KL among the rates where no seed
                 diverged (a rate needs every seed finished to be chosen).

results/lr_<pair>.json holds every run, the mean and seed SD per (loss, rate), and the choice;
lab.calibrate.study_config reads the choice, so budgets are calibrated at each loss's own rate and record
it. Runs are seed-major (every loss and rate at seed 0 first), and finished runs are reused, so the sweep
resumes after a stop and a partial result already covers every cell once.

    python -m study lr --pair tiny        # 5 losses x 6 rates x 3 seeds of 400 steps
    python -m study lr --pair smollm2     # 5 losses x 5 rates x 2 seeds of 12 steps

A rate chosen at either end of the grid is marked (lr_table: "top of the grid"): the best rate may lie beyond
it, and the grid should grow until the choice is inside.
"""

import json
import math
import statistics
from pathlib import Path

from budget import json_cap
from cli import NonFinite
from config import STUDY_LOSSES
from lab.calibrate import short_run, train_settings
from lab.runfiles import drop_checkpoint
from models import device_label
from study.common import RESULTS, mean_sd, plt_axes, save_figure, slug, write

LR_GRID = {
    # the analytic loss's demo rate is 1.5e-3; 6e-3 added when the analytic loss chose the top, 3e-3
    "tiny": (1e-4, 3e-4, 6e-4, 1.5e-3, 3e-3, 6e-3),
    # the demo rate is 5e-5; the grid grew while its top was best at seed 0: every loss at 1e-4 first, then
    # four of five at 2e-4
    "smollm2": (2e-5, 5e-5, 1e-4, 2e-4, 4e-4),
    "gemma3": (2e-5, 5e-5, 1e-4),
}
LR_SEEDS = {"tiny": 3, "smollm2": 2, "gemma3": 2}


def lr_run(out: Path, pair: str, label: str, lr: float, seed: int, device: str) -> dict:
    """One clean baseline run of loss `label` at rate `lr`: its run_point, or a diverged point when
    training stopped on a non-finite loss (a rerun resumes it and stops the same way)."""
    point = {"loss": label, "lr": lr, "seed": seed}
    try:
        run = short_run(
            out,
            pair,
            run_name(label, lr, seed),
            seed=seed,
            device=device,
            rollout_over={},
            lr=lr,
            **STUDY_LOSSES[label],
        )
    except NonFinite as e:
        return {**point, "diverged": True, "stopped": str(e), "eval_rkl": None}
    diverged = not math.isfinite(run["eval_rkl"]) or run["eval_rkl"] > run["eval_rkl_start"]
    return {**point, **run, "diverged": diverged}


def run_name(label: str, lr: float, seed: int) -> str:
    """The run folder of one sweep run, under runs/study/lr_<pair>/."""
    return f"{slug(label)}-lr{lr:g}-seed{seed}"


def choose(points: list[dict], grid: tuple, seeds: int) -> tuple[list[dict], dict]:
    """Per (loss, rate): mean and seed SD of the final held-out reverse KL and greedy accuracy, how many
    seeds finished and diverged; and each loss's chosen rate (None while no rate qualifies)."""
    cells, chosen = [], {}
    for label in STUDY_LOSSES:
        for lr in grid:
            runs = [p for p in points if p["loss"] == label and p["lr"] == lr]
            ok = [p for p in runs if not p["diverged"]]
            rkl = mean_sd([p["eval_rkl"] for p in ok]) if ok else (None, None)
            acc = mean_sd([p["eval_acc"] for p in ok]) if ok and ok[0].get("eval_acc") is not None else None
            cells.append(
                {
                    "loss": label,
                    "lr": lr,
                    "seeds": len(runs),
                    "diverged": len(runs) - len(ok),
                    "eval_rkl_mean": rkl[0],
                    "eval_rkl_sd": rkl[1],
                    "eval_acc_mean": acc[0] if acc else None,
                }
            )
        ready = [c for c in cells if c["loss"] == label and c["seeds"] == seeds and c["diverged"] == 0]
        best = min(ready, key=lambda c: c["eval_rkl_mean"], default=None)
        chosen[label] = best["lr"] if best else None
    return cells, chosen


def recorded_points(pair: str) -> dict:
    """The points of an earlier sweep's results/lr_<pair>.json, by (loss, rate, seed), when it was made at
    today's settings and losses (its runs need not be on disk: a sweep resumes from its committed record);
    {} otherwise."""
    path = RESULTS / f"lr_{pair}.json"
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(old, dict)
        or old.get("settings") != sweep_settings(pair)
        or old.get("losses") != losses()
    ):
        return {}
    return {(p["loss"], p["lr"], p["seed"]): p for p in old.get("points", []) if isinstance(p, dict)}


def lr_sweep(pair: str, seeds: int, device: str) -> dict:
    """Run (or reuse) every loss x rate x seed, seed-major, taking the points results/lr_<pair>.json already
    records; rewrite that file after every run, so a stop loses at most the run in progress. A run's
    checkpoint is deleted once its point is recorded: the sweep reads only the record, and smollm2's
    checkpoints (1.4 GB a run, 50 runs) would not fit beside each other on a laptop's disk."""
    out = Path("runs") / "study" / f"lr_{pair}"
    grid, points, recorded = LR_GRID[pair], [], recorded_points(pair)
    jobs = [(s, lr, label) for s in range(seeds) for lr in grid for label in STUDY_LOSSES]
    for i, (seed, lr, label) in enumerate(jobs):
        if (label, lr, seed) in recorded:
            points.append(recorded[(label, lr, seed)])
            continue
        print(f"[{i + 1}/{len(jobs)}] {label} lr {lr:g} seed {seed}", flush=True)
        points.append(
            {**lr_run(out, pair, label, lr=lr, seed=seed, device=device), "device": device_label(device)}
        )
        write(f"lr_{pair}", lr_result(pair, points, seeds=seeds, device=device))
        drop_checkpoint(out / run_name(label, lr, seed))
    result = lr_result(pair, points, seeds=seeds, device=device)
    write(f"lr_{pair}", result)
    plot_lr(result, RESULTS / f"lr_{pair}.png")
    return result


def sweep_settings(pair: str) -> dict:
    """The training settings every run of the sweep shares (all but the loss and the rate)."""
    return {
        k: v
        for k, v in train_settings(pair).items()
        if k not in ("lr", "loss", "tis_cap", "center_advantages")
    }


def losses() -> dict:
    """STUDY_LOSSES as JSON records them (an uncapped TIS weight as "inf")."""
    return {
        label: {k: json_cap(v) if k == "tis_cap" else v for k, v in loss.items()}
        for label, loss in STUDY_LOSSES.items()
    }


QUALITY_MEASURES = {  # the candidate measures of a run's final quality, from its evaluations (step, eval_rkl)
    "final": lambda evals: evals[-1][1],
    "mean of the last two": lambda evals: statistics.fmean(e[1] for e in evals[-2:]),
}


def seed_noise(points: list[dict]) -> dict:
    """Where the noise of a run's quality comes from, per loss: the across-seed SD of each QUALITY_MEASURES
    measure, pooled over the rates where every finished seed stayed finite and none diverged,
        sd² = Σ_rate Σ_seed (x − mean_rate)² / Σ_rate (seeds_rate − 1),
    with its degrees of freedom. Seeds differ in training prompts, sampling and initial order only (the
    evaluation prompts are the same held-out set), so this is training noise plus the evaluation's own
    sampling noise, which lab.calibrate.eval_noise measures apart."""
    out = {}
    for label in STUDY_LOSSES:
        groups: dict[float, list[dict]] = {}
        for p in points:
            if p["loss"] == label and p.get("eval_rkl_by_step"):
                groups.setdefault(p["lr"], []).append(p)
        ok = [g for g in groups.values() if len(g) > 1 and not any(p["diverged"] for p in g)]
        dof = sum(len(g) - 1 for g in ok)
        row = {"dof": dof}
        for name, measure in QUALITY_MEASURES.items():
            values = [[measure(p["eval_rkl_by_step"]) for p in g] for g in ok]
            ss = sum((x - statistics.fmean(v)) ** 2 for v in values for x in v)
            row[name] = math.sqrt(ss / dof) if dof else None
        out[label] = row
    return out


def lr_result(pair: str, points: list[dict], seeds: int, device: str) -> dict:
    cells, chosen = choose(points, LR_GRID[pair], seeds)
    complete = len(points) == len(LR_GRID[pair]) * len(STUDY_LOSSES) * seeds
    return {
        "experiment": "lr",
        "pair": pair,
        "command": f"python -m study lr --pair {pair} --seeds {seeds}",
        "device": " and ".join(sorted({p.get("device", device_label(device)) for p in points})),
        "rule": "per loss, the rate with the lowest mean final held-out reverse KL among rates where no seed "
        "diverged (final eval reverse KL above step 0, or a non-finite loss)",
        "complete": complete,
        "grid": list(LR_GRID[pair]),
        "seeds": seeds,
        "settings": sweep_settings(pair),
        "losses": losses(),
        "chosen": chosen if complete else {},
        "seed_noise": seed_noise(points),
        "cells": cells,
        "points": points,
    }


def plot_lr(result: dict, path: Path) -> None:
    """Final held-out reverse KL against the rate, one line per loss (seed SD bars), diverged seeds as x,
    the chosen rate circled, the untrained student's value dashed."""
    _, fig, (ax,) = plt_axes(1, width=7.0)
    for label in STUDY_LOSSES:
        cells = [c for c in result["cells"] if c["loss"] == label and c["eval_rkl_mean"] is not None]
        if not cells:
            continue
        line = ax.errorbar(
            [c["lr"] for c in cells],
            [c["eval_rkl_mean"] for c in cells],
            yerr=[c["eval_rkl_sd"] for c in cells],
            marker="o",
            capsize=3,
            label=label,
        )
        bad = [c for c in result["cells"] if c["loss"] == label and c["diverged"]]
        ax.scatter(
            [c["lr"] for c in bad],
            [c["eval_rkl_mean"] or 0 for c in bad],
            marker="x",
            color=line[0].get_color(),
        )
        lr = result["chosen"].get(label)
        if lr is not None:
            c = next(c for c in cells if c["lr"] == lr)
            ax.scatter([lr], [c["eval_rkl_mean"]], s=160, facecolors="none", edgecolors=line[0].get_color())
    starts = [p["eval_rkl_start"] for p in result["points"] if p.get("eval_rkl_start") is not None]
    if starts:
        ax.axhline(starts[0], color="grey", ls="--", lw=1, label="untrained student")
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final held-out reverse KL (nats/token)")
    ax.legend(fontsize=8)
    title = f"{result['pair']}: clean baselines by learning rate (circled: chosen; x: diverged)"
    save_figure(None, fig, path, title=title)


def lr_table(result: dict) -> str:
    """A markdown table: one row per loss, one column per rate, each cell the mean ± seed SD of the final
    held-out reverse KL over the seeds run (n), diverged seeds counted; the chosen rate last."""
    grid = result["grid"]
    rows = [
        "| loss | " + " | ".join(f"lr {lr:g}" for lr in grid) + " | chosen |",
        "|---|" + "---|" * (len(grid) + 1),
    ]
    for label in result["losses"]:
        cells = []
        for lr in grid:
            c = next((c for c in result["cells"] if c["loss"] == label and c["lr"] == lr), None)
            if c is None or c["seeds"] == 0:
                cells.append("not run")
                continue
            value = (
                "diverged"
                if c["eval_rkl_mean"] is None
                else f"{c['eval_rkl_mean']:.3f} ± {c['eval_rkl_sd']:.3f}"
            )
            cells.append(
                f"{value} (n {c['seeds']}" + (f", {c['diverged']} diverged)" if c["diverged"] else ")")
            )
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {chosen_text(result, label)} |")
    state = (
        "complete" if result["complete"] else "incomplete: no rate chosen yet; rerun the command to continue"
    )
    table = "\n".join(rows) + f"\n\nFinal held-out reverse KL, nats/token ({state}; {result['device']})."
    return table + noise_table(result.get("seed_noise"))


def chosen_text(result: dict, label: str) -> str:
    """The rate chosen for a loss, marked where it is an end of the grid (the best rate may lie beyond)."""
    chosen, grid = result["chosen"].get(label), result["grid"]
    if not chosen:
        return "—"
    edge = {max(grid): ", top of the grid", min(grid): ", bottom of the grid"}.get(chosen, "")
    return f"{chosen:g}{edge}"


def noise_table(noise: dict | None) -> str:
    """seed_noise as a markdown table: per loss, the pooled across-seed SD of each quality measure."""
    if not noise:
        return ""
    names = list(QUALITY_MEASURES)
    rows = [
        "| loss | " + " | ".join(f"SD of the {n}" for n in names) + " | dof |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for label, row in noise.items():
        cells = [f"{row[n]:.3f}" if row[n] is not None else "—" for n in names]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {row['dof']} |")
    return (
        "\n\nSeed noise: the across-seed SD of a run's held-out reverse KL, pooled over the rates where no "
        "seed diverged (training seeds and the evaluation's own sampling together).\n\n" + "\n".join(rows)
    )
