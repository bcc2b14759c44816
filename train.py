"""On-policy distillation (OPD): the student samples, the teacher scores, the student lowers reverse KL.

One step (see loss.py for the formulas):
    1. the rollout engine (engine.RolloutEngine: its own copy of the student, possibly stale, noisy or in
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
`--budget B` compares each step's mismatch with budget B's interval as the run goes (lab/watch.py: a line
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
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from batches import Batches, make_engine
from cli import EXPECTED, RERUN, BadInput, NonFinite, OverBudget, StopSignals, fail, given_dests
from engine import snapshot
from evaluate import evaluate
from kl import mismatch_se, prefix_shift_kl
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
    resume_command,
    reusable_run,
    saved_run_id,
    start_files,
    summary,
)
from lab.train_args import SAFE_ON_RESUME, TrainConfig, build_parser, config_for, pair_config
from lab.watch import run_budget, watch_budget
from loss import opd_loss
from mismatch import rescored_token_kl
from models import check_prompts, format_prompt, load_pair, resolve_device
from rl import exact_match_rewards, group_advantages

# ---------------------------------------------------------------------------------------------------
# One step


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
        # over the budget with --over-budget stop: checkpoint, then stop
        halt = watch_budget(cfg, run.budget, run.records, rec=rec)
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
