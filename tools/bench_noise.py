"""Benchmark: one weight-noise draw (engine.add_weight_noise) against its peer and its floor.

A noisy engine pays one draw at every new version, and check pays one per probe batch. The peer is the same
formula written with fresh temporaries, W + σ·rms(W)·ε; the floor is drawing the model's normal numbers alone
into a buffer that already exists. Side by side in one run: interleaved, warm-up excluded, medians, ratios.

This is a benchmark, not a test: the times depend on the machine and on what else runs on it.

    python -m tools.bench_noise                    # smollm2 student, 7 rounds
    python -m tools.bench_noise --pair tiny --rounds 21
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import copy
import statistics
import time

import torch

from cli import EXPECTED, Parser, fail, positive_int
from config import CHAT_PAIR, CHAT_PAIR_HELP
from engine import add_weight_noise
from models import load_pair
from tools.machine import cpu_facts


def fresh_temporaries(model, sigma: float, generator: torch.Generator) -> None:
    """The peer: the formula as written, one fresh tensor per intermediate."""
    with torch.no_grad():
        for p in model.parameters():
            rms = p.float().pow(2).mean().sqrt()
            p.add_((torch.randn(p.shape, generator=generator, device=p.device) * sigma * rms).to(p.dtype))


def draw_only(model, sigma: float, generator: torch.Generator, buf: torch.Tensor) -> None:
    """The floor: the same normal numbers drawn into an existing buffer, nothing added."""
    for p in model.parameters():
        torch.randn(p.shape, generator=generator, out=buf[: p.numel()].view(p.shape))


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=CHAT_PAIR, choices=("tiny", "smollm2"), help=CHAT_PAIR_HELP)
    p.add_argument("--rounds", type=positive_int, default=7, help="rounds, the first not timed (default: 7)")
    args = p.parse_args(argv)
    try:
        student = load_pair(args.pair, device="cpu").student
    except EXPECTED as e:
        fail(e)
    buf = torch.empty(max(q.numel() for q in student.parameters()))
    sides = {
        "add_weight_noise": add_weight_noise,
        "fresh temporaries": fresh_temporaries,
        "floor (draw only)": lambda m, s, g: draw_only(m, s, g, buf=buf),
    }
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, fn in sides.items():
            model = copy.deepcopy(student)
            t0 = time.perf_counter()
            fn(model, 1.0, torch.Generator().manual_seed(r))
            if r:  # round 0 warms the allocator and the generator up
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    n = sum(q.numel() for q in student.parameters())
    print(f"{args.pair} student, {n:,} parameters; {cpu_facts()}; medians of {args.rounds - 1} rounds")
    for name, t in med.items():
        print(f"  {name:<18} {t:.3f} s")
    ours, peer, floor = med["add_weight_noise"], med["fresh temporaries"], med["floor (draw only)"]
    print(
        f"add_weight_noise is {peer / ours:.2f}x faster than fresh temporaries; {ours / floor:.2f}x its floor"
    )


if __name__ == "__main__":
    main()
