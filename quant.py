"""Precision: FP8 weights through torchao, a hand-written FP8 KV cache, and KV capacity arithmetic.

FP8 e4m3 (torch.float8_e4m3fn) has 4 exponent and 3 mantissa bits: finite values up to ±448, and a
relative rounding error of at most 2^-4 = 6.25% (half a unit in the last place of a 3-bit mantissa) for
normal numbers. To use that range, a tensor x is stored as q = cast(clamp(x / s, −448, 448)) with a scale
    s = amax(|x|) / 448      (per group: here per layer and per KV head),
and read back as x̂ = q · s. Clamping before the cast matters: values beyond ±448 would otherwise become
NaN in float8_e4m3fn (it has no infinity). Scales are stored beside the data, in fp32.

KV scales come from one of two places (`kv_scales`):
    calibrated  amax/448 per layer and head, from one forward pass over probe prompts (`calibrate_kv_scales`)
    unit        s = 1, what inference engines default to when a checkpoint ships no scales; keys and values
                beyond ±448 saturate, and small ones lose precision in e4m3's subnormal range.

Our cache attends to the *quantized* keys and values in prefill as well as in decode: every read goes
through FP8, so the prompt and the response see the same precision. (Engines differ here; transformers'
Fp8QuantizedLayer attends to the unquantized states in prefill.)

FP8 weights go through torchao (`quantize_weights`: fp8 weight-only, fp8-dyn W8A8 on CUDA sm >= 8.9, and
fp8-emu, a fake-quantized emulation of W8A8 that runs anywhere). `sensitivity` quantizes one decoder block
at a time and builds a greedy skip recipe.

    python quant.py kv-capacity --memory-gb 80    # KV tokens that fit: bf16 vs fp8 weights and KV cache
    python quant.py sensitivity --pair smollm2    # FP8 one block at a time: ranking, bar plot, recipe
"""

import argparse
import fnmatch
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from models import BadInput

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
EPS = 1e-12


# ---------------------------------------------------------------------------------------------------
# Pure primitives


def fp8_scale(x: torch.Tensor, dims) -> torch.Tensor:
    """s = amax(|x|) / 448 over `dims` (kept as size-1 dims), eps-clamped so an all-zero group stays finite."""
    return (x.detach().abs().float().amax(dim=dims, keepdim=True) / FP8_MAX).clamp(min=EPS)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q = cast_e4m3(clamp(x / s, −448, 448)). Out-of-range values saturate instead of becoming NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """x̂ = q · s."""
    return (q.float() * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------
# The FP8 KV cache


class Fp8KVLayer(DynamicLayer):
    """One attention layer's cache: keys and values stored as e4m3 with fixed per-head scales [1, H, 1, 1].

    update() quantizes the new states, appends them, and returns the dequantized keys and values of the
    whole sequence (prefill included), in the dtype the model computes in.
    """

    def __init__(self, key_scale: torch.Tensor, value_scale: torch.Tensor):
        super().__init__()
        self.key_scale, self.value_scale = key_scale, value_scale

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = torch.empty(B, H, 0, D, dtype=FP8, device=self.device)
        self.values = torch.empty(B, H, 0, D, dtype=FP8, device=self.device)
        self.key_scale = self.key_scale.to(self.device)
        self.value_scale = self.value_scale.to(self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, quantize_fp8(key_states, self.key_scale)], dim=-2)
        self.values = torch.cat([self.values, quantize_fp8(value_states, self.value_scale)], dim=-2)
        return dequantize_fp8(self.keys, self.key_scale, self.dtype), dequantize_fp8(self.values, self.value_scale, self.dtype)


@dataclass
class KVScales:
    """Per-layer, per-head scales: keys[L] and values[L], each [1, H_kv, 1, 1] fp32."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def unit(config) -> "KVScales":
        one = torch.ones(1, config.num_key_value_heads, 1, 1)
        return KVScales([one] * config.num_hidden_layers, [one] * config.num_hidden_layers)


def fp8_kv_cache(scales: KVScales) -> Cache:
    return Cache(layers=[Fp8KVLayer(k, v) for k, v in zip(scales.keys, scales.values)])


class _AmaxRecorder(DynamicLayer):
    """A bf16/fp32 cache layer that also records amax(|k|), amax(|v|) per head over everything it sees."""

    def update(self, key_states, value_states, *args, **kwargs):
        k_amax, v_amax = fp8_scale(key_states, (0, 2, 3)) * FP8_MAX, fp8_scale(value_states, (0, 2, 3)) * FP8_MAX
        self.k_amax = torch.maximum(getattr(self, "k_amax", k_amax), k_amax)
        self.v_amax = torch.maximum(getattr(self, "v_amax", v_amax), v_amax)
        return super().update(key_states, value_states, *args, **kwargs)


@torch.no_grad()
def calibrate_kv_scales(model, tokenizer, prompts: list[str], cfg) -> KVScales:
    """amax/448 per layer and head over a short sampled rollout of the probe prompts (prompt and response)."""
    from rollout import generate

    layers = [_AmaxRecorder() for _ in range(model.config.num_hidden_layers)]
    generate(model, tokenizer, prompts, cfg, generator=torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed), cache=Cache(layers=layers))
    return KVScales([(l.k_amax / FP8_MAX).clamp(min=EPS).cpu() for l in layers], [(l.v_amax / FP8_MAX).clamp(min=EPS).cpu() for l in layers])


def kv_bytes_per_token(config, kv_cache: str, dtype_bytes: int = 2) -> float:
    """Bytes one token occupies in the KV cache, all layers: 2 (K and V) × L × H_kv × D × element size.

    The fp8 cache's per-head scales (2 × L × H_kv fp32 numbers) are stored once, not per token.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elems = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return elems * (1 if kv_cache == "fp8" else dtype_bytes)


@dataclass
class ModelShape:
    """Just the numbers KV arithmetic needs (written in, so larger models need no download)."""

    name: str
    params: float  # total parameters
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    head_dim: int


# Published configs of well-known models.
KNOWN_SHAPES = [
    ModelShape("Llama-3.1-8B", 8.03e9, 32, 32, 8, 4096, 128),
    ModelShape("Qwen2.5-32B", 32.8e9, 64, 40, 8, 5120, 128),
    ModelShape("Llama-3.1-70B", 70.6e9, 80, 64, 8, 8192, 128),
]


def kv_capacity(shape, memory_bytes: float) -> dict:
    """KV tokens that fit in `memory_bytes` after the weights, for bf16/fp8 weights × bf16/fp8 KV.

    tokens = (memory − params × weight bytes − scale bytes) / (KV bytes per token); fp8 KV stores
    2 × L × H_kv fp32 scales once. Weight-side FP8 scales (one per output row) are ignored: < 0.1%.
    """
    scale_bytes = 2 * shape.num_hidden_layers * shape.num_key_value_heads * 4
    out = {}
    for weights, w_bytes in (("bf16", 2), ("fp8", 1)):
        for kv in ("bf16", "fp8"):
            free = memory_bytes - shape.params * w_bytes - (scale_bytes if kv == "fp8" else 0)
            out[(weights, kv)] = max(0, int(free // kv_bytes_per_token(shape, kv)))
    return out


def cache_bytes(cache) -> int:
    """Real bytes held by a filled cache: stored keys and values, plus the fp8 layers' scales."""
    total = 0
    for layer in cache.layers:
        total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        if isinstance(layer, Fp8KVLayer):
            total += (layer.key_scale.numel() + layer.value_scale.numel()) * layer.key_scale.element_size()
    return total


@torch.no_grad()
def measured_kv_bytes(model, tokenizer, prompts: list[str], new_tokens: int = 32) -> dict:
    """Bytes per cached token of a real rollout, bf16 cache vs our fp8 cache (scales included)."""
    import copy

    from transformers import DynamicCache

    from rollout import RolloutConfig, generate

    cfg = RolloutConfig(max_new_tokens=new_tokens, ignore_eos=True)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    caches = {"bf16": DynamicCache(config=model.config), "fp8": fp8_kv_cache(KVScales.unit(model.config))}
    out = {}
    for kind, cache in caches.items():
        generate(bf16_model if kind == "bf16" else model, tokenizer, prompts, cfg, cache=cache)
        tokens = cache.layers[0].keys.shape[0] * cache.layers[0].keys.shape[2]  # batch × cached positions
        out[kind] = cache_bytes(cache) / tokens
    return out


def print_kv_capacity(memory_gb: float, shapes) -> None:
    memory = memory_gb * 2**30
    print(f"KV tokens that fit in {memory_gb:g} GiB after the weights (weights / KV cache):")
    print(f"{'model':<26}{'KV B/token bf16':>16}{'bf16/bf16':>12}{'bf16/fp8':>12}{'fp8/bf16':>12}{'fp8/fp8':>12}{'fp8 KV ÷ bf16 KV':>18}")
    for s in shapes:
        c = kv_capacity(s, memory)
        bf16_bf16 = c[("bf16", "bf16")] or c[("fp8", "bf16")]  # compare at bf16 weights when they fit, else at fp8
        ratio = f"{(c[('bf16', 'fp8')] or c[('fp8', 'fp8')]) / bf16_bf16:.3f}x" if bf16_bf16 else "does not fit"
        print(f"{s.name:<26}{kv_bytes_per_token(s, 'bf16'):>16,.0f}{c[('bf16', 'bf16')]:>12,}{c[('bf16', 'fp8')]:>12,}"
              f"{c[('fp8', 'bf16')]:>12,}{c[('fp8', 'fp8')]:>12,}{ratio:>18}")  # fmt: skip


def shape_of(name: str, model) -> ModelShape:
    c = model.config
    return ModelShape(name, sum(p.numel() for p in model.parameters()), c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                      c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# FP8 weights (torchao)

DEFAULT_SKIP = ("lm_head",)  # the output head stays in high precision unless a skip list without it is given


def fp8_dyn_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def quantize_weights(model, mode: str, skip=DEFAULT_SKIP):
    """Quantize the Linear layers of `model` in place with torchao; modules matching a `skip` pattern stay.

    fp8      Float8WeightOnlyConfig, per-row scales: weights stored in e4m3, matmuls in the activation dtype.
    fp8-dyn  Float8DynamicActivationFloat8WeightConfig, per-row: W8A8 with real FP8 matmuls (CUDA sm >= 8.9).
    fp8-emu  an *emulation* of fp8-dyn's numerics on any device: torchao fake quantization (QATConfig with
             Float8FakeQuantizeConfig(PerRow) for activations and weights) rounds both through e4m3 and
             computes in high precision. Same rounding, none of the speed.
    Embeddings are not Linear layers and are never touched.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow, quantize_
    from torchao.quantization.qat import Float8FakeQuantizeConfig, QATConfig

    if mode == "fp8-dyn" and not fp8_dyn_available():
        raise BadInput("weights 'fp8-dyn' needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper); use 'fp8' or the emulation 'fp8-emu' here")
    configs = {
        "fp8": lambda: Float8WeightOnlyConfig(granularity=PerRow()),
        "fp8-dyn": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        # hp_value_lb: an all-zero row (a padding position) would otherwise get scale 0 and turn into NaN.
        "fp8-emu": lambda: QATConfig(activation_config=Float8FakeQuantizeConfig(granularity=PerRow(), hp_value_lb=EPS),
                                     weight_config=Float8FakeQuantizeConfig(granularity=PerRow(), hp_value_lb=EPS), step="prepare"),  # fmt: skip
    }

    def keep_in_fp8(module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not any(fnmatch.fnmatch(name, pat) for pat in skip)

    quantize_(model, configs[mode](), filter_fn=keep_in_fp8)
    return model


# ---------------------------------------------------------------------------------------------------
# Per-layer FP8 sensitivity and a greedy skip recipe


def block_skip(n_layers: int, quantized: set[int]) -> tuple:
    """fp8_skip patterns that leave exactly the decoder blocks in `quantized` to FP8 (lm_head always kept)."""
    return ("lm_head", *(f"model.layers.{i}.*" for i in range(n_layers) if i not in quantized))


def block_params(model, i: int) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith(f"model.layers.{i}.") and p.dim() == 2)


def sensitivity(pair, mode: str, n_probes: int, target: float | None = None, max_new_tokens: int = 48, progress: bool = True) -> dict:
    """Mismatch with one decoder block in FP8 at a time, and a greedy recipe meeting `target`.

    Greedy recipe: quantize every block, then keep the most sensitive blocks in high precision, one at a
    time in ranking order, until the measured mismatch falls under `target` (default: half of all-FP8).
    """
    from tqdm import tqdm

    from mismatch import measure
    from models import format_prompt
    from rollout import RolloutConfig, RolloutEngine

    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:n_probes]]
    n = pair.student.config.num_hidden_layers

    def mismatch(quantized: set[int]) -> float:
        cfg = RolloutConfig(weights=mode, fp8_skip=block_skip(n, quantized), max_new_tokens=max_new_tokens)
        engine = RolloutEngine(pair.student, pair.tokenizer, cfg)
        engine.sync(pair.student, 0)
        return measure(engine, pair.student, pair.tokenizer, probes)["mismatch_kl"]

    per_block = [mismatch({i}) for i in tqdm(range(n), desc=f"{mode} one block at a time", disable=not progress)]
    ranking = sorted(range(n), key=lambda i: -per_block[i])
    all_fp8 = mismatch(set(range(n)))
    target = all_fp8 / 2 if target is None else target
    kept, current, steps = [], all_fp8, [(0, all_fp8)]
    for i in ranking:
        if current <= target:
            break
        kept.append(i)
        current = mismatch(set(range(n)) - set(kept))
        steps.append((len(kept), current))
    linear = sum(block_params(pair.student, i) for i in range(n))
    return {"mode": mode, "per_block": per_block, "ranking": ranking, "all_fp8": all_fp8, "target": target, "kept_high_precision": kept,
            "recipe_mismatch": current, "greedy_path": steps,
            "kept_fraction_of_block_weights": sum(block_params(pair.student, i) for i in kept) / linear}  # fmt: skip


def plot_sensitivity(result: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 0.3 * len(result["per_block"])), 3.5))
    ax.bar(range(len(result["per_block"])), result["per_block"], color=["C3" if i in result["kept_high_precision"] else "C0" for i in range(len(result["per_block"]))])
    ax.set(xlabel="decoder block quantized alone (red: kept high precision by the recipe)", ylabel="KL(engine ‖ train), nats/token", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    import json
    import sys

    from models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    cap = sub.add_parser("kv-capacity", help="KV tokens that fit in a memory budget: bf16 vs fp8 weights and KV cache")
    cap.add_argument("--memory-gb", type=float, default=80.0, help="memory budget in GiB (default 80, one H100)")
    cap.add_argument("--pairs", default="tiny,smollm2", help="embedded pairs to include (comma-separated; '' = none)")
    sens = sub.add_parser("sensitivity", help="mismatch with one decoder block in FP8 at a time; ranking, bar plot, greedy recipe")
    sens.add_argument("--pair", default="tiny", help="tiny | smollm2")
    sens.add_argument("--weights", default="fp8", help="fp8 | fp8-emu | fp8-dyn (CUDA)")
    sens.add_argument("--probes", type=int, default=16, help="held-out probe prompts (default 16)")
    sens.add_argument("--max-new-tokens", type=int, default=32, help="response length of the probes (default 32)")
    sens.add_argument("--target", type=float, help="recipe target mismatch, nats/token (default: half the all-FP8 mismatch)")
    sens.add_argument("--out", default="results", help="folder for the plot and JSON (default results)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "sensitivity":
            if args.weights not in ("fp8", "fp8-emu", "fp8-dyn"):
                raise BadInput(f"--weights {args.weights!r}: choose fp8, fp8-emu or fp8-dyn")
            from pathlib import Path

            pair = load_pair(args.pair)
            result = sensitivity(pair, args.weights, args.probes, args.target, args.max_new_tokens)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            plot_sensitivity(result, out / f"sensitivity_{args.pair}_{args.weights}.png", f"{args.pair}: FP8 ({args.weights}) one block at a time, cpu")
            (out / f"sensitivity_{args.pair}_{args.weights}.json").write_text(json.dumps(result, indent=2) + "\n")
            print(f"{args.pair} {args.weights}: all blocks FP8 -> {result['all_fp8']:.3e} nats/token")
            print("ranking (block: mismatch alone): " + ", ".join(f"{i}: {result['per_block'][i]:.2e}" for i in result["ranking"]))
            print(f"greedy recipe: keep blocks {result['kept_high_precision']} in high precision -> {result['recipe_mismatch']:.3e} "
                  f"(target {result['target']:.3e}); {result['kept_fraction_of_block_weights']:.0%} of block weights kept")  # fmt: skip
            return
        if args.memory_gb <= 0:
            raise BadInput(f"--memory-gb {args.memory_gb}: must be positive")
        from models import format_prompt

        shapes, measured = [], []
        for name in filter(None, args.pairs.split(",")):
            pair = load_pair(name)
            shapes += [shape_of(f"{name} teacher", pair.teacher), shape_of(f"{name} student", pair.student)]
            prompts = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:4]]
            measured.append((f"{name} student", measured_kv_bytes(pair.student, pair.tokenizer, prompts)))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for name, m in measured:
        print(f"measured KV memory, {name}: bf16 {m['bf16']:,.1f} B/token, fp8 {m['fp8']:,.1f} B/token with scales ({m['fp8'] / m['bf16']:.3f}x)")
    print_kv_capacity(args.memory_gb, shapes + KNOWN_SHAPES)


if __name__ == "__main__":
    main()
