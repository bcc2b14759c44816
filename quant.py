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

    python quant.py kv-capacity --memory-gb 16
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

    For fp8 the per-head scales are amortised over `tokens` (they are stored once per layer and head).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elems = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return elems * (1 if kv_cache == "fp8" else dtype_bytes)


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
        "fp8-emu": lambda: QATConfig(activation_config=Float8FakeQuantizeConfig(granularity=PerRow()),
                                     weight_config=Float8FakeQuantizeConfig(granularity=PerRow()), step="prepare"),  # fmt: skip
    }

    def keep_in_fp8(module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not any(fnmatch.fnmatch(name, pat) for pat in skip)

    quantize_(model, configs[mode](), filter_fn=keep_in_fp8)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)


if __name__ == "__main__":
    main()
