"""Benchmark: one OPD step of this project against TRL's GKDTrainer, side by side in one run.

Both train their own copy of the smollm2 student against the same teacher, fully on-policy, with the reverse
KL (TRL: GKDTrainer with lmbda=1, beta=1, temperature 1, i.e. generalized_jsd_loss(beta=1), which equals our
analytic loss), the same sequences per step (8: our 4 prompts × 2 samples; TRL's batch of 8 prompts), the
same response limit (48 new tokens), learning rate (5e-5) and AdamW. Our step also computes the exact mismatch
KL(engine ‖ train) and logs it, as every training step does. The steps alternate (TRL step, our step, ...,
driven by a TrainerCallback), the first `--warmup` of each are excluded, and the medians give the ratio.

TRL is a benchmark-only dependency (requirements-bench.txt; it leaves torch and transformers as pinned):

    pip install -r requirements-bench.txt
    python -m tools.bench_step                 # 6 steps each, about 4 minutes on a 2-core CPU
"""

import copy
import importlib.util
import statistics
import sys
import tempfile
import time

import torch

from batches import Batches, make_engine
from cli import Parser, positive_int
from models import load_pair
from tools.machine import cpu_facts
from train import pair_config, train_step


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
    cfg = pair_config("smollm2", steps=args.steps + args.warmup)
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
