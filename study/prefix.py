"""prefix: per-token vs prefix-shift mismatch under weight noise σ, and the quality loss of three OPD
estimators as σ grows: analytic (immune to the per-token part), sampled-token, sampled-token + TIS.

    python -m study prefix
"""

from pathlib import Path

from config import TINY_EARLY
from lab.runfiles import read_metrics
from models import device_label
from study.common import (
    RESULTS,
    mean_by,
    mean_sd,
    paired,
    plt_axes,
    save_figure,
    slug,
    sweep,
    values_by,
    write,
)

# ---------------------------------------------------------------------------------------------------
# prefix: per-token vs prefix shift

PREFIX_ESTIMATORS = {
    "analytic": {"loss": "analytic"},
    "sampled": {"loss": "sampled"},
    "sampled+TIS": {"loss": "sampled", "tis_cap": 2.0},
}
PREFIX_SIGMAS = (0.0, 0.1, 0.3, 0.5, 1.0)
# The settings results/prefix_tiny.json was measured with (tiny's 64 prompts × 4 samples, 60 steps at a
# constant lr 3e-4: config.TINY_EARLY), pinned so the command reproduces it whatever the study's become.
PREFIX_TRAIN = dict(**TINY_EARLY, eval_every=0)


def prefix(seeds: int, device: str) -> dict:
    plan = [
        (f"{e} noise {s:g}", over, {"noise": s})
        for e, over in PREFIX_ESTIMATORS.items()
        for s in PREFIX_SIGMAS
    ]
    out = RESULTS / "runs" / "prefix_tiny"
    points = sweep(out, "tiny", plan, seeds=seeds, device=device, desc="prefix shift", **PREFIX_TRAIN)
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
        "steps": PREFIX_TRAIN["steps"],
        "train": PREFIX_TRAIN,
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
        ys, sds = zip(*(mean_sd(values_by(result["points"], lab, "delta_eval_rkl")) for lab in labels))
        axes[1].errorbar(xs, ys, yerr=sds, fmt="os^"[i] + "-", capsize=2, label=e)
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set(
        xscale="log",
        xlabel="per-token mismatch, nats/token (log)",
        ylabel="final held-out RKL − same estimator at σ=0 (±1 SD over seeds)",
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
        stats = [mean_sd(values_by(result["points"], f"{e} noise {s:g}", "delta_eval_rkl")) for e in ests]
        cells = " | ".join(f"{y:+.4f}" + (f"±{sd:.4f}" if sd else "") for y, sd in stats)
        lines.append(
            f"| {s:g} | {mean_by(result['points'], lab, 'mismatch'):.3g} | "
            f"{mean_by(result['points'], lab, 'prefix_kl'):.3g} | {cells} |"
        )
    return (
        "\n".join(lines) + f"\n\n{result['steps']} steps, {result['seeds']} seed(s) (mean ± SD); "
        f"mismatch columns are run means over steps; {result['device']}."
    )


def tolerated(result: dict, fraction: float) -> dict:
    """How much weight noise each estimator of a prefix study tolerates, judged at `fraction` of the study's
    own baseline improvement (the analytic loss at σ 0: the same steps, seeds and settings as every run in
    it):
        tol = fraction · (RKL_step0 − mean final RKL of that baseline).
    Each σ > 0 is within when the mean paired loss over seeds is within tol by two standard errors,
    mean + 2·SE <= tol; beyond when mean − 2·SE > tol; undecided otherwise. Returns {"tolerance": tol,
    estimator: {"sigma": the largest σ within with every smaller σ within (0.0: none), "mismatch": its mean
    logged mismatch (0.0: none), "by_sigma": {σ: (mean, SE, judgement)}}}."""
    points = result["points"]
    base = [p for p in points if p["label"] == "analytic noise 0"]
    tol = fraction * sum(p["eval_rkl_start"] - p["eval_rkl"] for p in base) / len(base)
    out: dict = {"tolerance": tol}
    for est in result["estimators"]:
        by_sigma, largest = {}, 0.0
        for s in sorted(s for s in result["sigmas"] if s > 0):
            vals = values_by(points, f"{est} noise {s:g}", "delta_eval_rkl")
            mean, sd = mean_sd(vals)
            se = sd / len(vals) ** 0.5
            judged = "within" if mean + 2 * se <= tol else "beyond" if mean - 2 * se > tol else "undecided"
            by_sigma[s] = (mean, se, judged)
        for s, (_, _, judged) in by_sigma.items():
            if judged != "within":
                break
            largest = s
        mismatch = mean_by(points, f"{est} noise {largest:g}", "mismatch") if largest else 0.0
        out[est] = {"sigma": largest, "mismatch": mismatch, "by_sigma": by_sigma}
    return out
