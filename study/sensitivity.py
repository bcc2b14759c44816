"""sensitivity: one decoder block of the student in FP8 at a time, everything else in high precision, then a
greedy recipe: quantize every block and keep the most sensitive ones in high precision, in ranking order,
until the mismatch falls under a target (default: half of all-FP8).

    python -m study sensitivity --pair smollm2 --probes 8 --max-new-tokens 24
"""

import json
import time

from matplotlib.figure import Figure
from tqdm import tqdm

from cli import check_output_dir
from lab.atomic import atomic_write_text
from lab.runfiles import atomic_savefig
from mismatch import measure_config
from models import device_label, format_prompt, held_out, load_pair
from quant import kv_bytes_per_token
from rollout import RolloutConfig


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
    max_new_tokens: int = RolloutConfig.max_new_tokens,
    progress: bool = True,
) -> dict:
    """Mismatch with one decoder block in FP8 at a time, and a greedy recipe meeting `target`."""
    probes = [format_prompt(pair.tokenizer, p.text) for p in held_out(pair, n_probes, "--probes")]
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
