"""The study's experiments: sets of short train.py runs, summarised into results/ (JSON + plot each).

validate  The admission check against real training. For candidate rollout configurations that the
          calibration never ran, `admit.py check` gives a verdict in seconds; a real run of the
          calibration's length (same seeds) gives the outcome: within tolerance if its quality loss
              mean over seeds of (final eval reverse KL − the same-seed baseline run's) <= tolerance.
          Agreement = admit & within, or reject & beyond; uncertain verdicts are counted apart.
rl        OPD vs a GRPO baseline (rl.py), with and without TIS, under the same rollout configurations
          (tiny). Each method's quality is compared with its own mismatch-free run (same seed):
              Δ eval_reward = held-out exact-match rate of temperature-1 samples, minus the baseline's
              Δ eval_rkl    = held-out reverse KL to the teacher, minus the baseline's.
prefix    Per-token vs prefix-shift mismatch under weight noise σ, as training proceeds (train.py logs
          mismatch_kl and prefix_kl every step), and the quality loss of three OPD estimators as σ grows:
          analytic (immune to the per-token part), sampled-token, sampled-token + TIS.
async     Time-to-quality for sync/async × bf16/fp8 rollout weights (smollm2 on CPU by default). The
          quality target is 80% of the sync-bf16 run's held-out improvement; steps-to-quality is the first
          evaluation that reaches it, wall-clock-to-quality the training seconds (evaluation excluded)
          up to that step. A modeled GPU projection (labelled as such) is printed beside the measurement.
report    results/SUMMARY.md from the JSON files above, the budgets and the sensitivity results.

Finished runs are reused and killed ones resume (train.run_or_resume), so any command can be rerun.

    python study.py validate --pair tiny     # ~11 min on a 2-core CPU
    python study.py rl                       # ~15 min
    python study.py prefix                   # ~6 min
    python study.py async                    # smollm2, ~10 min
    python study.py report
"""

import json
import re
import time
from dataclasses import replace
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from admit import budget_ci, check, read_budget, short_run, study_config
from cli import EXPECTED, BadInput, Parser, fail, positive_int
from experiments import block_skip
from models import DEVICES, PAIRS, device_label, load_pair, resolve_device
from runfiles import atomic_write_text, read_metrics
from train import pair_config, run_or_resume

RESULTS = Path("results")


def slug(label: str) -> str:
    """A run-folder name for a label: "sampled+TIS noise 0.1" -> "sampled_TIS_noise_0.1"."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", label)


def sweep(
    out: Path, pair: str, plan: list[tuple[str, dict, dict]], seeds: int, device: str, desc: str, **common
) -> list[dict]:
    """Run (or reuse) every (label, TrainConfig overrides, RolloutConfig overrides) × seed; one point each."""
    jobs = [
        (label, train_over, roll_over, seed) for label, train_over, roll_over in plan for seed in range(seeds)
    ]
    points = []
    for label, train_over, roll_over, seed in tqdm(jobs, desc=desc, unit="run"):
        run = short_run(
            out,
            pair,
            f"{slug(label)}-seed{seed}",
            seed=seed,
            device=device,
            rollout_over=roll_over,
            **{**common, **train_over},
        )
        points.append({"label": label, "seed": seed, **train_over, **roll_over, **run})
    return points


def paired(points: list[dict], key: str, baseline_of) -> None:
    """Adds Δkey = point[key] − the same-seed baseline point's key (baseline_of(point) -> baseline label)."""
    base = {(p["label"], p["seed"]): p for p in points}
    for p in points:
        b = base[(baseline_of(p), p["seed"])]
        p[f"delta_{key}"] = p[key] - b[key] if p[key] is not None else None


def mean_by(points: list[dict], label: str, key: str) -> float:
    vals = [p[key] for p in points if p["label"] == label]
    return sum(vals) / len(vals)


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
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------------
# validate

# Candidates each pair's calibration never ran (tiny's default calibration runs noise 0.003…1, fp8, kv-fp8,
# staleness 2).
VALIDATION = {
    "tiny": [
        ("noise 0.2", {"noise": 0.2}),
        ("noise 0.4", {"noise": 0.4}),
        ("noise 0.7", {"noise": 0.7}),
        ("noise 2", {"noise": 2.0}),
        ("fp8 + noise 0.05", {"weights": "fp8", "noise": 0.05}),
        ("fp8-emu", {"weights": "fp8-emu"}),
        ("kv-fp8 unit scales", {"kv_cache": "fp8", "kv_scales": "unit"}),
        ("staleness 4", {"staleness": 4}),
        ("fp8 all Linear + kv-fp8", {"weights": "fp8", "fp8_skip": (), "kv_cache": "fp8"}),
        ("staleness 1 + noise 0.6", {"staleness": 1, "noise": 0.6}),
    ],
    # smollm2: its calibration ran noise 0.03–1 and 3, fp8, kv-fp8 and staleness 2; these are other noise
    # levels between its grid points and the other real configurations. FP8 weights sample 3–5× slower on
    # this CPU, so the two FP8 candidates are last: the W8A8 emulation, and the recipe that keeps the blocks
    # `experiments.py sensitivity --pair smollm2` found most sensitive (0–3, 23) in high precision, whose
    # all-FP8 counterpart is the calibration's "fp8" point.
    "smollm2": [
        ("noise 0.05", {"noise": 0.05}),
        ("noise 0.25", {"noise": 0.25}),
        ("noise 0.7", {"noise": 0.7}),
        ("noise 2", {"noise": 2.0}),
        ("kv-fp8 unit scales", {"kv_cache": "fp8", "kv_scales": "unit"}),
        ("staleness 1", {"staleness": 1}),
        ("staleness 4", {"staleness": 4}),
        ("kv-fp8 + staleness 1", {"kv_cache": "fp8", "staleness": 1}),
        ("fp8 recipe", {"weights": "fp8", "fp8_skip": block_skip(24, set(range(24)) - {0, 1, 2, 3, 23})}),
        ("fp8-emu", {"weights": "fp8-emu"}),
    ],
}


def validate(pair_name: str, budget_path: Path, seeds: int, probes: int, device: str) -> dict:
    if pair_name not in VALIDATION:
        raise BadInput(f"--pair {pair_name}: no validation candidates; choose from {', '.join(VALIDATION)}")
    budget = read_budget(budget_path, pair_name)
    candidates = VALIDATION[pair_name]
    pair = load_pair(pair_name, device=device)
    base_cfg = study_config(pair_name, device=device)
    verdicts = {}
    for label, over in tqdm(candidates, desc="checking", unit="config"):
        verdicts[label] = check(budget, pair, replace(base_cfg.rollout, **over), cap=probes, device=device)
    plan = [("baseline", {}, {})] + [(label, {}, over) for label, over in candidates]
    points = sweep(
        RESULTS / "runs" / f"validate_{pair_name}",
        pair_name,
        plan,
        seeds=seeds,
        device=device,
        desc="training",
        steps=budget["steps"],
        eval_every=0,
    )
    paired(points, "eval_rkl", lambda p: "baseline")
    tol, rows = budget["tolerance"]["nats"], []
    for label, _ in candidates:
        loss = mean_by(points, label, "delta_eval_rkl")
        outcome = "within" if loss <= tol else "beyond"
        v = verdicts[label]
        agree = None if v["verdict"] == "uncertain" else (v["verdict"] == "admit") == (outcome == "within")
        rows.append(
            {
                "candidate": label,
                "check_mismatch": v["mismatch_kl"],
                "ci": [v["ci_low"], v["ci_high"]],
                "verdict": v["verdict"],
                "check_seconds": v["seconds"],
                "train_mismatch": mean_by(points, label, "mismatch"),
                "quality_loss": loss,
                "outcome": outcome,
                "agree": agree,
            }
        )
    decided = [r for r in rows if r["agree"] is not None]
    result = {
        "pair": pair_name,
        "budget": budget["budget"],
        "budget_how": budget["how"],
        "tolerance_nats": tol,
        "steps": budget["steps"],
        "seeds": seeds,
        "probes": probes,
        "device": device_label(device),
        "rows": rows,
        "points": points,
        "decided": len(decided),
        "agreement": sum(r["agree"] for r in decided) / len(decided) if decided else None,
    }
    write(f"validation_{pair_name}", result)
    return result


def validation_table(result: dict) -> str:
    lines = [
        (
            "| candidate | check: mismatch [95% CI] | verdict | training: mismatch | quality loss "
            "| outcome | agree |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        agree = {True: "yes", False: "**no**", None: "–"}[r["agree"]]
        lines.append(
            f"| {r['candidate']} | {r['check_mismatch']:.3g} [{r['ci'][0]:.3g}, {r['ci'][1]:.3g}] "
            f"| {r['verdict']} | "
            f"{r['train_mismatch']:.3g} | {r['quality_loss']:+.4f} | {r['outcome']} | {agree} |"
        )
    agreement = "n/a" if result["agreement"] is None else f"{result['agreement']:.0%}"
    lines.append(
        f"\nBudget {result['budget']:.3g} nats/token ({result['budget_how']}), "
        f"tolerance {result['tolerance_nats']:.4f} nats; "
        f"agreement on decided verdicts: {agreement} ({result['decided']} of {len(result['rows'])} decided); "
        f"{result['steps']} steps × {result['seeds']} seeds per run; {result['device']}."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# rl: OPD vs GRPO

RL_METHODS = {
    "OPD": {"loss": "analytic"},
    "GRPO": {"loss": "grpo"},
    "GRPO+TIS": {"loss": "grpo", "tis_cap": 2.0},
}
RL_CONFIGS = [
    ("fp32", {}),
    ("bf16", {"weights": "bf16"}),
    ("fp8", {"weights": "fp8"}),
    ("noise 0.1", {"noise": 0.1}),
    ("noise 0.3", {"noise": 0.3}),
    ("noise 1", {"noise": 1.0}),
    ("staleness 4", {"staleness": 4}),
]
RL_COMMON = dict(
    steps=120, batch_size=32, samples_per_prompt=8, eval_every=0
)  # groups of 8 for GRPO; the same batches for OPD


def rl(seeds: int, device: str) -> dict:
    plan = [(f"{m} {c}", over_m, over_c) for m, over_m in RL_METHODS.items() for c, over_c in RL_CONFIGS]
    points = sweep(
        RESULTS / "runs" / "rl_tiny",
        "tiny",
        plan,
        seeds=seeds,
        device=device,
        desc="OPD vs GRPO",
        **RL_COMMON,
    )
    for key in ("eval_reward", "eval_rkl", "eval_acc"):
        paired(points, key, lambda p: p["label"].split(" ")[0] + " fp32")
    result = {
        "pair": "tiny",
        "methods": RL_METHODS,
        "configs": [c for c, _ in RL_CONFIGS],
        "common": RL_COMMON,
        "seeds": seeds,
        "device": device_label(device),
        "points": points,
    }
    write("rl_tiny", result)
    plot_rl(result, RESULTS / "rl_tiny.png")
    return result


def plot_rl(result: dict, path: Path) -> None:
    plt, fig, axes = plt_axes(3, 4.6)
    for i, method in enumerate(result["methods"]):
        for ax, key in zip(axes, ("delta_eval_reward", "delta_eval_acc", "delta_eval_rkl")):
            for j, c in enumerate(
                result["configs"]
            ):  # points, not lines: the configurations are different sources
                x, y = (
                    max(mean_by(result["points"], f"{method} {c}", "mismatch"), 1e-5),
                    mean_by(result["points"], f"{method} {c}", key),
                )
                ax.scatter([x], [y], marker="os^"[i], color=f"C{i}", label=method if j == 0 else None)
                ax.annotate(c, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points", color=f"C{i}")
    titles = (
        "held-out sampled accuracy",
        "held-out greedy accuracy",
        "held-out reverse KL (lower is better)",
    )
    for ax, title in zip(axes, titles):
        ax.axhline(0, color="k", lw=0.6)
        ax.set(
            xscale="log",
            xlabel="mismatch during training, nats/token (fp32 drawn at 1e-5)",
            ylabel="Δ vs the method's own fp32 run",
            title=title,
        )
        ax.legend(fontsize=8)
    save_figure(
        plt,
        fig,
        path,
        title=f"OPD vs GRPO under the same rollout mismatch (tiny, {result['common']['steps']} steps; "
        f"{result['device']})",
    )


def rl_table(result: dict) -> str:
    lines = [
        "| rollout | mismatch | "
        + " | ".join(f"{m}: Δ sampled acc / Δ greedy acc / Δ RKL" for m in result["methods"])
        + " |",
        "|---|---|" + "---|" * len(result["methods"]),
    ]
    for c in result["configs"]:
        cells = []
        for m in result["methods"]:
            deltas = [
                mean_by(result["points"], f"{m} {c}", f"delta_{k}")
                for k in ("eval_reward", "eval_acc", "eval_rkl")
            ]
            cells.append(" / ".join(f"{d:+.3f}" for d in deltas))
        lines.append(
            f"| {c} | {mean_by(result['points'], f'OPD {c}', 'mismatch'):.3g} | " + " | ".join(cells) + " |"
        )
    base = "; ".join(
        f"{m} fp32 run: sampled acc {mean_by(result['points'], f'{m} fp32', 'eval_reward_start'):.3f} -> "
        f"{mean_by(result['points'], f'{m} fp32', 'eval_reward'):.3f}, "
        f"RKL {mean_by(result['points'], f'{m} fp32', 'eval_rkl'):.3f}"
        for m in result["methods"]
    )
    return (
        "\n".join(lines)
        + f"\n\nBaselines: {base}. {result['common']['steps']} steps, {result['seeds']} seed(s); "
        f"{result['device']}."
    )


# ---------------------------------------------------------------------------------------------------
# prefix: per-token vs prefix shift

PREFIX_ESTIMATORS = {
    "analytic": {"loss": "analytic"},
    "sampled": {"loss": "sampled"},
    "sampled+TIS": {"loss": "sampled", "tis_cap": 2.0},
}
PREFIX_SIGMAS = (0.0, 0.1, 0.3, 0.5, 1.0)


def prefix(seeds: int, device: str) -> dict:
    plan = [
        (f"{e} noise {s:g}", over, {"noise": s})
        for e, over in PREFIX_ESTIMATORS.items()
        for s in PREFIX_SIGMAS
    ]
    out = RESULTS / "runs" / "prefix_tiny"
    points = sweep(out, "tiny", plan, seeds=seeds, device=device, desc="prefix shift", steps=60, eval_every=0)
    paired(points, "eval_rkl", lambda p: p["label"].rsplit(" ", 1)[0] + " 0")
    trajectories = {}  # per σ, from the sampled+TIS runs of seed 0: per-step per-token and prefix KL
    for s in PREFIX_SIGMAS:
        records = read_metrics(
            out / f"{slug(f'sampled+TIS noise {s:g}')}-seed0" / "metrics.jsonl", upto=10**9
        )
        trajectories[f"{s:g}"] = [
            {"step": r["step"], "mismatch_kl": r["mismatch_kl"], "prefix_kl": r["prefix_kl"]}
            for r in records
            if "prefix_kl" in r
        ]
    result = {
        "pair": "tiny",
        "estimators": PREFIX_ESTIMATORS,
        "sigmas": PREFIX_SIGMAS,
        "steps": 60,
        "seeds": seeds,
        "device": device_label(device),
        "points": points,
        "trajectories": trajectories,
    }
    write("prefix_tiny", result)
    plot_prefix(result, RESULTS / "prefix_tiny.png")
    return result


def plot_prefix(result: dict, path: Path) -> None:
    plt, fig, axes = plt_axes(2, 5.2)
    for i, (s, traj) in enumerate(result["trajectories"].items()):
        if float(s) == 0:
            continue
        axes[0].plot(
            [r["step"] for r in traj],
            [r["mismatch_kl"] for r in traj],
            "-",
            color=f"C{i}",
            label=f"σ={s} per-token",
        )
        axes[0].plot(
            [r["step"] for r in traj],
            [r["prefix_kl"] for r in traj],
            "--",
            color=f"C{i}",
            label=f"σ={s} prefix",
        )
    axes[0].set(
        yscale="log",
        xlabel="training step",
        ylabel="nats (per token / per prefix)",
        title="mismatch parts as training proceeds",
    )
    axes[0].legend(fontsize=7, ncol=2)
    for i, e in enumerate(result["estimators"]):
        labels = [f"{e} noise {s:g}" for s in result["sigmas"]]
        xs = [max(mean_by(result["points"], lab, "mismatch"), 1e-5) for lab in labels]
        axes[1].plot(
            xs, [mean_by(result["points"], lab, "delta_eval_rkl") for lab in labels], "os^"[i] + "-", label=e
        )
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set(
        xscale="log",
        xlabel="per-token mismatch, nats/token (log)",
        ylabel="final held-out RKL − same estimator at σ=0",
        title="quality loss as σ grows",
    )
    axes[1].legend(fontsize=8)
    save_figure(
        plt,
        fig,
        path,
        title=f"Per-token vs prefix-shift mismatch under weight noise (tiny, {result['steps']} steps; "
        f"{result['device']})",
    )


def prefix_table(result: dict) -> str:
    ests = list(result["estimators"])
    lines = [
        "| σ | per-token KL | prefix KL | " + " | ".join(f"{e}: Δ RKL" for e in ests) + " |",
        "|---|---|---|" + "---|" * len(ests),
    ]
    for s in result["sigmas"]:
        lab = f"sampled+TIS noise {s:g}"
        cells = " | ".join(
            f"{mean_by(result['points'], f'{e} noise {s:g}', 'delta_eval_rkl'):+.4f}" for e in ests
        )
        lines.append(
            f"| {s:g} | {mean_by(result['points'], lab, 'mismatch'):.3g} | "
            f"{mean_by(result['points'], lab, 'prefix_kl'):.3g} | {cells} |"
        )
    return (
        "\n".join(lines) + f"\n\n{result['steps']} steps, {result['seeds']} seed(s); "
        f"mismatch columns are run means over steps; {result['device']}."
    )


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


def noise_line(noise: dict | None) -> str:
    """How far a budget's quality axis can be trusted (admit.quality_noise); "" if not recorded."""
    if not noise:
        return ""
    sds = ", ".join(f"{v['sd']:.3f} on {n} prompts" for n, v in noise["eval_sd_by_prompts"].items())
    line = f"\nEvaluation noise (SD over {noise['eval_seeds']} evaluation seeds, one checkpoint): {sds}."
    if noise["paired_loss_se"] is not None:
        line += (
            f" Paired quality loss: SD {noise['paired_loss_sd']:.3f} across seeds, "
            f"SE {noise['paired_loss_se']:.3f} (tolerance = {noise['tolerance_over_se']:.1f} SE)."
        )
    return line + "\n"


def ci_line(budget: dict) -> str:
    """The budget's 95% seed-bootstrap interval: as recorded, or refitted from the recorded points when the
    budget.json predates it (admit.budget_ci is a pure function of them); "" with one seed."""
    if budget["how"] != "crossing" or budget.get("seeds", 2) < 2:
        return ""
    recorded = budget.get("budget_ci")
    ci = recorded or budget_ci(budget["points"], budget["tolerance"]["fraction"])
    source = "" if recorded else " (refitted here from the recorded points: the budget.json predates it)"
    lo, hi = (
        f"{v:.3g}" if v is not None else "beyond the largest mismatch tried" for v in (ci["lo"], ci["hi"])
    )
    return (
        f"95% interval over training seeds (bootstrap, {ci['draws']} draws): [{lo}, {hi}]; "
        f"{ci['beyond_largest_mismatch']:.0%} of draws do not cross the tolerance{source}.\n"
    )


def report() -> Path:
    """results/SUMMARY.md from what the commands above wrote; sections whose results are missing say so."""
    parts = [
        "# Results\n",
        "Regenerate: `python study.py report` (each section names the command that made its numbers).\n",
    ]
    for pair in PAIRS:
        path = Path("budgets") / pair / "budget.json"
        if path.exists():
            b = json.loads(path.read_text())
            lower = (
                b["how"] == "all-within"
            )  # no run lost more than the tolerance: the budget is at least the largest mismatch tried
            how = "a lower bound: no run lost more than the tolerance" if lower else b["how"]
            command = b.get("command") or f"python admit.py calibrate --pair {pair}"
            parts.append(
                f"## Budget: {pair}\n\n"
                f"`{command}`: budget **{'≥ ' if lower else ''}{b['budget']:.3g} nats/token** ({how}); "
                f"tolerance {b['tolerance']['nats']:.4f} nats "
                f"({b['tolerance']['fraction']:.0%} of the baseline's "
                f"{b['baseline']['improvement']:.3f}-nat improvement); "
                f"{len(b['points'])} runs of {b['steps']} steps; "
                f"device {b['device']}. Plot: `{path.with_suffix('.png')}`.\n"
                + ci_line(b)
                + noise_line(b.get("noise"))
            )
    for path in sorted(RESULTS.glob("sensitivity_*.json")):
        s = json.loads(path.read_text())
        top = ", ".join(f"{b} ({s['per_block'][b]:.2g})" for b in s["ranking"][:5])
        parts.append(
            f"## Sensitivity: {path.stem}\n\n"
            "Made by `python experiments.py sensitivity` (the README gives each pair's flags). "
            f"Most sensitive blocks (mismatch with that block alone in FP8): {top}; "
            f"all blocks FP8: {s['all_fp8']:.3g}; keeping blocks "
            f"{s['kept_high_precision']} in high precision: {s['recipe_mismatch']:.3g}. File: `{path}`.\n"
        )
    sections = [
        *[
            (
                f"validation_{p}",
                f"Validation of the admission check: {p}",
                f"python study.py validate --pair {p}",
                validation_table,
            )
            for p in VALIDATION
        ],
        ("rl_tiny", "OPD vs GRPO", "python study.py rl", rl_table),
        ("prefix_tiny", "Per-token vs prefix shift", "python study.py prefix", prefix_table),
        ("async_smollm2", "FP8 + async time-to-quality", "python study.py async", async_table),
    ]
    for name, title, command, table in sections:
        path = RESULTS / f"{name}.json"
        body = table(json.loads(path.read_text())) if path.exists() else f"(not run yet: `{command}`)"
        plot = f" Plot: `results/{name}.png`." if (RESULTS / f"{name}.png").exists() else ""
        parts.append(f"## {title}\n\n`{command}`.{plot}\n\n{body}\n")
    out = RESULTS / "SUMMARY.md"
    RESULTS.mkdir(exist_ok=True)
    out.write_text("\n".join(parts))
    return out


# ---------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser(
        "validate", help="admission check verdicts vs real training runs on held-out configurations"
    )
    v.add_argument("--pair", default="tiny", choices=PAIRS, help="the pair (default: %(default)s)")
    v.add_argument("--budget", help="budget.json (default: budgets/<pair>/budget.json)")
    v.add_argument(
        "--seeds",
        type=positive_int,
        default=4,
        help="training seeds per candidate (default: %(default)s; "
        "near the knee, 2 seeds cannot resolve the tolerance)",
    )
    v.add_argument(
        "--probes",
        type=positive_int,
        default=64,
        help="most probe prompts for each check (default: %(default)s)",
    )
    for name, helptext in (
        ("rl", "OPD vs GRPO (tiny)"),
        ("prefix", "per-token vs prefix shift, with and without TIS (tiny)"),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--seeds", type=positive_int, default=1, help="seeds per run (default: %(default)s)")
    a = sub.add_parser("async", help="sync/async × bf16/fp8 time-to-quality")
    a.add_argument("--pair", default="smollm2", choices=PAIRS, help="the pair (default: %(default)s)")
    a.add_argument("--steps", type=positive_int, default=8, help="steps per run (default: %(default)s)")
    sub.add_parser("report", help="results/SUMMARY.md from the results")
    for sp in sub.choices.values():
        sp.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.cmd == "validate":
            budget = Path(args.budget or f"budgets/{args.pair}/budget.json")
            print(
                validation_table(validate(args.pair, budget, args.seeds, probes=args.probes, device=device))
            )
        elif args.cmd == "rl":
            print(rl_table(rl(args.seeds, device)))
        elif args.cmd == "prefix":
            print(prefix_table(prefix(args.seeds, device)))
        elif args.cmd == "async":
            print(async_table(async_study(args.pair, args.steps, device)))
        print(f"wrote {report()}")
    except EXPECTED as e:
        fail(e)


if __name__ == "__main__":
    main()
