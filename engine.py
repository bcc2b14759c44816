"""The rollout engine: its own copy of the student, changed the way a cheap rollout system changes it
(stale weights, weight noise, bf16 or FP8 weights, an FP8 KV cache), sampling with rollout.generate.

    engine = RolloutEngine(student, tokenizer, RolloutConfig(weights="fp8", staleness=2))
    engine.sync(student, version)          # after each optimizer step
    rollout = engine.generate(prompts)     # a Rollout with the engine's own distributions recorded

Weight noise is relative, W + σ · rms(W) · ε (add_weight_noise), the one definition opd_minimal.py shares.
"""

import copy
from collections import deque

import torch

from cli import BadInput
from quant import (
    FP8_WEIGHTS,
    AmaxRecorder,
    KVScales,
    fp8_kv_cache,
    quantize_weights,
    round_weights_once,
    scales_from_amax,
)
from rollout import Rollout, RolloutConfig, generate

from transformers.cache_utils import Cache  # isort: skip


@torch.no_grad()
def calibrate_kv_scales(model, tokenizer, prompts: list[str], cfg: RolloutConfig) -> KVScales:
    """amax/448 per layer and head over a short sampled rollout of the probe prompts (prompt and response)."""
    layers = [AmaxRecorder() for _ in range(model.config.num_hidden_layers)]
    generator = torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed)
    generate(model, tokenizer, prompts, cfg=cfg, generator=generator, cache=Cache(layers=layers))
    return scales_from_amax(layers)


# ---------------------------------------------------------------------------------------------------
# The engine's own weight copy


def add_weight_noise(model, sigma: float, generator: torch.Generator) -> None:
    """W <- W + σ · rms(W) · ε, ε ~ N(0, I), for every parameter tensor: noise relative to its scale.
    ε is drawn into one reused fp32 buffer and scaled in place: on a CPU, fresh temporaries the size of the
    embedding cost as much as the draw itself (a test compares this with the formula written directly)."""
    with torch.no_grad():
        params = list(model.parameters())
        if not params:
            return
        buf = torch.empty(max(p.numel() for p in params), device=params[0].device)
        for p in params:
            eps = torch.randn(p.shape, generator=generator, out=buf[: p.numel()].view(p.shape))
            rms = torch.linalg.vector_norm(p, dtype=torch.float32) / p.numel() ** 0.5
            p.add_(eps.mul_(sigma * rms).to(p.dtype))


def snapshot(model) -> dict:
    """A detached copy of the weights. Tied tensors (embeddings = lm_head) are copied once and stay tied."""
    copies = {}
    return {k: copies.setdefault(v.data_ptr(), v.detach().clone()) for k, v in model.state_dict().items()}


class RolloutEngine:
    """The rollout engine's own copy of the student, changed the way a cheap rollout system changes it.

    sync(student, version) pushes the trainer's weights after each optimizer step. The engine then serves:
        staleness k  the weights of version max(v − k, first version seen): it keeps the last k+1 snapshots
                     (memory: (k+1) × the student's fp32 size, about 0.45 GB each for smollm2);
        noise σ      add_weight_noise with a generator seeded by (seed, served version): reproducible;
        weights      the copy cast to bf16 or quantized to FP8 (quant.quantize_weights), after the noise; on
                     CPU, FP8 weights are rounded once (quant.round_weights_once) instead of at every call;
                     fp8-dyn casts to bf16 first (torchao's per-row FP8 matmul takes bf16 in and out);
        kv_cache     fp8: quant.Fp8KVLayer with calibrated (probe prompts, recomputed at every new version)
                     or unit scales.
    The engine's model is rebuilt from the served snapshot at every new version, so FP8 weights are
    re-quantized after every sync. It never changes the student it was given.
    """

    def __init__(self, student, tokenizer, cfg: RolloutConfig, probe_prompts: list[str] = ()):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.template = copy.deepcopy(student).cpu()  # architecture only; weights come from snapshots
        self.device = next(student.parameters()).device
        self.probe_prompts = list(probe_prompts)
        if cfg.kv_cache == "fp8" and cfg.kv_scales == "calibrated" and not self.probe_prompts:
            raise BadInput(
                "kv_scales 'calibrated' needs probe prompts to calibrate on; pass some, or use 'unit'"
            )
        self.snapshots: deque = deque()
        self.model, self.version, self.kv_scales = None, None, None

    def sync(self, student, version: int) -> None:
        self.receive(version, snapshot(student))

    def receive(self, version: int, weights: dict) -> None:
        """sync's second half, for weights already snapshotted (the async worker rebuilds off the trainer's
        thread)."""
        self.snapshots.append((version, weights))
        while len(self.snapshots) > self.cfg.staleness + 1:
            self.snapshots.popleft()
        served, weights = self.snapshots[0]
        if served != self.version:
            self.model, self.version = self._build(weights, served), served

    def _build(self, weights: dict, version: int):
        if self.cfg.weights == "fp32" and self.model is not None:
            model = self.model  # same structure and dtype: load the new weights in place, no template copy
        else:  # bf16 casts and FP8 quantization change the modules: start from the fp32 template
            model = copy.deepcopy(self.template).to(self.device)
        model.load_state_dict(weights)
        if self.cfg.noise > 0:
            seed = self.cfg.seed * 1_000_003 + version
            add_weight_noise(model, self.cfg.noise, torch.Generator(self.device).manual_seed(seed))
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise BadInput(
                    f"--noise {self.cfg.noise:g} makes the engine's weights non-finite (version "
                    f"{version}); use a smaller --noise"
                )
        if self.cfg.weights in ("bf16", "fp8-dyn"):  # torchao's per-row W8A8 takes bf16 weights only
            model = model.to(torch.bfloat16)
        if self.cfg.weights in FP8_WEIGHTS:
            quantize_weights(model, self.cfg.weights, self.cfg.fp8_skip)
            if self.device.type == "cpu":  # torchao would round the same weights again at every call
                round_weights_once(model)
        model.eval()
        if self.cfg.kv_cache == "fp8":
            calibrated = self.cfg.kv_scales == "calibrated"
            self.kv_scales = (
                calibrate_kv_scales(model, self.tokenizer, self.probe_prompts, cfg=self.cfg)
                if calibrated
                else KVScales.unit(model.config)
            )
        return model

    def new_cache(self):
        """An empty KV cache of the engine's kind (None = the model's default). The FP8 cache keeps a
        working copy on CPU only (faster there); on a GPU it holds one byte per element (quant.Fp8KVLayer)."""
        if self.cfg.kv_cache != "fp8":
            return None
        return fp8_kv_cache(self.kv_scales, working_copy=self.device.type == "cpu")

    def generate(self, prompts: list[str], generator: torch.Generator | None = None) -> Rollout:
        """Sample with the served weights, recording the engine's distributions (see the module docstring)."""
        return generate(
            self.model,
            self.tokenizer,
            prompts,
            cfg=self.cfg,
            generator=generator,
            version=self.version,
            cache=self.new_cache(),
            record=True,
        )
