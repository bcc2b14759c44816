"""Benchmark: our rollout sampler against its peer, side by side in one run (interleaved, warm-up excluded,
medians, and the ratio).

default         ours vs Hugging Face `generate`: same model (a pair's student, fp32), prompts, batch, length
                (EOS ignored, so every row makes exactly --new-tokens tokens) and sampling (temperature,
                top-p, no top-k). Also one decode step (prefill excluded: the time of N tokens minus that
                of 1, over N − 1) against two floors of this machine: reading every weight once (a sum over
                each parameter; batch-4 decode is bound by memory) and the projections alone (every weight
                matrix times the batch, as the sampler multiplies it: what torch's fp32 GEMM reaches).
--profile       also the top operators of our sampler's decode steps (torch.profiler, self CPU time).
--kv-cache fp8  ours with the FP8 KV cache (unit scales) vs ours with the model's default cache: what FP8 KV
                costs in decode time on this machine (a GPU would gain: half the bytes to read).

This is a benchmark, not a test: the ratio depends on the machine and on what else runs on it.

    python -m tools.bench_sampler                                  # smollm2 student, batch 4, 64 new tokens
    python -m tools.bench_sampler --pair tiny --batch 64 --new-tokens 6
    python -m tools.bench_sampler --kv-cache fp8 --new-tokens 256
    python -m tools.bench_sampler --batch 16 --profile
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import statistics
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from cli import EXPECTED, BadInput, Parser, batch_int, fail, fraction, positive_int, temperature
from config import CHAT_PAIR, CHAT_PAIR_HELP, PAIRS
from cpu_decode import _small_batch_linear
from models import format_prompt, load_pair
from quant import KVScales, fp8_kv_cache
from rollout import RolloutConfig, encode_prompts, generate
from tools.machine import cpu_facts

from transformers import GenerationConfig  # isort: skip


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(*fns, repeats: int) -> list[float]:
    """Median seconds of each function over `repeats` interleaved rounds, after one warm-up run of each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t.append(timed(fn))
    return [statistics.median(t) for t in times]


@torch.no_grad()
def weight_read_ms(model) -> float:
    """Milliseconds to read every weight once (a sum over each parameter): the decode step's memory floor."""
    params = list(model.parameters())
    return 1000 * side_by_side(lambda: [p.sum() for p in params], repeats=5)[0]


@torch.no_grad()
def projection_ms(model, batch: int) -> float:
    """Milliseconds for every weight matrix of the model (each nn.Linear, the output head included) times
    `batch` rows, as the sampler multiplies them (rollout._small_batch_linear): the decode step's GEMM floor
    on this machine, everything but the matrix products left out."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = [torch.randn(batch, m.in_features) for m in linears]

    def products():
        return [_small_batch_linear(m, x) for m, x in zip(linears, rows)]

    return 1000 * side_by_side(products, repeats=5)[0]


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=CHAT_PAIR, choices=PAIRS, help=CHAT_PAIR_HELP)
    p.add_argument("--batch", type=batch_int, default=4, help="prompts per batch (default: %(default)s)")
    p.add_argument(
        "--new-tokens", type=positive_int, default=64, help="tokens per row (default: %(default)s)"
    )
    p.add_argument("--temperature", type=temperature, default=1.0, help="(default: %(default)s)")
    p.add_argument("--top-p", type=fraction, default=0.95, help="nucleus mass (default: %(default)s)")
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs of each (default: %(default)s)"
    )
    p.add_argument("--profile", action="store_true", help="also print our decode step's top operators")
    p.add_argument(
        "--kv-cache",
        default="model",
        choices=("model", "fp8"),
        help="model: ours vs HF generate; fp8: our FP8 KV cache vs the default cache",
    )
    return p


def hf_generate(model, tok, prompts: list[str], args):
    """HF generate with our sampler's settings: the same rows, length and sampling."""
    ids, attn = encode_prompts(tok, prompts, "cpu")
    hf_cfg = GenerationConfig(
        do_sample=args.temperature > 0,
        temperature=args.temperature or None,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )

    def hf():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=hf_cfg)
        assert out.shape[1] - ids.shape[1] == args.new_tokens

    return hf


def report(args, model, t_ours: float, t_hf: float, t_one: float) -> None:
    tokens = args.batch * args.new_tokens
    print(
        f"{args.pair} student, batch {args.batch}, {args.new_tokens} new tokens, temperature "
        f"{args.temperature}, top-p {args.top_p}, {torch.get_num_threads()} threads; {cpu_facts()}"
    )
    print(f"{'sampler':<14}{'median s':>10}{'tokens/s':>10}{'ms/step':>10}")
    for name, t in (("ours", t_ours), ("HF generate", t_hf)):
        print(f"{name:<14}{t:>10.2f}{tokens / t:>10.1f}{1000 * t / args.new_tokens:>10.1f}")
    step = 1000 * (t_ours - t_one) / max(args.new_tokens - 1, 1)
    read, gemm = weight_read_ms(model), projection_ms(model, args.batch)
    print(f"ours, one decode step (prefill excluded): {step:.1f} ms")
    print(
        f"floors: weight read {read:.1f} ms (every weight once); projections {gemm:.1f} ms (every weight "
        f"matrix times {args.batch} rows)"
    )
    print(f"ours / weight-read floor: {step / read:.2f}x; ours / projection floor: {step / gemm:.2f}x")
    print(f"ratio ours / HF generate: {t_hf / t_ours:.2f}x")


def profile(run, steps: int) -> None:
    """Our sampler's top operators by self CPU time, per decode step (prefill included in the totals)."""
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    print(f"profile of ours, per step ({steps} steps): operator, ms, calls, share of self CPU time")
    for e in ops[:12]:
        print(
            f"  {e.key:<28}{e.self_cpu_time_total / 1000 / steps:>8.2f}{e.count / steps:>8.0f}"
            f"{e.self_cpu_time_total / total:>8.1%}"
        )


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    try:
        pair = load_pair(args.pair)
        if len(pair.eval_prompts) < args.batch:
            n = len(pair.eval_prompts)
            raise BadInput(f"--batch {args.batch}: the {args.pair} pair has {n} held-out prompts")
    except EXPECTED as e:
        fail(e)
    model, tok = pair.student.eval(), pair.tokenizer
    prompts = [format_prompt(tok, p.text) for p in pair.eval_prompts[: args.batch]]
    cfg = RolloutConfig(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.new_tokens, ignore_eos=True
    )

    def ours(cache_factory=lambda: None, cfg=cfg):
        gen = torch.Generator().manual_seed(0)
        out = generate(model, tok, prompts, cfg=cfg, generator=gen, cache=cache_factory())
        assert int(out.response_mask.sum()) == args.batch * cfg.max_new_tokens

    if args.kv_cache == "fp8":
        fp8, default = side_by_side(
            lambda: ours(lambda: fp8_kv_cache(KVScales.unit(model.config))), ours, repeats=args.repeats
        )
        print(
            f"{args.pair} student, batch {args.batch}, {args.new_tokens} new tokens, "
            f"{torch.get_num_threads()} threads"
        )
        print(
            f"FP8 KV {fp8:.2f} s, default cache {default:.2f} s: FP8-KV decode time {fp8 / default:.2f}x "
            "the default's"
        )
        return
    one = replace(cfg, max_new_tokens=1)  # prefill and one sample: what a decode step adds is the rest
    hf = hf_generate(model, tok, prompts, args=args)
    report(args, model, *side_by_side(ours, hf, lambda: ours(cfg=one), repeats=args.repeats))
    if args.profile:
        profile(ours, args.new_tokens)


if __name__ == "__main__":
    main()
