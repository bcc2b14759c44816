"""The one scale: identity values, monotone in noise, estimators vs exact (the engine itself: test_engine.py)."""

import pytest
import torch
from conftest import assert_close

from engine import RolloutEngine
from mismatch import measure
from models import format_prompt
from rollout import RolloutConfig


def probes(pair, n=32):
    return [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:n]]


def measure_cfg(pair, cfg):
    engine = RolloutEngine(pair.student, pair.tokenizer, cfg)
    engine.sync(pair.student, 0)
    return measure(engine, pair.student, pair.tokenizer, probes(pair))


def test_identical_engine_gives_identity_values(tiny_pair):
    r = measure_cfg(tiny_pair, RolloutConfig(max_new_tokens=6))
    assert abs(r["mismatch_kl"]) < 1e-7 and abs(r["ci_low"]) < 1e-7 and abs(r["ci_high"]) < 1e-7
    for key, identity in [
        ("k1", 0),
        ("k3", 0),
        ("dp_mean", 0),
        ("dp_max", 0),
        ("chi2", 0),
        ("ratio_mean", 1),
        ("ratio_min", 1),
        ("ratio_max", 1),
        ("ess", 1),
        ("logppl_diff", 0),
        ("seq_kl", 0),
        ("seq_ess", 1),
    ]:
        assert abs(r[key] - identity) < 1e-5, (key, r[key])


def test_mismatch_grows_with_noise(tiny_pair):
    values = [
        measure_cfg(tiny_pair, RolloutConfig(max_new_tokens=6, noise=s))["mismatch_kl"]
        for s in (0.003, 0.01, 0.03, 0.1)
    ]
    assert all(a < b for a, b in zip(values, values[1:])), values


def run_cli(script, *args, cwd=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    module = script.startswith("-m ")
    command = [sys.executable, *script.split()] if module else [sys.executable, str(root / script)]
    return subprocess.run(
        [*command, *args],
        cwd=cwd or root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)},
    )


@pytest.mark.slow
def test_mismatch_cli_json_has_each_source_and_combined():
    import json

    args = (
        "--pair",
        "tiny",
        "--probes",
        "16",
        "--weights",
        "fp8",
        "--noise",
        "0.01",
        "--staleness",
        "1",
        "--json",
    )
    result = run_cli("-m study", "sources", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)["rows"]
    assert [r["source"] for r in rows] == ["weights fp8", "staleness 1", "noise 0.01", "combined"]
    for r in rows:
        assert r["mismatch_kl"] > 0 and r["ci_low"] <= r["mismatch_kl"] <= r["ci_high"] and r["seconds"] > 0


@pytest.mark.slow
def test_mismatch_cli_bad_input():
    result = run_cli("mismatch.py", "--pair", "tiny", "--kv-cache", "fp4")
    assert result.returncode == 2 and "--kv-cache" in result.stderr and "'fp4'" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_kv_capacity_cli_shows_the_fp8_ratio():
    result = run_cli("-m lab.kv_capacity", "--memory-gb", "80", "--pairs", "tiny")
    assert result.returncode == 0, result.stderr[-2000:]
    llama8b = next(line for line in result.stdout.splitlines() if line.startswith("Llama-3.1-8B"))
    ratio = float(llama8b.split()[-1].rstrip("x"))
    assert 1.93 <= ratio <= 2.0


@pytest.mark.slow
def test_sensitivity_cli_writes_ranking_and_plot(tmp_path):
    import json

    result = run_cli(
        "-m study",
        "sensitivity",
        "--pair",
        "tiny",
        "--probes",
        "16",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "sensitivity_tiny_fp8.json").read_text())
    assert sorted(data["ranking"]) == [0, 1] and data["recipe_mismatch"] <= data["all_fp8"]
    assert data["kv_bytes_per_token"] == 2 * data["kv_bytes_per_token_fp8"] and data["seconds"] > 0
    assert (tmp_path / "sensitivity_tiny_fp8.png").stat().st_size > 0


def test_rescored_token_kl_equals_direct_full_forward(tiny_pair):
    """The fallback (no recorded distributions) against a direct computation over the full forward."""
    from mismatch import rescored_token_kl
    from rollout import positions

    engine = RolloutEngine(
        tiny_pair.student, tiny_pair.tokenizer, RolloutConfig(max_new_tokens=6, noise=0.05)
    )
    engine.sync(tiny_pair.student, 0)
    rollout = engine.generate(probes(tiny_pair, 16), generator=torch.Generator().manual_seed(0))
    kw = dict(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
    )
    with torch.no_grad():
        logp_e = torch.log_softmax(engine.model(**kw).logits[:, :-1].double(), -1)
        logp_t = torch.log_softmax(tiny_pair.student(**kw).logits[:, :-1].double(), -1)
    direct = (logp_e.exp() * (logp_e - logp_t)).sum(-1)[rollout.response_mask[:, 1:].bool()]
    for chunk in (5, 1000):
        assert_close(
            rescored_token_kl(engine, tiny_pair.student, rollout, chunk=chunk),
            direct,
            atol=1e-6,
            what=f"chunk {chunk}",
        )


@pytest.mark.parametrize(
    "cfg",
    [RolloutConfig(max_new_tokens=6, weights="bf16"), RolloutConfig(max_new_tokens=6, kv_cache="fp8")],
    ids=["bf16", "fp8-kv"],
)
def test_mismatch_kl_equals_a_float64_replay_of_the_engine_decode(tiny_pair, cfg):
    """mismatch_kl (from the distributions the engine recorded, against the loss's own student forward) equals
    the KL of a replay of the engine's schedule (its dtype and cache, prefill, then one token at a time)
    against a separate full forward of the trainer, both in float64, within 1e-5 relative."""
    from transformers import DynamicCache

    from loss import opd_loss
    from rollout import decode, encode_prompts, positions, prefill

    prompts = probes(tiny_pair, 32)
    calib = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_pair.train_prompts[:8]]
    engine = RolloutEngine(tiny_pair.student, tiny_pair.tokenizer, cfg, probe_prompts=calib)
    engine.sync(tiny_pair.student, 0)
    rollout = engine.generate(prompts, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, stats = opd_loss(tiny_pair.student, tiny_pair.teacher, rollout)
        ids, attn = encode_prompts(tiny_pair.tokenizer, prompts, "cpu")
        P, N = ids.shape[1], rollout.tokens.shape[1] - ids.shape[1]
        cache = engine.new_cache() or DynamicCache(config=engine.model.config)
        attn_all = torch.cat([attn, torch.ones(len(prompts), N, dtype=attn.dtype)], 1)
        steps = [prefill(engine.model, ids, attn, cache)]
        for t in range(N - 1):
            steps.append(decode(engine.model, rollout.tokens[:, P + t], attn_all[:, : P + t + 1], cache))
        logp_e = torch.log_softmax(torch.stack(steps, 1).double(), -1)  # [B, N, V]
        kw = dict(
            input_ids=rollout.tokens,
            attention_mask=rollout.attention_mask,
            position_ids=positions(rollout.attention_mask),
        )
        logp_t = torch.log_softmax(
            tiny_pair.student(**kw).logits[:, P - 1 : -1].double(), -1
        )  # predicts P..P+N-1
    replay = (logp_e.exp() * (logp_e - logp_t)).sum(-1)[rollout.response_mask[:, P:].bool()]
    ours = stats["mismatch_N"]
    assert replay.mean() > 0, "the engine differs from the trainer, so the KL is positive"
    rel = abs(ours.mean().item() - replay.mean().item()) / replay.mean().item()
    assert rel <= 1e-5, (
        f"mismatch_kl {ours.mean().item():.9g} vs replay {replay.mean().item():.9g}: {rel:.2e} relative"
    )
