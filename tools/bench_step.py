"""Benchmark: one OPD step of this project against TRL's GKDTrainer, side by side in one run.

Both train their own copy of the smollm2 student against the same teacher, fully on-policy, with the reverse
KL (TRL: GKDTrainer with lmbda=1, beta=1, temperature 1, i.e. generalized_jsd_loss(beta=1), which equals our
analytic loss), the same sequences per step (8: our 4 prompts × 2 samples; TRL's batch of 8 prompts), the
same response limit (48 new tokens), learning rate (5e-5) and AdamW. Our step also computes the exact mismatch
KL(engine ‖ train) and logs it, as every training step does. The steps alternate (TRL step, our step, ...,
driven by a TrainerCallback), the first `--warmup` of each are excluded, and the medians give the ratio.

After the side-by-side steps, two more steps of ours run: one under torch.profiler, which counts each
phase's matmul FLOPs, and one timed phase by phase (without the profiler's per-operator cost). Each phase's
time is set against its floor on this machine: sampling against the prefill's FLOPs at the GEMM rate plus
one weight read per decode step; the student forward, its backward and the teacher forward against the
FLOPs of their matrix products at the GEMM rate (one large fp32 matmul, measured here); the mismatch KL and
AdamW against the bytes they must move at the weight-read bandwidth. Attention scores, elementwise work and
the float64 arithmetic of the exact KL are not in the floors.

TRL is a benchmark-only dependency (requirements-bench.txt; it leaves torch and transformers as pinned):

    pip install -r requirements-bench.txt
    python -m tools.bench_step                 # 6 steps each, about 4 minutes on a 2-core CPU
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import copy
import importlib.util
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import loss
from batches import Batches, make_engine
from cli import Parser, positive_int
from lab.train_args import pair_config
from models import load_pair
from tools.bench_sampler import side_by_side, weight_read_ms
from tools.machine import cpu_facts
from train import train_step


def require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        print("error: bench_step.py needs TRL: pip install -r requirements-bench.txt", file=sys.stderr)
        sys.exit(2)


def trl_trainer(pair, steps: int, lr: float, max_new_tokens: int, callback):
    """GKDTrainer on a copy of the student: fully on-policy (lmbda 1), reverse KL (beta 1), 8 prompts."""
    from datasets import Dataset  # TRL's own dependency, present only when TRL is installed
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    rows = [
        {"messages": [{"role": "user", "content": p.text}, {"role": "assistant", "content": ""}]}
        for p in pair.train_prompts
    ]
    args = GKDConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_step_"),
        per_device_train_batch_size=8,
        max_new_tokens=max_new_tokens,
        lmbda=1.0,
        beta=1.0,
        temperature=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        max_length=1024,
        # TRL's configs default bf16 to True when fp16 is unset; ours trains in fp32, so pin TRL to fp32 too
        # (like for like: the ratio must not depend on the CPU's bf16 support)
        bf16=False,
        fp16=False,
    )
    return GKDTrainer(
        model=copy.deepcopy(pair.student),
        teacher_model=pair.teacher,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=pair.tokenizer,
        callbacks=[callback],
    )


def gemm_flops_per_s(n: int = 2048) -> float:
    """The fp32 GEMM rate of this machine: one n×n by n×n matmul, median of 5 after a warm-up."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = side_by_side(lambda: a @ b, repeats=5)[0]
    return 2 * n**3 / t


def descendants(event):
    yield event
    for child in event.cpu_children:
        yield from descendants(child)


def phase_flops(events) -> dict:
    """{phase: matmul FLOPs} from one profiled step: the named ranges of loss.py, the autograd engine's
    backward functions and the optimizer's step (outermost events only, so nothing counts twice)."""

    def phase_of(e):
        if e.name in ("student forward", "teacher forward", "mismatch KL"):
            return e.name
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "student backward"
        return "optimizer (AdamW)" if e.name.startswith("Optimizer.step#") else None

    out = {}
    for e in events:
        name, parent = phase_of(e), e.cpu_parent
        while parent is not None and phase_of(parent) is None:
            parent = parent.cpu_parent
        if name is None or parent is not None:  # not a phase, or inside an outer one
            continue
        out[name] = out.get(name, 0) + sum(d.flops or 0 for d in descendants(e))
    return out


def floors(rollout, pair, flops: dict, rate: float, read_s: float) -> dict:
    """Each phase's floor in seconds (see the module docstring). bandwidth = student bytes / read_s."""
    B, P = rollout.tokens.shape[0], rollout.prompt_len
    decode_steps = rollout.tokens.shape[1] - P - 1
    n_tok, vocab = int(rollout.response_mask.sum()), pair.student.config.vocab_size
    student_bytes = 4 * sum(p.numel() for p in pair.student.parameters())
    bandwidth = student_bytes / read_s
    body = sum(p.numel() for n, p in pair.student.named_parameters() if "embed" not in n)
    floor = {name: n / rate for name, n in flops.items()}
    floor["sampling"] = 2 * body * B * P / rate + decode_steps * read_s
    floor["mismatch KL"] = 2 * 4 * n_tok * vocab / bandwidth  # two fp32 [N, V] logit blocks read
    floor["optimizer (AdamW)"] = 7 * student_bytes / bandwidth  # read p, g, m, v; write p, m, v
    return floor


def print_phases(rec: dict, rows: dict, floor: dict, rate: float) -> None:
    print(f"our step against its floor (GEMM rate {rate / 1e9:.0f} GFLOP/s fp32; one timed step):")
    print(f"  {'phase':<20}{'ours s':>8}{'floor s':>9}{'multiple':>10}")
    for name, seconds in rows.items():
        print(f"  {name:<20}{seconds:>8.2f}{floor[name]:>9.2f}{seconds / floor[name]:>9.1f}x")
    total, total_floor = rec["seconds"], sum(floor[k] for k in rows)
    print(f"  {'whole step':<20}{total:>8.2f}{total_floor:>9.2f}{total / total_floor:>9.1f}x")


@contextmanager
def timing(times: dict, name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def timed_step(pair, batches, cfg, optimizer, step: int) -> tuple[dict, dict, object]:
    """One step of ours with each phase's wall time (no profiler, whose per-operator cost would inflate the
    many small ops of sampling): loss.py's named ranges and the optimizer's step are timed, sampling is the
    step's own sample_seconds, and the student backward is the remainder (with zero_grad and clipping)."""
    times, seen = {}, []
    get, update = batches.get, optimizer.step
    batches.get = lambda *a: seen.append(get(*a)) or seen[-1]  # keep the rollout for the floors
    loss.record_function = lambda name: timing(times, name)  # loss.py's ranges, timed instead of profiled

    def step_timed(*args, **kwargs):
        with timing(times, "optimizer (AdamW)"):
            return update(*args, **kwargs)

    optimizer.step = step_timed
    try:
        rec = train_step(pair, batches, cfg, optimizer=optimizer, step=step, device="cpu")
    finally:
        loss.record_function, batches.get = record_function, get
        del optimizer.step
    times = {"sampling": rec["sample_seconds"], **times}
    times["student backward"] = rec["seconds"] - sum(times.values())
    return rec, times, seen[-1][0]


def phases_against_floors(pair, batches, cfg, optimizer, step: int) -> None:
    """Two more steps of ours: one profiled for the matmul FLOPs of each phase, one timed; each phase's time
    against its floor."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        train_step(pair, batches, cfg, optimizer=optimizer, step=step, device="cpu")
    flops = phase_flops(prof.events())
    rec, times, rollout = timed_step(pair, batches, cfg, optimizer=optimizer, step=step + 1)
    rate, read_s = gemm_flops_per_s(), weight_read_ms(pair.student) / 1000
    floor = floors(rollout, pair, flops, rate=rate, read_s=read_s)
    print_phases(rec, times, floor=floor, rate=rate)


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=positive_int, default=6, help="timed steps of each (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=1, help="first steps of each left out (default: 1)"
    )
    args = parser.parse_args(argv)
    require_trl()
    from transformers import TrainerCallback  # the callback base class TRL's trainer drives

    pair = load_pair("smollm2")
    cfg = pair_config("smollm2", steps=args.steps + args.warmup + 2)  # + the profiled and the timed step
    ours_pair = copy.copy(pair)
    ours_pair.student = copy.deepcopy(pair.student)
    optimizer = torch.optim.AdamW(ours_pair.student.parameters(), lr=cfg.lr)
    batches = Batches(ours_pair, make_engine(ours_pair, cfg), cfg, "cpu")
    times = {"trl": [], "ours": []}

    class Alternate(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):  # after TRL's step: time it, then run one of ours
            times["trl"].append(time.perf_counter() - self.t0)
            rec = train_step(
                ours_pair, batches, cfg, optimizer=optimizer, step=len(times["ours"]) + 1, device="cpu"
            )
            times["ours"].append(rec["seconds"])
            print(
                f"step {len(times['ours'])}: TRL {times['trl'][-1]:.1f} s, ours {rec['seconds']:.1f} s "
                f"(mismatch_kl {rec['mismatch_kl']:.2e})",
                flush=True,
            )

    trl_trainer(
        pair,
        args.steps + args.warmup,
        cfg.lr,
        max_new_tokens=cfg.rollout.max_new_tokens,
        callback=Alternate(),
    ).train()
    trl_s, ours_s = (statistics.median(times[k][args.warmup :]) for k in ("trl", "ours"))
    phases_against_floors(ours_pair, batches, cfg, optimizer=optimizer, step=len(times["ours"]) + 1)
    print(cpu_facts())
    print(
        f"both fp32; smollm2, 8 sequences × {cfg.rollout.max_new_tokens} new tokens, lr {cfg.lr:g}, "
        f"{torch.get_num_threads()} threads; median of steps {args.warmup + 1}–{args.warmup + args.steps}"
    )
    print(
        f"TRL GKDTrainer {trl_s:.2f} s/step, ours {ours_s:.2f} s/step: ours is {trl_s / ours_s:.2f}x faster"
    )


if __name__ == "__main__":
    main()
