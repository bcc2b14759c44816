"""The mismatch budget inside a training run: each step's measured mismatch against a budget's interval.
run_budget reads --budget and matches it to the run before anything loads; watch_budget compares the running
interval (running_mismatch) with it at every step and names the engine settings the mismatch comes from."""

import math
import sys
from pathlib import Path

from tqdm import tqdm

from budget import budget_band, budget_center, match_loss, match_pair, read_budget
from cli import BadInput
from lab.hf_pairs import pair_files
from lab.train_args import TrainConfig
from rollout import RolloutConfig

BUDGET_WINDOW = 10  # steps the running interval pools: recent enough to show a drift, enough to be stable
Z95 = 1.959964  # the normal 97.5% quantile
# the engine settings that make a run's mismatch, with the flag that names each (train.py's)
SOURCE_FLAGS = ("weights", "fp8_skip", "kv_cache", "kv_scales", "staleness", "noise", "temperature", "top_p")


def run_budget(cfg: TrainConfig) -> dict | None:
    """cfg.budget (None: no budget) read (budget.read_budget) and matched to the run: the same pair, by its
    models for --teacher/--student (budget.match_pair), and the same loss, cap and centring
    (budget.match_loss, budget.center_advantages); one line (BadInput) otherwise, before anything loads."""
    if cfg.budget is None:
        return None
    where = f"--budget {cfg.budget}"
    budget = read_budget(Path(cfg.budget), None)
    match_pair(budget, cfg.pair, pair_files(cfg.teacher, cfg.student), where=where)
    match_loss(budget, cfg.loss, cfg.tis_cap)
    if budget_center(budget, where) != cfg.center_advantages:
        raise BadInput(
            f"{where} was calibrated with center_advantages {budget_center(budget, where)}, this run "
            f"trains with {cfg.center_advantages}; a budget holds only for its loss"
        )
    return budget


def engine_source(cfg: TrainConfig) -> str:
    """Where the run's mismatch comes from, as its flags name it: each engine setting that differs from an
    exact copy of the student (RolloutConfig's defaults), and --async (one step stale)."""
    exact = RolloutConfig()
    flags = [
        f"--{k.replace('_', '-')} {','.join(v) if isinstance(v, tuple) else v}"
        for k in SOURCE_FLAGS
        if (v := getattr(cfg.rollout, k)) != getattr(exact, k)
    ]
    flags += ["--async"] if cfg.async_rollout else []
    return " ".join(flags) or "none set (the engine is the student's exact copy: the rounding floor)"


def running_mismatch(records: list[dict]) -> dict | None:
    """The running interval of the mismatch over the last BUDGET_WINDOW steps that carry a standard error:
    with their mismatch_kl m_i and mismatch_se se_i (n steps, each drawn afresh, so independent),
        mean = Σ m_i / n,   se = √(Σ se_i²) / n,   [max(0, mean − 1.96 se), mean + 1.96 se]
    (normal approximation). None before such a step."""
    rows = [r for r in records if r.get("mismatch_se") is not None][-BUDGET_WINDOW:]
    if not rows:
        return None
    mean = sum(r["mismatch_kl"] for r in rows) / len(rows)
    se = math.sqrt(sum(r["mismatch_se"] ** 2 for r in rows)) / len(rows)
    return {"mean": mean, "lo": max(0.0, mean - Z95 * se), "hi": mean + Z95 * se, "steps": len(rows)}


def watch_budget(cfg: TrainConfig, budget: dict | None, records: list[dict], rec: dict) -> bool:
    """With a budget (run_budget's), compare the running mismatch (running_mismatch, this step included) with
    the budget's interval [B_lo, B_hi] (budget.budget_band) and record it in the step's metrics:
    mismatch_run_mean/_lo/_hi, mismatch_run_steps and over_budget, true when lo > B_hi (as check REJECTS).
    Prints one line when over_budget turns true (the step, the numbers, the budget and the source:
    engine_source) and one when it turns false again. True when the run should stop here (over, and
    --over-budget stop). The training mismatch is on training prompts and the moving student, the budget's
    on the calibration's probes against the untrained student: a warning says to check the configuration
    (admit.py check), not that quality was lost."""
    if budget is None:
        return False
    interval = running_mismatch([*records, rec])
    if interval is None:
        return False
    b_lo, b_hi = budget_band(budget)
    over = interval["lo"] > b_hi
    rec.update({f"mismatch_run_{k}": v for k, v in interval.items()}, over_budget=over)
    was = next((r["over_budget"] for r in reversed(records) if "over_budget" in r), False)
    if over != was:
        numbers = (
            f"step {rec['step']}: running mismatch {interval['mean']:.3e} nats/token, 95% interval "
            f"[{interval['lo']:.3e}, {interval['hi']:.3e}] over the last {interval['steps']} steps"
        )
        where = f"the budget's interval [{b_lo:.3e}, {b_hi:.3e}] ({cfg.budget})"
        tqdm.write(
            f"warning: {numbers}, is above {where}; source: {engine_source(cfg)}"
            if over
            else f"note: {numbers}, is no longer above {where}",
            file=sys.stderr,
        )
    return over and cfg.over_budget == "stop"
