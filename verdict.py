"""The verdict: a measured mismatch interval judged against a budget's interval (pure: no model, no engine).

    admit      if hi < B_lo
    reject     if lo > B_hi
    uncertain  otherwise, with the number of extra probes likely to settle it;
never a reject where the budget's interval is open above, and a stale candidate against a sampled-token budget
judged on its own axis, the calibration's stale runs. `admit.py check` judges live probes with it,
`port/judge.py` an export's steps.
"""

import math
import statistics

from budget import budget_band, loss_label, source_staleness

VERDICT_EXIT = {"admit": 0, "reject": 1, "uncertain": 4}  # exit codes of `check`, for gating a CI job
CI_KEYS = ("mismatch_kl", "ci_low", "ci_high")  # the per-step numbers of a multi-step export


def verdict(
    lo: float,
    hi: float,
    mean: float,
    budget: float,
    n_probes: int,
    available: int | None = None,
    band: tuple[float, float] | None = None,
) -> dict:
    """admit if hi < B_lo, reject if lo > B_hi, else uncertain with an estimate of the probes needed.

    [B_lo, B_hi] is `band`, the budget's own interval (default [budget, budget]): a candidate whose mismatch
    the calibration cannot place on one side of the budget is not decided by more probes. Otherwise the
    interval's half-width shrinks like 1/sqrt(n) and must shrink below the gap to the nearer edge:
        n_needed ≈ n · (half-width / gap)², extra = n_needed − n,
    and never more than the `available` probes that remain (None: no limit known).
    """
    b_lo, b_hi = band or (budget, budget)
    if hi < b_lo:
        return {
            "verdict": "admit",
            "reason": f"upper bound {hi:.3e} < {band_edge_note(budget, b_lo, 'lower')}",
        }
    if lo > b_hi:
        return {
            "verdict": "reject",
            "reason": f"lower bound {lo:.3e} > {band_edge_note(budget, b_hi, 'upper')}",
        }
    reason = f"interval [{lo:.3e}, {hi:.3e}] contains budget {budget:.3e}"
    if b_lo < b_hi:
        reason = f"interval [{lo:.3e}, {hi:.3e}] overlaps the budget's 95% interval [{b_lo:.3e}, {b_hi:.3e}]"
    if b_lo <= mean <= b_hi:  # inside the budget's own uncertainty (or on it): probes cannot decide
        if b_lo < b_hi:
            reason += "; the mean lies inside it, where more calibration seeds, not probes, would decide"
        return {"verdict": "uncertain", "reason": reason, "extra_probes": None}
    half, gap = (hi - lo) / 2, (b_lo - mean if mean < b_lo else mean - b_hi)
    extra = math.ceil(n_probes * (half / gap) ** 2) - n_probes
    if available is not None and extra > available - n_probes:
        reason += f"; it would take about {extra} more probes and only {available - n_probes} remain"
        extra = None
    return {"verdict": "uncertain", "reason": reason, "extra_probes": extra}


def band_edge_note(budget: float, end: float, which: str) -> str:
    """How a verdict's reason names the threshold: the budget itself, or an end of its interval."""
    if end == budget:
        return f"budget {budget:.3e}"
    return f"{end:.3e}, the {which} end of budget {budget:.3e}'s 95% interval"


def json_band(budget: dict) -> list:
    """budget_band for a result's JSON: [B_lo, B_hi], B_hi None where open above."""
    b_lo, b_hi = budget_band(budget)
    return [b_lo, None if b_hi == math.inf else b_hi]


def beyond_lower_bound(budget: dict, m: dict) -> bool:
    """True when the budget's interval is open above and the whole CI lies above its lower end: uncertain
    whatever more probes show, so probing stops."""
    b_lo, b_hi = budget_band(budget)
    return b_hi == math.inf and m["ci_low"] > b_lo


def judge(budget: dict, m: dict, n: int, available: int | None) -> dict:
    """verdict() on a measurement against the budget's interval, which can never reject where it is open
    above (a lower-bound budget, or a crossing some seeds put beyond the grid)."""
    band = budget_band(budget)
    lo, hi, mean = m["ci_low"], m["ci_high"], m["mismatch_kl"]
    decision = verdict(lo, hi, mean, budget=budget["budget"], n_probes=n, available=available, band=band)
    if beyond_lower_bound(budget, m):
        where = (
            "the largest calibrated mismatch, where no run lost quality"
            if budget["how"] == "all-within"
            else "the lower end of the budget's interval, which some seeds put beyond the largest mismatch "
            "calibrated"
        )
        decision = {
            "verdict": "uncertain",
            "extra_probes": None,
            "reason": f"lower bound {m['ci_low']:.3e} is beyond {where} ({band[0]:.3e}): no number of "
            "probes can reject; calibrate with larger mismatch to decide",
        }
    return decision


def calibration_staleness(budget: dict) -> dict[int, tuple[float, float, int]]:
    """The calibration's stale runs by staleness k: (mean probe mismatch, mean quality loss, seeds)."""
    groups: dict[int, list[dict]] = {}
    for p in budget["points"]:
        if k := source_staleness(p["source"]):
            groups.setdefault(k, []).append(p)
    return {
        k: (
            statistics.fmean(p["mismatch"] for p in g),
            statistics.fmean(p["quality_loss"] for p in g),
            len(g),
        )
        for k, g in sorted(groups.items())
    }


def stale_axis(budget: dict, staleness: int) -> dict | None:
    """A stale candidate against a sampled-token budget, judged on its own axis. These losses feel staleness
    (an error along the last updates) far more than weight noise of the same per-token KL, so the scale, which
    the noise grid calibrates, cannot place it (DESIGN.md, "A budget holds for one loss"). With the
    calibration's stale runs (quality loss q_j at staleness j), and more staleness losing at least as much:
        reject     some j <= staleness has q_j > tolerance
        None       some j >= staleness has q_j <= tolerance: the scale decides, as for any candidate
        uncertain  neither (calibrate with --real staleness-K to decide).
    None as well for the analytic loss (the scale ranks staleness there) and for a fresh engine."""
    if budget["loss"] == "analytic" or not staleness:
        return None
    tol, ran = budget["tolerance"]["nats"], calibration_staleness(budget)
    label = loss_label(budget["loss"], budget["tis_cap"])
    runs = "; ".join(
        f"staleness {k}: {m:.2g} nats/token, quality loss {q:+.3f} ({n} seeds)"
        for k, (m, q, n) in ran.items()
    )
    seen = f"the calibration's stale runs: {runs or 'none'}; tolerance {tol:.3f} nats"
    if any(k <= staleness and q > tol for k, (_, q, _) in ran.items()):
        why = (
            f"staleness {staleness} is at least as stale as a calibration run that lost beyond the tolerance"
        )
        return {"verdict": "reject", "extra_probes": None, "reason": f"{why} ({label} loss; {seen})"}
    if any(k >= staleness and q <= tol for k, (_, q, _) in ran.items()):
        return None
    why = f"the {label} loss feels staleness beyond its per-token KL; no calibration run brackets {staleness}"
    return {
        "verdict": "uncertain",
        "extra_probes": None,
        "reason": f"{why} ({seen}); calibrate with --real staleness-{staleness} to decide",
    }


def with_stale_axis(decision: dict, axis: dict | None) -> dict:
    """The scale's decision, overruled by the staleness axis where that one rejects, or cannot vouch for an
    admit or an uncertain the scale gave."""
    if axis and (axis["verdict"] == "reject" or decision["verdict"] != "reject"):
        return axis
    return decision
