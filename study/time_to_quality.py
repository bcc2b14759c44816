"""async: time-to-quality for sync/async × bf16/fp8 rollout weights (smollm2 on CPU by default).

The quality target is 80% of the sync-bf16 run's held-out improvement; steps-to-quality is the first
evaluation that reaches it, wall-clock-to-quality the training seconds (evaluation excluded) up to that
step. A modeled GPU projection (labelled as such) is printed beside the measurement.

    python -m study async
"""

import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from lab.train_args import pair_config
from models import device_label
from study.common import RESULTS, plt_axes, save_figure, write
from train import run_or_resume

# ---------------------------------------------------------------------------------------------------
# async: time-to-quality

ASYNC_VARIANTS = [
    ("sync bf16", {}, {"weights": "bf16"}),
    ("sync fp8", {}, {"weights": "fp8"}),
    ("async bf16", {"async_rollout": True}, {"weights": "bf16"}),
    ("async fp8", {"async_rollout": True}, {"weights": "fp8"}),
]


def time_to_quality(records: list[dict], target: float) -> tuple[int | None, float | None]:
    """First step whose held-out reverse KL is <= target, and the training seconds (no evaluation) up
    to it."""
    elapsed = 0.0
    for r in records:
        elapsed += r["seconds"]
        if r["step"] > 0 and r.get("eval_rkl", float("inf")) <= target:
            return r["step"], elapsed
    return None, None


def modeled_gpu(gen_fraction: float, fp8_gen_ratio: float) -> dict:
    """MODELED, not measured. With generation taking fraction f of a sync bf16 step (the rest training),
        sync bf16 = 1,  async bf16 = max(f, 1 − f),  sync fp8 = f·r + (1 − f),  async fp8 = max(f·r, 1 − f)
    where r = fp8/bf16 decode time, taken as the ratio of bytes read per decoded token \
(memory-bound decode)."""
    # async_study writes this docstring out as the formula; the \ above keeps its last line unbroken.
    f, r = gen_fraction, fp8_gen_ratio
    return {
        "sync bf16": 1.0,
        "async bf16": max(f, 1 - f),
        "sync fp8": f * r + 1 - f,
        "async fp8": max(f * r, 1 - f),
    }


def async_study(pair_name: str, steps: int, device: str) -> dict:
    out = RESULTS / "runs" / f"async_{pair_name}"
    wall, histories = {}, {}
    for label, train_over, roll_over in tqdm(ASYNC_VARIANTS, desc="time-to-quality", unit="run"):
        cfg = pair_config(
            pair_name,
            device=device,
            steps=steps,
            eval_every=2,
            name=label.replace(" ", "_"),
            out_dir=str(out),
            **train_over,
        )
        cfg.rollout = replace(cfg.rollout, **roll_over)
        t0 = time.time()
        histories[label] = run_or_resume(cfg)
        wall[label] = time.time() - t0
    base = [r for r in histories["sync bf16"] if "eval_rkl" in r]
    target = base[0]["eval_rkl"] - 0.8 * (base[0]["eval_rkl"] - base[-1]["eval_rkl"])
    rows = []
    for label, records in histories.items():
        step, seconds = time_to_quality(records, target)
        train = [r for r in records if r["step"] > 0]
        rows.append(
            {
                "variant": label,
                "steps_to_quality": step,
                "seconds_to_quality": seconds,
                "seconds_per_step": sum(r["seconds"] for r in train) / len(train),
                "sample_seconds_per_step": sum(r["sample_seconds"] for r in train) / len(train),
                "final_eval_rkl": [r for r in records if "eval_rkl" in r][-1]["eval_rkl"],
                "mean_mismatch": sum(r["mismatch_kl"] for r in train) / len(train),
                "wall_seconds_this_call": wall[label],
            }
        )
    sync_bf16 = rows[0]
    f = sync_bf16["sample_seconds_per_step"] / sync_bf16["seconds_per_step"]
    result = {
        "pair": pair_name,
        "steps": steps,
        "target_eval_rkl": target,
        "device": device_label(device),
        "rows": rows,
        "histories": {
            k: [{key: r.get(key) for key in ("step", "seconds", "sample_seconds", "eval_rkl")} for r in v]
            for k, v in histories.items()
        },
        "modeled_gpu": {
            "formula": modeled_gpu.__doc__.strip(),
            "fp8_gen_ratio": 0.5,
            "by_gen_fraction": {str(g): modeled_gpu(g, 0.5) for g in (0.5, 0.7, 0.9)},
            "measured_cpu_gen_fraction": f,
        },
    }
    write(f"async_{pair_name}", result)
    plot_async(result, RESULTS / f"async_{pair_name}.png")
    return result


def plot_async(result: dict, path: Path) -> None:
    plt, fig, axes = plt_axes(2, 5.2)
    for i, (label, hist) in enumerate(result["histories"].items()):
        evals, elapsed, t = [], 0.0, []
        for r in hist:
            elapsed += r["seconds"] or 0.0
            if r["eval_rkl"] is not None:
                evals.append(r)
                t.append(elapsed)
        axes[0].plot(
            [r["step"] for r in evals], [r["eval_rkl"] for r in evals], "o-", color=f"C{i}", label=label
        )
        axes[1].plot(t, [r["eval_rkl"] for r in evals], "o-", color=f"C{i}", label=label)
    for ax, xl in zip(axes, ("step", "training wall-clock seconds (evaluation excluded)")):
        ax.axhline(result["target_eval_rkl"], color="k", ls=":", lw=0.8, label="quality target")
        ax.set(xlabel=xl, ylabel="held-out reverse KL (nats/token)")
        ax.legend(fontsize=8)
    save_figure(plt, fig, path, title=f"Time to quality, {result['pair']}: MEASURED on {result['device']}")


def async_table(result: dict) -> str:
    lines = [
        (
            "| variant | s/step | of which waiting for samples | steps to quality | training s to quality "
            "| final RKL | mean mismatch |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        stq = "not reached" if r["steps_to_quality"] is None else str(r["steps_to_quality"])
        sq = "–" if r["seconds_to_quality"] is None else f"{r['seconds_to_quality']:.0f}"
        lines.append(
            f"| {r['variant']} | {r['seconds_per_step']:.1f} | {r['sample_seconds_per_step']:.1f} | "
            f"{stq} | {sq} | {r['final_eval_rkl']:.3f} | {r['mean_mismatch']:.3g} |"
        )
    m = result["modeled_gpu"]
    lines.append(
        f"\nMeasured on {result['device']}; quality target: held-out RKL <= {result['target_eval_rkl']:.3f}."
    )
    lines.append(
        f"\nMODELED GPU projection (not measured): relative step time, r = {m['fp8_gen_ratio']} "
        "(fp8/bf16 bytes per decoded token).\n"
        f"{m['formula']}\n"
    )
    lines.append(
        "| generation fraction f | " + " | ".join(m["by_gen_fraction"]["0.5"]) + " |\n|---|" + "---|" * 4
    )
    for f, row in m["by_gen_fraction"].items():
        lines.append(f"| {f} | " + " | ".join(f"{v:.2f}" for v in row.values()) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# report
