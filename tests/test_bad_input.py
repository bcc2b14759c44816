"""Every CLI refuses bad input with one line naming the value, exit code 2, no traceback, and no file
created or changed. Run in-process (each main(argv)), so ~150 cases cost seconds, not minutes.

The cases are grouped by cause (a write target, an unbounded number, a prompt, a resumed folder's contents,
a budget, a dump, a pair, a cache); below them, the behaviours no single refusal shows: two processes racing
for one new run name, the lock's write window, SIGINT/SIGTERM mid-run with an exact resume, and a full disk
at each write."""

import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

GOOD_BUDGET = {
    "schema_version": 2,
    "pair": "tiny",
    "loss": "analytic",
    "tis_cap": 0,
    "budget": 1.0,
    "how": "crossing",
    "tolerance": {"nats": 0.01},
    "seconds_per_run": 10.0,
}


def write_fixtures(root: Path) -> None:
    """Files the cases point at: bad prompt files, budgets, dumps, a finished run and a corrupt one."""
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "bad.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": 5}\n')
    (root / "noanswer.jsonl").write_text("".join(f'{{"prompt": "{i}+1="}}\n' for i in range(20)))
    (root / "afile").write_text("not a folder\n")
    (root / "good_budget.json").write_text(json.dumps(GOOD_BUDGET))
    (root / "nokeys.json").write_text(json.dumps({"schema_version": 2, "pair": "tiny"}))
    (root / "sampled_budget.json").write_text(json.dumps({**GOOD_BUDGET, "loss": "sampled"}))
    (root / "infcap_budget.json").write_text(json.dumps({**GOOD_BUDGET, "loss": "sampler", "tis_cap": "inf"}))
    noloss = {k: v for k, v in GOOD_BUDGET.items() if k not in ("loss", "tis_cap")}
    (root / "noloss_budget.json").write_text(json.dumps(noloss))
    (root / "nan_budget.json").write_text(json.dumps({**GOOD_BUDGET, "budget": math.nan}))
    (root / "v1_budget.json").write_text(json.dumps({**GOOD_BUDGET, "schema_version": 1}))
    (root / "smollm2_budget.json").write_text(json.dumps({**GOOD_BUDGET, "pair": "smollm2"}))
    (root / "bad_how.json").write_text(json.dumps({**GOOD_BUDGET, "how": "guess"}))
    (root / "steps_budget.json").write_text(json.dumps({**GOOD_BUDGET, "steps": 2}))
    (root / "smollm2_validation.json").write_text(json.dumps({"pair": "smollm2", "points": []}))
    (root / "empty.jsonl").write_text("")
    (root / "lengths.jsonl").write_text(
        json.dumps({"engine_logprobs": [-1.0, -2.0], "train_logprobs": [-1.0]}) + "\n"
    )
    (root / "nan.jsonl").write_text('{"engine_logprobs": [-1.0, NaN], "train_logprobs": [-1.0, -2.0]}\n')
    (root / "positive.jsonl").write_text(
        json.dumps({"engine_logprobs": [0.5], "train_logprobs": [-1.0]}) + "\n"
    )
    (root / "notjson.jsonl").write_text('{"engine_logprobs": [-1.0], "train_logprobs": [-1.0]}\n{oops\n')
    (root / "nokey.jsonl").write_text(json.dumps({"engine_logprobs": [-1.0]}) + "\n")
    (root / "broken.pt").write_bytes(b"not a torch file")
    (root / "runs" / "exists").mkdir(parents=True)
    (root / "runs" / "exists" / "metrics.jsonl").write_text("precious\n")
    write_hostile_fixtures(root)


def write_hostile_fixtures(root: Path) -> None:
    """Files for the causes: prompts, budgets and dumps of the wrong type or size, a FIFO, bad pairs."""
    # distinct prompts (a repeated one is refused first, as both held out and trained on)
    (root / "surrogate.jsonl").write_text("".join(f'{{"prompt": "{i}+\\ud800="}}\n' for i in range(12)))
    long_prompt = {"prompt": "1+" * 40 + "1="}  # 82 characters; tiny's context is 64 tokens
    (root / "long.jsonl").write_text(
        "".join(json.dumps(p) + "\n" for p in [*({"prompt": f"{i}+1="} for i in range(11)), long_prompt])
    )
    (root / "alien.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+x="}) + "\n" for i in range(12)))
    (root / "one.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    (root / "dup.jsonl").write_text((json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n") * 12)
    os.mkfifo(root / "fifo")
    budgets = {
        "bool_budget.json": {**GOOD_BUDGET, "budget": True},
        "zero_seconds.json": {**GOOD_BUDGET, "seconds_per_run": 0},
        "zero_tolerance.json": {**GOOD_BUDGET, "tolerance": {"nats": 0.0}},
        "str_tolerance.json": {**GOOD_BUDGET, "tolerance": "abc"},
    }
    for name, budget in budgets.items():
        (root / name).write_text(json.dumps(budget))
    (root / "bigint_budget.json").write_text(
        json.dumps(GOOD_BUDGET).replace('"budget": 1.0', '"budget": 1' + "0" * 400)
    )
    (root / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    good = {"engine_logprobs": [-1.0, -2.0], "train_logprobs": [-1.0, -2.0]}
    (root / "bigint.jsonl").write_text(json.dumps(good).replace("-2.0]", "-1" + "0" * 400 + "]", 1) + "\n")
    (root / "tiny_logprob.jsonl").write_text(json.dumps({**good, "engine_logprobs": [-1.0, -1e308]}) + "\n")
    (root / "nested.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    t = torch.full((2, 3), -1.0)
    torch.save({"engine_logprobs": [[-1.0]], "train_logprobs": t, "mask": t}, root / "list.pt")
    torch.save({"engine_logprobs": t, "train_logprobs": t, "mask": "all"}, root / "strmask.pt")
    torch.save({"engine_logprobs": t.long(), "train_logprobs": t, "mask": t}, root / "intlogp.pt")
    big = torch.full((200_001, 1), -1.0)
    torch.save(
        {"engine_logprobs": big, "train_logprobs": big, "mask": torch.ones(200_001, 1)}, root / "big.pt"
    )
    write_bad_pairs(root)


def write_bad_pairs(root: Path) -> None:
    """--teacher/--student folders that cannot be a pair: weights missing, a tokenizer without EOS or pad, a
    vocabulary smaller than the tokenizer; and an $OPD_CACHE with a truncated conversion."""
    from transformers import LlamaForCausalLM

    from models import TINY_DIR, tiny_config

    (root / "noweights").mkdir()
    shutil.copy(TINY_DIR / "student" / "config.json", root / "noweights" / "config.json")
    for side in ("teacher", "student"):
        shutil.copytree(TINY_DIR / side, root / "noeos" / side)
        path = root / "noeos" / side / "tokenizer_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in config.items() if k not in ("eos_token", "pad_token")}))
        config = tiny_config("student")
        config.vocab_size = 10  # the tokenizer has 15 tokens
        LlamaForCausalLM(config).save_pretrained(root / "smallvocab" / side)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TINY_DIR / side / name, root / "smallvocab" / side / name)
    cache = root / "cache" / "smollm2-135m-instruct"
    cache.mkdir(parents=True)
    shutil.copy(TINY_DIR / "student" / "config.json", cache / "config.json")
    data = (TINY_DIR / "student" / "model.safetensors").read_bytes()
    (cache / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    prompts = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    (root / "pairprompts.jsonl").write_text(prompts)


def write_bad_runs(root: Path) -> None:
    """Copies of the finished run `done` with one thing wrong each, for --resume."""
    done = root / "runs" / "done"

    def copy(name: str, config=None, checkpoint=None) -> Path:
        shutil.copytree(done, root / "runs" / name)
        if config is not None:
            saved = json.loads((done / "config.json").read_text())
            (root / "runs" / name / "config.json").write_text(json.dumps({**saved, **config}))
        if checkpoint is not None:
            state = torch.load(done / "checkpoint.pt", weights_only=True)
            torch.save({**state, **checkpoint(state)}, root / "runs" / name / "checkpoint.pt")
        return root / "runs" / name

    copy("strsteps", config={"steps": "abc"})
    copy("strlr", config={"lr": "fast"})
    copy("boolsteps", config={"steps": True})
    copy("otherpair", config={"pair": "nope"})
    copy("hugelr", config={"lr": 1e39})
    copy("strstep", checkpoint=lambda state: {"step": "2"})
    teacher = torch.load(done.parent.parent / "teacher_state.pt", weights_only=True)
    copy("otherarch", checkpoint=lambda state: {"student": teacher})
    copy("asyncckpt", checkpoint=lambda state: {"config": {**state["config"], "async_rollout": True}})
    metrics_dir = copy("metricsdir")
    (metrics_dir / "metrics.jsonl").unlink()
    (metrics_dir / "metrics.jsonl").mkdir()
    (copy("lockdir") / ".lock").mkdir()
    (copy("nockpt") / "checkpoint.pt").unlink()  # finished, its checkpoint removed to reclaim space


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the fixtures and a finished 2-step tiny run (runs/done) and a corrupt copy of it."""
    import train

    root = tmp_path_factory.mktemp("bad")
    write_fixtures(root)
    cfg = train.pair_config(
        "tiny",
        steps=2,
        batch_size=4,
        samples_per_prompt=2,
        eval_every=0,
        eval_prompts=8,
        name="done",
        out_dir=str(root / "runs"),
    )
    train.run(cfg, quiet=True)
    from models import load_pair

    torch.save(load_pair("tiny").teacher.state_dict(), root / "teacher_state.pt")
    write_bad_runs(root)
    corrupt = root / "runs" / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((root / "runs" / "done" / "config.json").read_text())
    (corrupt / "checkpoint.pt").write_bytes(b"\x00" * 100)
    return root


TRAIN = [
    (["--pair", "nope"], "--pair"),
    (["--loss", "forward"], "--loss"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--prompts", "missing.jsonl"], "missing.jsonl"),
    (["--device", "tpu"], "--device"),
    (["--tis-cap", "2"], "--tis-cap 2"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--warmup", "-1"], "--warmup"),
    (["--grad-clip", "-1"], "--grad-clip"),
    (["--grad-clip", "nan"], "--grad-clip"),
    (["--noise", "inf"], "--noise"),
    (["--noise", "-0.1"], "--noise"),
    (["--noise", "nan"], "--noise"),
    (["--temperature", "-1"], "--temperature"),
    (["--staleness", "-1"], "--staleness"),
    (["--batch-size", "0"], "--batch-size"),
    (["--samples-per-prompt", "0"], "--samples-per-prompt"),
    (["--eval-prompts", "0"], "--eval-prompts"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--kl-chunk", "0"], "--kl-chunk"),
    (["--ckpt-every", "-1"], "--ckpt-every"),
    (["--ckpt-minutes", "nan"], "--ckpt-minutes"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--weights", "fp16"], "--weights"),
    (["--kv-cache", "fp4"], "--kv-cache"),
    (["--kv-scales", "auto"], "--kv-scales"),
    (["--student-layers", "10"], "--student-layers 10"),
    (["--seed", "abc"], "--seed"),
    (["--teacher", "./nope", "--student", "./nope2", "--prompts", "bad.jsonl"], "bad.jsonl:2"),
    (["--teacher", "./nope", "--student", "./nope2", "--prompts", "noanswer.jsonl"], "./nope"),
    (["--teacher", "x/y"], "--teacher and --student"),
    (["--prompts", "latin1.jsonl"], "not UTF-8"),
    (["--prompts", "bad.jsonl"], "bad.jsonl:2"),
    (["--out-dir", "afile"], "afile"),
    (["--weights", "fp8-dyn"], "fp8-dyn"),
    (["--noise", "1e38"], "noise"),
    (["--loss", "grpo", "--prompts", "noanswer.jsonl"], "--loss grpo"),
    (["--name", "exists"], "already exists"),
    (["--resume"], "--resume needs --name"),
    (["--resume", "--name", "missing"], "nothing to resume"),
    (["--resume", "--name", "done", "--steps", "1"], "--steps 1"),
    (["--resume", "--name", "corrupt"], "cannot be read"),
    # write targets: checked before any work
    (["--out-dir", "afile/runs"], "afile is a file"),
    (["--out-dir", "/proc/opd-runs"], "cannot create"),
    (["--name", "x" * 300], "at most 255 bytes"),
    (["--name", "a/b"], "one folder name"),
    (["--name", ".."], "one folder name"),
    (["--name", "/tmp/abs"], "one folder name"),
    # numbers: typed and bounded by what the machine and the model hold
    (["--seed", str(2**63)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--temperature", "1e-310"], "--temperature"),
    (["--max-new-tokens", "1000000"], "--max-new-tokens"),
    (["--max-new-tokens", "60"], "context"),
    (["--batch-size", "10000000000000"], "--batch-size"),
    (["--batch-size", "4096", "--samples-per-prompt", "2"], "rows"),
    (["--eval-prompts", "100000"], "--eval-prompts"),
    (["--lr", "1e39"], "--lr"),
    (["--steps", str(2**40)], "--steps"),
    (["--loss", "grpo", "--samples-per-prompt", "1"], "--samples-per-prompt 1"),
    # prompts: encodable, in the vocabulary, inside the context; the held-out set disjoint from training
    (["--prompts", "surrogate.jsonl"], "cannot encode"),
    (["--prompts", "alien.jsonl"], "vocabulary"),
    (["--prompts", "long.jsonl"], "context"),
    (["--prompts", "one.jsonl"], "at least 2"),
    (["--prompts", "dup.jsonl"], "both held out"),
    # pairs whose models and tokenizer agree
    (["--teacher", "noweights", "--student", "noweights", "--prompts", "pairprompts.jsonl"], "cannot load"),
    (["--teacher", "noeos/teacher", "--student", "noeos/student", "--prompts", "pairprompts.jsonl"], "EOS"),
    (
        [
            "--teacher",
            "smallvocab/teacher",
            "--student",
            "smallvocab/student",
            "--prompts",
            "pairprompts.jsonl",
        ],
        "output logits",
    ),
    # a resumed folder: typed config.json, checkpoint, metrics; flags that would change the run
    (["--resume", "--name", "strsteps"], "steps is 'abc'"),
    (["--resume", "--name", "strlr"], "lr is 'fast'"),
    (["--resume", "--name", "boolsteps"], "steps is"),
    (["--resume", "--name", "otherpair"], "pair is 'nope'"),
    (["--resume", "--name", "hugelr"], "lr is 1e+39"),
    (["--resume", "--name", "strstep"], "step is '2'"),
    (["--resume", "--name", "otherarch"], "does not fit"),
    (["--resume", "--name", "asyncckpt"], "async_rollout"),
    (["--resume", "--name", "metricsdir"], "not a regular file"),
    (["--resume", "--name", "lockdir"], "not a lock file"),
    (["--resume", "--name", "nockpt", "--steps", "3"], "finished its 2 steps and has no checkpoint"),
    (["--resume", "--name", "done", "--lr", "0.1"], "lr 0.1"),
    (["--resume", "--name", "done", "--weights", "bf16"], "rollout.weights"),
    (["--resume", "--name", "../runs/done"], "one folder name"),
]
OTHERS = [
    ("mismatch", ["--probes", "0"], "--probes"),
    ("mismatch", ["--probes", "-5"], "--probes"),
    ("mismatch", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("mismatch", ["--noise", "inf"], "--noise"),
    ("mismatch", ["--kv-cache", "fp4"], "--kv-cache"),
    ("mismatch", ["--staleness", "2"], "python -m study sources"),
    ("mismatch", ["--pair", "nope"], "--pair"),
    ("mismatch", ["--prompts", "missing.jsonl"], "missing.jsonl"),
    ("mismatch", ["--dump-out", "no/such/dir/x.jsonl"], "--dump-out"),
    ("mismatch", ["--noise", "1e38"], "noise"),
    ("quant", ["kv-capacity", "--memory-gb", "nan"], "--memory-gb"),
    ("quant", ["kv-capacity", "--memory-gb", "inf"], "--memory-gb"),
    ("quant", ["kv-capacity", "--memory-gb", "0"], "--memory-gb"),
    ("quant", ["kv-capacity", "--pairs", "foo"], "'foo'"),
    ("admit", ["check", "--budget", "good_budget.json", "--probes", "0"], "--probes"),
    ("admit", ["check", "--budget", "good_budget.json", "--probes", "-3"], "--probes"),
    ("admit", ["check", "--budget", "missing.json"], "missing.json"),
    ("admit", ["check", "--budget", "nokeys.json"], "budget is None"),
    ("admit", ["check", "--budget", "good_budget.json", "--loss", "sampler"], "calibrated for loss analytic"),
    ("admit", ["check", "--budget", "sampled_budget.json", "--tis-cap", "2"], "for loss sampled;"),
    ("admit", ["check", "--budget", "noloss_budget.json"], "loss is None"),
    ("admit", ["check", "--budget", "infcap_budget.json", "--tis-cap", "-1"], "--tis-cap"),
    ("lab.calibrate", ["--tis-cap", "2"], "analytic loss has no importance weights"),
    ("admit", ["check", "--budget", "nan_budget.json"], "budget is nan"),
    ("admit", ["check", "--budget", "v1_budget.json"], "schema_version 1"),
    ("admit", ["check", "--budget", "smollm2_budget.json"], "'smollm2'"),
    ("admit", ["check", "--budget", "bad_how.json"], "guess"),
    ("admit", ["check", "--budget", "afile"], "not JSON"),
    ("lab.calibrate", ["--tolerance", "1.5"], "--tolerance"),
    ("lab.calibrate", ["--noise-grid", "a,b"], "--noise-grid"),
    ("lab.calibrate", ["--noise-grid", "nan"], "--noise-grid"),
    ("lab.calibrate", ["--real", "bogus"], "bogus"),
    ("lab.calibrate", ["--steps", "0"], "--steps"),
    ("lab.calibrate", ["--reuse", "missing.json"], "--reuse missing.json: no such file"),
    ("lab.calibrate", ["--reuse", "smollm2_budget.json"], "'smollm2'"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "empty.jsonl"], "no sequences"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "lengths.jsonl"], "lengths.jsonl:1"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "nan.jsonl"], "nan.jsonl:1"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "positive.jsonl"], "positive log-prob"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "notjson.jsonl"], "notjson.jsonl:2"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "nokey.jsonl"], "train_logprobs"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "broken.pt"], "broken.pt"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "missing.jsonl"], "missing.jsonl"),
    ("study.__main__", ["validate", "--seeds", "0"], "--seeds"),
    ("study.__main__", ["async", "--steps", "0"], "--steps"),
    ("study.__main__", ["validate", "--pair", "nope"], "--pair"),
    ("study.__main__", ["validate", "--pair", "gemma3"], "gemma3"),
    ("study.__main__", ["validate", "--budget", "missing.json"], "missing.json"),
    ("study.__main__", ["validate", "--budget", "steps_budget.json", "--reuse", "missing.json"], "--reuse"),
    (
        "study.__main__",
        ["validate", "--budget", "steps_budget.json", "--reuse", "smollm2_validation.json"],
        "pair is 'smollm2'",
    ),
    ("study.__main__", ["sources", "--probes", "0"], "--probes"),
    ("study.__main__", ["sensitivity", "--weights", "bf16"], "--weights"),
    ("study.__main__", ["sensitivity", "--out", "afile"], "afile"),
    ("study.__main__", ["sources", "--noise", "-1"], "--noise"),
    ("study.__main__", ["coverage", "--draws", "0"], "--draws"),
    ("study.__main__", ["coverage", "--pair", "gemma3"], "--pair"),
    ("rollout", ["--n", "-2"], "--n"),
    ("rollout", ["--top-p", "2"], "--top-p"),
    ("models", ["info", "--pair", "nope"], "--pair"),
    ("opd_minimal", ["--lr", "nan"], "--lr"),
    ("opd_minimal", ["--batch", "0"], "--batch"),
    ("opd_minimal", ["--steps", "0"], "--steps"),
    ("opd_minimal", ["--noise", "-1"], "--noise"),
    # write targets of the other CLIs: a FIFO would block forever, a device would swallow the file
    ("mismatch", ["--dump-out", "/dev/full"], "not a regular file"),
    ("mismatch", ["--dump-out", "fifo"], "not a regular file"),
    ("mismatch", ["--dump-out", "afile/x.jsonl"], "--dump-out"),
    ("study.__main__", ["sensitivity", "--out", "afile/sub"], "afile is a file"),
    ("lab.calibrate", ["--out", "afile/sub"], "afile is a file"),
    # numbers
    ("mismatch", ["--seed", "-1"], "--seed"),
    ("mismatch", ["--max-new-tokens", "70"], "context"),
    ("rollout", ["--temperature", "1e-310"], "--temperature"),
    ("rollout", ["--seed", str(2**64)], "--seed"),
    ("rollout", ["--n", "99999999"], "--n"),
    ("tools.bench_sampler", ["--temperature", "1e-9"], "--temperature"),
    ("tools.bench_sampler", ["--batch", "10000000"], "--batch"),
    ("tools.bench_check", ["--pair", "gemma3"], "--pair"),
    ("tools.bench_noise", ["--rounds", "0"], "--rounds"),
    ("admit", ["check", "--budget", "good_budget.json", "--seed", "1" + "0" * 30], "--seed"),
    ("study.__main__", ["sources", "--seed", "-5"], "--seed"),
    # prompts
    ("mismatch", ["--prompts", "surrogate.jsonl"], "cannot encode"),
    # budget files: no bools for numbers, finite, positive tolerance and run time, no deep nesting
    ("admit", ["check", "--budget", "bool_budget.json"], "budget is True"),
    ("admit", ["check", "--budget", "bigint_budget.json"], "budget is 1000"),
    ("admit", ["check", "--budget", "zero_seconds.json"], "seconds_per_run is 0"),
    ("admit", ["check", "--budget", "zero_tolerance.json"], "tolerance.nats is 0.0"),
    ("admit", ["check", "--budget", "str_tolerance.json"], "tolerance.nats is 'abc'"),
    ("admit", ["check", "--budget", "nested.json"], "not JSON"),
    # dumps: typed tensors, finite log-probs a float can hold, a size cap
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "list.pt"], "engine_logprobs is a list"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "strmask.pt"], "mask is a str"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "intlogp.pt"], "torch.int64"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "big.pt"], "at most 100000 sequences"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "bigint.jsonl"], "too large"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "tiny_logprob.jsonl"], "-1e+308"),
    ("admit", ["check", "--budget", "good_budget.json", "--dump", "nested.jsonl"], "not valid JSON"),
]
# (module, argv, needle, environment): causes that come from the environment
ENV_CASES = [
    ("models", ["info", "--pair", "smollm2"], "is not a folder", {"OPD_CACHE": "afile"}),
    ("models", ["info", "--pair", "smollm2"], "afile is a file", {"OPD_CACHE": "afile/cache"}),
    ("models", ["info", "--pair", "smollm2"], "cached conversion cannot be read", {"OPD_CACHE": "cache"}),
]
CASES = [
    ("train", ["--pair", "tiny", *argv] if "--pair" not in argv and "--teacher" not in argv else argv, needle)
    for argv, needle in TRAIN
] + OTHERS


def tree(root: Path) -> dict:
    """Every file's size and mtime, and every folder's existence. A folder's own mtime is left out: taking and
    releasing a run's lock inside it changes that, and nothing else."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "folder"
        for p in root.rglob("*")
    }


def case_id(module: str, argv: list[str]) -> str:
    return " ".join([module, *argv])[:120]


@pytest.mark.parametrize(
    "module, argv, needle, env",
    [(*case, {}) for case in CASES] + ENV_CASES,
    ids=[case_id(m, a) for m, a, _ in CASES] + [f"{case_id(m, a)} {e}" for m, a, _, e in ENV_CASES],
)
def test_bad_input_is_one_line_exit_2(workdir, monkeypatch, capsys, module, argv, needle, env):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = tree(workdir)
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert tree(workdir) == before, "a refused command created or changed files"


CLIS = (
    "train",
    "mismatch",
    "quant",
    "admit",
    "lab.calibrate",
    "study.__main__",
    "rollout",
    "models",
    "opd_minimal",
    "tools.bench_sampler",
    "tools.bench_check",
    "tools.bench_noise",
)


def test_every_cli_and_every_bounded_flag_of_train_has_a_refusal_case():
    """Every entry point is exercised, and every train.py flag with a typed converter (a number) has at least
    one case that gives it a bad value: a new flag without a case fails here."""
    import train

    assert set(CLIS) == {m for m, _, _ in CASES} | {m for m, _, _, _ in ENV_CASES}
    typed_flags = {
        action.option_strings[0]
        for action in train.build_parser()._actions
        if action.option_strings and callable(action.type) and action.type not in (str,)
    }
    covered = {arg for _, argv, _ in CASES for arg in argv if arg.startswith("--")}
    assert typed_flags and typed_flags <= covered, sorted(typed_flags - covered)


# ---------------------------------------------------------------------------------------------------
# Behaviours: reuse, the lock, a race, signals, a full disk

TINY = ["--pair", "tiny", "--batch-size", "4", "--samples-per-prompt", "2", "--eval-prompts", "8"]


def cli(*args, cwd, **popen):
    command = [sys.executable, str(ROOT / "train.py"), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=env, text=True, **popen)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in records]


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reusable_run_needs_the_same_settings_and_an_evaluation_at_the_step(workdir):
    from lab.runfiles import reusable_run

    done = workdir / "runs" / "done"
    settings = json.loads((done / "config.json").read_text())
    assert reusable_run(done, settings, step=2)
    assert not reusable_run(done, {**settings, "steps": 4}, step=2), "other steps"
    assert not reusable_run(done, {**settings, "rollout": {**settings["rollout"], "noise": 0.1}}, step=2)
    assert not reusable_run(done, settings, step=1), "eval_every 0: no evaluation at step 1"
    assert not reusable_run(workdir / "runs" / "corrupt", settings, step=2), "no metrics"
    assert not reusable_run(workdir / "runs" / "metricsdir", settings, step=2), "metrics.jsonl a folder"


def test_run_or_resume_refuses_a_finished_run_made_with_other_steps(workdir, monkeypatch):
    """What a calibration calls: a finished 2-step run is not reused (nor overwritten) for 1 step."""
    from dataclasses import replace

    import train
    from cli import BadInput
    from lab.runfiles import load_config

    monkeypatch.chdir(workdir)
    done = workdir / "runs" / "done"
    cfg = replace(load_config(done, train.TrainConfig), out_dir=str(workdir / "runs"), name="done")
    before = tree(workdir)
    with pytest.raises(BadInput, match="--steps 1: .* already finished 2 steps"):
        train.run_or_resume(replace(cfg, steps=1))
    assert without_time(train.run_or_resume(cfg)) == without_time(metric_lines(done)), "same settings: reused"
    assert tree(workdir) == before


def test_the_lock_appears_with_its_content_or_not_at_all(tmp_path, monkeypatch):
    """A process paused for 1 s inside taking the lock (its content written, not yet linked into place): a
    second one takes the lock meanwhile, the first is then refused, and .lock is never seen empty."""
    from cli import BadInput
    from lab.runfiles import RunLock

    real_link = os.link

    def slow_link(src, dst):
        if threading.current_thread().name == "slow":
            time.sleep(1.0)
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", slow_link)
    held, refused, seen = {}, {}, []

    def take(name: str) -> None:
        lock = RunLock(tmp_path)
        try:
            lock.acquire()
            held[name] = lock
        except BadInput as e:
            refused[name] = str(e)

    slow = threading.Thread(target=take, args=("slow",), name="slow")
    slow.start()
    time.sleep(0.2)
    fast = threading.Thread(target=take, args=("fast",), name="fast")
    fast.start()
    while slow.is_alive():
        try:
            seen.append((tmp_path / ".lock").read_text())
        except FileNotFoundError:
            pass
    fast.join()
    assert list(held) == ["fast"] and f"in use by PID {os.getpid()}" in refused["slow"], (held, refused)
    assert seen and all(json.loads(text)["pid"] == os.getpid() for text in seen), "never empty or partial"
    held["fast"].release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no lock and no private file left"


def test_a_lock_is_judged_by_its_flock_never_by_its_content(tmp_path):
    """An empty .lock whose writer is alive (it holds the flock) is refused, not taken over; once that writer
    is gone, the same empty file is taken over with a note."""
    import fcntl

    from cli import BadInput
    from lab.runfiles import RunLock

    path = tmp_path / ".lock"
    path.write_text("")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with pytest.raises(BadInput, match="in use"):
        RunLock(tmp_path).acquire()
    assert path.read_text() == "", "not taken over while its writer lives"
    os.close(fd)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_a_folder_holding_only_a_dead_runs_lock_can_be_started(tmp_path, monkeypatch):
    import train

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "lockonly"
    run_dir.mkdir(parents=True)
    (run_dir / ".lock").write_text("")  # what a full disk at the very start used to leave
    train.main([*TINY, "--steps", "1", "--eval-every", "0", "--name", "lockonly"])
    assert [r["step"] for r in metric_lines(run_dir)] == [0, 1] and not (run_dir / ".lock").exists()


def test_two_processes_racing_for_one_new_name_never_overwrite_a_run(tmp_path, monkeypatch):
    """The slower process passes the early "folder exists" check before the faster one starts, then loads
    its pair until the faster run has finished: under the lock it finds the finished run and is refused."""
    args = [*TINY, "--steps", "2", "--eval-every", "0", "--name", "race"]
    slow = f"""
import pathlib, sys, time
sys.path.insert(0, {str(ROOT)!r})
import train
load = train.load_pair
def slow_load(*a, **k):
    pathlib.Path("slow_checked").touch()  # past the early check; the folder did not exist yet
    while not pathlib.Path("go").exists():
        time.sleep(0.05)
    return load(*a, **k)
train.load_pair = slow_load
train.main({args!r})
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", slow],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while not (tmp_path / "slow_checked").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "runs").exists()
    import train

    monkeypatch.chdir(tmp_path)
    train.main(args)  # the faster process (this one) finishes the run
    run_dir = tmp_path / "runs" / "race"
    finished = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.strip().splitlines() == [err.strip().splitlines()[-1]], err
    assert "already exists" in err and "never overwritten" in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == finished, "the finished run is untouched"


SIGNAL_RUN = [*TINY, "--steps", "40", "--ckpt-every", "7", "--eval-every", "6"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    full = cli(*SIGNAL_RUN, "--name", "full", cwd=root)
    assert full.returncode == 0, full.stderr[-2000:]
    return root / "runs" / "full"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_at_a_safe_point_and_the_resume_is_exact(
    tmp_path, monkeypatch, capsys, uninterrupted, signum
):
    """SIGINT/SIGTERM mid-run: one line naming the step and the resume command, exit 128 + signal, a
    checkpoint at that step, the lock released. metrics.jsonl is then damaged (a line lost, one repeated):
    the resume repairs it from the checkpoint's copy, and ends exactly where the uninterrupted run did."""
    proc = cli(*SIGNAL_RUN, "--name", "cut", cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    path, deadline = tmp_path / "runs" / "cut" / "metrics.jsonl", time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= 4:
            proc.send_signal(signum)
            break
        time.sleep(0.01)
    err = proc.communicate(timeout=300)[1]
    line = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signum and "Traceback" not in err, err[-2000:]
    assert line.startswith("interrupted at step ") and line.endswith("--name cut --resume"), line
    step = int(line.split()[3].rstrip(";"))
    run_dir = tmp_path / "runs" / "cut"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint.pt", "config.json", "metrics.jsonl"]
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == step < 40
    lines = path.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(step + 1))
    path.write_text("\n".join([lines[0], *lines[2:], lines[-1]]) + "\n")  # step 1 lost, the last repeated
    import train

    monkeypatch.chdir(tmp_path)
    train.main(["--name", "cut", "--resume"])
    assert "rewritten from the checkpoint" in capsys.readouterr().err
    assert without_time(metric_lines(run_dir)) == without_time(metric_lines(uninterrupted))
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (run_dir, uninterrupted))
    assert all(torch.equal(a["student"][k], b["student"][k]) for k in a["student"])


class FullDisk:
    """A file on a full disk: the first write lands half of its bytes, then fails with ENOSPC."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        data = bytes(data)
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()
        return False


def full_disk_at(monkeypatch, target: str, nth: int = 1) -> None:
    """Every write goes through cli._open: the nth file opened whose name starts with target is full."""
    import cli

    real_open, count = cli._open, []

    def open_(path, mode):
        f = real_open(path, mode)
        if Path(path).name.startswith(target):
            count.append(path)
            if len(count) == nth:
                return FullDisk(f)
        return f

    monkeypatch.setattr(cli, "_open", open_)


# (file, which write of it fails): the lock's private file, config.json, the second metrics line, the first
# checkpoint, the plot
WRITES = [(".lock", 1), ("config.json", 1), ("metrics.jsonl", 2), ("checkpoint.pt", 1), ("curves.png", 1)]


@pytest.mark.parametrize("target, nth", WRITES, ids=[t for t, _ in WRITES])
def test_a_full_disk_at_any_write_is_one_line_exit_5_and_nothing_half_written(
    tmp_path, monkeypatch, capsys, target, nth
):
    import train

    monkeypatch.chdir(tmp_path)
    args = [*TINY, "--steps", "2", "--eval-every", "0", "--ckpt-every", "1", "--name", "full"]
    full_disk_at(monkeypatch, target, nth=nth)
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 5 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: could not write runs/full/"), err
    run_dir = tmp_path / "runs" / "full"
    left = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert not [n for n in left if n.endswith((".tmp", ".new")) or n == ".lock"], left
    if (run_dir / "metrics.jsonl").exists():
        assert [r["step"] for r in metric_lines(run_dir)] == list(range(len(metric_lines(run_dir))))
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    if "config.json" in left:  # with room again, the run goes on (resume), or starts (nothing was kept)
        train.main([*args, "--resume"])
    else:
        assert left == [], "a run that wrote nothing leaves no folder"
        train.main(args)
    assert [r["step"] for r in metric_lines(run_dir)] == [0, 1, 2]


def test_a_full_disk_writing_a_dump_is_one_line_exit_5(workdir, tmp_path, monkeypatch, capsys):
    import mismatch

    monkeypatch.chdir(tmp_path)
    full_disk_at(monkeypatch, "dump.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        mismatch.main(["--pair", "tiny", "--probes", "4", "--dump-out", "dump.jsonl"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 5 and err.strip().splitlines()[-1].startswith("error: could not write")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no dump and no temporary file"


def test_resume_applies_the_safe_flags_and_records_them(workdir, tmp_path, monkeypatch, capsys):
    import train

    shutil.copytree(workdir / "runs" / "done", tmp_path / "runs" / "again")
    monkeypatch.chdir(tmp_path)
    train.main(["--name", "again", "--resume", "--steps", "3", "--ckpt-every", "3", "--pair", "tiny"])
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --resume: ckpt_every 3 (was 100); recorded in config.json",
        "note: --resume: steps 3 (was 2); recorded in config.json",
    ], err
    saved = json.loads((tmp_path / "runs" / "again" / "config.json").read_text())
    assert (saved["steps"], saved["ckpt_every"]) == (3, 3)
    assert [r["step"] for r in metric_lines(tmp_path / "runs" / "again")] == [0, 1, 2, 3]


def test_a_read_only_output_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    """A read-only mount: access(2) says EROFS even to root, whom a chmod would not stop (so it is simulated)."""
    import cli
    from cli import BadInput, check_output_dir, check_output_file

    real_access = os.access
    monkeypatch.setattr(
        cli.os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode)
    )
    with pytest.raises(BadInput, match="is not writable"):
        check_output_dir(tmp_path / "runs", "--out-dir")
    with pytest.raises(BadInput, match="is not writable"):
        check_output_file(tmp_path / "dump.jsonl", "--dump-out")


def test_a_zero_byte_or_truncated_cache_file_is_one_line(tmp_path):
    from cli import BadInput
    from lab.runfiles import load_cached

    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save([{"w": torch.ones(1000)}], tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:600])
    for name in ("empty.pt", "cut.pt"):
        with pytest.raises(BadInput, match=f"{name}: a cached file that cannot be read"):
            load_cached(tmp_path / name, "cpu")
