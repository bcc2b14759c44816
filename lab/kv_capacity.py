"""KV tokens that fit in a memory budget: bf16 vs fp8 weights and KV cache, as a table (the command).

The arithmetic is quant.py's (`kv_bytes_per_token`, `kv_capacity`, `KNOWN_SHAPES`); this module prints it for
well-known models and the embedded pairs, beside the bytes per token measured on a filled cache.

    python -m lab.kv_capacity --memory-gb 80    # KV tokens that fit: bf16 vs fp8 weights and KV cache
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import torch

from cli import EXPECTED, BadInput, Parser, fail, positive_float
from config import PAIRS
from models import cache_arg, format_prompt, load_pair
from quant import KNOWN_SHAPES, KVScales, cache_bytes, fp8_kv_cache, kv_bytes_per_token, kv_capacity, shape_of

from transformers import DynamicCache  # isort: skip


@torch.no_grad()
def measured_kv_bytes(model, tokenizer, prompts: list[str]) -> dict:
    """Bytes per cached token after one forward pass over the prompts: bf16 cache vs our fp8 cache."""
    enc = tokenizer(prompts, padding=True, add_special_tokens=False, return_tensors="pt")
    caches = {"bf16": DynamicCache(config=model.config), "fp8": fp8_kv_cache(KVScales.unit(model.config))}
    out = {}
    for kind, cache in caches.items():
        runner = model.to(torch.bfloat16) if kind == "bf16" else model.float()
        runner(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            **cache_arg(runner, cache),
            use_cache=True,
        )
        tokens = cache.layers[0].keys.shape[0] * cache.layers[0].keys.shape[2]  # batch × cached positions
        out[kind] = cache_bytes(cache) / tokens
    model.float()
    return out


def print_kv_capacity(memory_gb: float, shapes) -> None:
    memory = memory_gb * 2**30
    print(f"KV tokens that fit in {memory_gb:g} GiB after the weights (weights / KV cache):")
    header = ["KV B/token bf16", "bf16/bf16", "bf16/fp8", "fp8/bf16", "fp8/fp8", "fp8 KV ÷ bf16 KV"]
    print(
        f"{'model':<26}"
        + "".join(f"{h:>{18 if h.startswith('fp8 KV') else 16 if 'B/' in h else 12}}" for h in header)
    )
    for s in shapes:
        c = kv_capacity(s, memory)
        bf16_kv = c[("bf16", "bf16")] or c[("fp8", "bf16")]  # compare at bf16 weights when they fit, else fp8
        fp8_kv = c[("bf16", "fp8")] or c[("fp8", "fp8")]
        ratio = f"{fp8_kv / bf16_kv:.3f}x" if bf16_kv else "does not fit"
        cells = [c[("bf16", "bf16")], c[("bf16", "fp8")], c[("fp8", "bf16")], c[("fp8", "fp8")]]
        print(
            f"{s.name:<26}{kv_bytes_per_token(s, 'bf16'):>16,.0f}"
            + "".join(f"{x:>12,}" for x in cells)
            + f"{ratio:>18}"
        )


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--memory-gb",
        type=positive_float,
        default=80.0,
        help="memory budget in GiB (default: %(default)s, one H100)",
    )
    parser.add_argument(
        "--pairs",
        default="tiny,smollm2",
        help="embedded pairs to include, comma-separated ('' = none; default: %(default)s)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.pairs.split(",") if n]
    shapes, measured = [], []
    try:
        for name in names:
            if name not in PAIRS:
                raise BadInput(
                    f"--pairs {args.pairs!r}: {name!r} is not a pair; choose from {', '.join(PAIRS)}"
                )
        for name in names:
            pair = load_pair(name)
            shapes += [shape_of(f"{name} teacher", pair.teacher), shape_of(f"{name} student", pair.student)]
            prompts = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:4]]
            measured.append((f"{name} student", measured_kv_bytes(pair.student, pair.tokenizer, prompts)))
    except EXPECTED as e:
        fail(e)
    for name, m in measured:
        print(
            f"measured KV memory, {name}: bf16 {m['bf16']:,.1f} B/token, fp8 {m['fp8']:,.1f} B/token with "
            f"scales ({m['fp8'] / m['bf16']:.3f}x)"
        )
    print_kv_capacity(args.memory_gb, shapes + KNOWN_SHAPES)


if __name__ == "__main__":
    main()
