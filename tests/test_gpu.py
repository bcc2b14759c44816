"""The CUDA path against the CPU tests' oracles, marked `gpu` (`pytest -m gpu`; skipped without a CUDA
device); and, on CPU every time: the GPU's FP8 cache against the CPU's, torchao being optional, and the dry
run of tools/gpu_check.sh."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_rollout import hf_greedy, tiny_prompts
from test_train import same_steps, stale_twin

from cli import BadInput
from config import TINY_EARLY
from engine import RolloutEngine
from lab.calibrate import study_config
from lab.runfiles import load_checkpoint
from loss import opd_loss
from models import format_prompt, load_pair
from quant import HAVE_TORCHAO, KVScales, fp8_dyn_available, fp8_kv_cache, quantize_weights
from rollout import RolloutConfig, decode, encode_prompts, generate, positions, prefill
from tools import gpu_check
from train import run

from transformers import DynamicCache  # isort: skip

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def gpu(test):
    """Marked for `pytest -m gpu`, and skipped where there is no CUDA device."""
    return pytest.mark.gpu(needs_cuda(test))


@pytest.fixture(scope="module")
def cuda_pair():
    return load_pair("tiny", device="cuda")


# ---------------------------------------------------------------------------------------------------
# The CUDA path (pytest -m gpu)


@gpu
def test_greedy_matches_hf_generate_on_cuda(cuda_pair, random_model):
    """The sampler's greedy tokens equal HF generate's on CUDA: the trained tiny student (EOS ends rows) and a
    random model (it rarely emits EOS: many decode steps on a padded batch)."""
    for model, n_new in ((cuda_pair.student, 6), (random_model.to("cuda"), 20)):
        prompts = tiny_prompts(cuda_pair.tokenizer, n=8)
        ours = generate(
            model, cuda_pair.tokenizer, prompts, cfg=RolloutConfig(temperature=0, max_new_tokens=n_new)
        )
        theirs = hf_greedy(model, cuda_pair.tokenizer, prompts, n_new)
        assert ours.tokens.device.type == "cuda"
        assert torch.equal(ours.tokens[:, ours.prompt_len :][:, : theirs.shape[1]], theirs)


@gpu
@pytest.mark.parametrize(
    "cfg",
    [RolloutConfig(max_new_tokens=6, weights="bf16"), RolloutConfig(max_new_tokens=6, kv_cache="fp8")],
    ids=["bf16", "fp8-kv"],
)
def test_recorded_logits_replay_on_cuda(cuda_pair, cfg):
    """tests/test_mismatch.py's replay on CUDA: mismatch_kl from the distributions the engine recorded equals
    the KL of a float64 replay of the engine's schedule (its dtype and cache, prefill, then one token at a
    time) against a full forward of the trainer, within 1e-5 relative."""
    prompts = [format_prompt(cuda_pair.tokenizer, p.text) for p in cuda_pair.eval_prompts[:32]]
    calib = [format_prompt(cuda_pair.tokenizer, p.text) for p in cuda_pair.train_prompts[:8]]
    engine = RolloutEngine(cuda_pair.student, cuda_pair.tokenizer, cfg, probe_prompts=calib)
    engine.sync(cuda_pair.student, 0)
    rollout = engine.generate(prompts, generator=torch.Generator("cuda").manual_seed(0))
    assert rollout.engine_logits.device.type == "cuda"
    with torch.no_grad():
        _, stats = opd_loss(cuda_pair.student, cuda_pair.teacher, rollout)
        ids, attn = encode_prompts(cuda_pair.tokenizer, prompts, "cuda")
        P, N = ids.shape[1], rollout.tokens.shape[1] - ids.shape[1]
        cache = engine.new_cache() or DynamicCache(config=engine.model.config)
        attn_all = torch.cat([attn, torch.ones(len(prompts), N, dtype=attn.dtype, device="cuda")], 1)
        steps = [prefill(engine.model, ids, attn, cache=cache)]
        for t in range(N - 1):
            steps.append(
                decode(engine.model, rollout.tokens[:, P + t], attn_all[:, : P + t + 1], cache=cache)
            )
        logp_e = torch.log_softmax(torch.stack(steps, 1).double(), -1)  # [B, N, V]
        kw = dict(
            input_ids=rollout.tokens,
            attention_mask=rollout.attention_mask,
            position_ids=positions(rollout.attention_mask),
        )
        logp_t = torch.log_softmax(cuda_pair.student(**kw).logits[:, P - 1 : -1].double(), -1)
    replay = (logp_e.exp() * (logp_e - logp_t)).sum(-1)[rollout.response_mask[:, P:].bool()]
    ours = stats["mismatch_N"]
    assert replay.mean() > 0, "the engine differs from the trainer, so the KL is positive"
    rel = abs(ours.mean().item() - replay.mean().item()) / replay.mean().item()
    assert rel <= 1e-5, (
        f"mismatch_kl {ours.mean().item():.9g} vs replay {replay.mean().item():.9g}: {rel:.2e}"
    )


@gpu
@pytest.mark.skipif(not (HAVE_TORCHAO and CUDA and fp8_dyn_available()), reason="needs torchao and sm >= 8.9")
def test_fp8_dyn_rounds_like_fp8_emu(cuda_pair):
    """Real W8A8 (fp8-dyn, torch._scaled_mm) and its emulation (fp8-emu, fake quantization) round through the
    same e4m3 values: on the same bf16 student their logits are 4× closer to each other than the emulation
    is to plain bf16 (what is left is bf16 rounding of the dequantized operands and accumulation order)."""
    bf16 = copy.deepcopy(cuda_pair.student).to(torch.bfloat16)
    dyn = quantize_weights(copy.deepcopy(bf16), "fp8-dyn")
    emu = quantize_weights(copy.deepcopy(bf16), "fp8-emu")
    plain = [m for name, m in dyn.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"]
    assert plain and all(type(m.weight) is not torch.nn.Parameter for m in plain), "every Linear is FP8"
    prompts = [format_prompt(cuda_pair.tokenizer, p.text) for p in cuda_pair.eval_prompts[:32]]
    ids, attn = encode_prompts(cuda_pair.tokenizer, prompts, "cuda")
    with torch.no_grad():
        logits = {
            k: m(input_ids=ids, attention_mask=attn).logits.float()
            for k, m in (("bf16", bf16), ("dyn", dyn), ("emu", emu))
        }
    dyn_emu = (logits["dyn"] - logits["emu"]).abs().mean().item()
    bf16_emu = (logits["bf16"] - logits["emu"]).abs().mean().item()
    assert dyn_emu < 0.25 * bf16_emu, f"fp8-dyn vs fp8-emu {dyn_emu:.3g}, bf16 vs fp8-emu {bf16_emu:.3g}"


@pytest.mark.slow
@gpu
def test_twenty_step_tiny_run_lowers_held_out_kl_and_its_checkpoint_loads_on_cpu(tmp_path):
    """20 steps at the settings of tiny's early budgets (config.TINY_EARLY: 64 prompts × 4 samples,
    lr 3e-4 constant, warm-up 10) lower the held-out reverse KL on CUDA; the checkpoint the CUDA run writes
    loads on CPU."""
    cfg = study_config(
        "tiny",
        **{**TINY_EARLY, "steps": 20},
        eval_every=20,
        eval_prompts=128,
        ckpt_every=0,
        device="cuda",
        name="gpu20",
        out_dir=str(tmp_path),
    )
    records = run(cfg, quiet=True)
    assert records[-1]["eval_rkl"] < records[0]["eval_rkl"], (records[0]["eval_rkl"], records[-1]["eval_rkl"])
    state = load_checkpoint(tmp_path / "gpu20" / "checkpoint.pt", "cpu")
    assert all(v.device.type == "cpu" for v in state["student"].values())
    student = load_pair("tiny").student
    student.load_state_dict(state["student"])  # a CPU model takes the GPU run's weights


@gpu
def test_async_equals_its_sync_twin_at_staleness_1_on_cuda(tmp_path):
    """tests/test_train.py's twin on CUDA, where the async worker samples on its own CUDA stream."""
    asyn = stale_twin(tmp_path, "async", steps=4, device="cuda", async_rollout=True)
    stale1 = stale_twin(tmp_path, "stale1", steps=4, staleness=1, device="cuda")
    assert [r["engine_version"] for r in asyn] == [0, 0, 1, 2] == [r["engine_version"] for r in stale1]
    same_steps(asyn, stale1)


@gpu
def test_fp8_kv_cache_holds_twice_the_tokens_of_bf16_in_a_fixed_slice_of_gpu_memory():
    """A SmolLM2-135M-shaped bf16 model (random weights): requests of 512 tokens fill a 256 MiB slice. Our FP8
    cache as the GPU engine keeps it fits >= 1.9× the tokens of the bf16 cache (the arithmetic says 2×), and
    torch.cuda.memory_allocated agrees with the bytes the caches' tensors hold within 5%."""
    model = gpu_check.random_model(gpu_check.SMOLLM2_SHAPE, "cuda")
    slice_bytes, request = 256 * 2**20, 512
    bf16_cache = lambda: DynamicCache(config=model.config)  # noqa: E731
    bf16 = gpu_check.fill_slice(model, bf16_cache, slice_bytes, request_tokens=request)
    fp8 = gpu_check.fill_slice(
        model, gpu_check.kv_cache_factory("fp8", model.config, "cuda"), slice_bytes, request_tokens=request
    )
    assert fp8["tokens"] >= 1.9 * bf16["tokens"] > 0, (fp8, bf16)
    for r in (bf16, fp8):
        assert abs(r["bytes"] - r["held_bytes"]) <= 0.05 * r["held_bytes"], r


# ---------------------------------------------------------------------------------------------------
# On CPU, every time


def test_fp8_cache_without_working_copy_samples_what_the_working_copy_does(tiny_pair):
    """The GPU engine's FP8 cache (one byte per element; every read dequantizes the stored sequence) against
    the CPU engine's (a working copy dequantized once per position): the same tokens, log-probs and recorded
    logits, bit for bit, with less memory held."""
    prompts = tiny_prompts(tiny_pair.tokenizer, n=8)
    cfg = RolloutConfig(max_new_tokens=12, ignore_eos=True)
    caches = {
        keep: fp8_kv_cache(KVScales.unit(tiny_pair.student.config), working_copy=keep) for keep in (1, 0)
    }
    a, b = (
        generate(tiny_pair.student, tiny_pair.tokenizer, prompts, cfg=cfg, cache=caches[keep], record=True)
        for keep in (1, 0)
    )
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.engine_logits, b.engine_logits)
    assert gpu_check.cache_held_bytes([caches[0]]) < 0.5 * gpu_check.cache_held_bytes([caches[1]])


def test_fp8_weights_without_torchao_are_one_bad_input_line(tiny_pair, monkeypatch):
    import quant

    monkeypatch.setattr(quant, "HAVE_TORCHAO", False)
    with pytest.raises(BadInput, match="torchao"):
        quantize_weights(copy.deepcopy(tiny_pair.student), "fp8")


@pytest.mark.slow
def test_everything_but_fp8_weights_runs_without_torchao(tmp_path):
    """With torchao unimportable (as on the GPU machine), train.py, mismatch.py and admit.py import, a bf16 +
    FP8 KV engine samples, and --weights fp8 is one line, exit 2, before the run folder is made."""
    block = "import sys; sys.modules['torchao'] = None; "
    script = block + (
        "import train, mismatch, admit, quant; assert not quant.HAVE_TORCHAO; "
        "import sys; sys.argv = ['mismatch.py', '--weights', 'bf16', '--kv-cache', 'fp8', '--probes', '4']; "
        "mismatch.main()"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and "combined" in ok.stdout, ok.stderr[-2000:]
    train = block + "import sys, train; sys.argv = ['train.py'] + sys.argv[1:]; train.main()"
    args = ["--pair", "tiny", "--steps", "1", "--weights", "fp8", "--name", "x", "--out-dir", str(tmp_path)]
    bad = subprocess.run(
        [sys.executable, "-c", train, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr[-2000:]
    assert "torchao" in bad.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_json(tmp_path):
    """tools/gpu_check.sh --dry-run: every step on CPU at toy sizes, into $OUT/gpu_dry_run.json."""
    env = {**os.environ, "OUT": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_dry_run.json").read_text())
    assert out["dry_run"] and out["torch"] == torch.__version__ and "CPU" in out["device_name"]
    assert out["pytest"]["failed"] == 0 and out["pytest"]["skipped"] >= 6  # every gpu test skips on CPU
    rows = out["decode"]["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 and all(r["decode_tokens_per_s"] > 0 for r in rows)  # models, w, kv, B
    cap = out["kv_capacity"]
    assert cap["ratio_arithmetic"] == 2.0 and 1.8 <= cap["ratio_fp8"] <= 2.0  # one byte vs two a element
    assert cap["ratio_fp8_working_copy"] < 1, "the CPU's working copy holds more than a bf16 cache"
    race = out["tiny_race"]
    assert race["target_eval_rkl"] is None or race["target_eval_rkl"] < race["start_eval_rkl"]
    assert "too small" in race["note"] and race["sync_bf16"]["seconds_per_step"] > 0
    assert set(out["seconds"]) == {"pytest", "decode", "kv_capacity", "tiny_race"}


def test_time_to_target_counts_training_seconds_up_to_the_first_evaluation_at_the_target():
    records = [
        {"seconds": 0.0, "eval_rkl": 3.0},
        {"seconds": 1.0},
        {"seconds": 2.0, "eval_rkl": 2.5},
        {"seconds": 4.0, "eval_rkl": 2.0},
    ]
    assert gpu_check.time_to_target(records, 2.6) == 3.0
    assert gpu_check.time_to_target(records, 2.0) == 7.0 and gpu_check.time_to_target(records, 1.0) is None


@pytest.mark.slow
def test_gpu_check_without_a_gpu_is_one_line_exit_2(tmp_path):
    if CUDA:
        pytest.skip("this machine has a CUDA device")
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--dry-run" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()
