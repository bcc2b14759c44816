"""lab/calibrate.py's pure pieces: the isotonic fit against a brute-force oracle, the budget's crossing, its
seed-bootstrap interval, the noise gate, and where a reused calibration's points trained. The calibration
runs themselves (a subprocess each) are tested in tests/test_admit.py beside the check that reads them."""

import itertools
import json
import random
import statistics

import pytest

from cli import BadInput
from lab.calibrate import budget_ci, fit_budget, isotonic, paired_loss_sd, refuse_noise, trained_on


def isotonic_oracle(y: list[float], w: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit by its min-max formula, O(n^3):
    fit_i = max_{j <= i} min_{k >= i} (Σ_{t=j..k} w_t y_t) / (Σ_{t=j..k} w_t)."""
    n = len(y)

    def mean(j, k):
        return sum(w[t] * y[t] for t in range(j, k + 1)) / sum(w[t] for t in range(j, k + 1))

    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_isotonic_equals_the_min_max_formula_on_small_inputs():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 7)
        y = [rng.choice([rng.gauss(0, 1), float(rng.randint(0, 2))]) for _ in range(n)]  # ties too
        w = [rng.uniform(0.1, 3.0) for _ in range(n)] if trial % 2 else None
        fit = isotonic(y, w)
        expected = isotonic_oracle(y, w or [1.0] * n)
        assert all(abs(a - b) < 1e-12 for a, b in zip(fit, expected)), (y, w, fit, expected)


def test_isotonic_is_no_worse_than_any_monotone_fit_on_a_grid():
    """Least squares by exhaustion: no non-decreasing sequence of grid values fits closer."""
    y = [0.3, -0.2, 0.5, 0.1, 0.4]
    sse = sum((a - b) ** 2 for a, b in zip(isotonic(y), y))
    grid = [i / 20 - 0.5 for i in range(21)]
    best = min(
        sum((a - b) ** 2 for a, b in zip(c, y)) for c in itertools.combinations_with_replacement(grid, len(y))
    )
    assert sse <= best + 1e-12 and best - sse < 0.01, (sse, best)


def test_fit_budget_interpolates_the_crossing_by_hand():
    """Points given out of order; the loss 0.3 at mismatch 2 and 0.1 at 3 violate monotonicity and pool to
    0.2, 0.2. Tolerance 0.25: the fit first exceeds it at mismatch 4 (0.5), so the budget lies on the segment
    from (3, 0.2) to (4, 0.5):  3 + (0.25 − 0.2) / (0.5 − 0.2) · (4 − 3) = 3.1667."""
    fit = fit_budget([4.0, 1.0, 3.0, 2.0], [0.5, 0.0, 0.1, 0.3], 0.25)
    assert fit["how"] == "crossing" and fit["x"] == [1.0, 2.0, 3.0, 4.0]
    assert fit["fit"] == pytest.approx([0.0, 0.2, 0.2, 0.5])
    assert fit["budget"] == pytest.approx(3 + 0.05 / 0.3)
    # a tolerance the fit reaches exactly at a point: that point's mismatch
    assert fit_budget([1.0, 2.0, 3.0], [0.0, 0.2, 0.4], 0.2)["budget"] == pytest.approx(2.0)


def test_isotonic_is_monotone_and_least_squares():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    y = [random.Random(0).gauss(0, 1) for _ in range(50)]
    fit = isotonic(y)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(fit))
    assert abs(sum(fit) - sum(y)) < 1e-9  # PAV preserves the mean


def knee_points(knee=0.01, slope=50.0, noise=0.0, seed=0):
    """Quality loss 0 up to the knee, then linear: the fit must find where it crosses the tolerance."""
    rng = random.Random(seed)
    xs = [0.0005 * 1.5**i for i in range(16)]
    return xs, [max(0.0, slope * (x - knee)) + rng.gauss(0, noise) for x in xs]


def test_fit_returns_the_known_knee():
    xs, ys = knee_points()
    tol = 0.2  # the truth crosses it at 0.014, between two grid points on the linear part
    fit = fit_budget(xs, ys, tol)
    assert fit["how"] == "crossing"
    assert abs(fit["budget"] - (0.01 + tol / 50)) < 1e-9  # interpolation is exact on a linear segment
    # With a tolerance whose crossing falls next to the kink, the estimate stays between the grid points.
    small = fit_budget(xs, ys, 0.05)["budget"]
    assert xs[7] <= small <= xs[8] and abs(small - 0.011) < 0.0015


def test_fit_is_robust_to_one_noisy_point():
    xs, ys = knee_points()
    ys[3] = 0.2  # one wild run below the knee
    fit = fit_budget(xs, ys, 0.05)
    assert fit["budget"] >= xs[2], (
        "the outlier is pooled with its neighbours, not taken as the crossing alone"
    )
    assert all(a <= b for a, b in zip(fit["fit"], fit["fit"][1:]))
    clean = fit_budget(*knee_points(), 0.05)["budget"]
    xs2, ys2 = knee_points()
    ys2[12] += 0.5  # and one noisy point above the knee does not move it
    assert fit_budget(xs2, ys2, 0.05)["budget"] == pytest.approx(clean)


def test_fit_edge_cases():
    assert fit_budget([0.1, 0.2], [0.0, 0.01], 0.05)["how"] == "all-within"
    for ys in ([0.0, 0.0, 0.08], [0.0, 0.08, 0.0]):  # tied mismatches are pooled in any input order
        assert fit_budget([0.1, 0.2, 0.2], ys, 0.05)["how"] == "all-within"
    assert (
        fit_budget([0.1, 0.2], [0.3, 0.4], 0.05) | {}
        and fit_budget([0.1, 0.2], [0.3, 0.4], 0.05)["budget"] == 0.0
    )


def test_paired_loss_sd_is_the_pooled_within_configuration_sd():
    """Against statistics.variance per configuration, pooled by degrees of freedom; the baseline left out."""
    rng = random.Random(1)
    losses = {"a": [rng.gauss(0, 1) for _ in range(2)], "b": [rng.gauss(3, 1) for _ in range(4)], "c": [0.5]}
    points = [{"source": k, "quality_loss": x} for k, v in losses.items() for x in v]
    points += [{"source": "baseline", "quality_loss": 0.0}] * 3
    pooled = (statistics.variance(losses["a"]) * 1 + statistics.variance(losses["b"]) * 3) / 4
    assert abs(paired_loss_sd(points) - pooled**0.5) < 1e-12
    assert paired_loss_sd([{"source": "c", "quality_loss": 0.5}]) is None
    near = abs(sum(losses["a"]) / 2) + 0.1  # "b", mean near 3, is far beyond: left out
    assert abs(paired_loss_sd(points, near=near) - statistics.stdev(losses["a"])) < 1e-12


def calibration_like(losses_by_seed: list[list[float]]) -> list[dict]:
    """Points as calibrate writes them: a baseline (start 1.0, final 0.0: improvement 1) and one
    configuration per knee_points x, with one paired loss per seed."""
    xs = knee_points()[0]
    points = [
        {"source": "baseline", "mismatch": 0.0, "quality_loss": 0.0, "eval_rkl_start": 1.0, "eval_rkl": 0.0}
        for _ in losses_by_seed
    ]
    for i, x in enumerate(xs):
        points += [{"source": f"c{i}", "mismatch": x, "quality_loss": ys[i]} for ys in losses_by_seed]
    return points


def test_budget_ci_brackets_the_budget_and_collapses_without_seed_spread():
    ys = knee_points()[1]
    same = budget_ci(calibration_like([ys, ys]), 0.2, draws=200)
    assert same["lo"] == same["hi"] == pytest.approx(fit_budget(knee_points()[0], ys, 0.2)["budget"])
    ys2 = knee_points(knee=0.02)[1]  # the second seed breaks later
    ci = budget_ci(calibration_like([ys, ys2]), 0.2, draws=400)
    budgets = [fit_budget(knee_points()[0], y, 0.2)["budget"] for y in (ys, ys2)]
    assert min(budgets) - 1e-12 <= ci["lo"] < ci["hi"] <= max(budgets) + 1e-12
    # Only seed 1's last point exceeds the tolerance: a draw crosses only when it takes that point twice
    # (1 in 4; once, it is pooled with seed 0's 0 at the same mismatch: 0.15); otherwise the budget lies
    # beyond the largest mismatch tried.
    flat = budget_ci(calibration_like([[0.0] * 16, [0.0] * 15 + [0.3]]), 0.2, draws=400)
    assert flat["hi"] is None and flat["lo"] is not None, "all-within draws read as +inf"
    assert 0.65 < flat["beyond_largest_mismatch"] < 0.85
    json.dumps(flat, allow_nan=False)  # and stay valid JSON


def test_a_tolerance_under_two_standard_errors_writes_no_budget(tmp_path):
    """Seed noise larger than half the tolerance: refused with one line naming both, the would-be budget kept
    in refused.json; enough seeds, or one seed (no spread to judge by), pass."""
    noisy = {
        "tolerance_at_least_2se": False,
        "tolerance_over_se": 0.3,
        "paired_loss_se": 0.29,
        "paired_loss_sd": 0.41,
    }
    budget = {"noise": noisy, "tolerance": {"nats": 0.087}}
    # the power rule's seeds: ceil((3 · 0.41 / 0.087)²) = ceil(199.9) = 200
    with pytest.raises(
        BadInput, match=r"0\.0870 nats, is 0\.30 standard errors .* about 200 seeds .* no budget written"
    ):
        refuse_noise(budget, tmp_path)
    assert json.loads((tmp_path / "refused.json").read_text()) == budget
    for passed, over_se in ((True, 4.7), (None, None)):
        noise = {**noisy, "tolerance_at_least_2se": passed, "tolerance_over_se": over_se}
        refuse_noise({**budget, "noise": noise}, tmp_path)
        # a passing calibration removes the earlier refusal's file
        assert not (tmp_path / "budget.json").exists() and not (tmp_path / "refused.json").exists()
        (tmp_path / "refused.json").write_text("{}")


def test_a_reused_calibration_says_where_its_points_trained():
    fresh, old = {"source": "noise 0.1"}, {"source": "noise 0.3", "reused": True}
    assert trained_on({"device": "A", "points": [fresh]}) == "A"
    assert trained_on({"device": "A", "points": [old], "reused": {"trained_on": "B"}}) == "B"
    assert trained_on({"device": "A", "points": [fresh, old], "reused": {"trained_on": "B"}}) == "A and B"
    assert trained_on({"device": "A", "points": [fresh, old], "reused": {"trained_on": "A"}}) == "A"
    assert trained_on({"device": "A", "points": [old], "reused": {"points": 1}}) == "A", "an older record"


def test_a_run_is_paired_only_with_the_baseline_of_its_seed_trained_on_its_machine():
    """calibrate.paired_quality_losses: quality loss = final eval reverse KL − the same-seed baseline's
    trained on the same machine; a run whose seed's baseline trained elsewhere is refused in one line."""
    from cli import BadInput
    from lab.calibrate import paired_quality_losses

    def point(source, seed, rkl, on):
        return {"source": source, "seed": seed, "eval_rkl": rkl, "eval_rkl_start": 3.0, "trained_on": on}

    points = [point("baseline", 0, 2.0, "A"), point("baseline", 1, 2.2, "A"), point("noise 0.1", 1, 2.5, "A")]
    tol, _ = paired_quality_losses(points, 0.2)
    assert abs(points[2]["quality_loss"] - 0.3) < 1e-12 and abs(tol - 0.2 * (3.0 - 2.1)) < 1e-12
    mixed = [point("baseline", 0, 2.0, "A"), point("noise 0.1", 0, 2.5, "B")]
    with pytest.raises(BadInput, match="not paired"):
        paired_quality_losses(mixed, 0.2)


def test_seeds_for_power_is_the_smallest_n_with_se_within_a_third_of_the_tolerance():
    """n = ceil((3 sd / tol)²), at least 2: sd/√n <= tol/3 holds at n and fails at n − 1 (when n > 2)."""
    from lab.calibrate import seeds_for_power

    assert seeds_for_power(None, 0.2) is None
    for sd, tol in [(0.1, 0.2), (0.2, 0.2), (0.05, 0.4), (0.3, 0.1), (0.199, 0.2)]:
        n = seeds_for_power(sd, tol)
        assert sd / n**0.5 <= tol / 3 + 1e-12
        assert n == 2 or sd / (n - 1) ** 0.5 > tol / 3


def test_powered_points_adds_the_seeds_the_spread_asks_for_and_stops_at_the_cap(monkeypatch):
    """calibrate's seeds by power: under-powered at 2 seeds, the loop reruns calibration_points with the seeds
    the measured spread asks for (finished runs would be reused), never past max_seeds; a powered first round
    runs no more seeds."""
    import lab.calibrate as cal

    calls = []

    def fake_points(pair, out, noise_grid, *, seeds, **kw):
        calls.append(seeds)
        rng = random.Random(seeds)
        points = [
            {"source": s, "seed": i, "eval_rkl_start": 3.0, "trained_on": "A", "mismatch": m}
            for s, m in (("baseline", 0.0), ("noise 0.1", 0.01))
            for i in range(seeds)
        ]
        for p in points:  # a spread of about `spread` nats in the paired loss; the baseline improves by 1
            p["eval_rkl"] = 2.0 + (spread * rng.gauss(0, 1) if p["source"] != "baseline" else 0.0)
        return points

    monkeypatch.setattr(cal, "calibration_points", fake_points)
    for spread, max_seeds in [(0.01, 20), (0.5, 6)]:
        calls.clear()
        loss = {"loss": "analytic", "tis_cap": 0.0}
        points, tol, _, seeds, power = cal.powered_points(
            "tiny", None, [], seeds=2, max_seeds=max_seeds, tolerance=0.2, loss=loss, reuse=None
        )
        rounds = power["rounds"]
        assert calls[0] == 2 and seeds == calls[-1] <= max_seeds and len(rounds) == len(calls)
        assert all(b > a for a, b in zip(calls, calls[1:]))
        last = rounds[-1]
        assert (last["se_over_tolerance"] <= 1 / 3) or seeds == max_seeds
        if spread == 0.01:  # sd ≈ 0.01 against a 0.2-nat tolerance: powered at the first round
            assert calls == [2]
        else:  # sd ≈ 0.5: (3 · 0.5 / 0.2)² ≈ 56 seeds asked for, 6 allowed
            assert calls[-1] == 6 and last["se_over_tolerance"] > 1 / 3
