"""The GPU check: one prepared run that measures the paper's GPU-side claims and runs the gpu tests.

    bash tools/gpu_check.sh              # a CUDA machine: $OUT/gpu_h200.json (budget: 8 minutes on one H200)
    bash tools/gpu_check.sh --dry-run    # the same steps on CPU at toy sizes: $OUT/gpu_dry_run.json
    python -m tools.gpu_check --dry-run --out /tmp/gpu    # the driver itself, from the repository root

It writes one JSON file, rewritten after every step (a run cut short keeps what it measured):
    environment  device name, compute capability, torch / CUDA / transformers / torchao versions.
    pytest       `pytest -m gpu tests/test_gpu.py`: passed, failed, skipped, and the failing tests.
    kv_capacity  tokens of a SmolLM2-135M-shaped cache that fit in a fixed slice of memory: requests of R
                 tokens, each prefilled into a cache of its own, are admitted while the memory the caches hold
                 stays within the slice (CUDA: torch.cuda.memory_allocated after the prefill minus before the
                 first; CPU: the bytes of the caches' tensors). bf16 DynamicCache vs our FP8 cache as the GPU
                 engine keeps it (one byte per element, no working copy) and as the CPU engine keeps it (with
                 the working copy); ratio to bf16 beside the paper's 1.93x and the arithmetic's 2x.
    decode       decode tokens/s of our sampler (rollout.generate, ignore_eos) on random-weight models of
                 SmolLM2-135M's shape and of Llama-3.2-1B's: engine weights bf16 vs FP8 (fp8-dyn, real W8A8,
                 where the GPU and torchao allow it, else the emulation fp8-emu) × KV cache model (bf16) vs
                 fp8 × batch 1/16/64 (without torchao, bf16 only). With t(n)
                 the wall time of a generate call making n new tokens per row (after a warm-up call),
                     decode tokens/s = B · (N − 1) / (t(N) − t(1))        (prefill excluded).
    tiny_race    train.run on the tiny pair: a synchronous bf16 engine vs an async engine with FP8 weights
                 and FP8 KV. Target = halfway from the starting held-out reverse KL to the worse run's final
                 one (none when a run ends no lower than it started); time to target = seconds of training
                 steps (evaluations excluded) up to the first evaluation at or below it. The tiny models are
                 far too small for FP8 or async rollouts to pay off: this shows that the path runs end to end
                 on the device, not the paper's speed-up.
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as token_models

from cli import EXPECTED, BadInput, Parser, check_output_dir, fail, path_text
from lab.atomic import append_text, atomic_write_text
from lab.train_args import pair_config
from models import device_label, n_params
from quant import (
    HAVE_TORCHAO,
    KVScales,
    fp8_dyn_available,
    fp8_kv_cache,
    kv_bytes_per_token,
    quantize_weights,
)
from rollout import RolloutConfig, generate, prefill
from train import run

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # isort: skip

ROOT = Path(__file__).resolve().parents[1]
PAPER_KV_RATIO = 1.93  # the paper's FP8-KV capacity claim (tokens, fp8 over bf16)
# SmolLM2-135M-Instruct's config.json (the smollm2 teacher) and Llama-3.2-1B's: shapes only, random weights.
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TOY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Sizes:
    """How big each step is: FULL on a GPU, TOY for --dry-run."""

    shapes: tuple  # (name, LlamaConfig kwargs) of the decode-throughput models; the first is KV capacity's
    batches: tuple  # decode batch sizes
    prompt_len: int  # prompt tokens per row in the decode timing
    new_tokens: int  # N of the decode formula
    slice_mib: float  # the memory slice of the KV capacity measurement
    request_tokens: int  # R: tokens of each admitted request
    tiny_steps: int  # optimizer steps of each tiny_race run
    tiny_batch: int  # training prompts per step (4 samples each)
    tiny_eval_every: int
    tiny_eval_prompts: int
    pytest_timeout: int  # seconds


FULL = Sizes(
    shapes=(("smollm2-135m", SMOLLM2_SHAPE), ("llama-1b", LLAMA_1B_SHAPE)),
    batches=(1, 16, 64),
    prompt_len=128,
    new_tokens=32,
    slice_mib=1024,
    request_tokens=512,
    tiny_steps=200,
    tiny_batch=64,
    tiny_eval_every=20,
    tiny_eval_prompts=128,
    pytest_timeout=240,
)
TOY = Sizes(
    shapes=(("smollm2-135m", TOY_SHAPE), ("llama-1b", {**TOY_SHAPE, "num_hidden_layers": 3})),
    batches=(1, 4),
    prompt_len=8,
    new_tokens=4,
    slice_mib=0.5,
    request_tokens=64,
    tiny_steps=4,
    tiny_batch=4,
    tiny_eval_every=2,
    tiny_eval_prompts=8,
    pytest_timeout=120,
)


# ---------------------------------------------------------------------------------------------------
# Random-weight models of a given shape, and a tokenizer for them


def random_model(shape: dict, device, dtype=torch.bfloat16):
    """A LlamaForCausalLM of `shape` with random (seeded) weights, built on `device`, cast to `dtype`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    return model.to(dtype).eval()


def number_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the word str(i); '0' pads (left), '1' ends. Prompts are space-separated numbers."""
    tok = Tokenizer(token_models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", eos_token="1", padding_side="left")


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids_B_P = torch.randint(2, vocab_size, (batch, length), generator=g)
    return [" ".join(map(str, row)) for row in ids_B_P.tolist()]


def kv_cache_factory(kind: str, config, device, working_copy: bool | None = None):
    """A maker of empty caches: kind "model" gives None (the model's default cache), "fp8" our FP8 cache with
    unit scales, keeping its working copy as the engine does on `device` (CPU only; RolloutEngine.new_cache)
    unless `working_copy` says otherwise."""
    if kind == "model":
        return lambda: None
    keep = torch.device(device).type == "cpu" if working_copy is None else working_copy
    return lambda: fp8_kv_cache(KVScales.unit(config), working_copy=keep)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------
# Decode throughput


def decode_rate(model, tokenizer, prompts: list[str], new_tokens: int, new_cache) -> float:
    """Decode tokens/s = B · (N − 1) / (t(N) − t(1)), each t the faster of two generate calls after a
    warm-up one (kernels, workspaces and the allocator's pool come up outside the timing)."""
    device = next(model.parameters()).device

    def seconds(n: int) -> float:
        cfg = RolloutConfig(max_new_tokens=n, ignore_eos=True)
        synchronize(device)
        t0 = time.perf_counter()
        generate(model, tokenizer, prompts, cfg=cfg, cache=new_cache())
        synchronize(device)
        return time.perf_counter() - t0

    seconds(new_tokens)
    t_1 = min(seconds(1), seconds(1))
    t_n = min(seconds(new_tokens), seconds(new_tokens))
    return len(prompts) * (new_tokens - 1) / max(t_n - t_1, 1e-9)


def fp8_weight_mode(device) -> str | None:
    """The FP8 weight mode this device can time: fp8-dyn (real FP8 matmuls), else the emulation, else none."""
    if not HAVE_TORCHAO:
        return None
    return "fp8-dyn" if fp8_dyn_available(device) else "fp8-emu"


def decode_table(sizes: Sizes, device) -> dict:
    """decode_rate for every shape × weights × KV cache × batch, and the speed-ups read off it."""
    fp8 = fp8_weight_mode(device)
    rows = []
    for name, shape in sizes.shapes:
        model = random_model(shape, device)
        tokenizer, params = number_tokenizer(shape["vocab_size"]), n_params(model)
        for weights in ("bf16", fp8) if fp8 else ("bf16",):
            if weights != "bf16":
                quantize_weights(model, weights)  # in place: the bf16 rows are done
            for kv in ("model", "fp8"):
                for batch in sizes.batches:
                    prompts = random_prompts(shape["vocab_size"], batch, sizes.prompt_len)
                    rate = decode_rate(
                        model,
                        tokenizer,
                        prompts,
                        new_tokens=sizes.new_tokens,
                        new_cache=kv_cache_factory(kv, model.config, device),
                    )
                    rows.append(
                        {
                            "model": name,
                            "params": params,
                            "weights": weights,
                            "kv_cache": kv,
                            "batch": batch,
                            "decode_tokens_per_s": rate,
                        }
                    )
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return {
        "fp8_weights": fp8,
        "prompt_len": sizes.prompt_len,
        "new_tokens": sizes.new_tokens,
        "rows": rows,
        "speedups": speedups(rows),
    }


def speedups(rows: list[dict]) -> list[dict]:
    """Per model and batch: FP8 weights over bf16 (model KV), FP8 KV over model KV (bf16 weights), both."""
    rate = {(r["model"], r["weights"], r["kv_cache"], r["batch"]): r["decode_tokens_per_s"] for r in rows}
    out = []
    for (model, weights, kv, batch), base in rate.items():
        if weights != "bf16" or kv != "model":
            continue
        fp8 = next((w for (m, w, _, _) in rate if m == model and w != "bf16"), None)
        row = {"model": model, "batch": batch, "fp8_kv": rate[(model, "bf16", "fp8", batch)] / base}
        if fp8:
            row["fp8_weights"] = rate[(model, fp8, "model", batch)] / base
            row["fp8_weights_and_kv"] = rate[(model, fp8, "fp8", batch)] / base
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------
# KV capacity in a fixed slice of memory


def cache_held_bytes(caches) -> int:
    """Bytes of every tensor the caches' layers hold (each storage once): the CPU's memory count, and a
    cross-check of torch.cuda.memory_allocated on a GPU."""
    storages = {}
    for cache in caches:
        for layer in cache.layers:
            for value in vars(layer).values():
                if torch.is_tensor(value):
                    storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@torch.no_grad()
def fill_slice(model, new_cache, slice_bytes: int, request_tokens: int) -> dict:
    """Admit requests of `request_tokens` random tokens, each prefilled into its own new_cache(), while the
    memory the caches hold stays within `slice_bytes`. Returns the tokens admitted, and their bytes."""
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    ids_1_R = torch.randint(2, model.config.vocab_size, (1, request_tokens), device=device)
    attn_1_R = torch.ones_like(ids_1_R)
    prefill(model, ids_1_R, attn_1_R, cache=new_cache())  # warm-up: kernels and workspaces stay out
    base = torch.cuda.memory_allocated(device) if on_gpu else 0
    caches, used = [], 0
    while len(caches) <= slice_bytes // request_tokens:  # >= 1 byte a token: a cache that holds nothing stops
        cache = new_cache()
        prefill(model, ids_1_R, attn_1_R, cache=cache)
        now = torch.cuda.memory_allocated(device) - base if on_gpu else cache_held_bytes(caches + [cache])
        if now > slice_bytes:
            break
        caches.append(cache)
        used = now
    tokens = len(caches) * request_tokens
    return {
        "tokens": tokens,
        "requests": len(caches),
        "bytes": used,
        "held_bytes": cache_held_bytes(caches),
        "bytes_per_token": used / max(tokens, 1),
    }


def kv_capacity(sizes: Sizes, device) -> dict:
    """fill_slice for the bf16 cache and our FP8 cache (as the GPU engine keeps it, and with the working
    copy) on a bf16 model of the first shape (SmolLM2-135M's); ratios of tokens to bf16's."""
    name, shape = sizes.shapes[0]
    model = random_model(shape, device)
    slice_bytes = int(sizes.slice_mib * 2**20)
    kinds = {
        "bf16": lambda: DynamicCache(config=model.config),
        "fp8": kv_cache_factory("fp8", model.config, device, working_copy=False),
        "fp8_working_copy": kv_cache_factory("fp8", model.config, device, working_copy=True),
    }
    result = {
        kind: fill_slice(model, make, slice_bytes, request_tokens=sizes.request_tokens)
        for kind, make in kinds.items()
    }
    bf16 = max(result["bf16"]["tokens"], 1)
    return {
        "model": name,
        "slice_mib": sizes.slice_mib,
        "request_tokens": sizes.request_tokens,
        **result,
        "ratio_fp8": result["fp8"]["tokens"] / bf16,
        "ratio_fp8_working_copy": result["fp8_working_copy"]["tokens"] / bf16,
        "ratio_arithmetic": kv_bytes_per_token(model.config, "bf16")
        / kv_bytes_per_token(model.config, "fp8"),
        "paper_ratio": PAPER_KV_RATIO,
    }


# ---------------------------------------------------------------------------------------------------
# The tiny race: sync bf16 vs async + FP8, to the same held-out target


def time_to_target(records: list[dict], target: float) -> float | None:
    """Seconds of training steps (evaluations excluded) up to the first evaluation with eval_rkl <= target."""
    elapsed = 0.0
    for r in records:
        elapsed += r["seconds"]
        if r.get("eval_rkl") is not None and r["eval_rkl"] <= target:
            return elapsed
    return None


def tiny_race(sizes: Sizes, device) -> dict:
    """train.run twice on the tiny pair (same seed, prompts and schedule): a synchronous bf16 engine, and an
    async one with FP8 weights (fp8_weight_mode) and FP8 KV (calibrated scales); their times to one target."""
    fp8 = fp8_weight_mode(device)
    arms = {
        "sync_bf16": (False, {"weights": "bf16"}),
        "async_fp8": (True, {"weights": fp8 or "bf16", "kv_cache": "fp8"}),
    }
    runs = {}
    with tempfile.TemporaryDirectory() as work:
        for name, (async_rollout, engine) in arms.items():
            cfg = pair_config(
                "tiny",
                steps=sizes.tiny_steps,
                batch_size=sizes.tiny_batch,
                warmup=max(sizes.tiny_steps // 10, 1),
                eval_every=sizes.tiny_eval_every,
                eval_prompts=sizes.tiny_eval_prompts,
                ckpt_every=0,
                device=str(device),
                async_rollout=async_rollout,
                name=name,
                out_dir=work,
            )
            cfg.rollout = replace(cfg.rollout, **engine)
            runs[name] = run(cfg, quiet=True)
    start = runs["sync_bf16"][0]["eval_rkl"]
    worse_final = max(records[-1]["eval_rkl"] for records in runs.values())
    target = (
        start - 0.5 * (start - worse_final) if worse_final < start else None
    )  # None: a run did not improve
    out = {
        "steps": sizes.tiny_steps,
        "batch_size": sizes.tiny_batch,
        "start_eval_rkl": start,
        "target_eval_rkl": target,
        "async_fp8_weights": fp8 or "bf16 (no torchao here)",
    }
    for name, records in runs.items():
        out[name] = {
            "final_eval_rkl": records[-1]["eval_rkl"],
            "seconds_to_target": time_to_target(records, target) if target is not None else None,
            "seconds_per_step": sum(r["seconds"] for r in records[1:]) / max(len(records) - 1, 1),
        }
    sync_t, fast_t = out["sync_bf16"]["seconds_to_target"], out["async_fp8"]["seconds_to_target"]
    out["time_to_target_ratio"] = sync_t / fast_t if sync_t and fast_t else None  # > 1: async + FP8 is sooner
    out["note"] = (
        "the tiny pair (0.1M-parameter student, 6-token answers) is far too small for FP8 or async "
        "rollouts to pay off; this shows the path runs, not the paper's speed-up"
    )
    return out


# ---------------------------------------------------------------------------------------------------
# The gpu tests, the environment, and the driver


def gpu_tests(out: Path, timeout: int) -> dict:
    """`pytest -m gpu tests/test_gpu.py` in a subprocess; its log and JUnit XML go next to the JSON."""
    xml = out / "pytest_gpu.xml"
    # One process, whatever pytest.ini asks: the device machine need not have pytest-xdist.
    plain = [sys.executable, "-m", "pytest", "-o", "addopts=-p no:cacheprovider"]
    cmd = [*plain, "-q", "-m", "gpu", "tests/test_gpu.py", f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    atomic_write_text(out / "pytest_gpu.log", proc.stdout + proc.stderr)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failing = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "exit_code": proc.returncode,
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "failing": failing,
    }


def environment(device) -> dict:
    info = {
        "device_name": device_label(str(device)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "torchao": version("torchao") if HAVE_TORCHAO else None,
        "python": platform.python_version(),
    }
    if torch.device(device).type == "cuda":
        info["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
        info["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def run_steps(steps: dict, result: dict, path: Path, log: Path) -> bool:
    """Run each step, storing what it returns (or the error it raised) and rewriting the JSON after each:
    one broken step on the device must not cost the others their measurements. True when all succeeded."""
    ok = True
    for name, step in steps.items():
        t0 = time.time()
        try:
            result[name] = step()
        except Exception as e:  # recorded, with its traceback in the log; the next step still runs
            ok = False
            result[name] = {
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            }
            append_text(log, f"--- {name}\n{traceback.format_exc()}\n")
        result.setdefault("seconds", {})[name] = time.time() - t0
        atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return ok


def main(argv=None) -> None:
    parser = Parser(description="Run the gpu tests and measure decode speed, KV capacity and the tiny race.")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every step on CPU at toy sizes (well under a minute): checks the script",
    )
    parser.add_argument(
        "--out",
        type=path_text,
        default="gpu_check_out",
        help="folder for the JSON, the pytest log and tracebacks (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if not args.dry_run and not torch.cuda.is_available():
            raise BadInput("no CUDA device here; run with --dry-run to check the steps on CPU at toy sizes")
        check_output_dir(out, "--out")
        device = torch.device("cpu" if args.dry_run else "cuda")
        sizes = TOY if args.dry_run else FULL
        out.mkdir(parents=True, exist_ok=True)
        path = out / ("gpu_dry_run.json" if args.dry_run else "gpu_h200.json")
        result = {"dry_run": args.dry_run, **environment(device)}
        steps = {
            "pytest": lambda: gpu_tests(out, sizes.pytest_timeout),
            "kv_capacity": lambda: kv_capacity(sizes, device),
            "decode": lambda: decode_table(sizes, device),
            "tiny_race": lambda: tiny_race(sizes, device),
        }
        ok = run_steps(steps, result, path, log=out / "gpu_check_errors.log")  # a full disk: exit 5
    except EXPECTED as e:
        fail(e)
    print(f"wrote {path} ({sum(result['seconds'].values()):.0f} s{'' if ok else '; some steps failed'})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
