"""Calibration: how much mismatch OPD tolerates for a pair and a loss (the budget), from short training runs.

Short OPD runs of the same length and seeds under increasing mismatch: a baseline, a noise-σ grid (the
continuous knob) and real configurations (fp8 weights, fp8 KV, staleness). Each run gives a point: its
configuration's mismatch measured on held-out probes against the untrained student (`probe_mismatch`, one
noise draw per configuration; `admit.py check` measures a candidate the same way, in doubling batches of
probes with a fresh noise draw per batch), and its final held-out reverse KL. Measuring both on probes
matters: the mean `mismatch_kl` over training is on other prompts and a moving student, and its ratio to
the probe number depends on the source. The quality loss of a point is its final eval reverse KL minus that
of the baseline run with the same seed. Paired runs share prompts and sampling seeds, yet over hundreds of
sampled steps their trajectories part, so pairing cancels little of the seed-to-seed spread (budget.json's
noise records the paired SD beside the baseline's): seeds are added by power instead (--max-seeds). The
tolerance is a fraction (config.STUDY_TOLERANCE) of the baseline's improvement over step 0. The budget is
read off a monotone (isotonic, non-decreasing) fit of quality loss against mismatch over all
points and seeds, never off a single noisy point:
    budget = the mismatch where the fitted loss first crosses the tolerance
             (linear interpolation between the fitted points around the crossing).
Writes budget.json and budget.png. Finished runs are reused, so an interrupted calibration resumes; a
calibration that adds configurations or changes the tolerance can also take the points an earlier one
recorded (`--reuse its budget.json or refused.json`), so runs that are no longer on disk are not run again.

    python -m lab.calibrate --pair tiny --out budgets/tiny
    python -m lab.calibrate --teacher T --student S --prompts my.jsonl --out budgets/mine   # your own pair

Your own pair takes train.py's flags (--teacher/--student/--prompts: any Hugging Face pair that shares a
tokenizer; the probes are the prompts' held-out tenth), and its budget.json names the models and the prompts
(pair "custom", teacher, student, prompts, prompts_sha256), which check and train.py --budget compare.
"""

import cli

# first, before the heavy imports below: a SIGINT/SIGTERM during them is one line too
cli.exit_on_signals(__name__, note=cli.RERUN)

import json
import math
import random
import shlex
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from admit import stale_versions
from budget import (
    CALIBRATABLE,
    POWER_RULE,
    SCALE,
    SCHEMA_VERSION,
    json_cap,
    loss_label,
    pair_flags,
    read_budget,
    source_staleness,
)
from cli import (
    EXPECTED,
    BadInput,
    Parser,
    cap_float,
    check_output_dir,
    fail,
    noise_levels,
    open_fraction,
    path_text,
    positive_int,
)
from cli import learning_rate as lr_value
from config import (
    CHECK_PROBES,
    DEFAULT_PAIR,
    DEFAULT_PAIR_HELP,
    DEVICES,
    PAIRS,
    STUDY_TOLERANCE,
    STUDY_TRAIN,
)
from evaluate import evaluate
from lab.atomic import atomic_write_text
from lab.hf_pairs import pair_files, prompts_sha256
from lab.runfiles import atomic_savefig, drop_checkpoint, load_checkpoint, read_metrics, run_seconds
from lab.train_args import add_pair_files, pair_config
from mismatch import measure_config
from models import (
    device_label,
    format_prompt,
    held_out,
    load_pair,
    resolve_device,
)
from rollout import RolloutConfig
from train import run_or_resume

# ---------------------------------------------------------------------------------------------------
# The budget fit (pure)


def isotonic(y: list[float], w: list[float] | None = None) -> list[float]:
    """Pool-adjacent-violators: the non-decreasing sequence closest to y in weighted least squares."""
    w = w or [1.0] * len(y)
    blocks = []  # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [v for v, _, c in blocks for _ in range(c)]


def fit_budget(mismatch: list[float], loss: list[float], tolerance: float) -> dict:
    """The largest mismatch whose fitted (monotone) quality loss stays within `tolerance`.

    Returns the budget, the sorted points with their fit, and how the budget was found: "crossing"
    (interpolated where the fit crosses the tolerance), "all-within" (the fit stays within it: the budget
    is at least the largest mismatch tried) or "none-within" (even the smallest mismatch exceeds it).
    """
    # Ties in mismatch go largest loss first, so the fit pools them into one value whatever their input
    # order (a bootstrap draw can take two seeds of a configuration whose probes measured the same).
    order = sorted(range(len(mismatch)), key=lambda i: (mismatch[i], -loss[i]))
    xs, ys = [mismatch[i] for i in order], [loss[i] for i in order]
    fit = isotonic(ys)
    if fit[0] > tolerance:
        return {"budget": 0.0, "how": "none-within", "x": xs, "fit": fit}
    if fit[-1] <= tolerance:
        return {"budget": xs[-1], "how": "all-within", "x": xs, "fit": fit}
    j = next(i for i, f in enumerate(fit) if f > tolerance)
    x0, x1, f0, f1 = xs[j - 1], xs[j], fit[j - 1], fit[j]
    budget = x0 + (tolerance - f0) / (f1 - f0) * (x1 - x0) if f1 > f0 else x0
    return {"budget": budget, "how": "crossing", "x": xs, "fit": fit}


def by_source(points: list[dict]) -> dict[str, list[dict]]:
    """The calibration points grouped by configuration (source), in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for p in points:
        groups.setdefault(p["source"], []).append(p)
    return groups


def baseline_improvement(start: float, points: list[dict]) -> float:
    """What the tolerance is a fraction of: start − the mean final eval reverse KL of the baseline points,
    where start is the first baseline's step-0 evaluation."""
    return start - statistics.fmean(p["eval_rkl"] for p in points if p["source"] == "baseline")


BUDGET_CI_DRAWS = 2000  # bootstrap redraws of the calibration's seeds for the budget's interval


def budget_ci(points: list[dict], fraction: float, draws: int = BUDGET_CI_DRAWS, seed: int = 0) -> dict:
    """A 95% percentile bootstrap interval for the budget over the calibration's training seeds.

    Each draw resamples, per configuration (source), its seeds with replacement, keeping every point's paired
    quality loss and probe mismatch; the tolerance is recomputed from the resampled baselines as calibrate
    computes it, fraction · (first baseline's eval_rkl_start − mean final eval_rkl); then, refitted:
        budget_b = fit_budget(mismatch_b, loss_b, tol_b)["budget"], b = 1..draws,
    with "all-within" read as +inf (the budget lies beyond the largest mismatch tried) and "none-within" as 0.
    lo, hi are the 2.5% and 97.5% quantiles, None where +inf. With few seeds (2: three distinct
    resamples per configuration) the interval understates the spread: read it as a rough range.
    """
    rng = random.Random(seed)
    start = points[0]["eval_rkl_start"]  # as calibrate's tolerance: the first baseline's step-0 evaluation
    groups = by_source(points).values()
    values = []
    for _ in range(draws):
        drawn = [rng.choice(group) for group in groups for _ in group]
        tol = fraction * baseline_improvement(start, drawn)
        fit = fit_budget([p["mismatch"] for p in drawn], [p["quality_loss"] for p in drawn], tol)
        values.append(math.inf if fit["how"] == "all-within" else fit["budget"])
    values.sort()
    lo, hi = (values[min(draws - 1, int(q * draws))] for q in (0.025, 0.975))
    return {
        "level": 0.95,
        "lo": None if math.isinf(lo) else lo,
        "hi": None if math.isinf(hi) else hi,
        "draws": draws,
        "beyond_largest_mismatch": sum(map(math.isinf, values)) / draws,
        "method": "percentile bootstrap over each configuration's seeds (paired losses kept, tolerance "
        "refitted); None: above the largest mismatch tried",
    }


# calibrate


STALE_AXIS = "every point but the stale runs, which check judges on their own axis (verdict.stale_axis)"


def fit_points(points: list[dict], loss: str) -> list[dict]:
    """The points a budget is fitted to: all of them for the analytic loss; for a sampled-token loss all but
    the stale runs. Those losses feel staleness far more than weight noise of the same per-token KL, so a
    stale point would drag the noise-made curve down; check judges a stale candidate on its own axis."""
    if loss == "analytic":
        return points
    return [p for p in points if not source_staleness(p["source"])]


def budget_fit(points: list[dict], loss: str, fraction: float, tol: float, seeds: int) -> dict:
    """A budget's fitted fields from its points (fit_points): budget, how, the seed-bootstrap interval and the
    curve. A pure function of the points, so a committed budget can be refitted from its own file."""
    fitted = fit_points(points, loss)
    fit = fit_budget([p["mismatch"] for p in fitted], [p["quality_loss"] for p in fitted], tol)
    return {
        "budget": fit["budget"],
        "how": fit["how"],
        "budget_ci": budget_ci(fitted, fraction) if seeds > 1 else None,
        "method": "isotonic fit of quality loss vs mismatch over the points fitted_to names, all seeds; "
        "budget where the fit crosses the tolerance",
        "fitted_to": "every point" if loss == "analytic" else STALE_AXIS,
        "fit": {"mismatch": fit["x"], "quality_loss": fit["fit"]},
    }


def calibration_configs(noise_grid: list[float], real: list[str]) -> list[tuple[str, dict]]:
    """(source label, rollout overrides): the baseline, the noise grid and the real configurations."""
    configs = [("baseline", {})] + [(f"noise {s:g}", {"noise": s}) for s in noise_grid if s > 0]
    named = {
        "fp8": {"weights": "fp8"},
        "fp8-emu": {"weights": "fp8-emu"},
        "kv-fp8": {"kv_cache": "fp8"},
        "kv-fp8-unit": {"kv_cache": "fp8", "kv_scales": "unit"},
    }
    for r in real:
        if r.startswith("staleness-") and r[len("staleness-") :].isdigit():
            configs.append((r.replace("-", " "), {"staleness": int(r[len("staleness-") :])}))
        elif r in named:
            configs.append((r, named[r]))
        else:
            raise BadInput(f"--real {r!r}: choose from {', '.join(named)}, staleness-K")
    return configs


def run_point(records: list[dict]) -> dict:
    """A finished run as one point: its mean per-step mismatch (and prefix-shift part), start and final
    quality."""
    train = [r for r in records if "mismatch_kl" in r]
    evals = [r for r in records if "eval_rkl" in r]

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in train) / len(train)

    return {
        "mismatch": mean("mismatch_kl"),
        "prefix_kl": mean("prefix_kl"),
        "eval_rkl_start": evals[0]["eval_rkl"],
        "eval_rkl": evals[-1]["eval_rkl"],
        "eval_acc_start": evals[0].get("eval_acc"),
        "eval_acc": evals[-1].get("eval_acc"),
        "eval_reward_start": evals[0].get("eval_reward"),
        "eval_reward": evals[-1].get("eval_reward"),
        # every evaluation, so that a later analysis can average the last few instead of the final one
        "eval_rkl_by_step": [[r["step"], r["eval_rkl"]] for r in evals],
        "seconds": run_seconds(records),
    }


RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def study_recipe(pair: str, label: str) -> dict:
    """The learning rate `python -m study lr` chose for this pair and loss ({"lr": rate}), or {} while its
    result is missing or incomplete (the study's settings then hold for every loss)."""
    path = RESULTS_DIR / f"lr_{pair}.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    lr = result.get("chosen", {}).get(label) if isinstance(result, dict) and result.get("complete") else None
    return {"lr": float(lr)} if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 else {}


TRAIN_KEYS = (
    "batch_size",
    "samples_per_prompt",
    "lr",
    "warmup",
    "schedule",
    "weight_decay",
    "grad_clip",
    "loss",
    "tis_cap",
    "center_advantages",
    "eval_prompts",
)


def train_settings(pair: str, **loss) -> dict:
    """The training settings of the study's runs for this pair and loss (TRAIN_KEYS of study_config), as
    budget.json records them and check rebuilds stale weights from them."""
    return {k: v for k, v in asdict(study_config(pair, **loss)).items() if k in TRAIN_KEYS}


def study_config(pair: str, **overrides):
    """lab.train_args.pair_config with the study's settings (config.STUDY_TRAIN, then the loss's own rate,
    study_recipe) in place of the pair's demo defaults, then the overrides."""
    label = loss_label(
        overrides.get("loss", "analytic"),
        overrides.get("tis_cap", 0.0),
        center=overrides.get("center_advantages", False),
    )
    return pair_config(pair, **{**STUDY_TRAIN.get(pair, {}), **study_recipe(pair, label), **overrides})


def short_run(
    out: Path, pair: str, name: str, seed: int, device: str, rollout_over: dict, **train_over
) -> dict:
    """One short OPD run of an experiment, run or reused in out/name: the pair's defaults, then train_over
    and rollout_over, with `seed` for prompts, sampling and noise. Returns its run_point."""
    cfg = study_config(pair, device=device, seed=seed, name=name, out_dir=str(out), **train_over)
    cfg.rollout = replace(cfg.rollout, seed=seed, **rollout_over)
    return run_point(run_or_resume(cfg))


def probe_mismatch(pair, cfg: RolloutConfig, n_probes: int, device, settings: dict) -> dict:
    """A rollout configuration's canonical mismatch as check measures it: engine samples of the first n
    held-out prompts, against the pair's untrained student (a stale engine: the student `staleness` real
    OPD steps on with the training `settings`, the engine serving the old weights). Returns
    mismatch.measure_config's dict."""
    probes = [format_prompt(pair.tokenizer, p.text) for p in held_out(pair, n_probes, "--probes")]
    versions = stale_versions(pair, cfg.staleness, settings, device=device)[0] if cfg.staleness else None
    return measure_config(pair, cfg, probes, versions=versions)


def paired_quality_losses(points: list[dict], tolerance: float) -> tuple[float, dict]:
    """Sets each point's quality_loss (final eval reverse KL − the same-seed baseline's) and returns the
    tolerance in nats (a fraction of the baseline's improvement over step 0) and the baselines by seed.
    A baseline that did not improve gives no tolerance to judge by: refused, never written."""
    base = {p["seed"]: p["eval_rkl"] for p in points if p["source"] == "baseline"}
    on = {(p["seed"], p.get("trained_on")): p["eval_rkl"] for p in points if p["source"] == "baseline"}
    improvement = baseline_improvement(points[0]["eval_rkl_start"], points)
    if not improvement > 0:
        raise BadInput(
            f"the baseline runs did not improve (held-out reverse KL {points[0]['eval_rkl_start']:.4f} -> "
            f"{statistics.fmean(base.values()):.4f}), so there is no tolerance to calibrate against: "
            "train longer (--steps) or change the study's settings; no budget written"
        )
    for p in points:  # paired with the same-seed baseline trained on the same machine
        if (p["seed"], p.get("trained_on")) not in on:
            raise BadInput(
                f"{p['source']}, seed {p['seed']}, trained on {p.get('trained_on')}, has no baseline of "
                "its seed trained on that machine: two CPUs' rounding, amplified over hundreds of sampled "
                "steps, moves a run by about the tolerance, so runs of two machines are not paired; run "
                "the baseline here (calibrate without --reuse, or with a record of this machine)"
            )
        p["quality_loss"] = p["eval_rkl"] - on[(p["seed"], p.get("trained_on"))]
    return tolerance * improvement, base


def own_pair(args) -> tuple[str, dict]:
    """The pair a calibration is for, read from its flags as train.py reads them: "custom" with --teacher and
    --student (they replace --pair), else --pair; and the files it loads (lab.hf_pairs.pair_files), refused
    now when missing, before any run."""
    if (args.teacher is None) != (args.student is None):
        raise BadInput("--teacher and --student must be given together")
    if args.teacher is not None and args.prompts is None:
        raise BadInput("--teacher/--student need --prompts FILE.jsonl (its held-out tenth are the probes)")
    return ("custom" if args.teacher else args.pair), pair_files(args.teacher, args.student, args.prompts)


PAIR_KEYS = ("teacher", "student", "prompts_sha256")  # what budget.json names of a pair beyond its name


def pair_record(files: dict) -> dict:
    """budget.json's record of the files a pair was loaded from (lab.hf_pairs.pair_files: the teacher and
    student of a custom pair, the prompts file) and the sha256 of its prompts, whose held-out tenth are the
    probes the budget's scale is measured on; {} for an embedded pair as it ships."""
    return {**files, **({"prompts_sha256": prompts_sha256(files["prompts"])} if "prompts" in files else {})}


def budget_header(pair: str, loss: dict, command: str, device: str, files: dict | None = None) -> dict:
    """What a budget is for and how it was made: schema, pair (and the files of a custom one, pair_record),
    loss, command, scale and device."""
    return {
        "schema_version": SCHEMA_VERSION,
        "pair": pair,
        **pair_record(files or {}),
        "loss": loss["loss"],
        "tis_cap": json_cap(loss["tis_cap"]),
        "center_advantages": bool(loss.get("center_advantages", False)),
        "command": command,
        "scale": SCALE,
        "device": device_label(device),
    }


def tolerance_record(points: list[dict], base: dict, *, tol: float, fraction: float) -> dict:
    """budget.json's tolerance (in nats, and what it is a fraction of) and the baseline it comes from."""
    return {
        "tolerance": {
            "fraction": fraction,
            "nats": tol,
            "of": "baseline improvement in held-out reverse KL over step 0",
        },
        "baseline": {
            "eval_rkl_start": points[0]["eval_rkl_start"],
            "eval_rkl_final": statistics.fmean(base.values()),
            "improvement": tol / fraction,
        },
    }


def reuse_entry(reuse: dict | None, points: list[dict]) -> dict:
    """budget.json's record of the points taken from an earlier calibration ({} when none were)."""
    if not reuse:
        return {}
    return {"reused": {"from": reuse["path"], "points": reused_count(points), "trained_on": reuse["device"]}}


def calibrate(
    pair: str,
    out: Path,
    noise_grid,
    real,
    steps: int,
    seeds: int,
    tolerance: float,
    device: str,
    n_probes: int = CHECK_PROBES,
    command: str = "",
    loss: dict | None = None,
    reuse: dict | None = None,
    files: dict | None = None,
    max_seeds: int | None = None,
) -> dict:
    """The budget of `pair` (loaded from `files`: lab.hf_pairs.pair_files) for the OPD loss `loss` ({"loss":
    estimator, "tis_cap": C}; None: analytic), taking the points of `reuse` (reused_record) as recorded;
    `seeds` seeds per configuration, more up to `max_seeds` while under-powered (powered_points)."""
    loss, files = loss or {"loss": "analytic", "tis_cap": 0.0}, files or {}
    points, tol, base, seeds, power = powered_points(
        pair,
        out,
        noise_grid,
        real=real,
        steps=steps,
        seeds=seeds,
        max_seeds=max_seeds or seeds,
        tolerance=tolerance,
        device=device,
        n_probes=n_probes,
        loss=loss,
        reuse=reuse,
        files=files,
    )
    budget = {
        **budget_header(pair, loss=loss, command=command, device=device, files=files),
        **tolerance_record(points, base, tol=tol, fraction=tolerance),
        **budget_fit(points, loss["loss"], fraction=tolerance, tol=tol, seeds=seeds),
        "steps": steps,
        "train_settings": {**train_settings(pair, **loss), "tis_cap": json_cap(loss["tis_cap"])},
        "seeds": seeds,
        "probes": n_probes,
        "seconds_per_run": sum(p["seconds"] for p in points) / len(points),
        "noise": quality_noise(
            pair,
            out / "runs" / "baseline-seed0",
            points,
            loss=loss["loss"],
            tol=tol,
            seeds=seeds,
            device=device,
            recorded=reuse["noise"]["eval_sd_by_prompts"] if reuse else None,
            files=files,
        ),
        "power": power,
        **reuse_entry(reuse, points),
        "points": points,
    }
    return write_budget(budget, out)


def powered_points(
    pair: str,
    out: Path,
    noise_grid,
    *,
    seeds: int,
    max_seeds: int,
    tolerance: float,
    loss: dict,
    reuse,
    **run,
) -> tuple[list[dict], float, dict, int, list[dict]]:
    """calibration_points with seeds by power. Every configuration runs `seeds` seeds; while the budget is
    under-powered (se of a configuration's mean paired loss > tol / POWER_RULE, paired_loss_gate) and fewer
    than `max_seeds` ran, every configuration gets the seeds the measured spread asks for,
        n = ceil((POWER_RULE · sd / tol)²),  at least one more and at most max_seeds,
    and the fit is redone (finished runs are reused). Returns the points (paired losses set), the tolerance
    in nats, the baselines by seed, the seeds run and budget.json's `power` record (each round's spread).
    `run`: the other arguments of calibration_points."""
    rounds = []
    while True:
        points = calibration_points(
            pair,
            out,
            noise_grid,
            seeds=seeds,
            loss=loss,
            reused=reuse["points"] if reuse else [],
            reused_on=reuse["device"] if reuse else None,
            **run,
        )
        tol, base = paired_quality_losses(points, tolerance)
        gate = paired_loss_gate(points, tol=tol, seeds=seeds, loss=loss["loss"])
        rounds.append({"seeds": seeds, **{k: gate[k] for k in ("paired_loss_sd", "se_over_tolerance")}})
        if not gate["under_powered"] or seeds >= max_seeds:
            power = {"rule": f"SE <= tolerance / {POWER_RULE}", "max_seeds": max_seeds, "rounds": rounds}
            return points, tol, base, seeds, power
        seeds = min(max_seeds, max(seeds + 1, seeds_for_power(gate["paired_loss_sd"], tol) or 0))


def seeds_for_power(sd: float | None, tol: float) -> int | None:
    """The seeds per configuration at which a paired loss of spread `sd` has SE = sd/√n <= tol / POWER_RULE:
    n = ceil((POWER_RULE · sd / tol)²), at least 2; None without a measured spread."""
    if sd is None:
        return None
    return max(2, math.ceil((POWER_RULE * sd / tol) ** 2 - 1e-9))


def write_budget(budget: dict, out: Path) -> dict:
    """out/budget.json and budget.png, unless the quality axis is noise (refuse_noise)."""
    out.mkdir(parents=True, exist_ok=True)
    refuse_noise(budget, out)
    atomic_write_text(out / "budget.json", json.dumps(budget, indent=2) + "\n")
    plot_budget(budget, out / "budget.png")
    return budget


def run_name(source: str, seed: int) -> str:
    """A calibration run's folder under out/runs: "noise 0.1", seed 1 -> "noise_0.1-seed1"."""
    return f"{source.replace(' ', '_')}-seed{seed}"


def calibration_points(
    pair: str,
    out: Path,
    noise_grid,
    real,
    steps: int,
    seeds: int,
    device: str,
    n_probes: int,
    loss: dict,
    reused: list[dict] = (),
    reused_on: str | None = None,
    files: dict | None = None,
) -> list[dict]:
    """One short OPD run per calibration configuration and seed (resumed where finished), each with its
    probe-measured mismatch: the points calibrate fits the budget to. A configuration and seed that
    `reused` (a recorded calibration's points, same settings) holds is taken from it, marked "reused",
    with the machine it trained on (its own trained_on, else `reused_on`, the record's device).
    `files`: the --teacher/--student/--prompts the pair loads (lab.hf_pairs.pair_files), for the runs too."""
    files = files or {}
    plan = [
        (label, over, seed) for label, over in calibration_configs(noise_grid, real) for seed in range(seeds)
    ]
    recorded = {(p["source"], p["seed"]): p for p in reused}
    loaded = load_pair(pair, device=device, **files)  # for the probe measurements
    held_out(loaded, n_probes, "--probes")  # more probes than the pair holds: refused before any run
    points, train_over = [], {"steps": steps, "eval_every": 0, **loss, **files}
    for label, over, seed in tqdm(plan, desc=f"calibrating {pair}", unit="run"):
        old = recorded.get((label, seed))
        if old is not None and all(old.get(k) == v for k, v in over.items()):
            kept = {k: v for k, v in old.items() if k != "quality_loss"}
            points.append({"trained_on": reused_on, **kept, "reused": True})
            continue
        name = run_name(label, seed)
        run = short_run(out / "runs", pair, name, seed=seed, device=device, rollout_over=over, **train_over)
        cfg = replace(study_config(pair).rollout, seed=seed, **over)
        probe = cached_probe(
            out / "runs" / name / "probe.json",
            cfg,
            n_probes,
            pair=loaded,
            device=device,
            settings=train_settings(pair, **loss),
        )
        if label != "baseline":  # probes use the untrained student; only eval_noise reads the baseline's
            drop_checkpoint(out / "runs" / name)
        points.append(
            {
                "source": label,
                "seed": seed,
                **over,
                **run,
                "trained_on": device_label(device),
                "train_mismatch": run["mismatch"],
                "mismatch": probe["mismatch_kl"],
                "mismatch_ci": [probe["ci_low"], probe["ci_high"]],
            }
        )
    return points


def reused_count(points: list[dict]) -> int:
    return sum(1 for p in points if p.get("reused"))


# what a recorded calibration must share with this one for its points to stand in for runs
REUSE_KEYS = ("pair", *PAIR_KEYS, "loss", "tis_cap", "center_advantages", "steps", "train_settings", "probes")
# what a reused point must hold (lab.budget_schema.POINT types them): its configuration and seed, its probe
# mismatch, its start and final quality, its run time; and the record's evaluation-noise measurement
REUSE_NEEDS = (
    "points.source",
    "points.seed",
    "points.mismatch",
    "points.eval_rkl_start",
    "points.eval_rkl",
    "points.seconds",
    "noise.eval_sd_by_prompts",
)


def reused_record(path: Path, wanted: dict) -> dict:
    """A recorded calibration (budget.json or refused.json, budget.read_budget) whose REUSE_KEYS equal
    `wanted`'s: its points, its evaluation-noise measurement, its path and where its points trained
    (trained_on). One line (BadInput) naming the first field that differs: points trained at other
    settings would be paired with the wrong baseline. Every point's fields are checked here, before any run
    (REUSE_NEEDS: what calibration_points and the fit read of a reused point)."""
    record = read_budget(path, wanted["pair"], needs=REUSE_NEEDS, flag="--reuse")
    for key in REUSE_KEYS:
        if record.get(key) != wanted[key]:
            raise BadInput(
                f"--reuse {path}: its {key} is {json.dumps(record.get(key))}, this calibration's is "
                f"{json.dumps(wanted[key])}; only a calibration at the same settings can be reused"
            )
    earlier = (record.get("reused") or {}).get("trained_on")
    points = [  # each point with the machine it trained on, where the record tells it apart
        {"trained_on": earlier if p.get("reused") and earlier else str(record.get("device")), **p}
        for p in record["points"]
    ]
    return {"path": str(path), "points": points, "noise": record["noise"], "device": trained_on(record)}


def trained_on(record: dict) -> str:
    """Where a recorded calibration's points trained: its device for the runs it trained itself, and for
    those it reused, the device its own record of them names ("A and B" when both)."""
    earlier = (record.get("reused") or {}).get("trained_on")
    fresh = any(not p.get("reused") for p in record["points"])
    places = ([str(record.get("device"))] if fresh or not earlier else []) + ([earlier] if earlier else [])
    return " and ".join(dict.fromkeys(places))


def cached_probe(path: Path, cfg: RolloutConfig, n_probes: int, pair, device, settings: dict) -> dict:
    """probe_mismatch, saved next to its run (probe.json) and reused when made with the same engine
    configuration and probe count (and, for a stale engine, training settings), so a resumed calibration
    does not measure its finished points again."""
    key = {"probes": n_probes, "rollout": json.loads(json.dumps(asdict(cfg)))}
    if cfg.staleness:
        key["settings"] = {k: json_cap(v) if k == "tis_cap" else v for k, v in settings.items()}
    if path.is_file():
        saved = json.loads(path.read_text())
        if {k: saved.get(k) for k in key} == key:
            return saved
    probe = probe_mismatch(pair, cfg, n_probes, device=device, settings=settings)
    saved = {**key, **{k: probe[k] for k in ("mismatch_kl", "ci_low", "ci_high")}}
    atomic_write_text(path, json.dumps(saved, indent=1) + "\n")
    return saved


EVAL_SEEDS = 4  # evaluation seeds for the evaluation-noise measurement


def eval_noise(pair_name: str, run_dir: Path, device: str, files: dict | None = None) -> dict:
    """The evaluation's own sampling noise: one finished run's final student evaluated with EVAL_SEEDS
    evaluation seeds (nothing else varies), on the demo's 16 held-out prompts and on the study's number.
    Returns {prompts: {"eval_rkl": [...], "sd": SD}}. Saved next to the run (eval_noise.json) and reused
    while the run's last metrics line and the evaluation settings are the same, so re-fitting a finished
    calibration neither evaluates again nor needs the checkpoint. `files`: as calibration_points."""
    cfg = study_config(pair_name, device=device)
    key = {
        "eval_seeds": EVAL_SEEDS,
        "prompts": sorted({pair_config(pair_name).eval_prompts, cfg.eval_prompts}),
        # the run's last metrics line, not its checkpoint, which may have been deleted to free space
        "run_final": read_metrics(run_dir / "metrics.jsonl", upto=sys.maxsize)[-1],
    }
    path = run_dir / "eval_noise.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("key") == key:
        return saved["by_prompts"]
    out = measure_eval_noise(pair_name, run_dir, cfg, prompts=key["prompts"], device=device, files=files)
    atomic_write_text(path, json.dumps({"key": key, "by_prompts": out}, indent=1) + "\n")
    return out


def measure_eval_noise(
    pair_name: str, run_dir: Path, cfg, prompts: list[int], device: str, files: dict | None = None
) -> dict:
    """eval_noise's measurement: the run's final student, EVAL_SEEDS evaluations per prompt count."""
    pair = load_pair(pair_name, device=device, **(files or {}))
    pair.student.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt", device)["student"])
    out = {}
    for n in prompts:
        rkl = [
            evaluate(pair, replace(cfg, eval_prompts=n, seed=s), device)["eval_rkl"]
            for s in range(EVAL_SEEDS)
        ]
        out[str(n)] = {"eval_rkl": rkl, "sd": statistics.stdev(rkl)}
    return out


NEAR = 3.0  # the noise that decides a budget: configurations whose mean loss is within NEAR × tolerance


def paired_loss_sd(points: list[dict], near: float = math.inf) -> float | None:
    """The pooled across-seed SD of the paired quality loss over the configurations (not the baseline) whose
    mean |loss| is at most `near`:
        sd² = Σ_c Σ_s (loss_cs − mean_c)² / Σ_c (seeds_c − 1);
    training and evaluation noise together. A configuration far beyond the tolerance is decided whatever
    its spread (a broken run's loss varies by more than the tolerance itself), so quality_noise pools only
    those near it. None without such a configuration run on two seeds."""
    losses = [[p["quality_loss"] for p in g] for s, g in by_source(points).items() if s != "baseline"]
    groups = [v for v in losses if len(v) > 1 and abs(sum(v) / len(v)) <= near]
    dof = sum(len(v) - 1 for v in groups)
    ss = sum((x - sum(v) / len(v)) ** 2 for v in groups for x in v)
    return math.sqrt(ss / dof) if dof else None


def refuse_noise(budget: dict, out: Path) -> None:
    """A tolerance under 2 standard errors of the paired quality loss cannot tell a loss from seed noise: no
    budget is written. What it would have been is kept in out/refused.json, so the refusal can be read and
    cited, and the runs stay in out/runs, reused by a calibration with more seeds. A passing calibration
    removes an earlier refusal's refused.json, so a folder never holds both a budget and a refusal."""
    noise, tol = budget["noise"], budget["tolerance"]["nats"]
    if noise["tolerance_at_least_2se"] is not False:
        (out / "refused.json").unlink(missing_ok=True)
    else:
        atomic_write_text(out / "refused.json", json.dumps(budget, indent=2) + "\n")
        n = seeds_for_power(noise["paired_loss_sd"], tol)
        raise BadInput(
            f"the tolerance, {tol:.4f} nats, is {noise['tolerance_over_se']:.2f} standard errors of the "
            f"paired quality loss (SE {noise['paired_loss_se']:.4f} over seeds; at least 2 needed): at these "
            f"settings the quality axis is noise; the power rule asks for about {n} seeds a configuration "
            f"(--seeds {n}, or --max-seeds {n} to add them as the spread asks; the runs so far are reused), "
            f"or change the study's settings; no budget written (its points: {out / 'refused.json'}; "
            f"the runs stay in {out / 'runs'})"
        )


def quality_noise(
    pair_name: str,
    base_run: Path,
    points: list[dict],
    *,
    loss: str,
    tol: float,
    seeds: int,
    device,
    recorded=None,
    files: dict | None = None,
) -> dict:
    """How far the quality axis can be trusted: the evaluation's own noise (eval_noise on base_run, or
    `recorded`, the measurement of a reused calibration whose baseline run is not on disk) and the paired
    loss's gate over the points the budget is fitted to (paired_loss_gate)."""
    base = [p["eval_rkl"] for p in points if p["source"] == "baseline"]
    on_disk = (base_run / "metrics.jsonl").is_file()
    eval_sd = recorded if recorded and not on_disk else eval_noise(pair_name, base_run, device, files=files)
    return {
        "eval_sd_by_prompts": eval_sd,
        "eval_seeds": EVAL_SEEDS,
        "baseline_sd_across_training_seeds": statistics.stdev(base) if len(base) > 1 else None,
        **paired_loss_gate(points, tol=tol, seeds=seeds, loss=loss),
    }


def paired_loss_gate(points: list[dict], *, tol: float, seeds: int, loss: str) -> dict:
    """The paired loss's spread near the tolerance (paired_loss_sd over the configurations the budget is
    fitted to, fit_points, whose mean loss lies within NEAR × tol), whose standard error over `seeds` seeds,
    se = sd / √seeds, is that of one configuration's mean paired loss. The tolerance should be ≥ 2·se
    (refuse_noise). A sampled-token loss's stale runs are left out as the fit leaves them out: check judges
    staleness by them on its own axis (verdict.stale_axis), never by the fitted curve."""
    sd = paired_loss_sd(fit_points(points, loss), near=NEAR * tol)
    se = sd / math.sqrt(seeds) if sd is not None else None
    pooled = f"configurations whose mean |quality loss| <= {NEAR:g} × tolerance"
    return {
        "paired_loss_sd": sd,
        "paired_loss_pooled_over": pooled if loss == "analytic" else f"fitted {pooled} (no stale runs)",
        "paired_loss_se": se,
        "tolerance_over_se": tol / se if se else None,
        "tolerance_at_least_2se": None if se is None else tol >= 2 * se,
        "se_over_tolerance": se / tol if se is not None else None,
        "under_powered": se is None or se > tol / POWER_RULE,  # budget.budget_power's rule
    }


def plot_budget(budget: dict, path: Path) -> None:
    fig = Figure(figsize=(8.5, 4))  # no pyplot: no global backend change
    ax = fig.subplots()
    floor = (
        min((p["mismatch"] for p in budget["points"] if p["mismatch"] > 0), default=1e-6) / 3
    )  # where zero (the baseline) is drawn
    fitted = {p["source"] for p in fit_points(budget["points"], budget["loss"])}
    for i, source in enumerate(dict.fromkeys(p["source"] for p in budget["points"])):
        pts = [p for p in budget["points"] if p["source"] == source]
        ax.scatter(
            [max(p["mismatch"], floor) for p in pts],
            [p["quality_loss"] for p in pts],
            label=source if source in fitted else f"{source} (not fitted: its own axis)",
            marker="os^vD<>p"[i % 8],
        )
    ax.plot(
        [max(x, floor) for x in budget["fit"]["mismatch"]],
        budget["fit"]["quality_loss"],
        "k-",
        lw=1,
        alpha=0.6,
        label="monotone fit",
    )
    ax.axhline(
        budget["tolerance"]["nats"],
        color="C3",
        ls=":",
        label=f"tolerance ({budget['tolerance']['fraction']:.0%} of improvement)",
    )
    if budget["budget"] > 0:
        ax.axvline(
            budget["budget"], color="C3", ls="--", label=f"budget {budget['budget']:.3g} ({budget['how']})"
        )
    ax.set(
        xscale="log",
        xlabel="mismatch as check measures it, KL(engine ‖ train) nats/token\n"
        "(the baseline, 0, drawn at the left edge)",
        ylabel="final held-out reverse KL − baseline",
    )
    ax.set_title(
        f"{budget['pair']}: quality vs mismatch, {budget['steps']} OPD steps × {budget['seeds']} seeds\n"
        f"{budget['device']}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: the points fill the axes
    fig.tight_layout()
    atomic_savefig(fig, path)


# ---------------------------------------------------------------------------------------------------
# check


def add_loss_args(group) -> None:
    """--loss, --tis-cap and --center-advantages: train.py's flags of the loss a budget holds for."""
    group.add_argument(
        "--loss",
        default="analytic",
        choices=CALIBRATABLE,
        help="the OPD estimator the budget is for (train.py --loss; default: %(default)s)",
    )
    group.add_argument(
        "--tis-cap",
        type=cap_float,
        default=0.0,
        help="importance-weight cap of the loss: 0 none, C, or inf (tinker: --loss sampler --tis-cap inf)",
    )
    group.add_argument(
        "--center-advantages",
        action="store_true",
        help="the loss centres its advantages on the batch mean (train.py --center-advantages; sampled, "
        "sampler)",
    )


def add_run_args(group) -> None:
    """--steps, --lr, --seeds and --max-seeds: the runs each configuration trains."""
    group.add_argument(
        "--steps",
        type=positive_int,
        help="OPD steps per run (default: the study's, "
        + ", ".join(f"{study_config(p).steps} {p}" for p in PAIRS)
        + ")",
    )
    group.add_argument(
        "--lr",
        type=lr_value,
        help="peak learning rate of every run (default: the loss's own, chosen by `python -m study lr`; "
        "the study's while that result is incomplete); budget.json records it in train_settings",
    )
    group.add_argument(
        "--seeds", type=positive_int, default=2, help="seeds per configuration (default: %(default)s)"
    )
    group.add_argument(
        "--max-seeds",
        type=positive_int,
        help="seeds by power: while the budget is under-powered (SE of a configuration's mean quality loss "
        f"> tolerance / {POWER_RULE}), add the seeds its measured spread asks for, up to this many "
        "(default: --seeds, no more)",
    )


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    # train.py's flags for any Hugging Face pair: the budget.json names these models
    add_pair_files(parser)  # the held-out tenth of --prompts are the probes
    parser.add_argument("--out", type=path_text, help="output folder (default: budgets/<pair>[/<loss>])")
    parser.add_argument(
        "--noise-grid",
        type=noise_levels,
        default="0.003,0.01,0.03,0.1,0.3,0.5,1",
        help="comma-separated noise levels σ (default: %(default)s)",
    )
    parser.add_argument(
        "--real",
        default="fp8,kv-fp8,staleness-2",
        help="real configurations: fp8, fp8-emu, kv-fp8, kv-fp8-unit, staleness-K "
        "('' = none; default: %(default)s)",
    )
    add_run_args(parser.add_argument_group("the runs: how long, at which rate, how many seeds"))
    parser.add_argument(
        "--tolerance",
        type=open_fraction,
        default=STUDY_TOLERANCE,
        help="allowed quality loss, a fraction of the baseline's improvement (default: %(default)s)",
    )
    parser.add_argument(
        "--probes",
        type=positive_int,
        default=CHECK_PROBES,
        help="held-out probes per configuration (default: %(default)s)",
    )
    add_loss_args(parser.add_argument_group("the loss the budget is for"))
    parser.add_argument(
        "--reuse",
        type=path_text,
        help="a budget.json or refused.json of a calibration at the same pair, loss, steps, settings and "
        "probes: its configurations and seeds are taken as recorded instead of run again",
    )
    parser.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.loss == "analytic" and args.tis_cap > 0:
            raise BadInput(f"--tis-cap {args.tis_cap:g}: the analytic loss has no importance weights")
        if args.center_advantages and args.loss == "analytic":
            raise BadInput("--center-advantages: the analytic loss has no advantages to centre")
        pair, files = own_pair(args)
        label = loss_label(args.loss, args.tis_cap, center=args.center_advantages)
        default = f"budgets/{pair}" if label == "analytic" else f"budgets/{pair}/{label}"
        out = check_output_dir(args.out or default, "--out")
        real = [r for r in args.real.split(",") if r]
        calibration_configs([], real)  # refuses an unknown --real before any run starts
        command = shlex.join(["python", "-m", "lab.calibrate", *(sys.argv[1:] if argv is None else argv)])
        loss = {"loss": args.loss, "tis_cap": args.tis_cap, "center_advantages": args.center_advantages}
        loss.update({"lr": args.lr} if args.lr else {})  # the recipe: a rate of one's own
        steps = args.steps or study_config(pair, **loss).steps
        wanted = {
            "pair": pair,
            **loss,
            "steps": steps,
            "probes": args.probes,
            "train_settings": train_settings(pair, **loss),
            **dict.fromkeys(PAIR_KEYS),
            **pair_record(files),
        }
        reuse = reused_record(Path(args.reuse), wanted) if args.reuse else None
        budget = calibrate(
            pair,
            out,
            args.noise_grid,  # a list: argparse applies noise_levels to the default too
            real=real,
            steps=steps,
            seeds=args.seeds,
            max_seeds=args.max_seeds,
            tolerance=args.tolerance,
            device=device,
            n_probes=args.probes,
            command=command,
            loss=loss,
            reuse=reuse,
            files=files,
        )
    except EXPECTED as e:
        fail(e)
    print(
        f"{pair_flags(pair, files)}, loss {label}: budget {budget['budget']:.3e} nats/token "
        f"({budget['how']}); tolerance {budget['tolerance']['nats']:.3f} nats of eval reverse KL; "
        f"wrote {out}/budget.json and budget.png"
    )


if __name__ == "__main__":
    main()
