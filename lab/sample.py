"""Sample a few held-out prompts with the rollout engine and print the responses with their log-probs.

The student samples through rollout.generate at the pair's response length, as a demo of the sampler:

    python -m lab.sample --pair tiny --n 4    # sample a few responses and print them with their log-probs
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import time
from dataclasses import asdict

from cli import EXPECTED, Parser, batch_int, fail, fraction, length_int, seed_int
from cli import temperature as temperature_value
from config import DEFAULT_PAIR, DEFAULT_PAIR_HELP, MAX_NEW_TOKENS, PAIRS
from models import check_prompts, format_prompt, held_out, load_pair
from rollout import RolloutConfig, generate


def main(argv=None) -> None:
    d = RolloutConfig()
    parser = Parser(description="Sample responses with the rollout engine and print them.")
    parser.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    parser.add_argument(
        "--n", type=batch_int, default=4, help="number of held-out prompts (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature", type=temperature_value, default=d.temperature, help="0 = greedy (default: 1.0)"
    )
    parser.add_argument(
        "--top-p", type=fraction, default=d.top_p, help="1 = no truncation (default: %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=length_int,
        help="length limit (default: the pair's, "
        + ", ".join(f"{MAX_NEW_TOKENS[p]} {p}" for p in PAIRS)
        + ")",
    )
    parser.add_argument("--seed", type=seed_int, default=d.seed, help="sampling seed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        cfg = RolloutConfig.for_pair(
            args.pair,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        pair = load_pair(args.pair)
        check_prompts(pair, cfg.max_new_tokens)
        prompts = [format_prompt(pair.tokenizer, p.text) for p in held_out(pair, args.n, "--n")]
        t0 = time.time()
        rollout = generate(pair.student, pair.tokenizer, prompts, cfg=cfg)
    except EXPECTED as e:
        fail(e)
    print(f"config: {asdict(cfg)}  ({time.time() - t0:.2f}s)")
    for p, r, lp, m in zip(
        pair.eval_prompts, rollout.responses(pair.tokenizer), rollout.logprobs, rollout.response_mask
    ):
        print(f"{p.text!r} -> {r!r}   sum log q = {lp[m.bool()].sum():.2f} over {int(m.sum())} tokens")


if __name__ == "__main__":
    main()
