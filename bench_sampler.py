"""Benchmark: our rollout sampler vs Hugging Face `generate`, side by side in one run.

Same model (the smollm2 student), same prompts, batch, length (EOS ignored, so every row makes exactly
`--new-tokens` tokens) and sampling settings (temperature, top-p, no top-k). Warm-up runs are excluded;
the two samplers alternate, and each reports the median over `--repeats` runs. This is a benchmark, not
a test: the ratio depends on the machine and on what else runs on it.

    python bench_sampler.py                       # CPU, batch 4, 64 new tokens
    python bench_sampler.py --batch 8 --new-tokens 128
"""

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig

from models import format_prompt, load_pair
from rollout import RolloutConfig, encode_prompts, generate


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per sampler (after one warm-up each)")
    ap.add_argument("--student-layers", type=int, default=24, help="smollm2 student depth")
    args = ap.parse_args()

    torch.manual_seed(0)
    pair = load_pair("smollm2", student_layers=args.student_layers)
    model, tok = pair.student.eval(), pair.tokenizer
    prompts = [format_prompt(tok, p.text) for p in pair.eval_prompts[: args.batch]]
    cfg = RolloutConfig(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.new_tokens, ignore_eos=True
    )
    ids, attn = encode_prompts(tok, prompts, "cpu")
    hf_cfg = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )

    def ours():
        out = generate(model, tok, prompts, cfg, generator=torch.Generator().manual_seed(0))
        assert int(out.response_mask.sum()) == args.batch * args.new_tokens

    def hf():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=hf_cfg)
        assert out.shape[1] - ids.shape[1] == args.new_tokens

    ours(), hf()  # warm-up
    times = {"ours": [], "hf": []}
    for _ in range(args.repeats):
        times["ours"].append(timed(ours))
        times["hf"].append(timed(hf))
    tokens = args.batch * args.new_tokens
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(
        f"device cpu ({torch.get_num_threads()} threads), smollm2 student ({args.student_layers} layers), "
        f"batch {args.batch}, "
        f"{args.new_tokens} new tokens, temperature {args.temperature}, top-p {args.top_p}"
    )
    print(f"{'sampler':<14}{'median s':>10}{'tokens/s':>10}")
    print(f"{'ours':<14}{statistics.median(times['ours']):>10.2f}{rate['ours']:>10.1f}")
    print(f"{'HF generate':<14}{statistics.median(times['hf']):>10.2f}{rate['hf']:>10.1f}")
    print(f"ratio ours / HF generate: {rate['ours'] / rate['hf']:.2f}x")


if __name__ == "__main__":
    main()
