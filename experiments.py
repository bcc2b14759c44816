"""Experiments that run real steps to measure: each mismatch source on the one scale (staleness included),
and per-block FP8 sensitivity with a greedy skip recipe.

sources      every source of a rollout configuration alone, then combined, each on held-out probes against
             the trainer's current policy (mismatch.measure_config). A stale engine serves the weights of k
             real OPD steps ago (train.trajectory: the pair's defaults, seed 0, from the untrained student).
sensitivity  one decoder block of the student in FP8 at a time, everything else in high precision, then a
             greedy recipe: quantize every block and keep the most sensitive ones in high precision, in
             ranking order, until the mismatch falls under a target (default: half of all-FP8).

    python experiments.py sources --pair smollm2 --weights fp8 --kv-cache fp8 --staleness 2 --noise 0.01
    python experiments.py sensitivity --pair smollm2 --probes 8 --max-new-tokens 24
"""

import json
import time

from matplotlib.figure import Figure
from tqdm import tqdm

from cli import (EXPECTED, Parser, atomic_write_text, check_output_dir, fail, positive_float, positive_int,
                 seed_int)
from mismatch import DEFAULT_PROBES, PROBES, measure_config, measure_sources, print_results
from models import DEVICES, PAIRS, device_label, format_prompt, load_pair, resolve_device
from quant import FP8_WEIGHTS, kv_bytes_per_token
from rollout import RolloutConfig, add_rollout_args, rollout_config_from_args
from runfiles import atomic_savefig
from train import trajectory


def block_skip(n_layers: int, quantized: set[int]) -> tuple:
    """fp8_skip patterns that leave exactly the decoder blocks in `quantized` to FP8 (lm_head always kept)."""
    return ("lm_head", *(f"model.layers.{i}.*" for i in range(n_layers) if i not in quantized))


def block_params(model, i: int) -> int:
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith(f"model.layers.{i}.") and p.dim() == 2
    )


def sensitivity(
    pair,
    mode: str,
    n_probes: int,
    target: float | None = None,
    max_new_tokens: int = 48,
    progress: bool = True,
) -> dict:
    """Mismatch with one decoder block in FP8 at a time, and a greedy recipe meeting `target`."""
    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:n_probes]]
    n = pair.student.config.num_hidden_layers

    def mismatch(quantized: set[int]) -> float:
        cfg = RolloutConfig(weights=mode, fp8_skip=block_skip(n, quantized), max_new_tokens=max_new_tokens)
        return measure_config(pair, cfg, probes)["mismatch_kl"]

    per_block = [
        mismatch({i}) for i in tqdm(range(n), desc=f"{mode} one block at a time", disable=not progress)
    ]
    ranking = sorted(range(n), key=lambda i: -per_block[i])
    all_fp8 = mismatch(set(range(n)))
    target = all_fp8 / 2 if target is None else target
    kept, current, path = [], all_fp8, [(0, all_fp8)]
    for i in ranking:
        if current <= target:
            break
        kept.append(i)
        current = mismatch(set(range(n)) - set(kept))
        path.append((len(kept), current))
    linear = sum(block_params(pair.student, i) for i in range(n))
    return {
        "mode": mode,
        "per_block": per_block,
        "ranking": ranking,
        "all_fp8": all_fp8,
        "target": target,
        "kept_high_precision": kept,
        "recipe_mismatch": current,
        "greedy_path": path,
        "kept_fraction_of_block_weights": sum(block_params(pair.student, i) for i in kept) / linear,
    }


def plot_sensitivity(result: dict, path, title: str) -> None:
    per_block = result["per_block"]
    fig = Figure(figsize=(max(5, 0.3 * len(per_block)), 3.5))  # no pyplot: no global backend change
    ax = fig.subplots()
    colors = ["C3" if i in result["kept_high_precision"] else "C0" for i in range(len(per_block))]
    ax.bar(range(len(per_block)), per_block, color=colors)
    ax.set_xticks(range(len(per_block)))
    ax.set(
        xlabel="decoder block quantized alone\n(red: kept in high precision by the recipe)",
        ylabel="KL(engine ‖ train), nats/token",
        title=title,
    )
    fig.tight_layout()
    atomic_savefig(fig, path)


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    src = sub.add_parser("sources", help="each mismatch source alone and combined, staleness included")
    src.add_argument(
        "--probes",
        type=positive_int,
        help=f"held-out probes (default: {PROBES['tiny']} tiny, {DEFAULT_PROBES} others)",
    )
    src.add_argument("--json", action="store_true", help="print JSON rows")
    src.add_argument(
        "--seed", type=seed_int, default=RolloutConfig.seed, help="sampling and noise seed (default: 0)"
    )
    add_rollout_args(src.add_argument_group("rollout engine"), sampling=False)
    sens = sub.add_parser(
        "sensitivity", help="FP8 one decoder block at a time; ranking, bar plot, greedy recipe"
    )
    sens.add_argument("--weights", default="fp8", choices=FP8_WEIGHTS, help="(default: %(default)s)")
    sens.add_argument(
        "--probes", type=positive_int, default=16, help="held-out probes (default: %(default)s)"
    )
    sens.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="probe response length (default: %(default)s)"
    )
    sens.add_argument(
        "--target", type=positive_float, help="recipe target mismatch (default: half the all-FP8 one)"
    )
    sens.add_argument("--out", default="results", help="folder for the plot and JSON (default: %(default)s)")
    for sp in (src, sens):
        sp.add_argument("--pair", default="tiny", choices=PAIRS, help="the pair (default: %(default)s)")
        sp.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def run_sensitivity(args, device: str) -> None:
    out = check_output_dir(args.out, "--out")
    t0 = time.time()
    pair = load_pair(args.pair, device=device)
    result = sensitivity(
        pair, args.weights, args.probes, target=args.target, max_new_tokens=args.max_new_tokens
    )
    result.update(  # provenance: what was measured, how, where and how long it took (loading included)
        pair=args.pair,
        probes=args.probes,
        max_new_tokens=args.max_new_tokens,
        device=device_label(device),
        seconds=time.time() - t0,
        kv_bytes_per_token=kv_bytes_per_token(pair.student.config, "model", dtype_bytes=2),
        kv_bytes_per_token_fp8=kv_bytes_per_token(pair.student.config, "fp8", dtype_bytes=2),
    )
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sensitivity_{args.pair}_{args.weights}"
    plot_sensitivity(
        result, stem.with_suffix(".png"), f"{args.pair}: FP8 ({args.weights}) one block at a time, {device}"
    )
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    print(f"{args.pair} {args.weights}: all blocks FP8 -> {result['all_fp8']:.3e} nats/token")
    print(
        "ranking (block: mismatch alone): "
        + ", ".join(f"{i}: {result['per_block'][i]:.2e}" for i in result["ranking"])
    )
    print(
        f"greedy recipe: keep blocks {result['kept_high_precision']} in high precision -> "
        f"{result['recipe_mismatch']:.3e} (target {result['target']:.3e}); "
        f"{result['kept_fraction_of_block_weights']:.0%} of block weights kept"
    )


def run_sources(args, device: str) -> None:
    cfg = rollout_config_from_args(args, pair=args.pair)
    pair = load_pair(args.pair, device=device)
    probes = [
        format_prompt(pair.tokenizer, p.text)
        for p in pair.eval_prompts[: args.probes or PROBES.get(args.pair, DEFAULT_PROBES)]
    ]
    versions = trajectory(pair, cfg.staleness, device) if cfg.staleness else None
    results = measure_sources(pair, cfg, probes, versions=versions, progress=not args.json)
    print_results(results, args.pair, device, as_json=args.json)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        (run_sources if args.cmd == "sources" else run_sensitivity)(args, device)
    except EXPECTED as e:
        fail(e)


if __name__ == "__main__":
    main()
