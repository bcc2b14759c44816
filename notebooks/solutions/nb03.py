"""Answers to notebook 03: an e4m3 round trip, KV bytes per token, KV tokens that fit."""

import torch

from quant import kv_bytes_per_token


def my_fp8_roundtrip(x, scale=None):
    """x̂ = cast(clamp(x / s, ±448)) · s with s = max(amax / 448, 1e-12) unless given."""
    if scale is None:
        scale = (x.abs().max() / 448).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.float() * scale


def my_kv_bytes_per_token(config, kv_cache, dtype_bytes=2):
    """2 (K and V) × layers × KV heads × head_dim × bytes per element."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = 1 if kv_cache == "fp8" else dtype_bytes
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def my_kv_tokens(shape, memory_bytes, weights, kv):
    """(memory − weights − fp8 scales) // KV bytes per token, at least 0."""
    free = memory_bytes - shape.params * (2 if weights == "bf16" else 1)
    if kv == "fp8":
        free -= 2 * shape.num_hidden_layers * shape.num_key_value_heads * 4
    return max(0, int(free // kv_bytes_per_token(shape, kv)))
