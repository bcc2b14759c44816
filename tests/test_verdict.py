"""The verdict rule (verdict.py): a measured interval against a budget's own interval, the open-above budget,
the extra probes an UNCERTAIN verdict asks for, and the staleness axis of a sampled-token budget."""

import math
import random

from budget import budget_band
from verdict import judge, verdict


def test_a_stale_candidate_against_a_sampled_token_budget_is_judged_on_the_staleness_axis():
    """A sampled-token loss feels staleness beyond its per-token KL: check judges a stale candidate by the
    calibration's own stale runs (means over seeds): reject at or beyond a staleness that lost, the scale's
    verdict at or below one that stayed within, uncertain otherwise; never for the analytic loss or a fresh
    engine. And the budget's curve is fitted without the stale runs, for sampled-token losses only."""
    from lab.calibrate import fit_points
    from verdict import stale_axis, with_stale_axis

    def stale(k, losses):
        return [{"source": f"staleness {k}", "mismatch": 0.002, "quality_loss": q} for q in losses]

    noise = [{"source": "noise 0.1", "mismatch": 0.2, "quality_loss": 0.04}]
    budget = {
        "loss": "sampler",
        "tis_cap": math.inf,
        "points": stale(2, (0.05, 0.07)) + noise,
        "tolerance": {"nats": 0.031},
    }
    for k in (2, 4):
        axis = stale_axis(budget, staleness=k)
        assert axis["verdict"] == "reject", axis
        assert (
            "staleness 2: 0.002 nats/token, quality loss +0.060 (2 seeds); tolerance 0.031" in axis["reason"]
        )
        assert "noise" not in axis["reason"]
    below = stale_axis(budget, staleness=1)
    assert below["verdict"] == "uncertain" and "calibrate with --real staleness-1" in below["reason"], below
    within = {**budget, "points": stale(2, (0.01, 0.02)) + noise}
    assert stale_axis(within, staleness=1) is None and stale_axis(within, staleness=2) is None
    assert stale_axis(within, staleness=3)["verdict"] == "uncertain"
    assert stale_axis(budget, staleness=0) is None
    assert stale_axis({**budget, "loss": "analytic", "tis_cap": 0.0}, staleness=2) is None
    assert "stale runs: none" in stale_axis({**budget, "points": noise}, staleness=2)["reason"]
    # the axis overrules an admit or an uncertain, and rejects; it never turns the scale's reject into less
    admit, reject = {"verdict": "admit"}, {"verdict": "reject"}
    assert with_stale_axis(admit, below) is below and with_stale_axis(reject, below) is reject
    assert (
        with_stale_axis(admit, None) is admit
        and with_stale_axis(admit, stale_axis(budget, 2))["verdict"] == "reject"
    )
    assert fit_points(budget["points"], "sampler") == noise
    assert fit_points(budget["points"], "analytic") == budget["points"]


def test_the_verdict_decides_against_the_budgets_own_interval():
    """Never admits unless the whole CI lies below the budget's interval; a point budget (no band, or a band
    of width 0, half the draws) is its own interval."""
    rng = random.Random(1)
    for i in range(10000):
        lo = rng.uniform(0, 1)
        hi = lo + rng.uniform(0, 1)
        mean = rng.uniform(lo, hi)
        b_lo = rng.uniform(0, 2)
        budget = b_lo + rng.uniform(0, 0.5) * (i % 2)
        b_hi = budget + rng.uniform(0, 0.5) * (i % 2)
        band = (b_lo, b_hi) if i % 4 else None
        v = verdict(lo, hi, mean, budget, 64, band=band)
        assert v["verdict"] == ("admit" if hi < b_lo else "reject" if lo > b_hi else "uncertain")
        if v["verdict"] == "uncertain" and b_lo <= mean <= b_hi:
            assert v["extra_probes"] is None, "inside the budget's interval more probes cannot decide"
    # a candidate above the point budget but inside its interval is not rejected
    assert verdict(1.1, 1.3, 1.2, 1.0, 64)["verdict"] == "reject"
    v = verdict(1.1, 1.3, 1.2, 1.0, 64, band=(0.9, 1.5))
    assert v["verdict"] == "uncertain" and "calibration seeds" in v["reason"]
    assert verdict(1.6, 1.8, 1.7, 1.0, 64, band=(0.9, 1.5))["verdict"] == "reject"
    v = verdict(0.5, 0.95, 0.7, 1.0, 64, band=(0.9, 1.5))  # below the interval: probes can decide
    assert v["verdict"] == "uncertain" and v["extra_probes"] == math.ceil(64 * (0.225 / 0.2) ** 2) - 64


def test_a_budget_open_above_never_rejects():
    ci = {"lo": 0.8, "hi": None}
    crossing = {"budget": 1.0, "how": "crossing", "budget_ci": ci}
    assert budget_band(crossing) == (0.8, math.inf)
    assert budget_band({**crossing, "budget_ci": None}) == (1.0, 1.0), "one seed: the point alone"
    assert budget_band({**crossing, "how": "all-within", "budget_ci": None}) == (1.0, math.inf)
    far = {"mismatch_kl": 50.0, "ci_low": 40.0, "ci_high": 60.0}
    v = judge(crossing, far, 64, available=64)
    assert v["verdict"] == "uncertain" and "beyond the lower end" in v["reason"]
    assert judge(crossing, {"mismatch_kl": 0.5, "ci_low": 0.4, "ci_high": 0.6}, 64, 64)["verdict"] == "admit"


def test_uncertain_estimates_extra_probes():
    v = verdict(0.8, 1.2, 1.05, 1.0, 64)
    assert v["verdict"] == "uncertain" and v["extra_probes"] == 64 * 16 - 64  # half-width 0.2 vs gap 0.05
