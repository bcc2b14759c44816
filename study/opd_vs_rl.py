"""rl: OPD vs a GRPO baseline (rl.py), with and without TIS, under the same rollout configurations (tiny).

Each method's quality is compared with its own mismatch-free run (same seed):
    Δ eval_reward = held-out exact-match rate of temperature-1 samples, minus the baseline's
    Δ eval_rkl    = held-out reverse KL to the teacher, minus the baseline's.

    python -m study rl
"""

from pathlib import Path

from models import device_label
from study.common import RESULTS, mean_by, paired, plt_axes, save_figure, sweep, write

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
# groups of 8 for GRPO; the same batches for OPD; the lr and schedule results/rl_tiny.json was measured with,
# pinned so the command reproduces it
RL_COMMON = dict(
    steps=120, batch_size=32, samples_per_prompt=8, lr=3e-4, warmup=10, schedule="constant", eval_every=0
)


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
