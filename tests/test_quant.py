"""FP8 primitives, the FP8 KV cache against the bf16/fp32 path, and FP8 weights."""

import pytest
import torch
from conftest import assert_close

from engine import RolloutEngine
from models import BadInput, format_prompt, tiny_problems
from quant import (
    FP8_MAX,
    KVScales,
    dequantize_fp8,
    fp8_scale,
    kv_bytes_per_token,
    quantize_fp8,
    quantize_weights,
)
from rollout import RolloutConfig, response_hidden


def test_round_trip_within_e4m3_bound():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 64) * torch.logspace(-2, 2, 64)  # many magnitudes
    s = fp8_scale(x, dims=(0, 2))  # per "head" (dim 1)
    xq = dequantize_fp8(quantize_fp8(x, s), s)
    # Normal e4m3 numbers round with relative error <= 2^-4; below the normal range (2^-6 · s) the
    # absolute error is at most half the subnormal step, 2^-10 · s.
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10)
    assert ((xq - x).abs() <= bound + 1e-7).all(), f"max excess {((xq - x).abs() - bound).max():.3g}"


def test_calibrated_scale_maps_amax_to_448_and_unit_saturates():
    x = torch.tensor([[0.5, -1000.0, 3.0, 1e-6]])
    s = fp8_scale(x, dims=(1,))
    assert quantize_fp8(x, s).float().abs().max().item() == FP8_MAX
    assert_close(
        dequantize_fp8(quantize_fp8(x, s), s)[0, 1], torch.tensor(-1000.0), atol=1e-3, what="amax survives"
    )
    unit = torch.ones(1, 1)
    q = dequantize_fp8(quantize_fp8(x, unit), unit)
    assert torch.isfinite(q).all(), "beyond ±448 must saturate, not become NaN"
    assert q[0, 1].item() == -FP8_MAX
    assert q[0, 3].item() == 0.0, "1e-6 is below e4m3's smallest subnormal (2^-9) with a unit scale"
    zero = torch.zeros(2, 3)
    assert torch.isfinite(
        dequantize_fp8(quantize_fp8(zero, fp8_scale(zero, (1,))), fp8_scale(zero, (1,)))
    ).all()


def engine_logprobs(pair, cfg, prompts):
    """The engine's sampled tokens and log-probs, with the same seed for every cache kind."""
    calib = [format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:8]]
    engine = RolloutEngine(pair.student, pair.tokenizer, cfg, probe_prompts=calib)
    engine.sync(pair.student, 0)
    return engine, engine.generate(prompts, generator=torch.Generator().manual_seed(0))


def test_fp8_kv_cache_logprobs_close_to_full_precision(tiny_pair):
    prompts = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_problems(32, seed=4, held_out=True)]
    ref_engine, ref = engine_logprobs(tiny_pair, RolloutConfig(temperature=0, max_new_tokens=6), prompts)
    fp8_engine, fp8 = engine_logprobs(
        tiny_pair, RolloutConfig(temperature=0, max_new_tokens=6, kv_cache="fp8"), prompts
    )
    # Score the same tokens through both caches (teacher forcing), so differences are the cache's alone.
    with torch.no_grad():
        h_ref, y = response_hidden(ref_engine.model, ref)
        h_fp8, _ = response_hidden(fp8_engine.model, ref, cache=fp8_engine.new_cache())
        lp = lambda m, h: torch.log_softmax(m.lm_head(h), -1).gather(-1, y[:, None]).squeeze(-1)  # noqa: E731
        lp_ref, lp_fp8 = lp(ref_engine.model, h_ref), lp(fp8_engine.model, h_fp8)
    # Stated tolerance (tiny pair, calibrated scales): mean |Δ log p| <= 0.05 nats, max <= 1 nat. The tiny
    # model's 16-wide heads make it more sensitive to e4m3's 6% rounding than large models are.
    assert_close(lp_fp8, lp_ref, atol=1.0, what="fp8 KV vs fp32 KV log-probs (calibrated scales)")
    assert (lp_fp8 - lp_ref).abs().mean() <= 0.05, (lp_fp8 - lp_ref).abs().mean()
    # The cached sampler and the one-pass scoring agree for the fp8 cache (prefill attends to quantized K/V too).
    mask = fp8.response_mask[:, 1:].bool()
    with torch.no_grad():
        h, y8 = response_hidden(fp8_engine.model, fp8, cache=fp8_engine.new_cache())
        one_pass = torch.log_softmax(fp8_engine.model.lm_head(h), -1).gather(-1, y8[:, None]).squeeze(-1)
    assert_close(fp8.logprobs[:, 1:][mask], one_pass, atol=1e-4, what="fp8 cache: incremental vs one pass")


def test_fp8_kv_cache_memory(tiny_pair):
    from quant import fp8_kv_cache

    cfg = tiny_pair.student.config
    cache = fp8_kv_cache(KVScales.unit(cfg))
    prompts = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_problems(4, seed=4, held_out=True)]
    from rollout import generate

    generate(
        tiny_pair.student,
        tiny_pair.tokenizer,
        prompts,
        RolloutConfig(max_new_tokens=6, ignore_eos=True),
        cache=cache,
    )
    stored = sum(
        l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
        for l in cache.layers
    )
    scales = sum(l.key_scale.numel() * 4 + l.value_scale.numel() * 4 for l in cache.layers)
    tokens = cache.layers[0].keys.shape[0] * cache.layers[0].keys.shape[2]
    bf16_bytes = tokens * kv_bytes_per_token(cfg, "bf16")
    assert stored == tokens * kv_bytes_per_token(cfg, "fp8")
    assert (stored + scales) / bf16_bytes <= 0.55, (stored + scales) / bf16_bytes


def test_fp8_dyn_fails_clearly_on_cpu(random_model):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BadInput, match="fp8-dyn.*compute capability"):
        quantize_weights(random_model, "fp8-dyn")


@pytest.mark.parametrize("mode", ["fp8", "fp8-emu"])
def test_fp8_weights_run_on_cpu_and_stay_close(tiny_pair, mode):
    import copy

    model = quantize_weights(copy.deepcopy(tiny_pair.student), mode)
    ids = tiny_pair.tokenizer(
        [format_prompt(tiny_pair.tokenizer, "123+45=")], add_special_tokens=False, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        ref, out = tiny_pair.student(ids).logits, model(ids).logits
    assert torch.isfinite(out).all()
    # e4m3 rounds each weight (and, for fp8-emu, each activation) by up to 6%: a small, nonzero change.
    assert 0 < (out - ref).abs().max() < 0.25 * ref.abs().max(), (out - ref).abs().max()
    assert type(model.lm_head) is torch.nn.Linear and not type(model.lm_head.weight).__name__.startswith(
        "Float8"
    ), "lm_head is skipped"


def test_fp8_emu_engine_samples_a_left_padded_batch(tiny_pair):
    # Regression: an all-zero activation row (a padding position) once got scale 0 and NaN logits.
    prompts = [format_prompt(tiny_pair.tokenizer, t) for t in ("12+34=", "123+456=", "7+8=")]
    _, rollout = engine_logprobs(tiny_pair, RolloutConfig(weights="fp8-emu", max_new_tokens=6), prompts)
    assert torch.isfinite(rollout.logprobs).all() and rollout.response_mask.sum() > 0


def test_torchao_fp8_weights_equal_per_row_round_trip(tiny_pair):
    """Oracle for the torchao path: round every Linear weight through our per-row e4m3 primitives."""
    import copy

    ours = copy.deepcopy(tiny_pair.student)
    with torch.no_grad():
        for name, m in ours.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                s = fp8_scale(m.weight, dims=(1,))
                m.weight.copy_(dequantize_fp8(quantize_fp8(m.weight, s), s))
    torchao_model = quantize_weights(copy.deepcopy(tiny_pair.student), "fp8")
    ids = tiny_pair.tokenizer(
        [format_prompt(tiny_pair.tokenizer, "123+45=")], add_special_tokens=False, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        assert_close(
            torchao_model(ids).logits, ours(ids).logits, atol=1e-4, what="torchao fp8 vs per-row round trip"
        )


@pytest.mark.parametrize("mode", ["fp8", "fp8-emu"])
def test_weights_rounded_once_give_torchaos_numbers(tiny_pair, mode):
    """round_weights_once (the CPU engine's fast path) against torchao's own forward, which rounds the weights
    at every call: the same logits on a left-padded batch, from plain fp32 weights."""
    import copy

    from quant import round_weights_once

    torchao_model = quantize_weights(copy.deepcopy(tiny_pair.student), mode)
    once = copy.deepcopy(torchao_model)
    round_weights_once(once)
    enc = tiny_pair.tokenizer(
        [format_prompt(tiny_pair.tokenizer, t) for t in ("123+45=", "7+8=")],
        add_special_tokens=False,
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        ref, out = torchao_model(**enc).logits, once(**enc).logits
    assert torch.equal(ref, out), (ref - out).abs().max()
    assert all(type(p) is torch.nn.Parameter for p in once.parameters()), "every weight is a plain tensor"
    assert not torch.equal(out, tiny_pair.student(**enc).logits), "still FP8-rounded"
