"""The study's pure parts: time to quality, the modeled GPU projection, and the report."""

import json
import math
from pathlib import Path

import pytest

from cli import BadInput
from study import answer, common, time_to_quality, validate
from study import coverage as study_coverage
from study import report as study_report

ROOT = Path(__file__).resolve().parents[1]


def test_time_to_quality_counts_training_seconds_up_to_the_first_eval_at_target():
    records = [
        {"step": 0, "seconds": 0.0, "eval_rkl": 3.0},
        {"step": 1, "seconds": 10.0},
        {"step": 2, "seconds": 12.0, "eval_rkl": 2.0},
        {"step": 3, "seconds": 9.0},
        {"step": 4, "seconds": 11.0, "eval_rkl": 1.0},
    ]
    assert time_to_quality.time_to_quality(records, target=2.0) == (2, 22.0)
    assert time_to_quality.time_to_quality(records, target=1.5) == (4, 42.0)
    assert time_to_quality.time_to_quality(records, target=0.5) == (None, None)
    assert time_to_quality.time_to_quality(records, target=3.5) == (
        2,
        22.0,
    )  # step 0 (untrained) never counts


def test_modeled_gpu_projection():
    m = time_to_quality.modeled_gpu(0.5, 0.5)
    assert m == {"sync bf16": 1.0, "async bf16": 0.5, "sync fp8": 0.75, "async fp8": 0.5}
    m = time_to_quality.modeled_gpu(0.9, 0.5)  # generation-bound: async hides training, FP8 halves generation
    assert (
        abs(m["async bf16"] - 0.9) < 1e-12
        and abs(m["async fp8"] - 0.45) < 1e-12
        and abs(m["sync fp8"] - 0.55) < 1e-12
    )


def test_report_names_the_command_of_every_missing_result(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = study_report.report().read_text()
    for command in (
        "python -m study validate --pair tiny",
        "python -m study rl",
        "python -m study prefix",
        "python -m study async",
    ):
        assert f"(not run yet: `{command}`)" in summary


def test_report_gives_the_budget_interval_recorded_or_refitted_from_the_points():
    from lab import calibrate

    budget = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
    budget.pop("budget_ci", None)  # a budget.json written before the interval was recorded
    ci = calibrate.budget_ci(budget["points"], budget["tolerance"]["fraction"])
    assert ci["lo"] <= budget["budget"] <= ci["hi"]
    assert f"[{ci['lo']:.3g}, {ci['hi']:.3g}]" in study_report.ci_line(budget)
    recorded = {**budget, "budget_ci": {**ci, "hi": None}}
    assert "beyond the largest mismatch tried]" in study_report.ci_line(recorded)
    assert study_report.ci_line({**budget, "how": "all-within"}) == "", (
        "a lower bound has no crossing to bracket"
    )


def test_report_says_where_a_budgets_reused_runs_trained():
    budget = json.loads((ROOT / "budgets" / "tiny" / "sampled-tis2" / "budget.json").read_text())
    here = {**budget, "reused": {"from": "r.json", "points": 3, "trained_on": budget["device"]}}
    assert study_report.trained_on(here) == "", "runs trained where the budget was written: nothing to add"
    assert study_report.trained_on({**budget, "reused": {"from": "r.json", "points": 3}}) == ""
    elsewhere = {**budget, "reused": {"from": "r.json", "points": 3, "trained_on": "CPU (other)"}}
    line = study_report.budget_section(Path("budget.json"), elsewhere)
    assert f"device {budget['device']}; 3 of its runs trained on CPU (other)." in line


def test_report_reads_the_noise_gate_from_the_points_of_a_budget_that_predates_it():
    """Two seeds of one near configuration, paired losses 0.01 and 0.03: sd = √(2 · 0.01²) = 0.01414,
    se = sd / √2 = 0.01, so a tolerance of 0.03 is 3 SE and one of 0.015 is 1.5 SE (under the gate)."""
    points = [{"source": "noise 0.1", "seed": s, "quality_loss": q} for s, q in ((0, 0.01), (1, 0.03))]
    budget = {"points": points, "seeds": 2, "tolerance": {"nats": 0.03}, "loss": "analytic"}
    assert "tolerance = 3.00 SE." in study_report.noise_line(budget)
    low = study_report.noise_line({**budget, "tolerance": {"nats": 0.015}})
    assert "tolerance = 1.50 SE: under the 2 SE" in low
    assert study_report.noise_line({**budget, "points": points[:1]}) == "", "one seed: no spread to read"
    # stale runs near the tolerance (0.0, 0.06) widen the analytic pool; a sampled-token loss's gate leaves
    # them out, as its fit does (they are judged on their own axis)
    stale = [{"source": "staleness 2", "seed": s, "quality_loss": q} for s, q in ((0, 0.0), (1, 0.06))]
    both = {**budget, "points": points + stale}
    assert "tolerance = 3.00 SE." not in study_report.noise_line(both)
    assert "tolerance = 3.00 SE." in study_report.noise_line({**both, "loss": "sampler"})


def test_validation_table_counts_agreement_on_decided_verdicts_only():
    rows = [
        {
            "candidate": "a",
            "check_mismatch": 0.1,
            "ci": [0.05, 0.2],
            "verdict": "admit",
            "train_mismatch": 0.1,
            "quality_loss": 0.0,
            "outcome": "within",
            "agree": True,
        },
        {
            "candidate": "b",
            "check_mismatch": 5.0,
            "ci": [4.0, 6.0],
            "verdict": "reject",
            "train_mismatch": 5.0,
            "quality_loss": 0.3,
            "outcome": "beyond",
            "agree": True,
        },
        {
            "candidate": "c",
            "check_mismatch": 2.0,
            "ci": [1.0, 3.0],
            "verdict": "uncertain",
            "train_mismatch": 2.0,
            "quality_loss": 0.0,
            "outcome": "within",
            "agree": None,
        },
    ]
    result = {
        "rows": rows,
        "agreement": 1.0,
        "decided": 2,
        "budget": 2.5,
        "budget_how": "crossing",
        "tolerance_nats": 0.01,
        "steps": 60,
        "seeds": 2,
        "probes": 64,
        "device": "CPU",
    }
    table = validate.validation_table(json.loads(json.dumps(result)))
    assert "agreement on decided verdicts: 100% (2 of 2; 2 of 3 unseen candidates decided)" in table
    assert "checks of at most 64 probes" in table
    assert sum(line.startswith("| ") for line in table.splitlines()) == 1 + len(
        rows
    )  # header + a row per candidate


def test_a_pairs_budgets_are_read_per_loss_tabled_and_overlaid(tmp_path):
    """budgets/<pair>/budget.json and budgets/<pair>/<loss>/budget.json: each read with its loss, one table
    row each (a budget below the smallest mismatch tried reads "< smallest"), one overlay figure."""
    from study import losses

    analytic = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
    sampled = {**analytic, "loss": "sampled", "tis_cap": 2.0, "budget": 0.0, "how": "none-within"}
    sampled["train_settings"] = {**analytic["train_settings"], "loss": "sampled", "tis_cap": 2.0}
    sampled["budget_ci"] = None  # the analytic interval would not hold this budget (read_budget refuses it)
    (tmp_path / "tiny" / "sampled-tis2").mkdir(parents=True)
    (tmp_path / "tiny" / "budget.json").write_text(json.dumps(analytic))
    (tmp_path / "tiny" / "sampled-tis2" / "budget.json").write_text(json.dumps(sampled))
    budgets = losses.pair_budgets("tiny", root=tmp_path)
    assert [(b["loss"], b["tis_cap"]) for _, b in budgets] == [("analytic", 0.0), ("sampled", 2.0)]
    rows = losses.losses_table(budgets).splitlines()[2:]
    smallest = min(p["mismatch"] for p in analytic["points"] if p["mismatch"] > 0)
    assert rows[0].startswith(f"| analytic | {analytic['budget']:.3g} |")
    assert rows[1].startswith(f"| sampled-tis2 | < {smallest:.2g} | — |")
    # each row sets the analytic budget refitted at its tolerance beside it: the analytic row its own
    fraction = f"{analytic['tolerance']['fraction']:.0%}"
    assert f"| {fraction}: {analytic['tolerance']['nats']:.4f} nats | {analytic['budget']:.3g} |" in rows[0]
    looser = losses.refit(analytic, 1.5 * analytic["tolerance"]["fraction"])
    assert looser["how"] == "crossing" and looser["budget"] > analytic["budget"]  # a looser tolerance, later
    losses.plot_losses("tiny", budgets, tmp_path / "overlay.png")
    assert (tmp_path / "overlay.png").stat().st_size > 10_000


def test_a_loss_is_compared_with_the_analytic_budget_trained_at_its_settings():
    """A loss calibrated at other settings than the analytic budget is set beside an analytic calibration at
    its own settings (a reference), never beside the other settings' budget."""
    from study import losses

    analytic = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
    early = {**analytic, "steps": analytic["steps"] + 1, "budget": 2.0}
    early["train_settings"] = {**analytic["train_settings"], "lr": analytic["train_settings"]["lr"] / 5}
    early["points"] = [{**p, "mismatch": p["mismatch"] / 2} for p in analytic["points"]]
    sampled = {**early, "loss": "sampled", "tis_cap": 2.0}
    sampled["train_settings"] = {**early["train_settings"], "loss": "sampled", "tis_cap": 2.0}
    budgets = [(Path("a.json"), analytic), (Path("s.json"), sampled)]
    assert losses.analytic_like(sampled, [analytic]) is None
    assert losses.analytic_like(sampled, [analytic, early]) is early
    centred = {**sampled, "train_settings": {**sampled["train_settings"], "center_advantages": True}}
    assert losses.analytic_like(centred, [analytic, early]) is early  # centring is the loss's, not a setting
    alone = losses.losses_table(budgets).splitlines()[3]
    assert alone.split(" | ")[4] == "—"  # no analytic calibration at its settings
    row = losses.losses_table(budgets, [(Path("r.json"), early)]).splitlines()[3]
    fraction = sampled["tolerance"]["fraction"]
    assert row.split(" | ")[4] == losses.budget_text({**early, **losses.refit(early, fraction)})


def test_drift_compares_each_window_of_training_mismatch_with_the_probe_measurement(tmp_path, monkeypatch):
    """A 20-step run logging mismatch_kl = 0.01 · step against a probe measurement of 0.1: the first tenth
    (steps 1-2) reads 0.015 (×0.15), the middle (steps 10-11) 0.105, the last (19-20) 0.195 (×1.95)."""
    from study import drift

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "budgets" / "tiny"
    run = folder / "runs" / "noise_0.1-seed0"
    run.mkdir(parents=True)
    run.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "mismatch_kl": 0.01 * s}) + "\n" for s in range(1, 21))
    )
    budget = {
        "schema_version": 2, "pair": "tiny", "loss": "analytic", "tis_cap": 0.0, "budget": 1.0,
        "how": "crossing", "tolerance": {"nats": 0.01}, "seconds_per_run": 1.0, "steps": 20, "seeds": 1,
        "points": [{"source": "baseline", "seed": 0, "mismatch": 0.0},
                   {"source": "noise 0.1", "seed": 0, "mismatch": 0.1}],
    }  # fmt: skip
    folder.joinpath("budget.json").write_text(json.dumps(budget))
    row = drift.drift(folder / "budget.json")["rows"]["noise 0.1"]
    assert list(drift.windows(20)["middle"]) == [10, 11]
    expected = {"first": 0.015, "middle": 0.105, "last": 0.195}
    for w, value in expected.items():
        assert abs(row[w] - value) < 1e-12 and abs(row[f"{w}_ratio"] - value / 0.1) < 1e-9
    assert "| noise 0.1 | 0.1 | 0.015 (×0.15) |" in drift.drift_table(drift.drift(folder / "budget.json"))
    assert (tmp_path / "results" / "drift_tiny_analytic.json").is_file()


def test_a_one_pair_coverage_run_keeps_the_other_pairs_results(tmp_path):
    path = tmp_path / "coverage.json"
    assert study_coverage.merged(path, [{"pair": "tiny", "cells": [1]}]) == [
        {"pair": "tiny", "cells": [1]}
    ], "no file yet"
    path.write_text(
        json.dumps({"results": [{"pair": "tiny", "cells": [1]}, {"pair": "smollm2", "cells": [2]}]})
    )
    out = study_coverage.merged(path, [{"pair": "smollm2", "cells": [3]}])
    assert out == [{"pair": "tiny", "cells": [1]}, {"pair": "smollm2", "cells": [3]}]


def test_a_sampled_loss_is_validated_near_its_own_budget():
    """Calibration points with mismatch = σ²: the noise for a target mismatch is its square root, moved off
    the calibration grid; a sampled-loss budget gets the real configurations and eight noises at 1/8–8× it."""
    points = [
        {"source": f"noise {s:g}", "noise": s, "seed": seed, "mismatch": s * s}
        for s in (0.01, 0.1, 1.0)
        for seed in (0, 1)
    ]
    budget = {"loss": "sampled", "how": "crossing", "budget": 0.0025, "points": points}
    assert validate.noise_for(budget, 0.0025) == 0.05
    assert validate.noise_for(budget, 0.01) == 0.11, "0.1 was calibrated: moved off the grid"
    assert validate.noise_for(budget, 4.0) == 2.0, "beyond the grid: extrapolated from the last two points"
    candidates = validate.candidates_for("tiny", budget)
    noises = [over["noise"] for _, over in candidates if "noise" in over]
    assert noises == [0.018, 0.025, 0.035, 0.043, 0.057, 0.071, 0.11, 0.14] and len(candidates) >= 12
    assert all("noise" not in over for _, over in candidates[: len(candidates) - 8])
    assert ("staleness 1", {"staleness": 1}) in candidates  # the mildest real staleness
    analytic = validate.candidates_for("tiny", {**budget, "loss": "analytic", "budget": 0.04})
    # the pair's list, then noise at 0.75× and 1.3× the budget (σ = √0.03, √0.052): two within ±30%
    near = [("noise 0.17", {"noise": 0.17}), ("noise 0.23", {"noise": 0.23})]
    assert analytic == validate.VALIDATION["tiny"] + near
    smollm2 = validate.candidates_for("smollm2", {**budget, "loss": "analytic"})
    assert smollm2 == validate.VALIDATION["smollm2"]  # two of its list's noises lie within ±30% already
    # a σ the list already holds is not added twice: 0.75 × 0.0533 = 0.04 -> σ 0.2, the list's "noise 0.2"
    assert [
        c for c, _ in validate.candidates_for("tiny", {**budget, "loss": "analytic", "budget": 0.0533})
    ].count("noise 0.2") == 1


def test_a_validation_trains_the_budgets_own_loss_on_configurations_its_calibration_never_ran():
    """The centred budget's validation trains the centred loss (not the uncorrected one, whose runs and
    record it would otherwise share), names its record for it, and leaves out what its calibration ran."""
    path = ROOT / "budgets/tiny/sampled-centered/budget.json"
    budget, loss = validate.validation_budget("tiny", path)
    assert loss == {"loss": "sampled", "tis_cap": 0.0, "center_advantages": True}
    assert budget["train_settings"]["center_advantages"] is True
    _, plain = validate.validation_budget("tiny", ROOT / "budgets/tiny/sampled/budget.json")
    assert plain["center_advantages"] is False
    # its calibration ran staleness 1 and 4: their rows are shown, and not counted
    ran = {p["source"] for p in budget["points"]}
    candidates = validate.candidates_for("tiny", budget)
    assert {"staleness 1", "staleness 4"} <= ran & {label for label, _ in candidates}
    points = [
        {"label": label, "seed": 0, "mismatch": 0.1, "delta_eval_rkl": 9.0 if "stale" in label else 0.0}
        for label, _ in candidates
    ]
    verdicts = {
        label: {"verdict": "reject" if "stale" in label else "admit", "mismatch_kl": 0.1}
        | {"ci_low": 0.05, "ci_high": 0.2, "seconds": 1.0}
        for label, _ in candidates
    }
    rows = validate.agreement_rows(candidates, points, verdicts, tol=0.2, ran=ran)
    counted = [r["candidate"] for r in rows if r["agree"] is not None]
    assert len(counted) == len(candidates) - 2 >= 8 and not ran & set(counted)
    assert all(r["calibrated"] == (r["candidate"] in ran) for r in rows)
    table = validate.validation_table(
        {"budget": 0.005, "budget_how": "crossing", "tolerance_nats": 0.2, "rows": rows, "steps": 400}
        | {"seeds": 1, "probes": 64, "device": "cpu", "decided": len(counted), "agreement": 1.0}
    )
    assert table.count("calibrated: not counted") == 2
    assert f"{len(counted)} of {len(counted)} unseen candidates decided; 2 the calibration also ran" in table


def test_every_committed_budget_was_trained_at_the_study_settings_of_its_loss():
    """A committed budget's recorded command reproduces it: its train_settings and steps are what
    calibrate.study_config gives its pair and loss today (config.STUDY_TRAIN, and the loss's own rate from
    results/lr_<pair>.json), or the rate its command names (--lr, a comparison of recipes), or, for a budget
    calibrated before its pair's sweep chose another rate, the rate it trained at, which the answer marks as
    not its loss's own."""
    import shlex

    from budget import read_budget
    from lab.calibrate import study_config, train_settings

    paths = sorted((ROOT / "budgets").glob("*/budget.json")) + sorted(
        (ROOT / "budgets").glob("*/*/budget.json")
    )
    assert len(paths) >= 5
    for path in paths:
        b = read_budget(path, None)
        loss = {
            "loss": b["loss"],
            "tis_cap": b["tis_cap"],
            "center_advantages": b.get("center_advantages", False),
        }
        words = shlex.split(b["command"])
        loss.update({"lr": float(words[words.index("--lr") + 1])} if "--lr" in words else {})
        recorded = b["train_settings"]["lr"]
        if "lr" not in loss and not math.isclose(study_config(b["pair"], **loss).lr, recorded):
            # calibrated before its pair's sweep chose another rate for its loss: the answer says so
            assert answer.rate_note(b["pair"], b).startswith("not its own"), path
            loss["lr"] = recorded
        assert b["train_settings"] == train_settings(b["pair"], **loss), path
        assert b["steps"] == study_config(b["pair"], **loss).steps, path


def test_validate_reuse_takes_a_recorded_validations_runs_and_trains_nothing(tmp_path):
    """validate --reuse: the recorded validation of the same budget gives the training points, so only the
    checks run again; a record of another budget is refused. The budget is the one the record validated, the
    committed analytic budget."""
    record = json.loads((ROOT / "results/validation_tiny.json").read_text())
    budget = json.loads((ROOT / "budgets/tiny/budget.json").read_text())
    assert budget["budget"] == record["budget"]
    recorded, trained_on = validate.reused_validation(
        ROOT / "results/validation_tiny.json", "tiny", budget, "analytic"
    )
    assert trained_on == record.get("reused", {}).get("trained_on", record["device"]), (
        "where the runs trained"
    )
    labels = ["baseline"] + [label for label, _ in validate.candidates_for("tiny", budget)]
    assert {(label, seed) for label in labels for seed in range(record["seeds"])} <= set(recorded)
    plan = [(label, {}, {}) for label in labels]
    points = common.sweep(
        tmp_path / "runs", "tiny", plan, seeds=record["seeds"], device="cpu", desc="t", recorded=recorded
    )
    assert all(p["reused"] for p in points) and not (tmp_path / "runs").exists(), "nothing trained"
    with pytest.raises(BadInput, match="budget is"):
        validate.reused_validation(
            ROOT / "results/validation_tiny.json", "tiny", {**budget, "budget": 1.0}, "analytic"
        )


def test_lr_choice_is_the_best_mean_among_rates_where_no_seed_diverged():
    """study.lr.choose: per loss, the lowest mean final eval reverse KL among rates with every seed finished
    and none diverged; a rate whose one seed diverged is never chosen, however good its other seeds."""
    from config import STUDY_LOSSES
    from study.lr import choose

    grid, seeds = (1e-4, 3e-4, 1e-3), 2
    finals = {1e-4: (2.5, 2.6), 3e-4: (2.0, 2.2), 1e-3: (1.0, None)}  # None: that seed diverged
    points = [
        {"loss": label, "lr": lr, "seed": s, "eval_rkl": v, "diverged": v is None, "eval_acc": None}
        for label in STUDY_LOSSES
        for lr, vals in finals.items()
        for s, v in enumerate(vals)
    ]
    cells, chosen = choose(points, grid, seeds)
    assert set(chosen.values()) == {3e-4}
    cell = next(c for c in cells if c["loss"] == "analytic" and c["lr"] == 1e-3)
    assert cell["diverged"] == 1 and cell["eval_rkl_mean"] == 1.0
    partial = [p for p in points if not (p["lr"] == 3e-4 and p["seed"] == 1)]
    assert set(choose(partial, grid, seeds)[1].values()) == {1e-4}  # a rate needs every seed to be chosen
    # a choice at an end of the grid is marked: the best rate may lie beyond it
    from study.lr import chosen_text

    result = {"grid": list(grid), "chosen": {"analytic": 3e-4, "sampled": 1e-4, "sampler-is": 1e-3}}
    assert chosen_text(result, "analytic") == "0.0003"
    assert chosen_text(result, "sampled") == "0.0001, bottom of the grid"
    assert chosen_text(result, "sampler-is") == "0.001, top of the grid"
    assert chosen_text(result, "sampled-tis2") == "—"


def test_lr_sweep_deletes_a_runs_checkpoint_once_its_point_is_recorded(tmp_path, monkeypatch):
    """study.lr.lr_sweep keeps every run's record and drops its checkpoint.pt once the point is written
    (the sweep resumes from the record, never from a checkpoint); a run it reuses is not run again."""
    import study.lr as sweep

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sweep.LR_GRID, "tiny", (1e-3,))
    written, ran = [], []

    def fake_run(out, pair, label, lr, seed, device):
        run_dir = out / sweep.run_name(label, lr, seed)
        run_dir.mkdir(parents=True)
        (run_dir / "checkpoint.pt").write_bytes(b"weights")
        (run_dir / "metrics.jsonl").write_text("{}\n")
        ran.append(label)
        return {"loss": label, "lr": lr, "seed": seed, "eval_rkl": 1.0, "diverged": False}

    first = next(iter(sweep.STUDY_LOSSES))
    reused = {(first, 1e-3, 0): {"loss": first, "lr": 1e-3, "seed": 0, "eval_rkl": 1.0, "diverged": False}}
    monkeypatch.setattr(sweep, "lr_run", fake_run)
    monkeypatch.setattr(sweep, "recorded_points", lambda pair: reused)
    monkeypatch.setattr(sweep, "write", lambda name, result: written.append(len(result["points"])))
    monkeypatch.setattr(sweep, "plot_lr", lambda result, path: None)
    sweep.lr_sweep("tiny", seeds=1, device="cpu")
    assert ran == list(sweep.STUDY_LOSSES)[1:], "the recorded run is reused, every other one runs"
    assert written[-1] == len(sweep.STUDY_LOSSES)
    folders = sorted((tmp_path / "runs" / "study" / "lr_tiny").iterdir())
    assert len(folders) == len(ran) and all((d / "metrics.jsonl").exists() for d in folders)
    assert not any((d / "checkpoint.pt").exists() for d in folders)


def test_a_study_sweep_keeps_each_runs_record_and_drops_its_checkpoint(tmp_path, monkeypatch):
    """study.common.sweep: every finished run keeps config.json and metrics.jsonl (what a resumed sweep
    reuses) and loses its checkpoint.pt; a recorded point is not run at all."""
    ran = []

    def fake_short_run(out, pair, name, seed, device, rollout_over, **train_over):
        run_dir = out / name
        run_dir.mkdir(parents=True)
        for f in ("config.json", "metrics.jsonl", "checkpoint.pt"):
            (run_dir / f).write_text("{}\n")
        ran.append(name)
        return {"eval_rkl": 1.0}

    monkeypatch.setattr(common, "short_run", fake_short_run)
    plan = [("clean", {}, {}), ("noise 0.1", {}, {"noise": 0.1})]
    recorded = {("clean", 1): {"label": "clean", "seed": 1, "eval_rkl": 2.0}}
    points = common.sweep(tmp_path, "tiny", plan, seeds=2, device="cpu", desc="t", recorded=recorded)
    assert ran == ["clean-seed0", "noise_0.1-seed0", "noise_0.1-seed1"]
    assert [p.get("reused", False) for p in points] == [False, True, False, False]
    for name in ran:
        assert sorted(f.name for f in (tmp_path / name).iterdir()) == ["config.json", "metrics.jsonl"]


def test_seed_noise_pools_the_within_rate_variance_of_each_quality_measure():
    """study.lr.seed_noise: per loss, sd² = Σ_rate Σ_seed (x − mean_rate)² / Σ_rate (n_rate − 1) for the final
    evaluation and for the mean of the last two; a rate with a diverged seed is left out."""
    import statistics

    from study.lr import seed_noise

    runs = {  # lr -> per seed, the evaluations at steps 0, 100, 200
        1e-4: [(3.0, 2.8, 2.6), (3.0, 2.7, 2.4)],
        3e-4: [(3.0, 2.2, 2.0), (3.0, 2.4, 2.3), (3.0, 2.1, 2.2)],
        1e-3: [(3.0, 1.0, 0.5), (3.0, 9.0, 9.5)],  # the second seed diverged: the rate is left out
    }
    points = [
        {
            "loss": "sampled",
            "lr": lr,
            "seed": s,
            "eval_rkl_by_step": [[100 * i, v] for i, v in enumerate(evals)],
            "diverged": evals[-1] > evals[0],
        }
        for lr, seeds in runs.items()
        for s, evals in enumerate(seeds)
    ]
    row = seed_noise(points)["sampled"]

    def pooled(groups):
        ss = sum((x - statistics.fmean(g)) ** 2 for g in groups for x in g)
        return (ss / sum(len(g) - 1 for g in groups)) ** 0.5

    kept = [runs[1e-4], runs[3e-4]]
    assert row["dof"] == 3
    assert abs(row["final"] - pooled([[e[-1] for e in g] for g in kept])) < 1e-12
    assert abs(row["mean of the last two"] - pooled([[(e[-1] + e[-2]) / 2 for e in g] for g in kept])) < 1e-12
    assert seed_noise(points)["analytic"] == {"dof": 0, "final": None, "mean of the last two": None}


def test_the_answer_refits_a_budget_at_one_tolerance_from_its_own_points():
    """study.answer.at_tolerance: a budget at its own fraction is itself; moved to another fraction and back,
    the fit, the seed interval and the noise come back as the calibration recorded them (pure functions of
    the points)."""
    b = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
    fraction = b["tolerance"]["fraction"]
    assert answer.at_tolerance(b, fraction) is b
    moved = {**b, "tolerance": {**b["tolerance"], "fraction": fraction / 2}}
    back = answer.at_tolerance(moved, fraction)
    assert back["budget"] == pytest.approx(b["budget"]) and back["how"] == b["how"]
    assert back["budget_ci"]["lo"] == pytest.approx(b["budget_ci"]["lo"])
    assert back["budget_ci"]["hi"] == pytest.approx(b["budget_ci"]["hi"])
    assert back["noise"]["paired_loss_se"] == pytest.approx(b["noise"]["paired_loss_se"])
    looser = answer.at_tolerance(b, 2 * fraction)
    assert looser["tolerance"]["nats"] == pytest.approx(2 * b["tolerance"]["nats"])
    assert looser["how"] == "all-within" or looser["budget"] > b["budget"]


def test_the_answer_gives_each_real_configuration_checks_verdict_and_trainings_outcome():
    """One row per committed budget; every real configuration's verdict is the live check's rule applied to
    its probe mismatch, and a stale run that lost beyond the tolerance under a sampled-token loss is always
    rejected (verdict.stale_axis); the table names every column, "not calibrated" where the budget has none."""
    from study import losses

    rows = answer.answer_rows(("tiny", "smollm2"))
    committed = [b for pair in ("tiny", "smollm2") for _, b in losses.pair_budgets(pair)]
    assert len(rows) == len(committed)
    for r in rows:
        assert r["fraction"] == answer.STUDY_TOLERANCE
        for source, m in r["real"].items():
            assert m["verdict"] in ("admit", "reject", "uncertain")
            assert m["outcome"] == ("within" if m["quality_loss"] <= r["tolerance_nats"] else "beyond")
            if r["loss"] != "analytic" and source.startswith("staleness") and m["outcome"] == "beyond":
                assert m["verdict"] == "reject", (r["pair"], r["loss"], source)
            if m["verdict"] == "admit":
                assert m["ci_high"] < r["budget"]  # the scale admits only below the budget
    table = answer.answer_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(s in table[0] for s in answer.REAL)
    missing = sum(s not in r["real"] for r in rows for s in answer.REAL)
    assert sum(line.count("not calibrated") for line in table) == missing


def test_a_validation_of_another_budget_says_that_todays_budget_is_not_validated():
    """The report's validation section of a record whose budget is not the committed one says which
    budget it checked and that today's is not validated; a record of today's budget gets no such line."""
    record = json.loads((ROOT / "results/validation_tiny.json").read_text())
    assert study_report.validated_budget_line(record, "tiny", "analytic") == ""
    other = {**record, "budget": record["budget"] * 2}
    line = study_report.validated_budget_line(other, "tiny", "analytic")
    assert "checked another budget" in line and "not validated yet" in line
    assert f"{other['budget']:.3g}" in line
    # a record kept from the budget at another rate is not read as a loss of its own
    assert (ROOT / "results/validation_smollm2_lr5e-05.json").is_file()
    assert study_report.budget_losses("smollm2")[0] == "analytic"
    assert not any("lr" in loss for loss in study_report.budget_losses("smollm2"))


def test_the_staleness_axis_pools_the_calibration_and_only_that_budgets_validation(tmp_path):
    """study.staleness: the calibration's stale runs first, then other seeds from the validation of that
    very budget (its paired delta_eval_rkl); a validation of another budget adds nothing, and a record that
    does not parse is one line naming it."""
    from budget import read_budget
    from study import staleness

    b = read_budget(ROOT / "budgets/tiny/sampler-is/budget.json", "tiny")
    b["points"] = [p for p in b["points"] if not (p["source"] == "staleness 1" and p["seed"] > 0)]
    record = {
        "budget": b["budget"],
        "points": [
            {"label": "staleness 1", "seed": 0, "delta_eval_rkl": 99.0},  # the calibration ran seed 0
            {"label": "staleness 1", "seed": 7, "delta_eval_rkl": -0.5},
        ],
    }
    calibrated = next(p["quality_loss"] for p in b["points"] if p["source"] == "staleness 1")
    assert staleness.stale_losses(b, record, 1) == {0: (calibrated, "calibration"), 7: (-0.5, "validation")}
    (tmp_path / "validation_tiny_sampler-is.json").write_text(json.dumps({**record, "budget": 1.0}))
    assert staleness.validation_of("tiny", b, tmp_path) is None
    (tmp_path / "validation_tiny_sampler-is.json").write_text(json.dumps(record))
    assert staleness.validation_of("tiny", b, tmp_path) == record
    (tmp_path / "validation_tiny_sampler-is.json").write_text('{"points": [')
    with pytest.raises(BadInput, match="validation_tiny_sampler-is.json: not a readable validation record"):
        staleness.validation_of("tiny", b, tmp_path)


def test_on_tiny_every_sampled_token_loss_loses_to_every_staleness_and_the_analytic_loss_to_none():
    """RESULTS' staleness finding, from the committed runs: staleness 1, 2 and 4 for each of tiny's five
    losses at its own rate, with at least 3 seeds each; the analytic loss within at each, every sampled-token
    loss beyond at each, on every seed."""
    from study import staleness

    rows = [r for r in staleness.staleness_rows("tiny") if r["record"] == "budget"]
    assert {(r["loss"], r["staleness"]) for r in rows} == {
        (loss, k)
        for loss in ("analytic", "sampled", "sampled-centered", "sampled-tis2", "sampler-is")
        for k in (1, 2, 4)
    }
    assert all(len(r["seeds"]) >= 3 for r in rows), [(r["loss"], r["staleness"], r["seeds"]) for r in rows]
    assert all(r["outcome"] == ("within" if r["loss"] == "analytic" else "beyond") for r in rows)
    assert all(min(r["losses"]) > r["tolerance_nats"] for r in rows if r["loss"] != "analytic")


def test_on_smollm2_at_its_own_rate_staleness_fits_the_uncorrected_estimator_and_not_tis():
    """RESULTS' smollm2 staleness finding, from the committed runs at 2e-4, 12 steps, 2 seeds: the analytic
    and the uncorrected losses within at staleness 1 and 2 (budgets); TIS (cap 2) and tinker's estimator
    beyond at both (calibrations the gate refused, rows marked so); the centred estimator within at 2."""
    from study import staleness

    rows = {(r["loss"], r["staleness"]): r for r in staleness.staleness_rows("smollm2") if r["lr"] == 2e-4}
    outcome = {key: (r["outcome"], r["record"]) for key, r in rows.items() if key[1] in (1, 2)}
    assert outcome == {
        ("analytic", 1): ("within", "budget"),
        ("analytic", 2): ("within", "budget"),
        ("sampled", 1): ("within", "budget"),
        ("sampled", 2): ("within", "budget"),
        ("sampled-tis2", 1): ("beyond", "refused"),
        ("sampled-tis2", 2): ("beyond", "refused"),
        ("sampler-is", 1): ("beyond", "refused"),
        ("sampler-is", 2): ("beyond", "refused"),
        ("sampled-centered", 2): ("within", "refused"),
    }
    assert all(len(r["seeds"]) == 2 for r in rows.values())


def test_a_refused_calibration_gives_staleness_rows_only_where_no_budget_holds_its_recipe(tmp_path):
    """study.staleness.refused_records: a refused record of a loss and settings that a committed budget
    shares (a later calibration with more seeds) is left out; one at another recipe is kept."""
    from budget import read_budget
    from study import staleness

    b = read_budget(ROOT / "budgets/tiny/sampler-is/budget.json", "tiny")
    (tmp_path / "refused_tiny_sampler-is_same.json").write_text(json.dumps(b))
    other = {**b, "train_settings": {**b["train_settings"], "lr": 3e-3}}
    (tmp_path / "refused_tiny_sampler-is_other.json").write_text(json.dumps(other))
    kept = staleness.refused_records("tiny", [b], tmp_path)
    assert [r["train_settings"]["lr"] for r in kept] == [3e-3]


def test_on_smollm2_at_5e5_the_centred_budget_lies_above_tinkers_and_its_seeds_part_past_the_knee():
    """RESULTS' smollm2 centred budget at 5e-5 (2 seeds): it crosses between σ = 0.1 and 0.3, its interval
    lies above tinker's budget at the same recipe and overlaps the uncorrected one's; the gate's pool meets the
    power rule, while past the knee (σ = 0.3 and 1, outside that pool) one seed collapses and the other does
    not; staleness 2 within on both seeds."""
    import statistics

    from budget import read_budget
    from lab.calibrate import by_source

    b = read_budget(ROOT / "budgets/smollm2/sampled-centered/budget.json", "smollm2")
    tinker = read_budget(ROOT / "budgets/smollm2/sampler-is/budget.json", "smollm2")
    uncorrected = read_budget(ROOT / "results/budget_smollm2_sampled_lr5e-05.json", "smollm2")
    assert b["train_settings"]["lr"] == tinker["train_settings"]["lr"] == uncorrected["train_settings"]["lr"]
    assert b["steps"] == tinker["steps"] == uncorrected["steps"] == 12
    tol = b["tolerance"]["nats"]
    by = by_source(b["points"])
    mean = {s: statistics.fmean(p["quality_loss"] for p in g) for s, g in by.items()}
    below = max(p["mismatch"] for p in by["noise 0.1"])
    above = min(p["mismatch"] for p in by["noise 0.3"])
    assert b["how"] == "crossing" and below < b["budget"] < above
    assert mean["noise 0.1"] <= tol < mean["noise 0.3"]
    assert b["budget_ci"]["lo"] > tinker["budget_ci"]["hi"]  # "tolerates more than tinker's"
    # the intervals overlap: both are open above the largest mismatch tried
    assert b["budget_ci"]["hi"] is None and uncorrected["budget_ci"]["hi"] is None
    assert b["noise"]["se_over_tolerance"] <= 1 / 3 and not b["noise"]["under_powered"]
    for source in ("noise 0.3", "noise 1"):  # past the knee the seeds part, outside the gate's pool
        losses = sorted(p["quality_loss"] for p in by[source])
        assert losses[0] < tol and losses[-1] > 3 * tol and mean[source] > 3 * tol, source
    assert all(p["quality_loss"] <= tol for p in by["staleness 2"])
