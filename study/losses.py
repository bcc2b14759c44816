"""losses: a pair's budgets side by side, one per OPD loss, and one figure that overlays their fits.

A budget is fitted for one loss (budget.py). The losses differ in how much mismatch they tolerate because
they see the engine differently: the analytic loss only through the prefixes it samples, the sampled ones
through every sampled token's log-prob. The figure puts each loss's monotone fit on one axis, the quality
lost as a fraction of that loss's own baseline improvement, so each tolerance fraction (5%, 20%) is one line
for the losses calibrated at it; the table sets beside each budget the analytic one trained at the same
settings, refitted at its fraction (a loss calibrated at other settings than today's analytic budget is
compared with an analytic calibration at its settings kept in results/calibration_<pair>_*.json).

python -m study report    # writes results/budgets_<pair>.png and the table in results/SUMMARY.md
"""

import math
from pathlib import Path

from matplotlib.figure import Figure

from budget import loss_label, read_budget
from lab.calibrate import budget_ci, fit_budget, fit_points
from lab.runfiles import atomic_savefig
from study.common import RESULTS

BUDGETS = Path("budgets")
# what the table, the figure and the report read of a budget beyond what every budget holds
# (budget.read_budget refuses one without them in one line naming the file, before anything is drawn)
STUDY_NEEDS = (
    "points.quality_loss",
    "fit",
    "baseline",
    "steps",
    "seeds",
    "train_settings",
    "tolerance.fraction",
    "device",
)


def pair_budgets(pair: str, root: Path = BUDGETS) -> list[tuple[Path, dict]]:
    """Every budget of a pair: root/<pair>/budget.json (the analytic one) and root/<pair>/<loss>/budget.json,
    read and checked (budget.read_budget), with the fields the study reads (STUDY_NEEDS)."""
    paths = [root / pair / "budget.json", *sorted((root / pair).glob("*/budget.json"))]
    return [(p, read_budget(p, pair, needs=STUDY_NEEDS, flag="")) for p in paths if p.is_file()]


def reference_budgets(pair: str, root: Path = RESULTS) -> list[tuple[Path, dict]]:
    """Analytic calibrations kept beside the budgets (root/calibration_<pair>_*.json): the analytic loss at
    the settings of a budget whose loss was calibrated at other settings than today's analytic budget."""
    paths = sorted(root.glob(f"calibration_{pair}_*.json"))
    return [(p, read_budget(p, pair, needs=STUDY_NEEDS, flag="")) for p in paths]


def label_of(b: dict) -> str:
    """A budget's loss in one word (budget.loss_label), centred advantages included."""
    return loss_label(b["loss"], b["tis_cap"], center=b.get("center_advantages", False))


def settings_of(b: dict) -> dict:
    """What a budget's runs were trained with, the loss aside: steps and train_settings without the loss (its
    estimator, importance-weight cap and centring)."""
    kept = {k: v for k, v in b["train_settings"].items() if k not in ("loss", "tis_cap", "center_advantages")}
    return {"steps": b["steps"], **kept}


def analytic_like(b: dict, analytics: list[dict]) -> dict | None:
    """The first analytic budget trained at b's settings (settings_of), the one to compare b with; None if
    none was."""
    return next((a for a in analytics if a["loss"] == "analytic" and settings_of(a) == settings_of(b)), None)


def budget_text(b: dict) -> str:
    """The budget as a reader should take it: a number, a lower bound, or below the smallest mismatch
    tried."""
    if b["how"] == "all-within":
        return f"≥ {b['budget']:.3g}"
    if b["how"] == "none-within":
        smallest = min((p["mismatch"] for p in b["points"] if p["mismatch"] > 0), default=math.nan)
        return f"< {smallest:.2g}"
    return f"{b['budget']:.3g}"


def budget_interval(b: dict) -> tuple[dict | None, bool]:
    """(the 95% seed-bootstrap interval, whether it was refitted): as recorded, or refitted from the recorded
    points (calibrate.budget_ci is a pure function of them); (None, False) with one seed or without a
    crossing."""
    if b["how"] != "crossing" or b.get("seeds", 2) < 2:
        return None, False
    if recorded := b.get("budget_ci"):
        return recorded, False
    return budget_ci(fit_points(b["points"], b["loss"]), b["tolerance"]["fraction"]), True


def interval_text(b: dict, beyond: str = "beyond the grid") -> str:
    """The interval as "[lo, hi]" (`beyond` for an end past the largest mismatch tried); "—" without one."""
    ci, _ = budget_interval(b)
    if ci is None:
        return "—"
    lo, hi = (f"{v:.3g}" if v is not None else beyond for v in (ci["lo"], ci["hi"]))
    return f"[{lo}, {hi}]"


def refit(b: dict, fraction: float) -> dict:
    """b's budget at another tolerance fraction, fitted to its recorded points (calibrate.fit_budget is a
    pure function of them): {"budget", "how", ...}. Puts budgets calibrated at different tolerances on
    one footing."""
    tol, points = fraction * b["baseline"]["improvement"], fit_points(b["points"], b["loss"])
    return fit_budget([p["mismatch"] for p in points], [p["quality_loss"] for p in points], tol)


def losses_table(budgets: list[tuple[Path, dict]], references: list[tuple[Path, dict]] = ()) -> str:
    """Markdown: one row per loss, budget with its interval, tolerance, baseline and the runs behind it, and
    the analytic budget trained at the same settings (analytic_like: a budget, else one of `references`)
    refitted at that row's tolerance fraction (refit), the like-for-like comparison."""
    analytics = [b for _, b in [*budgets, *references]]
    rows = [
        "| loss | budget (nats/token) | 95% interval | tolerance | analytic, same settings and tolerance | "
        "baseline improvement | runs | s/run | file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path, b in budgets:
        base, tol, analytic = b["baseline"], b["tolerance"], analytic_like(b, analytics)
        same = "—" if analytic is None else budget_text({**analytic, **refit(analytic, tol["fraction"])})
        rows.append(
            f"| {label_of(b)} | {budget_text(b)} | {interval_text(b)} | "
            f"{tol['fraction']:.0%}: {tol['nats']:.4f} nats | {same} | "
            f"{base['eval_rkl_start']:.3f} → {base['eval_rkl_final']:.3f} | "
            f"{len(b['points'])} × {b['steps']} steps | {b['seconds_per_run']:.0f} | `{path}` |"
        )
    return "\n".join(rows)


def plot_losses(pair: str, budgets: list[tuple[Path, dict]], path: Path) -> None:
    """Each loss's monotone fit of quality loss vs mismatch, as a fraction of its baseline improvement, with
    its budget; one horizontal line per tolerance fraction, labelled with the losses calibrated at it."""
    fig = Figure(figsize=(11, 4.2))
    ax = fig.subplots()
    # the baseline's probe mismatch is 0 up to float rounding (1e-13 to 1e-10): drawn at the left edge
    smallest = min((x for _, b in budgets for x in b["fit"]["mismatch"] if x > 1e-9), default=1e-6)
    floor = smallest / 3
    for i, (_, b) in enumerate(budgets):
        color, label = f"C{i}", label_of(b)
        improvement = b["baseline"]["improvement"]
        xs = [x if x > 1e-9 else floor for x in b["fit"]["mismatch"]]
        ys = [q / improvement for q in b["fit"]["quality_loss"]]
        ax.step(
            xs,
            ys,
            where="post",
            color=color,
            label=f"{label} ({b['steps']} steps, lr {b['train_settings']['lr']:g}): budget {budget_text(b)}",
        )
        ax.scatter(
            [p["mismatch"] if p["mismatch"] > 1e-9 else floor for p in b["points"]],
            [p["quality_loss"] / improvement for p in b["points"]],
            color=color,
            s=10,
            alpha=0.5,
        )
        if b["how"] == "crossing":
            ax.axvline(b["budget"], color=color, ls="--", lw=1)
    by_fraction: dict[float, list[str]] = {}
    for _, b in budgets:
        by_fraction.setdefault(b["tolerance"]["fraction"], []).append(label_of(b))
    styles = (":", "-.", (0, (1, 4)), (0, (6, 2)))
    for (f, labels), ls in zip(sorted(by_fraction.items()), styles):
        label = f"tolerance {f:.0%} of the improvement: {', '.join(labels)}"
        ax.axhline(f, color="k", ls=ls, lw=1, label=label)
    ax.set_yscale("symlog", linthresh=0.02)  # linear around the tolerance, logarithmic where losses break
    top = max(p["quality_loss"] / b["baseline"]["improvement"] for _, b in budgets for p in b["points"])
    ax.set_ylim(top=max(1.0, top) * 2)  # a diverged run stays in view
    ax.set(
        xscale="log",
        xlabel="mismatch as check measures it, KL(engine ‖ train) nats/token (baseline at the left edge)",
        ylabel="quality lost / baseline improvement",
    )
    ax.set_title(f"{pair}: how much mismatch each OPD loss tolerates (points: runs; lines: monotone fits)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the points stay visible
    fig.tight_layout()
    atomic_savefig(fig, path)
