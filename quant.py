"""Precision: FP8 weights through torchao, a hand-written FP8 KV cache, and KV capacity arithmetic.

FP8 e4m3 (torch.float8_e4m3fn) has 4 exponent and 3 mantissa bits: finite values up to ±448, and a
relative rounding error of at most 2^-4 = 6.25% (half a unit in the last place of a 3-bit mantissa) for
normal numbers. To use that range, a tensor x is stored as q = cast(clamp(x / s, −448, 448)) with a scale
    s = amax(|x|) / 448      (per group: here per layer and per KV head),
and read back as x̂ = q · s. Clamping before the cast matters: float8_e4m3fn has no infinity, and what a cast
does with values beyond ±448 depends on the kernel (NaN on some; torch 2.13 on CPU saturates to ±448), so we
saturate explicitly. Scales are stored beside the data, in fp32.

KV scales come from one of two places (`kv_scales`):
    calibrated  amax/448 per layer and head, measured on probe prompts (engine.calibrate_kv_scales)
    unit        s = 1, what inference engines default to when a checkpoint ships no scales; keys and values
                beyond ±448 saturate, and small ones lose precision in e4m3's subnormal range.

Our cache attends to the *quantized* keys and values in prefill as well as in decode: every read goes
through FP8, so the prompt and the response see the same precision. (Engines differ here; transformers'
Fp8QuantizedLayer attends to the unquantized states in prefill.) The e4m3 storage is preallocated and
written in place; each position is dequantized once, into a working copy attention reads (see Fp8KVLayer).

FP8 weights go through torchao (`quantize_weights`: fp8 weight-only, fp8-dyn W8A8 on CUDA sm >= 8.9, and
fp8-emu, a fake-quantized emulation of W8A8 that runs anywhere). torchao is optional: without it the FP8
weight modes refuse with one line and everything else runs.

The KV capacity arithmetic's table, with bytes measured on a filled cache beside it, is a command of its own:

    python -m lab.kv_capacity --memory-gb 80    # KV tokens that fit: bf16 vs fp8 weights and KV cache
"""

import fnmatch
from dataclasses import dataclass

import torch

from cli import BadInput
from models import n_params

try:  # torchao is optional: without it the FP8 weight modes refuse with one line, everything else runs
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig  # isort: skip
    from torchao.quantization import Float8WeightOnlyConfig  # isort: skip
    from torchao.quantization import PerRow, quantize_  # isort: skip
    from torchao.quantization.qat import Float8FakeQuantizeConfig, QATConfig  # isort: skip

    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False
from transformers.cache_utils import Cache, DynamicLayer  # isort: skip

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
EPS = 1e-12
FP8_WEIGHTS = ("fp8", "fp8-dyn", "fp8-emu")


# ---------------------------------------------------------------------------------------------------
# Pure primitives


def fp8_scale(x: torch.Tensor, dims) -> torch.Tensor:
    """s = amax(|x|) / 448 over `dims` (kept as size-1 dims), eps-clamped: an all-zero group stays finite."""
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

    update() quantizes the new states into preallocated e4m3 storage at the next positions (capacity doubles
    when full: O(log T) reallocations, not one per token), dequantizes just those positions into a working
    copy in the model's compute dtype, and returns the working copy of the whole sequence, prefill included.
    Attention therefore reads exactly q · s for every position, as if it dequantized the e4m3 storage at
    every token, but each token is converted once: on this CPU converting e4m3 costs ~1.5 ns an element, which
    re-done over a 300-token history at every step would add a quarter to the decode time. The working copy is
    what a CPU needs to attend; an FP8 engine on a GPU attends to the e4m3 storage directly, and the storage
    (plus scales) is what `keys`/`values`, `cache_bytes` and the KV-capacity arithmetic count.

    working_copy=False keeps no working copy: every update dequantizes the whole stored sequence into a
    temporary that attention reads and then frees. Same values (q · s, elementwise), one byte per element
    held instead of 1 + the compute dtype's: what a GPU needs for the cache to hold more tokens than bf16.
    """

    def __init__(self, key_scale: torch.Tensor, value_scale: torch.Tensor, working_copy: bool = True):
        super().__init__()
        self.key_scale, self.value_scale = key_scale, value_scale
        self.working_copy = working_copy
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:  # [B, H, T, D] e4m3: what is stored
        return self.k_store[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v_store[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:  # the base class initialises keys and values to None; nothing else may
        if value is not None:
            raise AttributeError("Fp8KVLayer stores keys only through update()")

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("Fp8KVLayer stores values only through update()")

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, T, D = key_states.shape
        self.k_store = torch.empty(B, H, max(T, 16), D, dtype=FP8, device=self.device)
        self.v_store = torch.empty_like(self.k_store)
        work_len = max(T, 16) if self.working_copy else 0
        self.k_work = torch.empty(B, H, work_len, D, dtype=self.dtype, device=self.device)
        self.v_work = torch.empty_like(self.k_work)
        self.key_scale = self.key_scale.to(self.device)
        self.value_scale = self.value_scale.to(self.device)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        capacity = self.k_store.shape[2]
        if needed > capacity:
            new = max(needed, 2 * capacity)
            for name in ("k_store", "v_store", "k_work", "v_work")[: 4 if self.working_copy else 2]:
                old = getattr(self, name)
                grown = torch.empty(*old.shape[:2], new, old.shape[3], dtype=old.dtype, device=self.device)
                grown[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, grown)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[2]
        self._grow(end)
        for states, scale, store, work in (
            (key_states, self.key_scale, self.k_store, self.k_work),
            (value_states, self.value_scale, self.v_store, self.v_work),
        ):
            q = quantize_fp8(states, scale)
            store[:, :, start:end] = q
            if self.working_copy:
                work[:, :, start:end] = dequantize_fp8(q, scale, self.dtype)
        self.length = end
        if not self.working_copy:
            return (
                dequantize_fp8(self.keys, self.key_scale, self.dtype),
                dequantize_fp8(self.values, self.value_scale, self.dtype),
            )
        return self.k_work[:, :, :end], self.v_work[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False


@dataclass
class KVScales:
    """Per-layer, per-head scales: keys[L] and values[L], each [1, H_kv, 1, 1] fp32."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def unit(config) -> "KVScales":
        one = torch.ones(1, config.num_key_value_heads, 1, 1)
        return KVScales([one] * config.num_hidden_layers, [one] * config.num_hidden_layers)


def fp8_kv_cache(scales: KVScales, working_copy: bool = True) -> Cache:
    """An FP8 KV cache of Fp8KVLayers (working_copy: see Fp8KVLayer; the engine keeps one on CPU only)."""
    layers = [Fp8KVLayer(k, v, working_copy=working_copy) for k, v in zip(scales.keys, scales.values)]
    return Cache(layers=layers)


class AmaxRecorder(DynamicLayer):
    """A bf16/fp32 cache layer that also records amax(|k|), amax(|v|) per head over everything it sees
    (engine.calibrate_kv_scales turns them into scales)."""

    def update(self, key_states, value_states, *args, **kwargs):
        k_amax = fp8_scale(key_states, (0, 2, 3)) * FP8_MAX
        v_amax = fp8_scale(value_states, (0, 2, 3)) * FP8_MAX
        self.k_amax = torch.maximum(getattr(self, "k_amax", k_amax), k_amax)
        self.v_amax = torch.maximum(getattr(self, "v_amax", v_amax), v_amax)
        return super().update(key_states, value_states, *args, **kwargs)


def scales_from_amax(layers: list[AmaxRecorder]) -> KVScales:
    """s = amax / 448 per layer and head (eps-clamped)."""
    keys = [(layer.k_amax / FP8_MAX).clamp(min=EPS).cpu() for layer in layers]
    return KVScales(keys, [(layer.v_amax / FP8_MAX).clamp(min=EPS).cpu() for layer in layers])


# ---------------------------------------------------------------------------------------------------
# KV memory arithmetic


def kv_bytes_per_token(config, kv_cache: str, dtype_bytes: int = 2) -> float:
    """Bytes one token occupies in the KV cache, all layers: 2 (K and V) × L × H_kv × D × element size.

    kv_cache "fp8" is 1 byte; anything else is `dtype_bytes` (2 for bf16, 4 for fp32). The fp8 cache's
    per-head scales (2 × L × H_kv fp32 numbers) are stored once, not per token.
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
        total += (
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel() * layer.values.element_size()
        )
        if isinstance(layer, Fp8KVLayer):
            total += (layer.key_scale.numel() + layer.value_scale.numel()) * layer.key_scale.element_size()
    return total


def shape_of(name: str, model) -> ModelShape:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return ModelShape(
        name,
        n_params(model),
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.hidden_size,
        head_dim,
    )


# ---------------------------------------------------------------------------------------------------
# FP8 weights (torchao)

DEFAULT_SKIP = ("lm_head",)  # the output head stays in high precision unless a skip list without it is given


def fp8_dyn_available(device=None) -> bool:
    """Real FP8 matmuls (torch._scaled_mm) need a CUDA device of compute capability >= 8.9 (Ada, Hopper).
    `device`: where the model lives (None: the current CUDA device); a CPU model never qualifies."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _device_text(device: torch.device) -> str:
    if device.type != "cuda":
        return f"a {device.type.upper()} model"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def fp8_linear_size(model, skip=DEFAULT_SKIP) -> tuple[int, int]:
    """(weight elements, output rows) of the Linear layers quantize_weights would put in FP8."""
    linears = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(fnmatch.fnmatch(name, pat) for pat in skip)
    ]
    return sum(m.weight.numel() for m in linears), sum(m.weight.shape[0] for m in linears)


def fp8_config(mode: str):
    """The torchao config of an FP8 weight mode (see quantize_weights)."""
    if mode == "fp8":
        return Float8WeightOnlyConfig(granularity=PerRow())
    if mode == "fp8-dyn":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    # hp_value_lb: an all-zero row (a padding position) would otherwise get scale 0 and turn into NaN.
    fake = Float8FakeQuantizeConfig(granularity=PerRow(), hp_value_lb=EPS)
    return QATConfig(activation_config=fake, weight_config=fake, step="prepare")


def quantize_weights(model, mode: str, skip=DEFAULT_SKIP):
    """Quantize the Linear layers of `model` in place with torchao; modules matching a `skip` pattern stay.

    fp8      Float8WeightOnlyConfig, per-row scales: weights stored in e4m3, matmuls in the activation dtype.
    fp8-dyn  Float8DynamicActivationFloat8WeightConfig, per-row: W8A8 with real FP8 matmuls (CUDA sm >= 8.9).
    fp8-emu  an *emulation* of fp8-dyn's numerics on any device: torchao fake quantization (QATConfig with
             Float8FakeQuantizeConfig(PerRow) for activations and weights) rounds both through e4m3 and
             computes in high precision. Same rounding, none of the speed.
    Embeddings are not Linear layers and are never touched.
    """
    if mode not in FP8_WEIGHTS:
        raise BadInput(f"weights {mode!r}: choose one of {', '.join(FP8_WEIGHTS)}")
    if not HAVE_TORCHAO:
        raise BadInput(
            f"weights {mode!r} needs torchao, which is not installed here (pip install torchao==0.18.0); "
            "use 'fp32' or 'bf16' weights without it"
        )
    device = next(model.parameters()).device
    if mode == "fp8-dyn" and not fp8_dyn_available(device):
        raise BadInput(
            f"weights 'fp8-dyn' needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper), not "
            f"{_device_text(device)}; use 'fp8' or the emulation 'fp8-emu' here"
        )

    def keep_in_fp8(module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not any(fnmatch.fnmatch(name, pat) for pat in skip)

    quantize_(model, fp8_config(mode), filter_fn=keep_in_fp8)
    return model


def round_weights_once(model) -> None:
    """Apply torchao's weight rounding once, where its CPU path applies it at every call, leaving the
    forward's numbers as they are (tests/test_quant.py):
        fp8      weight-only Float8 weights: torchao computes x @ dequantize(W)ᵀ at every call, so each
                 becomes its dequantized copy (e4m3 values times the row scale, held in fp32);
        fp8-emu  the weight fake-quantizer rounds the same weight at every call: it runs once and is
                 removed (the activations' fake-quantizer stays: activations change at every call).
    For CPU engines (sampling ~3× faster): a CPU has no FP8 arithmetic, so FP8 storage buys it nothing."""
    with torch.no_grad():
        for m in model.modules():
            weight = getattr(m, "weight", None)
            if isinstance(m, torch.nn.Linear) and hasattr(weight, "dequantize") and hasattr(weight, "qdata"):
                m.weight = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
            if getattr(m, "weight_fake_quantizer", None) is not None:
                m.weight = torch.nn.Parameter(m.weight_fake_quantizer(m.weight), requires_grad=False)
                m.weight_fake_quantizer = None
