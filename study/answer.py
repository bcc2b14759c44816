"""answer: the paper's question in one table. For each pair and OPD loss, the budget at one tolerance with the
recipe it holds for, beside the real configurations the calibration trained (fp8 weights, an fp8 KV cache,
stale weights): their probe mismatch, the verdict `check` gives that measurement, and what training under
them lost.

Every budget is put on one footing, the study's tolerance fraction (config.STUDY_TOLERANCE of the baseline's
improvement): one calibrated at another fraction is refitted to its own points at this one (at_tolerance;
the fit, its seed interval and its power are pure functions of the points). A real configuration's verdict is
the live check's rule (verdict.judge, overruled by verdict.stale_axis for a stale engine under a sampled-token
loss) applied to the probe mismatch the calibration measured for it; its outcome is its mean paired quality
loss over the seeds against the tolerance. So a row says both what `check` would answer and whether training
agreed.

python -m study report    # the table is results/SUMMARY.md's first section; notebook 05 prints it
"""

import math
import statistics
from pathlib import Path

from budget import budget_power, source_staleness
from config import STUDY_TOLERANCE
from lab.calibrate import budget_fit, by_source, paired_loss_gate, study_recipe
from study.losses import budget_text, interval_text, label_of, pair_budgets
from verdict import judge, stale_axis, with_stale_axis

REAL = ("fp8", "kv-fp8", "staleness 1", "staleness 2", "staleness 4")  # the columns, where calibrated


def at_tolerance(b: dict, fraction: float = STUDY_TOLERANCE) -> dict:
    """b as calibrated, or refitted to its own points at another tolerance fraction: tolerance, budget, how,
    its seed interval, its fit and its noise (the power rule's SE) recomputed at
        tol = fraction · baseline improvement."""
    if math.isclose(b["tolerance"]["fraction"], fraction):
        return b
    tol = fraction * b["baseline"]["improvement"]
    seeds = b["seeds"]
    fitted = budget_fit(b["points"], b["loss"], fraction, tol=tol, seeds=seeds)
    noise = {**(b.get("noise") or {}), **paired_loss_gate(b["points"], tol=tol, seeds=seeds, loss=b["loss"])}
    return {**b, **fitted, "tolerance": {**b["tolerance"], "fraction": fraction, "nats": tol}, "noise": noise}


def real_configurations(b: dict) -> dict[str, dict]:
    """The calibration's real configurations (REAL), each over its seeds: the mean probe mismatch, the
    widest probe interval, the mean paired quality loss, and the seeds."""
    groups = by_source(b["points"])
    out = {}
    for source in (s for s in REAL if s in groups):
        pts = groups[source]
        cis = [p.get("mismatch_ci") or (p["mismatch"], p["mismatch"]) for p in pts]
        out[source] = {
            "mismatch_kl": statistics.fmean(p["mismatch"] for p in pts),
            "ci_low": min(lo for lo, _ in cis),
            "ci_high": max(hi for _, hi in cis),
            "quality_loss": statistics.fmean(p["quality_loss"] for p in pts),
            "seeds": len(pts),
        }
    return out


def real_verdict(b: dict, source: str, m: dict) -> str:
    """The verdict `check` gives a candidate measured at m against b: the scale's (verdict.judge), unless a
    stale engine under a sampled-token loss is decided on its own axis (verdict.stale_axis)."""
    decision = judge(b, m, n=b["probes"], available=None)
    return with_stale_axis(decision, stale_axis(b, source_staleness(source)))["verdict"]


def rate_note(pair: str, b: dict) -> str:
    """Whether b's learning rate is its loss's own, chosen by `python -m study lr`
    (lab.calibrate.study_recipe), another, or one no sweep has searched for this pair."""
    own = study_recipe(pair, label_of(b)).get("lr")
    if own is None:
        return "not searched"
    return "its own" if math.isclose(own, b["train_settings"]["lr"]) else f"not its own ({own:g})"


def answer_rows(pairs=("tiny", "smollm2"), fraction: float = STUDY_TOLERANCE, root: Path = Path("budgets")):
    """One row per committed budget (study.losses.pair_budgets), at one tolerance fraction: pair, loss,
    recipe, budget and interval, power, and each real configuration's mismatch, verdict and outcome."""
    rows = []
    for pair in pairs:
        for path, committed in pair_budgets(pair, root):
            b = at_tolerance(committed, fraction)
            tol = b["tolerance"]["nats"]
            real = real_configurations(b)
            for source, m in real.items():
                m["verdict"] = real_verdict(b, source, m)
                m["outcome"] = "within" if m["quality_loss"] <= tol else "beyond"
            power = budget_power(b)
            rows.append(
                {
                    "pair": pair,
                    "loss": label_of(b),
                    "file": str(path),
                    "lr": b["train_settings"]["lr"],
                    "rate": rate_note(pair, b),
                    "steps": b["steps"],
                    "seeds": b["seeds"],
                    "fraction": fraction,
                    "tolerance_nats": tol,
                    "refitted": b is not committed,
                    "budget": b["budget"],
                    "how": b["how"],
                    "budget_text": budget_text(b),
                    "interval_text": interval_text(b),
                    "se_over_tolerance": power["se_over_tolerance"],
                    "under_powered": power["under_powered"],
                    "real": real,
                }
            )
    return rows


def real_cell(m: dict | None) -> str:
    """One real configuration in the table: its mismatch, the check's verdict, and what training lost."""
    if m is None:
        return "not calibrated"
    return f"{m['mismatch_kl']:.2g}: {m['verdict']}; trained {m['quality_loss']:+.2f} ({m['outcome']})"


def answer_table(rows: list[dict]) -> str:
    """Markdown: the answer, one row per pair and loss."""
    head = (
        "| pair | loss | recipe (lr: searched?, steps × seeds) | budget (nats/token) | 95% interval "
        "| SE / tol |"
    )
    lines = [
        head + "".join(f" {r} |" for r in REAL),
        "|" + "---|" * (6 + len(REAL)),
    ]
    for r in rows:
        power = "—" if r["se_over_tolerance"] is None else f"{r['se_over_tolerance']:.2f}"
        power += " (under-powered)" if r["under_powered"] else ""
        refit = " (refitted)" if r["refitted"] else ""
        lines.append(
            f"| {r['pair']} | {r['loss']} | {r['lr']:g}: {r['rate']}, {r['steps']} × {r['seeds']} "
            f"| {r['budget_text']}{refit} "
            f"| {r['interval_text']} | {power} |" + "".join(f" {real_cell(r['real'].get(s))} |" for s in REAL)
        )
    return "\n".join(lines)


def answer_section(rows: list[dict]) -> str:
    """The table with the sentence that says how to read it."""
    fraction = {r["fraction"] for r in rows}.pop() if rows else STUDY_TOLERANCE
    return (
        "## The answer: how much mismatch each OPD loss tolerates, and whether cheap rollouts fit\n\n"
        f"Every budget at one tolerance, {fraction:.0%} of its baseline's improvement (a budget calibrated "
        "at another fraction is refitted to its own points, marked refitted). Each real configuration: its "
        "probe mismatch (nats/token), the verdict `check` gives it, and the mean quality loss training under "
        "it lost (nats, paired with the same-seed baseline), within or beyond the tolerance. SE / tol: the "
        "standard error of one configuration's mean quality loss over the tolerance; above 1/3 the budget "
        "is under-powered. A learning rate is the loss's own where `python -m study lr` chose it for the "
        "pair.\n\n" + answer_table(rows) + "\n"
    )
