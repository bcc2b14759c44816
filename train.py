"""On-policy distillation (OPD): the student samples, the teacher scores, the student lowers reverse KL.

One step:
    1. the rollout engine (rollout.RolloutEngine: its own copy of the student, possibly stale, noisy or
       in FP8) samples `samples_per_prompt` responses for `batch_size` training prompts;
    2. student and teacher score every response token y_t at its prefix x_<t;
    3. the loss is the per-token reverse KL, averaged over all response tokens of the batch:
           KL_t = Σ_v p_s(v | x_<t) (log p_s(v | x_<t) − log p_t(v | x_<t))
       estimated either analytically over the full vocabulary (gradient through the student's logits),
       or from the sampled token alone, as a policy gradient with a detached advantage
           A_t = −(log p_s(y_t | x_<t) − log p_t(y_t | x_<t)),   loss = −mean_t A_t · log p_s(y_t | x_<t).
       Both treat each token's prefix as fixed (the usual OPD recipe): the gradient does not flow through
       the effect the student's choices have on later prefixes. --tis-cap C reweights the sampled-token
       estimator by min(π_train(y_t)/π_engine(y_t), C) (truncated importance sampling).
       --loss grpo swaps the teacher's signal for the RL baseline's (rl.py): an exact-match reward per
       response and group-normalised advantages, through the same engine, batches and TIS option.
    4. the canonical mismatch KL(π_engine ‖ π_train) of the batch is logged as `mismatch_kl`, and the
       prefix-shift part (mismatch.prefix_shift_kl) as `prefix_kl`.

--async samples one step ahead in a background thread (one-step-off, see `Batches`).

Outputs go to runs/<name>/: config.json, metrics.jsonl (a line per step, flushed), checkpoint.pt
(atomic, every step by default), curves.png. `--resume` continues a killed run exactly.

    python train.py                    # smollm2 pair, ~7 min on a 2-core CPU
    python train.py --pair tiny        # addition task, under 1.5 min; prints accuracy
    python train.py --pair tiny --weights fp8 --kv-cache fp8 --staleness 2   # through a cheap engine
    python train.py --pair tiny --name mine --resume
    python train.py --pair tiny --loss grpo --tis-cap 2     # the RL baseline
"""

import argparse
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from models import PAIRS, BadInput, exact_match_accuracy, format_prompt, load_pair
from rl import exact_match_rewards, group_advantages
from rollout import RolloutConfig, RolloutEngine, generate, positions, snapshot

LOSSES = ("analytic", "sampled", "grpo")

# Settings that differ per pair; anything not given on the command line comes from here.
PAIR_DEFAULTS = {
    "tiny": dict(steps=200, batch_size=64, samples_per_prompt=4, lr=3e-4, warmup=10, eval_every=50, eval_prompts=256, max_new_tokens=6),
    "smollm2": dict(steps=12, batch_size=4, samples_per_prompt=2, lr=5e-5, warmup=0, eval_every=4, eval_prompts=16, max_new_tokens=48),
    "gemma3": dict(steps=12, batch_size=4, samples_per_prompt=2, lr=5e-5, warmup=0, eval_every=4, eval_prompts=16, max_new_tokens=48),
    "custom": dict(steps=20, batch_size=4, samples_per_prompt=2, lr=5e-5, warmup=0, eval_every=5, eval_prompts=16, max_new_tokens=48),
}


@dataclass
class TrainConfig:
    """One OPD run. Saved in full to runs/<name>/config.json."""

    pair: str = "smollm2"  # tiny | smollm2 | custom (= --teacher/--student)
    teacher: str | None = None  # HF id or local path; replaces --pair
    student: str | None = None
    student_layers: int | None = None  # smollm2/gemma3: decoder layers the student keeps; None = 24 of 30 / 14 of 18
    prompts: str | None = None  # JSONL file of {"prompt": ...}; replaces the pair's prompts
    steps: int = 20  # optimizer steps
    batch_size: int = 4  # training prompts per step
    samples_per_prompt: int = 2  # responses sampled per prompt
    lr: float = 5e-5  # AdamW peak learning rate
    warmup: int = 0  # steps of linear learning-rate warm-up, then constant
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    loss: str = "analytic"  # analytic (full-vocabulary KL) | sampled (policy gradient on the sampled token) | grpo (RL baseline)
    tis_cap: float = 0.0  # truncated importance sampling cap C in min(π_train/π_engine, C); 0 = off (sampled, grpo)
    async_rollout: bool = False  # one-step-off: sample step s+1's batch in a background thread during step s
    kl_chunk: int = 256  # response tokens per chunk when computing full-vocabulary KL (bounds memory)
    eval_every: int = 5  # evaluate every N steps (and after the last); 0 = only at the start and end
    eval_prompts: int = 16  # held-out prompts per evaluation
    ckpt_every: int = 1  # write a checkpoint every N steps (and after the last)
    seed: int = 0  # seeds prompt order and sampling (per step, so a resumed run repeats them exactly)
    device: str = "auto"  # auto | cpu | cuda
    name: str = ""  # run folder name under out_dir; "" = <pair>-<timestamp>
    out_dir: str = "runs"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def pair_config(pair: str, **overrides) -> TrainConfig:
    """A TrainConfig with the pair's default settings (PAIR_DEFAULTS), then `overrides`."""
    d = dict(PAIR_DEFAULTS[pair])
    rollout = RolloutConfig(max_new_tokens=d.pop("max_new_tokens"))
    return TrainConfig(pair=pair, **{**d, "rollout": rollout, **overrides})


# ---------------------------------------------------------------------------------------------------
# The loss


def reverse_kl_terms(student_logits_N_V: torch.Tensor, teacher_logits_N_V: torch.Tensor, y_N: torch.Tensor):
    """For N scored positions: exact KL_n = Σ_v p_s(v)(log p_s(v) − log p_t(v)), log p_s(y_n), log p_t(y_n)."""
    logp_s_N_V = torch.log_softmax(student_logits_N_V.float(), -1)
    logp_t_N_V = torch.log_softmax(teacher_logits_N_V.float(), -1)
    kl_N = (logp_s_N_V.exp() * (logp_s_N_V - logp_t_N_V)).sum(-1)
    pick = lambda logp_N_V: logp_N_V.gather(-1, y_N[:, None]).squeeze(-1)  # noqa: E731
    return kl_N, pick(logp_s_N_V), pick(logp_t_N_V)


def response_hidden(model, rollout, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict response tokens, and those tokens.

    Position t−1's output predicts token t, so the hidden states are shifted by one against the mask.
    Returns h_N_H and y_N, where N = number of response tokens in the batch (row-major order).
    `cache`: an empty KV cache to score through (the engine's FP8 cache, so its rounding is included).
    """
    out = model.get_decoder()(input_ids=rollout.tokens, attention_mask=rollout.attention_mask, position_ids=positions(rollout.attention_mask),
                              cache=cache, use_cache=cache is not None)  # fmt: skip
    target_B_T = rollout.response_mask[:, 1:].bool()  # [B, T-1]: which next tokens are response tokens
    return out.last_hidden_state[:, :-1][target_B_T], rollout.tokens[:, 1:][target_B_T]


def head(model, h_N_H: torch.Tensor) -> torch.Tensor:
    """The output head, with final-logit softcapping where the architecture has it (Gemma)."""
    logits_N_V = model.get_output_embeddings()(h_N_H)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits_N_V / cap) if cap else logits_N_V


def tis_weights(logp_train_N: torch.Tensor, logp_engine_N: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance sampling: w_t = min(π_train(y_t) / π_engine(y_t), cap), detached.

    It reweights each sampled token's loss term towards what the trainer's policy would have sampled,
    correcting the per-token part of the mismatch (not the prefix shift). cap <= 0 means no correction.
    """
    if cap <= 0:
        return torch.ones_like(logp_train_N)
    return torch.exp(logp_train_N.detach() - logp_engine_N).clamp(max=cap)


def opd_loss(student, teacher, rollout, *, estimator: str = "analytic", chunk: int = 256, tis_cap: float = 0.0,
             advantages_B: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The OPD loss over all response tokens of `rollout` (token mean), and its statistics.

    estimator "grpo" is the RL baseline's loss, −mean_t w_t · A_i · log p_s(y_t), with one advantage per
    response (advantages_B, from rl.group_advantages) in place of the teacher's per-token signal.
    tis_cap > 0 (sampled and grpo) multiplies each token's term by tis_weights. The analytic loss
    needs no such correction: it sums over the whole vocabulary at each prefix, so how the engine drew
    y_t does not enter the term at t; only the prefixes it visits do (prefix shift). The engine's
    log-probs come from the rollout and are the sampling distribution's: TIS assumes temperature 1, top-p 1.

    The vocabulary-sized logits are formed `chunk` tokens at a time and recomputed in the backward pass
    (activation checkpointing), so peak memory is one chunk's [chunk, V] logits, not [N, V].
    stats: rkl = mean exact KL(p_s ‖ p_t) per token (whatever the estimator), tokens = N.
    """
    h_s_N_H, y_N = response_hidden(student, rollout)
    with torch.no_grad():
        h_t_N_H, _ = response_hidden(teacher, rollout)
    target_B_T = rollout.response_mask[:, 1:].bool()
    logp_engine_N = rollout.logprobs[:, 1:][target_B_T]  # same order as y_N
    n = len(y_N)
    adv_N = torch.zeros(n, device=y_N.device)
    if advantages_B is not None:  # each response's advantage, repeated over its tokens
        adv_N = advantages_B.to(y_N.device)[:, None].expand_as(target_B_T)[target_B_T]

    def chunk_terms(h_s_C_H, h_t_C_H, y_C, logp_e_C, adv_C):
        with torch.no_grad():
            teacher_logits_C_V = head(teacher, h_t_C_H)
        kl_C, logp_s_C, logp_t_C = reverse_kl_terms(head(student, h_s_C_H), teacher_logits_C_V, y_C)
        if estimator == "analytic":
            objective = kl_C.sum()
        else:
            advantage_C = adv_C if estimator == "grpo" else -(logp_s_C - logp_t_C).detach()
            objective = -(tis_weights(logp_s_C, logp_e_C, tis_cap) * advantage_C * logp_s_C).sum()
        return objective, kl_C.detach().sum()

    loss, kl_sum = torch.zeros((), device=y_N.device), torch.zeros((), device=y_N.device)
    for i in range(0, n, chunk):
        args = (h_s_N_H[i : i + chunk], h_t_N_H[i : i + chunk], y_N[i : i + chunk], logp_engine_N[i : i + chunk], adv_N[i : i + chunk])
        objective, kl = checkpoint(chunk_terms, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk_terms(*args)
        loss = loss + objective / max(n, 1)
        kl_sum = kl_sum + kl
    return loss, {"rkl": kl_sum.item() / max(n, 1), "tokens": n}


# ---------------------------------------------------------------------------------------------------
# Steps and evaluation


def step_generator(seed: int, step: int, device) -> torch.Generator:
    """A generator that depends only on (seed, step): a resumed run draws exactly what it would have."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)


def train_rollout(pair, engine: RolloutEngine, cfg: TrainConfig, step: int, device):
    """Sample this step's batch with the engine: `batch_size` prompts, each `samples_per_prompt` times
    (consecutive rows, so a prompt's responses form a group). Returns the rollout and each row's Prompt."""
    pick = torch.randint(len(pair.train_prompts), (cfg.batch_size,), generator=step_generator(cfg.seed, step, "cpu"))
    prompts = [pair.train_prompts[i] for i in pick.tolist() for _ in range(cfg.samples_per_prompt)]
    texts = [format_prompt(pair.tokenizer, p.text) for p in prompts]
    return engine.generate(texts, generator=step_generator(cfg.seed, step, device)), prompts


class Batches:
    """Where step s's batch comes from. The weights entering step s are version s − 1.

    sync   at the start of step s: engine.sync(version s − 1), then sample.
    async  one-step-off: while the trainer runs step s, a background thread samples step s+1's batch from
           version s − 1 (the weights entering step s), so every batch is exactly one version staler than
           in sync mode (version max(s − 2, 0)); the batches are the ones sync mode with staleness + 1
           would draw. Sampling then overlaps the optimizer step instead of preceding it. The trainer
           snapshots its weights before the update; the worker rebuilds the engine from that snapshot.
    """

    def __init__(self, pair, engine: RolloutEngine, cfg: TrainConfig, device):
        self.pair, self.engine, self.cfg, self.device = pair, engine, cfg, device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout") if cfg.async_rollout else None
        self.pending = None  # async: the future of the next step's batch

    def _sample(self, version: int, weights: dict, step: int):
        self.engine.receive(version, weights)
        return train_rollout(self.pair, self.engine, self.cfg, step, self.device)

    def get(self, student, step: int):
        """Step s's (rollout, prompts). Async: the batch prepared during step s − 1 (or, on the first step
        of a run or a resume, one sampled now from the current weights)."""
        if self.pool is None:
            self.engine.sync(student, version=step - 1)
            return train_rollout(self.pair, self.engine, self.cfg, step, self.device)
        if self.pending is None:
            self.pending = self.pool.submit(self._sample, step - 1, snapshot(student), step)
        batch, self.pending = self.pending.result(), None
        return batch

    def prefetch(self, student, step: int) -> None:
        """Async: start sampling step s+1's batch from the weights entering step s (call before the update)."""
        if self.pool is not None and step < self.cfg.steps:
            self.pending = self.pool.submit(self._sample, step - 1, snapshot(student), step + 1)

    def wait(self) -> None:
        """Let the worker finish (before evaluation: tokenizers are not safe to call from two threads)."""
        if self.pending is not None:
            self.pending.exception()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def make_engine(pair, cfg: TrainConfig) -> RolloutEngine:
    """The rollout engine; fp8 KV scales are calibrated on the first 8 training prompts (never eval ones)."""
    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:8]]
    return RolloutEngine(pair.student, pair.tokenizer, cfg.rollout, probe_prompts=probes)


@torch.no_grad()
def evaluate(pair, cfg: TrainConfig, device) -> dict:
    """Held-out quality: exact reverse KL of fresh student samples (fixed seed, temperature 1); when the
    prompts have answers, also the exact-match rate of those samples (eval_reward: what the RL baseline
    maximises) and greedy accuracy (eval_acc)."""
    pair.student.eval()
    prompts = pair.eval_prompts[: cfg.eval_prompts]
    texts = [format_prompt(pair.tokenizer, p.text) for p in prompts]
    rollout = generate(pair.student, pair.tokenizer, texts, cfg.rollout, generator=step_generator(cfg.seed + 7919, 0, device))
    _, stats = opd_loss(pair.student, pair.teacher, rollout, chunk=cfg.kl_chunk)
    result = {"eval_rkl": stats["rkl"]}
    if all(p.answer is not None for p in prompts):
        result["eval_reward"] = exact_match_rewards(rollout.responses(pair.tokenizer), [p.answer for p in prompts]).mean().item()
        result["eval_acc"] = exact_match_accuracy(pair.student, pair.tokenizer, prompts, cfg.rollout.max_new_tokens)
    return result


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over `warmup` steps, then constant. A function of the step alone, so resume needs no state."""
    return cfg.lr * min(1.0, step / cfg.warmup) if cfg.warmup else cfg.lr


def train_step(pair, batches: Batches, cfg: TrainConfig, optimizer, step: int, device) -> dict:
    """One OPD (or GRPO) step. The weights entering step s are version s − 1 (that many updates applied)."""
    from mismatch import exact_token_kl, prefix_shift_kl

    t0 = time.time()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    pair.student.eval()  # no dropout in sampling or scoring: the trained policy is the sampled one
    rollout, prompts = batches.get(pair.student, step)
    sample_seconds = time.time() - t0  # async: only the wait for a batch the worker has not finished
    # The one scale: exact KL(π_engine ‖ π_train) per token on the engine's samples (see mismatch.py).
    kl_N = exact_token_kl(batches.engine, pair.student, rollout, chunk=cfg.kl_chunk)
    batches.prefetch(pair.student, step)  # async: the next batch samples while this step trains
    extra, advantages_B = {}, None
    if cfg.loss == "grpo":
        rewards_B = exact_match_rewards(rollout.responses(pair.tokenizer), [p.answer for p in prompts])
        advantages_B = group_advantages(rewards_B, cfg.samples_per_prompt)
        extra["reward"] = rewards_B.mean().item()
    loss, stats = opd_loss(pair.student, pair.teacher, rollout, estimator=cfg.loss, chunk=cfg.kl_chunk, tis_cap=cfg.tis_cap, advantages_B=advantages_B)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(pair.student.parameters(), max_norm)
    optimizer.step()
    response_len = rollout.response_mask.sum(1).float().mean().item()
    return {"step": step, "loss": loss.item(), **stats, **extra, "mismatch_kl": kl_N.mean().item(),
            "prefix_kl": prefix_shift_kl(kl_N, rollout).mean().item(), "engine_version": rollout.version,
            "grad_norm": grad_norm.item(), "response_len": response_len, "sample_seconds": sample_seconds, "seconds": time.time() - t0}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Run folder: config, metrics, checkpoints


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file, then rename: a reader sees the old file or the new one, never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_metrics(path: Path, upto: int) -> list[dict]:
    """Metric lines with step <= upto; a torn last line from a killed run is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["step"] <= upto:
            records.append(rec)
    return records


def append_metrics(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "rkl" in r]
    evals = [r for r in records if "eval_rkl" in r]
    has_acc = any("eval_acc" in r for r in evals)
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(10 if has_acc else 5.5, 4), squeeze=False)
    ax = axes[0, 0]
    ax.plot([r["step"] for r in train], [r["rkl"] for r in train], label="train reverse KL (on-policy batch)", alpha=0.6)
    ax.plot([r["step"] for r in evals], [r["eval_rkl"] for r in evals], "o-", label="held-out reverse KL")
    ax.set(xlabel="step", ylabel="nats / token", title=title)
    ax.legend()
    if has_acc:
        acc = [r for r in evals if "eval_acc" in r]
        axes[0, 1].plot([r["step"] for r in acc], [r["eval_acc"] for r in acc], "o-", color="C2")
        axes[0, 1].set(xlabel="step", ylabel="exact-match accuracy (greedy)", title="held-out accuracy", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# The run


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available here; use --device cpu or auto")
    if name not in ("cpu", "cuda"):
        raise BadInput(f"--device {name!r}: choose auto, cpu or cuda")
    return name


def device_label(device: str) -> str:
    """What the numbers were measured on, for every figure and table: the GPU's name, or the CPU's and its threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")] if cpuinfo.exists() else []
    return f"CPU ({names[0] if names else platform.processor() or 'unknown model'}, {torch.get_num_threads()} threads)"


def run(cfg: TrainConfig, resume: bool = False, quiet: bool = False) -> list[dict]:
    """Train according to cfg; return the metric records. The run folder must be new unless resume."""
    run_dir = Path(cfg.out_dir) / cfg.name
    ckpt_path, metrics_path = run_dir / "checkpoint.pt", run_dir / "metrics.jsonl"
    device = resolve_device(cfg.device)
    pair = load_pair(cfg.pair, teacher=cfg.teacher, student=cfg.student, device=device, student_layers=cfg.student_layers, prompts=cfg.prompts)
    if cfg.loss == "grpo" and any(p.answer is None for p in pair.train_prompts):
        raise BadInput("--loss grpo needs a verifiable reward: every training prompt must have an \"answer\" (the tiny pair has them)")
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(pair.student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    start = 1
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        pair.student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
        records = read_metrics(metrics_path, upto=state["step"])
        # Drop what the killed run logged after its last checkpoint; those steps are redone identically.
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in records))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)  # only reachable for a fresh folder or a resume with no checkpoint yet
        records = []
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    if start == 1:  # step 0: the untrained student, evaluated once
        t0 = time.time()
        rec = {"step": 0, "tokens": 0, **evaluate(pair, cfg, device), "seconds": 0.0, "eval_seconds": time.time() - t0}
        append_metrics(metrics_path, rec)
        records.append(rec)
        if not quiet:
            tqdm.write(f"step 0: held-out reverse KL {rec['eval_rkl']:.3f}" + (f", accuracy {rec['eval_acc']:.3f}" if "eval_acc" in rec else ""))

    batches = Batches(pair, make_engine(pair, cfg), cfg, device)
    if start > 1 and cfg.async_rollout:
        tqdm.write(f"note: resuming an async run; step {start} samples from the step-{start - 1} weights (one version fresher than uninterrupted)")
    if start > 1 and cfg.rollout.staleness:
        # A stale engine serves snapshots the trainer has since overwritten; rebuild them by replaying is not
        # possible from one checkpoint, so a resumed stale run serves the resumed weights until it catches up.
        tqdm.write(f"note: resuming with staleness {cfg.rollout.staleness}; the engine restarts from the step-{start - 1} weights")
    bar = tqdm(range(start, cfg.steps + 1), initial=start - 1, total=cfg.steps, desc=f"OPD {cfg.name}", disable=quiet, unit="step")
    try:
        for step in bar:
            rec = train_step(pair, batches, cfg, optimizer, step, device)
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                t0 = time.time()
                batches.wait()  # async: the next batch's sampling, which the next step would otherwise wait for
                waited = time.time() - t0
                rec["seconds"] += waited
                rec["sample_seconds"] += waited
                t0 = time.time()
                rec.update(evaluate(pair, cfg, device))
                rec["eval_seconds"] = time.time() - t0
            # Metrics first, then the checkpoint: a kill in between only repeats this step on resume.
            append_metrics(metrics_path, rec)
            records.append(rec)
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                atomic_save({"step": step, "student": pair.student.state_dict(), "optimizer": optimizer.state_dict()}, ckpt_path)
            bar.set_postfix({k: f"{rec[k]:.3f}" for k in ("loss", "rkl", "reward", "eval_rkl", "eval_acc") if k in rec})
    finally:
        batches.close()

    plot_curves(records, run_dir / "curves.png", title=f"OPD {cfg.name}")
    return records


def run_or_resume(cfg: TrainConfig) -> list[dict]:
    """The records of run cfg.name: reused when it finished, resumed when it was killed, else run (quietly).
    How the experiments (admit.py, study.py) reuse their finished runs."""
    metrics_path = Path(cfg.out_dir) / cfg.name / "metrics.jsonl"
    records = read_metrics(metrics_path, upto=cfg.steps)
    if records and records[-1]["step"] == cfg.steps:
        return records
    return run(cfg, resume=metrics_path.exists(), quiet=True)


def summary(records: list[dict]) -> str:
    evals = [r for r in records if "eval_rkl" in r]
    first, last = evals[0], evals[-1]
    drop = 1 - last["eval_rkl"] / first["eval_rkl"] if first["eval_rkl"] > 0 else 0.0
    text = f"held-out reverse KL {first['eval_rkl']:.3f} -> {last['eval_rkl']:.3f} nats/token ({drop:.0%} lower)"
    if "eval_acc" in first:
        text += f"; held-out accuracy {first['eval_acc']:.3f} -> {last['eval_acc']:.3f}"
    return text + f"; {run_seconds(records):.0f}s"


def run_seconds(records: list[dict]) -> float:
    """Wall-clock seconds of a run: its training steps and its evaluations."""
    return sum(r["seconds"] + r.get("eval_seconds", 0.0) for r in records)


# ---------------------------------------------------------------------------------------------------
# Command line


def add_rollout_args(g, sampling: bool = True) -> None:
    """The rollout engine flags, shared by train.py and mismatch.py (sampling=False: policies at temperature 1)."""
    if sampling:
        g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default 1: sample the policy itself)")
        g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = no truncation (default 1)")
    g.add_argument("--max-new-tokens", type=int, help="response length limit (default: 6 tiny, 48 smollm2)")
    g.add_argument("--weights", default="fp32", help="engine weight precision: fp32 | bf16 | fp8 (weight-only) | fp8-dyn (W8A8, CUDA sm>=8.9) | fp8-emu (W8A8 emulated)")
    g.add_argument("--fp8-skip", default="lm_head", help="comma-separated module-name patterns kept in high precision under fp8 weights (default lm_head; '' = quantize every Linear)")
    g.add_argument("--kv-cache", default="model", help="KV cache: model (engine dtype) | fp8 (e4m3, per-head scales)")
    g.add_argument("--kv-scales", default="calibrated", help="fp8 KV scales: calibrated (amax/448 on probe prompts) | unit (1.0)")
    g.add_argument("--staleness", type=int, default=0, help="optimizer steps the engine lags behind the trainer; 0 = synchronous")
    g.add_argument("--noise", type=float, default=0.0, help="relative std of Gaussian noise on the engine's weights; 0 = none")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="On-policy distillation: the student lowers reverse KL to the teacher on its own samples.")
    p.add_argument("--pair", default="smollm2", help=f"embedded pair: {', '.join(PAIRS)} (default smollm2)")
    p.add_argument("--teacher", help="HF id or local path of the teacher (with --student; replaces --pair)")
    p.add_argument("--student", help="HF id or local path of the student; must share the teacher's tokenizer")
    p.add_argument("--student-layers", type=int, help="smollm2/gemma3: decoder layers the student keeps (default: 24 of 30 smollm2, 14 of 18 gemma3)")
    p.add_argument("--prompts", help="JSONL file of {\"prompt\": ..., \"answer\": optional}; every 10th line is held out")
    p.add_argument("--steps", type=int, help="optimizer steps (default: 200 tiny, 12 smollm2)")
    p.add_argument("--batch-size", type=int, help="training prompts per step (default: 64 tiny, 4 smollm2)")
    p.add_argument("--samples-per-prompt", type=int, help="responses per prompt (default: 4 tiny, 2 smollm2)")
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default: 3e-4 tiny, 5e-5 smollm2)")
    p.add_argument("--warmup", type=int, help="steps of linear learning-rate warm-up (default: 10 tiny, 0 smollm2)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 = no clipping (default 1)")
    p.add_argument("--loss", default="analytic", help="analytic: full-vocabulary reverse KL; sampled: policy gradient on the sampled token; "
                   "grpo: the RL baseline (exact-match reward, group-normalised advantages; prompts need answers)")
    p.add_argument("--tis-cap", type=float, default=0.0, help="--loss sampled or grpo: token-level truncated importance sampling weight min(π_train/π_engine, C); 0 = off (default)")
    p.add_argument("--async", dest="async_rollout", action="store_true", help="one-step-off: sample the next batch in a background thread during this step")
    p.add_argument("--kl-chunk", type=int, default=256, help="response tokens per full-vocabulary chunk (default 256)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps; 0 = only at start and end (default: 50 tiny, 4 smollm2)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per evaluation (default: 256 tiny, 16 smollm2)")
    p.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every N steps (default 1: a finished step is never lost)")
    p.add_argument("--seed", type=int, default=0, help="seed for prompt order and sampling (default 0)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present) | cpu | cuda")
    p.add_argument("--name", default="", help="run folder under runs/ (default: <pair>-<timestamp>)")
    p.add_argument("--out-dir", default="runs", help="parent folder of run folders (default runs)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its last checkpoint (its saved config is used; --steps may extend it)")
    add_rollout_args(p.add_argument_group("rollout engine"))
    return p


def rollout_config_from_args(args, max_new_tokens: int) -> RolloutConfig:
    """A RolloutConfig from the add_rollout_args flags (temperature 1 and top-p 1 where they are absent)."""
    skip = tuple(p for p in args.fp8_skip.split(",") if p)
    return RolloutConfig(temperature=getattr(args, "temperature", 1.0), top_p=getattr(args, "top_p", 1.0), max_new_tokens=max_new_tokens, seed=args.seed, weights=args.weights,
                         fp8_skip=skip, kv_cache=args.kv_cache, kv_scales=args.kv_scales, staleness=args.staleness, noise=args.noise)  # fmt: skip


def config_from_args(args) -> TrainConfig:
    pair = "custom" if args.teacher else args.pair
    if pair not in PAIR_DEFAULTS:
        raise BadInput(f"--pair {pair!r}: unknown pair; choose one of {', '.join(PAIRS)} or give --teacher/--student")
    if args.loss not in LOSSES:
        raise BadInput(f"--loss {args.loss!r}: choose one of {', '.join(LOSSES)}")
    d = PAIR_DEFAULTS[pair]
    pick = lambda key: d[key] if getattr(args, key) is None else getattr(args, key)  # noqa: E731
    rollout = rollout_config_from_args(args, max_new_tokens=pick("max_new_tokens"))
    cfg = TrainConfig(
        pair=pair, teacher=args.teacher, student=args.student, student_layers=args.student_layers, prompts=args.prompts,
        steps=pick("steps"), batch_size=pick("batch_size"), samples_per_prompt=pick("samples_per_prompt"), lr=pick("lr"), warmup=pick("warmup"),
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, loss=args.loss, tis_cap=args.tis_cap, async_rollout=args.async_rollout, kl_chunk=args.kl_chunk,
        eval_every=pick("eval_every"), eval_prompts=pick("eval_prompts"), ckpt_every=args.ckpt_every, seed=args.seed,
        device=args.device, name=args.name or f"{pair}-{time.strftime('%Y%m%d-%H%M%S')}", out_dir=args.out_dir, rollout=rollout,
    )  # fmt: skip
    for key in ("steps", "batch_size", "samples_per_prompt", "kl_chunk", "eval_prompts", "ckpt_every"):
        if getattr(cfg, key) < 1:
            raise BadInput(f"--{key.replace('_', '-')} {getattr(cfg, key)}: must be >= 1")
    if cfg.tis_cap < 0 or (cfg.tis_cap > 0 and cfg.loss == "analytic"):
        raise BadInput(f"--tis-cap {cfg.tis_cap}: must be >= 0, and applies to --loss sampled or grpo only (the analytic loss sums over the vocabulary, so the sampled token needs no correction)")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise BadInput(f"--lr {cfg.lr}: must be a positive number")
    if cfg.eval_every < 0:
        raise BadInput(f"--eval-every {cfg.eval_every}: must be >= 0 (0 = only at start and end)")
    return cfg


def load_saved_config(run_dir: Path) -> TrainConfig:
    saved = json.loads((run_dir / "config.json").read_text())
    rollout = RolloutConfig(**saved.pop("rollout"))
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in saved.items() if k in known}, rollout=rollout)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.resume:
            if not args.name:
                raise BadInput("--resume needs --name NAME of the run to continue")
            run_dir = Path(args.out_dir) / args.name
            if not (run_dir / "config.json").exists():
                raise BadInput(f"--resume: {run_dir} has no config.json; nothing to resume (start it without --resume)")
            cfg = load_saved_config(run_dir)
            if args.steps is not None:
                cfg.steps = args.steps
        else:
            cfg = config_from_args(args)
            run_dir = Path(cfg.out_dir) / cfg.name
            if run_dir.exists() and any(run_dir.iterdir()):
                raise BadInput(f"--name {cfg.name}: {run_dir} already exists; pass --resume to continue it, or choose another --name")
        records = run(cfg, resume=args.resume)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{cfg.name}: {summary(records)}")
    print(f"wrote {run_dir}/metrics.jsonl, {run_dir}/curves.png")


if __name__ == "__main__":
    main()
