"""On-policy distillation (OPD): the student samples, the teacher scores, the student lowers reverse KL.

One step (see loss.py for the formulas):
    1. the rollout engine (rollout.RolloutEngine: its own copy of the student, possibly stale, noisy or in
       FP8) samples `samples_per_prompt` responses for `batch_size` training prompts, recording the
       distribution it drew each token from;
    2. one student forward+backward and one teacher forward score every response token at its prefix;
       the loss is the per-token reverse KL (analytic, or sampled-token with optional TIS; or --loss grpo,
       the RL baseline of rl.py, through the same engine and batches);
    3. from the same student logits, detached: the one scale, KL(π_engine ‖ π_train) per token, logged as
       `mismatch_kl`, and its prefix-shift part (kl.prefix_shift_kl) as `prefix_kl`;
    4. a non-finite loss or gradient stops the run before the update (exit 3): checkpoint and metrics stay
       as they were after the last good step.

--async samples one step ahead in a background thread (one-step-off, see `Batches`).

Outputs go to runs/<name>/ (lab/runfiles.py): config.json, metrics.jsonl (a line per step), checkpoint.pt
(every `ckpt_every` steps or `ckpt_minutes` minutes, and at the end), curves.png. `--resume` continues a
killed run exactly from its last checkpoint (stale and async runs too): the steps after it are redone
identically.
SIGINT or SIGTERM stops a run after its current step, with a checkpoint there (exit 130 / 143).
`--budget B` compares each step's mismatch with budget B's interval as the run goes (watch_budget: a line
when the running interval passes it, over_budget in metrics.jsonl); `--over-budget stop` then ends the run
at that step with a checkpoint (exit 6).

    python train.py                    # smollm2 pair, ~3 min on a 2-core CPU
    python train.py --pair tiny        # addition task; prints accuracy
    python train.py --pair tiny --weights fp8 --kv-cache fp8 --staleness 2   # through a cheap engine
    python train.py --pair tiny --name mine --resume
    python train.py --pair tiny --loss grpo --tis-cap 2     # the RL baseline
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import copy
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from batches import Batches, make_engine
from budget import CALIBRATABLE, budget_band, budget_center, match_loss, match_pair, read_budget
from cli import (
    EXPECTED,
    MAX_BATCH,
    BadInput,
    NonFinite,
    OverBudget,
    RERUN,
    Parser,
    StopSignals,
    batch_int,
    cap_float,
    fail,
    given_dests,
    learning_rate as lr_value,
    nonneg_float,
    nonneg_int,
    path_text,
    positive_int,
    recheck_flags,
    seed_int,
)
from config import CHAT_PAIR, CHAT_PAIR_HELP, DEVICES, PAIR_TRAIN, PAIRS
from evaluate import evaluate
from loss import ESTIMATORS, opd_loss
from kl import prefix_shift_kl
from mismatch import rescored_token_kl
from models import (
    check_prompts,
    format_prompt,
    load_pair,
    pair_files,
    resolve_device,
)
from rl import exact_match_rewards, group_advantages
from rollout import RolloutConfig, add_rollout_args, rollout_config_from_args, snapshot
from lab.runfiles import (
    RunLock,
    append_metrics,
    atomic_save,
    changes,
    check_run_id,
    check_target,
    claim,
    clean_leftovers,
    load_checkpoint,
    load_config,
    new_run_id,
    note_changes,
    plot_curves,
    read_metrics,
    reconcile_metrics,
    refuse_finished,
    refuse_unsafe,
    remove_made,
    restore_state,
    resume_changes,
    resume_command,
    reusable_run,
    saved_run_id,
    start_files,
    summary,
)


@dataclass
class TrainConfig:
    """One OPD run. Saved in full to runs/<name>/config.json. The field defaults are what every pair shares;
    config.PAIR_TRAIN replaces some of them per pair (pair_config)."""

    pair: str = CHAT_PAIR  # tiny | smollm2 | gemma3 | custom (= --teacher/--student)
    teacher: str | None = None  # HF id or local path; replaces --pair
    student: str | None = None
    student_layers: int | None = None  # smollm2/gemma3: decoder layers the student keeps; None = the pair's
    prompts: str | None = None  # JSONL file of {"prompt": ...}; replaces the pair's prompts
    steps: int = 20  # optimizer steps
    batch_size: int = 4  # training prompts per step
    samples_per_prompt: int = 2  # responses sampled per prompt
    lr: float = 5e-5  # AdamW peak learning rate
    warmup: int = 0  # steps of linear learning-rate warm-up, then `schedule`
    schedule: str = "constant"  # after warm-up: constant | cosine (down to 10% of lr at the last step)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    loss: str = "analytic"  # analytic (full-vocabulary KL) | sampled (sampled-token gradient) | grpo (RL)
    tis_cap: float = field(default=0.0, metadata={"inf": True})  # C in min(π_train/π_engine, C); 0 off; inf
    center_advantages: bool = False  # sampled/sampler: subtract the batch's mean advantage (loss.py)
    async_rollout: bool = False  # one-step-off: sample step s+1's batch in a background thread during step s
    kl_chunk: int = 256  # response tokens per chunk when computing full-vocabulary KL (bounds memory)
    eval_every: int = 5  # evaluate every N steps (and after the last); 0 = only at the start and end
    eval_prompts: int = 16  # held-out prompts per evaluation
    ckpt_every: int = 1  # checkpoint every N steps; 0 = by time only (ckpt_minutes); always after the last
    ckpt_minutes: float = 0.0  # also checkpoint when this many minutes passed since the last one; 0 = off
    seed: int = 0  # seeds prompt order and sampling (per step, so a resumed run repeats them exactly)
    device: str = "auto"  # auto | cpu | cuda
    name: str = ""  # run folder name under out_dir; "" = <pair>-<timestamp>
    out_dir: str = "runs"
    budget: str | None = None  # budget.json the running mismatch is compared with (watch_budget); None off
    over_budget: str = "warn"  # above the budget: warn | stop (a checkpoint at that step, exit 6)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self):  # combinations no single flag can refuse (each flag's range: its converter)
        rows, k = self.batch_size * self.samples_per_prompt, self.samples_per_prompt
        if self.loss == "grpo" and k < 2:
            raise BadInput(
                f"--loss grpo --samples-per-prompt {k}: the advantage (a reward minus its group's "
                "mean) is 0 in a group of one; use 2 or more"
            )
        if rows > MAX_BATCH:
            raise BadInput(f"--batch-size x --samples-per-prompt = {rows} rows; at most {MAX_BATCH}")
        if self.tis_cap > 0 and self.loss == "analytic":
            raise BadInput(
                f"--tis-cap {self.tis_cap:g}: applies to --loss sampled, sampler or grpo (the "
                "analytic loss sums over the vocabulary: the sampled token needs no correction)"
            )
        if self.center_advantages and self.loss not in ("sampled", "sampler"):
            raise BadInput(
                f"--center-advantages with --loss {self.loss}: applies to --loss sampled or sampler (the "
                "analytic loss has no advantage; grpo's advantages are already centred on their group)"
            )
        if self.over_budget == "stop" and self.budget is None:
            raise BadInput("--over-budget stop: needs --budget BUDGET.json, the budget to stop at")
        if self.budget is not None and self.loss not in CALIBRATABLE:
            raise BadInput(
                f"--budget with --loss {self.loss}: a budget holds for one OPD loss "
                f"({', '.join(CALIBRATABLE)}; python -m lab.calibrate --loss)"
            )


def pair_config(pair: str, **overrides) -> TrainConfig:
    """A TrainConfig with the pair's default settings (config.PAIR_TRAIN, its response length), then
    `overrides`."""
    rollout = RolloutConfig.for_pair(pair)
    return TrainConfig(pair=pair, **{**PAIR_TRAIN[pair], "rollout": rollout, **overrides})


# ---------------------------------------------------------------------------------------------------
# One step


SCHEDULES = ("constant", "cosine")


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over `warmup` steps, then constant, or cosine from lr down to 0.1·lr at step `steps`:
        lr_s = lr · (0.1 + 0.9 · (1 + cos(π · (s − warmup) / (steps − warmup))) / 2).
    A function of (step, steps) alone, so a resumed run needs no scheduler state."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * step / cfg.warmup
    if cfg.schedule == "constant" or cfg.steps <= cfg.warmup:
        return cfg.lr
    progress = (step - cfg.warmup) / (cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2)


def train_step(pair, batches: Batches, cfg: TrainConfig, optimizer, step: int, device) -> dict:
    """One OPD (or GRPO) step: sample, one student fwd+bwd and one teacher fwd, the guard, the update."""
    t0 = time.time()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    pair.student.eval()  # no dropout in sampling or scoring: the trained policy is the sampled one
    rollout, prompts = batches.get(pair.student, step)
    sample_seconds = time.time() - t0  # async: only the wait for a batch the worker has not finished
    batches.prefetch(pair.student, step)  # async: the next batch samples while this step trains
    extra, advantages_B = {}, None
    if cfg.loss == "grpo":
        rewards_B = exact_match_rewards(rollout.responses(pair.tokenizer), [p.answer for p in prompts])
        advantages_B = group_advantages(rewards_B, cfg.samples_per_prompt)
        extra["reward"] = rewards_B.mean().item()
    loss, stats = opd_loss(
        pair.student,
        pair.teacher,
        rollout,
        estimator=cfg.loss,
        chunk=cfg.kl_chunk,
        tis_cap=cfg.tis_cap,
        center=cfg.center_advantages,
        advantages_B=advantages_B,
    )
    kl_N = stats.pop("mismatch_N")
    if kl_N is None:  # the engine's distributions were too large to record: re-score them (approximate)
        kl_N = rescored_token_kl(batches.engine, pair.student, rollout, chunk=cfg.kl_chunk)
        extra["mismatch_rescored"] = True
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(pair.student.parameters(), cfg.grad_clip or float("inf"))
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not torch.isfinite(value):
            raise NonFinite(
                f"step {step}: the {what} is {value.item()}; stopped before the update (lower "
                "--lr, keep --grad-clip on); the last checkpoint and metrics.jsonl hold the good "
                "steps"
            )
    optimizer.step()
    return {
        "step": step,
        "loss": loss.item(),
        **stats,
        **extra,
        "mismatch_kl": kl_N.mean().item(),
        "mismatch_se": mismatch_se(kl_N, rollout),
        "prefix_kl": prefix_shift_kl(kl_N, rollout).mean().item(),
        "engine_version": rollout.version,
        "grad_norm": grad_norm.item(),
        "response_len": rollout.response_mask.sum(1).float().mean().item(),
        "sample_seconds": sample_seconds,
        "seconds": time.time() - t0,
    }


def mismatch_se(kl_N: torch.Tensor, rollout) -> float | None:
    """The standard error of a step's mismatch_kl over its sequences: with S_b and n_b the KL sum and token
    count of response b (of B with a token), m = Σ S_b / Σ n_b, the ratio estimator's (delta method)
        se = √(B / (B − 1) · Σ_b (S_b − m · n_b)²) / Σ_b n_b.
    Responses, not tokens, are the units: the tokens of one response are correlated. None below 2."""
    target_B_T = rollout.response_mask[:, 1:].bool().to(kl_N.device)
    kl_B_T = torch.zeros(target_B_T.shape, dtype=torch.float64, device=kl_N.device)
    kl_B_T = kl_B_T.masked_scatter(target_B_T, kl_N.double())
    n_B = target_B_T.sum(1).double()
    sum_B, n_B = kl_B_T.sum(1)[n_B > 0], n_B[n_B > 0]
    if len(n_B) < 2:
        return None
    m = sum_B.sum() / n_B.sum()
    return (len(n_B) / (len(n_B) - 1) * ((sum_B - m * n_B) ** 2).sum()).sqrt().item() / n_B.sum().item()


def trajectory(pair, steps: int, device, **overrides) -> list[dict]:
    """The weights after 0..steps real OPD steps (the pair's defaults, then `overrides`) on a copy of the
    student: what a stale engine serves. Measurement (mismatch.measure_config) is handed these."""
    cfg = pair_config(pair.name, device=device, **overrides)
    work = replace(pair, student=copy.deepcopy(pair.student))
    optimizer = torch.optim.AdamW(work.student.parameters(), lr=cfg.lr)
    batches = Batches(work, make_engine(work, cfg), cfg, device)
    weights = [snapshot(work.student)]
    for step in range(1, steps + 1):
        train_step(work, batches, cfg, optimizer=optimizer, step=step, device=device)
        weights.append(snapshot(work.student))
    return weights


# ---------------------------------------------------------------------------------------------------
# The run


@dataclass
class Run:
    """Everything a run needs once its inputs are checked and its folder is locked."""

    cfg: TrainConfig
    pair: object
    optimizer: torch.optim.Optimizer
    batches: Batches
    device: str
    lock: RunLock
    records: list = field(default_factory=list)
    start: int = 1
    stop: StopSignals | None = None  # SIGINT/SIGTERM: stop after the current step
    rerun: str = ""  # how the line of an interrupted run says to continue it
    run_id: str | None = None  # in config.json and every checkpoint (None: a folder from before run ids)
    budget: dict | None = None  # cfg.budget, read and matched to the run (run_budget)

    @property
    def dir(self) -> Path:
        return Path(self.cfg.out_dir) / self.cfg.name


# Settings a --resume may change: none of them changes what the run computes (steps: extend only).
# The budget and what to do past it only watch the run.
SAFE_ON_RESUME = (
    "steps",
    "ckpt_every",
    "ckpt_minutes",
    "kl_chunk",
    "device",
    "name",
    "out_dir",
    "budget",
    "over_budget",
)


def prepare(cfg: TrainConfig, resume: bool) -> Run:
    """Check every input and build what a run needs, then claim the folder (its lock first; fresh or resume
    is decided under it) and restore the checkpoint. Nothing is written before the claim, and a refusal
    after it releases the lock and leaves the folder as it was."""
    run_dir = check_target(cfg.out_dir, cfg.name, resume)  # a fast refusal; claim() decides under the lock
    device = resolve_device(cfg.device)
    budget = run_budget(cfg)  # another pair's or loss's budget is refused before anything loads
    pair = load_pair(
        cfg.pair,
        teacher=cfg.teacher,
        student=cfg.student,
        device=device,
        student_layers=cfg.student_layers,
        prompts=cfg.prompts,
    )
    check_prompts(pair, cfg.rollout.max_new_tokens)
    if cfg.loss == "grpo" and any(p.answer is None for p in pair.train_prompts):
        raise BadInput(
            '--loss grpo needs a verifiable reward: every training prompt must have an "answer" '
            "(the tiny pair has them)"
        )
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(pair.student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine = make_engine(pair, cfg)
    engine.sync(pair.student, 0)  # build the first engine and let it sample once now: fp8-dyn on a CPU, or a
    engine.generate([format_prompt(pair.tokenizer, pair.train_prompts[0].text)])  # --noise that breaks the
    engine.snapshots.clear()  # weights, is refused before the folder is touched (step 1 re-syncs)
    batches = Batches(pair, engine, cfg, device)
    run = Run(cfg, pair, optimizer, batches, device, claim(run_dir, resume), budget=budget)
    try:
        if resume:
            restore(run)
        else:
            run.run_id = new_run_id()
        clean_leftovers(run_dir)
    except BaseException:
        run.lock.release()
        remove_made(run.lock.made)
        raise
    return run


def restore(run: Run) -> None:
    """Under the lock: the saved config must be this run's, then the checkpoint (if any) and the metrics."""
    cfg = run.cfg
    saved = load_config(run.dir, TrainConfig)
    run.run_id = saved_run_id(run.dir)
    differ = changes(asdict(saved), asdict(cfg))
    refuse_unsafe(differ, source=run.dir / "config.json", safe=SAFE_ON_RESUME)
    ckpt = run.dir / "checkpoint.pt"
    if not ckpt.exists():
        refuse_finished(run.dir, steps=saved.steps)  # a finished run is never redone over its own files
        return note_changes(differ)  # killed before its first checkpoint: start again from step 0
    state = load_checkpoint(ckpt, run.device)
    check_run_id(state, run.run_id, source=ckpt)  # another run's checkpoint, however alike, is refused
    if state["step"] > cfg.steps:
        raise BadInput(
            f"--steps {cfg.steps}: {run.dir} already finished {state['step']} steps; "
            "--steps can only extend it"
        )
    refuse_unsafe(changes(state.get("config", asdict(cfg)), asdict(cfg)), source=ckpt, safe=SAFE_ON_RESUME)
    restore_state(state, ckpt, model=run.pair.student, optimizer=run.optimizer, batches=run.batches)
    run.batches.engine.version = None  # rebuild from the restored snapshots at the next sync
    run.start = state["step"] + 1
    run.records = reconcile_metrics(run.dir / "metrics.jsonl", upto=state["step"], saved=state.get("records"))
    note_changes(differ)


def log(run: Run, rec: dict) -> None:
    append_metrics(run.dir / "metrics.jsonl", rec)
    run.records.append(rec)


def save_checkpoint(run: Run, step: int) -> None:
    state = {
        "step": step,
        "student": run.pair.student.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "batches": run.batches.state(),
        "config": asdict(run.cfg),
        "records": list(run.records),
        "run_id": run.run_id,
    }
    atomic_save(state, run.dir / "checkpoint.pt")


# ---------------------------------------------------------------------------------------------------
# The budget inside a run: each step's measured mismatch against a budget's interval


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


def watch_budget(run: Run, rec: dict) -> bool:
    """With a budget (run.budget), compare the running mismatch (running_mismatch, this step included) with
    the budget's interval [B_lo, B_hi] (budget.budget_band) and record it in the step's metrics:
    mismatch_run_mean/_lo/_hi, mismatch_run_steps and over_budget, true when lo > B_hi (as check REJECTS).
    Prints one line when over_budget turns true (the step, the numbers, the budget and the source:
    engine_source) and one when it turns false again. True when the run should stop here (over, and
    --over-budget stop). The training mismatch is on training prompts and the moving student, the budget's
    on the calibration's probes against the untrained student: a warning says to check the configuration
    (admit.py check), not that quality was lost."""
    if run.budget is None:
        return False
    interval = running_mismatch([*run.records, rec])
    if interval is None:
        return False
    b_lo, b_hi = budget_band(run.budget)
    over = interval["lo"] > b_hi
    rec.update({f"mismatch_run_{k}": v for k, v in interval.items()}, over_budget=over)
    was = next((r["over_budget"] for r in reversed(run.records) if "over_budget" in r), False)
    if over != was:
        numbers = (
            f"step {rec['step']}: running mismatch {interval['mean']:.3e} nats/token, 95% interval "
            f"[{interval['lo']:.3e}, {interval['hi']:.3e}] over the last {interval['steps']} steps"
        )
        where = f"the budget's interval [{b_lo:.3e}, {b_hi:.3e}] ({run.cfg.budget})"
        tqdm.write(
            f"warning: {numbers}, is above {where}; source: {engine_source(run.cfg)}"
            if over
            else f"note: {numbers}, is no longer above {where}",
            file=sys.stderr,
        )
    return over and run.cfg.over_budget == "stop"


def train_loop(run: Run, quiet: bool) -> None:
    cfg = run.cfg
    steps = range(run.start, cfg.steps + 1)
    bar = tqdm(
        steps, initial=run.start - 1, total=cfg.steps, desc=f"OPD {cfg.name}", disable=quiet, unit="step"
    )
    last_ckpt = time.time()
    for step in bar:
        rec = train_step(run.pair, run.batches, cfg, optimizer=run.optimizer, step=step, device=run.device)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            t0 = time.time()
            run.batches.wait()  # async: the next batch, which the next step would otherwise wait for
            rec["seconds"] += time.time() - t0
            rec["sample_seconds"] += time.time() - t0
            t0 = time.time()
            rec.update(evaluate(run.pair, cfg, run.device))
            rec["eval_seconds"] = time.time() - t0
        halt = watch_budget(run, rec)  # over the budget with --over-budget stop: checkpoint, then stop
        log(run, rec)  # metrics first, then the checkpoint: a kill in between only repeats this step
        due = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps
        saved = due or halt or (cfg.ckpt_minutes and time.time() - last_ckpt >= 60 * cfg.ckpt_minutes)
        if saved or (run.stop and run.stop.signum is not None):  # a signal: checkpoint here, then stop
            save_checkpoint(run, step)
            last_ckpt = time.time()
        if run.stop:
            run.stop.check(f"interrupted at step {step}; {run.rerun}")
        if halt:
            raise OverBudget(
                f"step {step}: the running mismatch is above --budget {cfg.budget}; stopped with a "
                f"checkpoint at step {step} (--over-budget stop); to go on past it: "
                f"{resume_command(cfg)} --over-budget warn"
            )
        shown = ("loss", "rkl", "reward", "eval_rkl", "eval_acc")
        bar.set_postfix({k: f"{rec[k]:.3f}" for k in shown if k in rec})


def run(cfg: TrainConfig, resume: bool = False, quiet: bool = False, rerun: str | None = None) -> list[dict]:
    """Train according to cfg; return the metric records. The run folder must be new unless resume.
    SIGINT or SIGTERM stops it after the current step with a checkpoint (cli.Interrupted), in one line that
    ends with `rerun`, how to continue it (default: train.py's --resume command)."""
    with StopSignals() as stop:
        r = prepare(cfg, resume)
        r.stop, r.rerun = stop, rerun or f"resume with: {resume_command(cfg)}"
        try:
            fresh = r.start == 1 and not resume
            stop.check(
                "interrupted before the run started; nothing was written" + (f"; {rerun}" if rerun else "")
                if fresh
                else f"interrupted before step {r.start}; {r.rerun}"
            )
            start_files(r.dir, r.records, config={**asdict(cfg), "run_id": r.run_id})
            if r.start == 1:  # step 0: the untrained student, evaluated once
                t0 = time.time()
                log(
                    r,
                    {
                        "step": 0,
                        "tokens": 0,
                        **evaluate(r.pair, cfg, r.device),
                        "seconds": 0.0,
                        "eval_seconds": time.time() - t0,
                    },
                )
                if not quiet:
                    acc = f", accuracy {r.records[-1]['eval_acc']:.3f}" if "eval_acc" in r.records[-1] else ""
                    tqdm.write(f"step 0: held-out reverse KL {r.records[-1]['eval_rkl']:.3f}{acc}")
            train_loop(r, quiet)
            plot_curves(r.records, r.dir / "curves.png", title=f"OPD {cfg.name}")
        finally:
            r.batches.close()
            r.lock.release()
            if not r.records:
                remove_made(r.lock.made)  # refused or stopped before writing: leave no empty folder
    return r.records


def run_or_resume(cfg: TrainConfig) -> list[dict]:
    """The records of run cfg.name: reused when it finished with these very settings (runfiles.reusable_run),
    resumed when killed, else run (quietly); other settings are refused. How lab/calibrate.py and the study
    reuse runs; a signal stops the run at its step with a line saying to rerun their command (cli.RERUN)."""
    run_dir = Path(cfg.out_dir) / cfg.name
    settings = {k: v for k, v in asdict(cfg).items() if k not in SAFE_ON_RESUME or k == "steps"}
    if reusable_run(run_dir, settings=settings, step=cfg.steps):
        return read_metrics(run_dir / "metrics.jsonl", upto=cfg.steps)
    return run(cfg, resume=(run_dir / "config.json").is_file(), quiet=True, rerun=RERUN)


# ---------------------------------------------------------------------------------------------------
# Command line


def per_pair(key: str) -> str:
    """'default: 600 tiny, 12 smollm2, ...' for a help string, read from config.PAIR_TRAIN."""
    values = {p: PAIR_TRAIN[p].get(key, getattr(TrainConfig, key, None)) for p in PAIR_TRAIN}
    shown = [f"{v:g} {p}" if isinstance(v, float) else f"{v} {p}" for p, v in values.items()]
    return "default: " + ", ".join(shown)


# (flag, type, help) of the training flags whose defaults differ per pair; their help reads PAIR_TRAIN.
PER_PAIR_FLAGS = [
    ("--steps", positive_int, "optimizer steps"),
    ("--batch-size", batch_int, "training prompts per step"),
    ("--samples-per-prompt", batch_int, "responses sampled per prompt"),
    ("--lr", lr_value, "AdamW peak learning rate"),
    ("--warmup", nonneg_int, "steps of linear learning-rate warm-up"),
    ("--eval-every", nonneg_int, "evaluate every N steps; 0 = only at the start and end"),
    ("--eval-prompts", batch_int, "held-out prompts per evaluation"),
    ("--ckpt-every", nonneg_int, "checkpoint every N steps; 0 = by time only"),
    ("--ckpt-minutes", nonneg_float, "also checkpoint every M minutes; 0 = off"),
]
# (flag, type, help) of the flags with one default for every pair, read from TrainConfig.
COMMON_FLAGS = [
    ("--weight-decay", nonneg_float, "AdamW weight decay"),
    ("--grad-clip", nonneg_float, "max gradient norm; 0 = no clipping"),
    ("--tis-cap", cap_float, "non-analytic losses: weight min(π_train/π_engine, C); 0 off, inf full IS"),
    ("--kl-chunk", positive_int, "response tokens per full-vocabulary chunk (bounds memory)"),
    ("--seed", seed_int, "seed for prompt order, sampling and weight noise"),
    ("--out-dir", path_text, "parent folder of run folders"),
]


# the flags that load any Hugging Face pair and its prompts, as train.py and lab.calibrate read them
PAIR_FILE_FLAGS = [
    ("--teacher", "HF id or local folder of the teacher (with --student; replaces --pair)"),
    ("--student", "HF id or local folder of the student; shares the teacher's tokenizer"),
    ("--prompts", 'JSONL of {"prompt": ..., "answer": optional}; every 10th is held out'),
]


def add_pair_files(p) -> None:
    """--teacher, --student and --prompts (PAIR_FILE_FLAGS): names of files and folders, so text."""
    for flag, text in PAIR_FILE_FLAGS:
        p.add_argument(flag, type=path_text, help=text)


def build_parser() -> Parser:
    d = TrainConfig()
    p = Parser(
        description="On-policy distillation: the student lowers reverse KL to the teacher on its own samples."
    )
    p.add_argument("--pair", default=d.pair, choices=PAIRS, help=CHAT_PAIR_HELP)
    add_pair_files(p)
    p.add_argument("--student-layers", type=positive_int, help="smollm2/gemma3: the student's decoder layers")
    for flag, kind, text in PER_PAIR_FLAGS:
        p.add_argument(flag, type=kind, help=f"{text} ({per_pair(flag[2:].replace('-', '_'))})")
    for flag, kind, text in COMMON_FLAGS:
        default = getattr(d, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    p.add_argument("--schedule", choices=SCHEDULES, help=f"lr after warm-up ({per_pair('schedule')})")
    p.add_argument(
        "--loss",
        default=d.loss,
        choices=ESTIMATORS,
        help="analytic: full-vocabulary reverse "
        "KL; sampled / sampler: sampled-token gradient, trainer's / engine's log-prob in the "
        "advantage (tinker: sampler --tis-cap inf); grpo: the RL baseline (default: %(default)s)",
    )
    p.add_argument(
        "--center-advantages",
        action="store_true",
        default=None,
        help="sampled / sampler: subtract the batch's mean advantage from every token's (a baseline)",
    )
    p.add_argument(
        "--async",
        dest="async_rollout",
        action="store_true",
        help="one-step-off: sample the next batch in a background thread during this step",
    )
    p.add_argument("--device", default=d.device, choices=DEVICES, help="(default: %(default)s: CUDA if any)")
    p.add_argument(
        "--name",
        type=path_text,
        default=d.name,
        help="run folder under --out-dir, one folder name (default: <pair>-<timestamp>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue --out-dir/--name from its last checkpoint "
        f"with its saved config (may change: {', '.join(SAFE_ON_RESUME[:4])}; --steps only up)",
    )
    add_rollout_args(p.add_argument_group("rollout engine"))
    add_budget_args(p.add_argument_group("the mismatch budget, checked at every step"))
    return p


OVER_BUDGET = ("warn", "stop")


def add_budget_args(g) -> None:
    g.add_argument(
        "--budget",
        type=path_text,
        help="budget.json of this pair and loss (python -m lab.calibrate): a line when the running mismatch "
        "is above its interval; over_budget in metrics.jsonl",
    )
    g.add_argument(
        "--over-budget",
        choices=OVER_BUDGET,
        help="above the budget: warn, or stop with a checkpoint at that step, exit 6 (default: warn)",
    )


def config_from_args(args) -> TrainConfig:
    """The pair's TrainConfig (config.PAIR_TRAIN), with every flag the user gave on top."""
    pair = "custom" if args.teacher else args.pair
    cfg = pair_config(pair)
    given = {
        f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None
    }
    given.update(pair=pair, name=args.name or f"{pair}-{time.strftime('%Y%m%d-%H%M%S')}")
    given.pop("rollout", None)
    cfg = replace(cfg, **given)
    cfg.rollout = rollout_config_from_args(args, pair=pair)
    return cfg


def config_for(args, given: set[str]) -> TrainConfig:
    """A new run's config; or, with --resume, the saved one (in the folder given, whatever it says inside)
    with the flags given applied if they are SAFE_ON_RESUME (with a note), refused by name otherwise."""
    if not args.resume:
        cfg = config_from_args(args)
        check_target(cfg.out_dir, cfg.name, resume=False)  # before loading anything
        return cfg
    if not args.name:
        raise BadInput("--resume needs --name NAME of the run to continue")
    run_dir = check_target(args.out_dir, args.name, resume=True)
    cfg = replace(load_config(run_dir, TrainConfig), out_dir=args.out_dir, name=args.name)
    choices = {
        "pair": (*PAIRS, "custom"),
        "loss": ESTIMATORS,
        "schedule": SCHEDULES,
        "over_budget": OVER_BUDGET,
    }
    recheck_flags(cfg, PER_PAIR_FLAGS + COMMON_FLAGS, choices=choices, where=f"{run_dir}/config.json")
    new = resume_changes(
        asdict(cfg),
        asdict(config_from_args(args)),
        given=given,
        safe=SAFE_ON_RESUME,
        source=run_dir / "config.json",
    )
    return replace(cfg, **new)


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with StopSignals() as stop:
            cfg = config_for(args, given_dests(parser, argv))
            stop.check("interrupted before the run started; nothing was written")
            records = run(cfg, resume=args.resume)
    except EXPECTED as e:
        fail(e)
    print(f"{cfg.name}: {summary(records)}")
    print(f"wrote {Path(cfg.out_dir) / cfg.name}/metrics.jsonl, curves.png")


if __name__ == "__main__":
    main()
