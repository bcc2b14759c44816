"""validate: the admission check against real training, on configurations the calibration never ran.

For each candidate, `admit.py check` gives a verdict in seconds; real runs of the calibration's length
(same seeds) give the outcome: within tolerance if its quality loss
    mean over seeds of (final eval reverse KL − the same-seed baseline run's) <= tolerance.
Agreement = admit & within, or reject & beyond; uncertain verdicts are counted apart.

    python -m study validate --pair tiny
"""

import json
import math
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from admit import check
from budget import read_budget
from cli import BadInput
from lab.budget_schema import check_schema
from lab.calibrate import study_config, train_settings, trained_on
from models import device_label, load_pair
from study.common import RESULTS, mean_by, paired, sweep, write
from study.losses import label_of
from study.sensitivity import block_skip

# Candidates off each pair's calibration grid (tiny's calibrations ran noise 0.003, 0.01, 0.03, 0.1, 0.3, 0.5
# and 1, fp8, kv-fp8 and staleness 2; the 400-step ones also staleness 1 and 4, so against those budgets the
# staleness-4 candidate is shown and not counted: agreement_rows).
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
    # levels between its grid points and the other real configurations. The two FP8 candidates come last:
    # the W8A8 emulation, and the recipe that keeps the blocks
    # `python -m study sensitivity --pair smollm2` found most sensitive (0–3, 23) in high precision, whose
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


# noise candidates of a sampled-loss validation, at these × the budget: two within ±30% of it, and others a
# factor 2 to 8 away on each side, where check should be right. smollm2's sampled runs take about 270 s each
# on 2 cores, so its list is the four nearest the budget's edges and the ends (8 candidates × 2 seeds,
# about 80 min)
NEAR_BUDGET = {"tiny": (0.125, 0.25, 0.5, 0.75, 1.3, 2.0, 4.0, 8.0), "smollm2": (0.25, 0.75, 1.3, 4.0)}
# real candidates of a sampled-loss validation: the pair's list without noise, plus (tiny) the mildest
# staleness, where a sampled loss already breaks (tiny's list has staleness 1 only with noise); smollm2's are
# one of each kind (FP8 weights real and emulated, FP8 KV, staleness 1)
SAMPLED_REAL = {
    "tiny": [label for label, over in VALIDATION["tiny"] if "noise" not in over] + ["staleness 1"],
    "smollm2": ["kv-fp8 unit scales", "staleness 1", "fp8 recipe", "fp8-emu"],
}
EXTRA_REAL = {"staleness 1": {"staleness": 1}}


def noise_for(budget: dict, target: float) -> float:
    """The noise σ whose probe mismatch the calibration's noise points put at `target`: log-log linear
    interpolation of mismatch vs σ (seeds averaged), extrapolated from the nearest two points outside the
    grid; rounded to two significant figures and moved off the grid (×1.1) so it is a configuration the
    calibration never ran."""
    by_sigma: dict[float, list[float]] = {}
    for p in budget.get("points", []):  # a noise configuration's points carry its σ (calibration_points)
        if p.get("noise") and p["mismatch"] > 0:
            by_sigma.setdefault(p["noise"], []).append(p["mismatch"])
    grid = sorted((s, sum(m) / len(m)) for s, m in by_sigma.items())
    if len(grid) < 2:
        raise BadInput("the budget has fewer than two noise points to place candidates near it")
    logs = [(math.log(s), math.log(m)) for s, m in grid]
    i = min(max(1, sum(lm < math.log(target) for _, lm in logs)), len(logs) - 1)
    (s0, m0), (s1, m1) = logs[i - 1], logs[i]
    sigma = float(f"{math.exp(s0 + (math.log(target) - m0) * (s1 - s0) / (m1 - m0)):.2g}")
    return round(sigma * 1.1, 4) if sigma in by_sigma else sigma


# noise candidates an analytic validation adds to its pair's list, at these × the budget, so that two lie
# within ±30% of it: smollm2's list has two there already (noise 0.7 and 2: 0.82× and 1.15×)
ANALYTIC_NEAR = {"tiny": (0.75, 1.3), "smollm2": ()}


def candidates_for(pair_name: str, budget: dict) -> list[tuple[str, dict]]:
    """The analytic loss: the pair's VALIDATION list and noise at ANALYTIC_NEAR × its budget. A sampled
    loss, whose budget lies far below the analytic one: the list's configurations without noise,
    SAMPLED_REAL's configurations, and noise at NEAR_BUDGET × its budget. A candidate the budget's calibration
    also ran is trained and shown all the same, but not counted (agreement_rows)."""
    if budget["how"] != "crossing":
        return VALIDATION[pair_name]
    if budget["loss"] == "analytic":
        listed = {over.get("noise") for _, over in VALIDATION[pair_name]}  # one candidate per σ
        sigmas = sorted({noise_for(budget, f * budget["budget"]) for f in ANALYTIC_NEAR[pair_name]} - listed)
        return VALIDATION[pair_name] + [(f"noise {s:g}", {"noise": s}) for s in sigmas]
    listed = {**dict(VALIDATION[pair_name]), **EXTRA_REAL}
    real = [(label, listed[label]) for label in SAMPLED_REAL[pair_name]]
    sigmas = sorted({noise_for(budget, f * budget["budget"]) for f in NEAR_BUDGET[pair_name]})
    return real + [(f"noise {s:g}", {"noise": s}) for s in sigmas]


def agreement_rows(candidates, points: list[dict], verdicts: dict, tol: float, ran=frozenset()) -> list[dict]:
    """One row per candidate: check's verdict beside the training outcome (within: mean paired quality loss
    <= tol), and whether they agree: None for an uncertain verdict, and for a candidate in `ran`, the
    sources the budget's calibration ran (a verdict on a configuration the budget was fitted to validates
    nothing)."""
    rows = []
    for label, _ in candidates:
        loss = mean_by(points, label, "delta_eval_rkl")
        outcome = "within" if loss <= tol else "beyond"
        v = verdicts[label]
        counted = v["verdict"] != "uncertain" and label not in ran
        agree = (v["verdict"] == "admit") == (outcome == "within") if counted else None
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
                "calibrated": label in ran,
            }
        )
    return rows


# what validate --reuse reads of a recorded validation (lab.budget_schema.check_schema's notation): each
# training point's candidate, seed and what the agreement rows average; where its runs trained
REUSED_RECORD = {
    "points": (
        "list",
        {
            "label": "text",
            "seed": "integer >= 0",
            "mismatch": "number",
            "eval_rkl": "number",
            "?seconds": "number >= 0",
            "?reused": "bool",
        },
    ),
    "?device": "text",
    "?reused": {"?from": "text", "?points": "integer >= 0", "?trained_on": "text"},
}


def reused_validation(path: Path, pair_name: str, budget: dict, label: str) -> tuple[dict, str]:
    """The training points of a recorded validation of this same budget (pair, loss, budget and steps),
    by (candidate, seed), for `validate --reuse`: the checks run again, the training runs are taken as
    recorded. Also where the record's runs trained (calibrate.trained_on: a validation record has the same
    device, reused and per-point reused fields as a calibration's)."""
    if not path.is_file():
        raise BadInput(f"--reuse {path}: no such file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # also UnicodeDecodeError, a 5000-digit integer
        raise BadInput(f"--reuse {path}: not a validation record ({type(e).__name__}: {e})") from None
    if not isinstance(record, dict) or "points" not in record:
        raise BadInput(f"--reuse {path}: not a validation record (expected an object with points)")
    wanted = {"pair": pair_name, "loss": label, "budget": budget["budget"], "steps": budget["steps"]}
    record.setdefault("loss", "analytic")  # a record from before validations named their loss
    for key, value in wanted.items():
        if record.get(key) != value:
            raise BadInput(
                f"--reuse {path}: {key} is {record.get(key)!r}, the budget's validation has {value!r}; "
                "only a validation of the same budget can be reused"
            )
    check_schema(record, REUSED_RECORD, where=f"--reuse {path}", at="")
    by_run = {
        (p["label"], p["seed"]): {k: v for k, v in p.items() if not k.startswith("delta_")}
        for p in record["points"]
    }
    return by_run, trained_on(record)


def validation_name(pair: str, label: str) -> str:
    """The name of the validation record of pair's budget for loss `label` (results/<name>.json)."""
    return f"validation_{pair}{'' if label == 'analytic' else '_' + label}"


def validation_budget(pair_name: str, budget_path: Path) -> tuple[dict, dict]:
    """The budget a validation checks against, and the loss (loss, tis_cap, center_advantages) it trains
    with: the budget's."""
    if pair_name not in VALIDATION:
        raise BadInput(f"--pair {pair_name}: no validation candidates; choose from {', '.join(VALIDATION)}")
    budget = read_budget(budget_path, pair_name)
    steps = budget.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInput(f"--budget {budget_path}: steps is {steps!r}; validation trains that many")
    center = bool(budget.get("center_advantages", False))
    return budget, {"loss": budget["loss"], "tis_cap": budget["tis_cap"], "center_advantages": center}


def validate(
    pair_name: str, budget_path: Path, seeds: int, probes: int, device: str, reuse: Path | None = None
) -> dict:
    budget, loss = validation_budget(pair_name, budget_path)
    name = label_of(budget)
    suffix = "" if name == "analytic" else f"_{name}"
    recorded, trained_where = ({}, "")
    if reuse:
        recorded, trained_where = reused_validation(reuse, pair_name, budget=budget, label=name)
    candidates = candidates_for(pair_name, budget)
    pair = load_pair(pair_name, device=device)
    # the validation trains as the calibration did: the budget's recorded settings, loss included
    settings = budget.get("train_settings") or train_settings(pair_name, **loss)
    base_cfg = study_config(pair_name, device=device, **settings)
    verdicts = {}
    for label, over in tqdm(candidates, desc="checking", unit="config"):
        verdicts[label] = check(budget, pair, replace(base_cfg.rollout, **over), cap=probes, device=device)
    plan = [("baseline", {}, {})] + [(label, {}, over) for label, over in candidates]
    points = sweep(
        RESULTS / "runs" / f"validate_{pair_name}{suffix}",
        pair_name,
        plan,
        seeds=seeds,
        device=device,
        desc="training",
        recorded=recorded,
        steps=budget["steps"],
        eval_every=0,
        **settings,
    )
    paired(points, "eval_rkl", lambda p: "baseline")
    tol = budget["tolerance"]["nats"]
    ran = {p.get("source") for p in budget.get("points", [])}
    rows = agreement_rows(candidates, points, verdicts, tol=tol, ran=ran)
    decided = [r for r in rows if r["agree"] is not None]
    reused = sum(bool(p.get("reused")) for p in points)
    result = {
        "pair": pair_name,
        "loss": name,
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
        **({"reused": {"from": str(reuse), "points": reused, "trained_on": trained_where}} if reuse else {}),
    }
    write(validation_name(pair_name, name), result)
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
        agree = (
            "calibrated: not counted"
            if r.get("calibrated")
            else {True: "yes", False: "**no**", None: "–"}[r["agree"]]
        )
        lines.append(
            f"| {r['candidate']} | {r['check_mismatch']:.3g} [{r['ci'][0]:.3g}, {r['ci'][1]:.3g}] "
            f"| {r['verdict']} | "
            f"{r['train_mismatch']:.3g} | {r['quality_loss']:+.4f} | {r['outcome']} | {agree} |"
        )
    agree_n = sum(r["agree"] is True for r in result["rows"])
    agreement = "n/a" if result["agreement"] is None else f"{result['agreement']:.0%}"
    seen = sum(bool(r.get("calibrated")) for r in result["rows"])
    unseen = len(result["rows"]) - seen
    lines.append(
        f"\nBudget {result['budget']:.3g} nats/token ({result['budget_how']}), "
        f"tolerance {result['tolerance_nats']:.4f} nats; agreement on decided verdicts: {agreement} "
        f"({agree_n} of {result['decided']}; "
        f"{result['decided']} of {unseen} unseen candidates decided"
        + (f"; {seen} the calibration also ran, shown and not counted" if seen else "")
        + "); "
        f"{result['steps']} steps × {result['seeds']} seeds per run; "
        f"checks of at most {result['probes']} probes; {result['device']}."
    )
    if reused := result.get("reused"):
        lines[-1] += (
            f" The {reused['points']} training runs are those of {reused['from']} (trained on "
            f"{reused['trained_on']}); only the checks ran again."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# rl: OPD vs GRPO
