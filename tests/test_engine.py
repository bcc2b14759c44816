"""The rollout engine (engine.py): weight noise relative to each tensor's scale and seeded, one formula;
staleness k serves version t − k, and staleness 0 is the synchronous engine."""

import copy

import pytest
import torch
from conftest import assert_close

from engine import RolloutEngine, add_weight_noise
from models import format_prompt
from rollout import RolloutConfig


def probes(pair, n=32):
    return [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:n]]


def test_noise_is_relative_and_seeded(random_model, tokenizer):
    cfg = RolloutConfig(noise=0.1, seed=3)
    a, b = RolloutEngine(random_model, tokenizer, cfg), RolloutEngine(random_model, tokenizer, cfg)
    a.sync(random_model, 5), b.sync(random_model, 5)
    w, wa, wb = (
        random_model.model.layers[0].mlp.up_proj.weight,
        a.model.model.layers[0].mlp.up_proj.weight,
        b.model.model.layers[0].mlp.up_proj.weight,
    )
    assert torch.equal(wa, wb), "same seed and version, same noise"
    rel = ((wa - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()
    assert 0.09 < rel < 0.11, rel


def test_weight_noise_matches_the_direct_formula(random_model):
    """add_weight_noise (one reused buffer, scaled in place) against W + σ · rms(W) · ε written directly,
    with ε drawn from the same generator state, tensor by tensor in parameter order."""
    noisy = copy.deepcopy(random_model)
    add_weight_noise(noisy, 0.3, torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    for w, w_noisy in zip(random_model.parameters(), noisy.parameters()):
        rms = w.detach().double().pow(2).mean().sqrt()
        expected = w.detach().double() + 0.3 * rms * torch.randn(w.shape, generator=gen).double()
        assert_close(w_noisy.double(), expected, atol=1e-5, what="noisy weight")


@pytest.mark.parametrize("k", [0, 1, 3])
def test_staleness_serves_version_t_minus_k(random_model, tokenizer, k):
    engine = RolloutEngine(random_model, tokenizer, RolloutConfig(staleness=k))
    for step in range(6):
        with torch.no_grad():
            for p in random_model.parameters():
                p.fill_(float(step))  # the weights encode the step number
        engine.sync(random_model, step)
        expected = max(step - k, 0)
        assert engine.version == expected
        assert all((p == expected).all() for p in engine.model.parameters())
    assert len(engine.snapshots) == k + 1


def test_staleness_zero_equals_synchronous(tiny_pair):
    prompts = probes(tiny_pair, 8)
    engine = RolloutEngine(tiny_pair.student, tiny_pair.tokenizer, RolloutConfig(max_new_tokens=6))
    engine.sync(tiny_pair.student, 0)
    from rollout import generate

    ours = engine.generate(prompts, generator=torch.Generator().manual_seed(1))
    sync = generate(
        tiny_pair.student,
        tiny_pair.tokenizer,
        prompts,
        RolloutConfig(max_new_tokens=6),
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.equal(ours.tokens, sync.tokens) and torch.equal(ours.logprobs, sync.logprobs)
