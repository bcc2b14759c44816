"""Every CLI refuses bad input with one line naming the value, exit code 2, no traceback, and no file
created or changed. Run in-process (each main(argv)), so ~150 cases cost seconds, not minutes.

The cases are grouped by cause (a write target, an unbounded number, a prompt, a resumed folder's contents,
a budget, a dump, a pair, a cache); below them, the behaviours no single refusal shows: two processes racing
for one new run name, the lock's write window, SIGINT/SIGTERM mid-run with an exact resume, and a full disk
at each write. BY_CAUSE holds the entry points' own causes (targets checked before work, bounds, names that
are not text); at the end, their behaviours: an audit's targets and its atomic figure, build_tiny's swap, a
run's id, and one signal rule for every entry point (each started as a user starts it, signalled once it has
its handlers: one line, exit 130 / 143, nothing written)."""

import argparse
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
CI = {
    "level": 0.95,
    "lo": 0.5,
    "hi": 2.0,
    "draws": 2000,
    "beyond_largest_mismatch": 0.0,
}  # calibrate.budget_ci
NOISE = {"eval_sd_by_prompts": {}, "eval_seeds": 4, **dict.fromkeys(("paired_loss_sd", "paired_loss_se"))}
NOISE["tolerance_over_se"] = None  # calibrate.quality_noise's fields, as one seed leaves them
VALIDATION_OF_STEPS_BUDGET = {
    "pair": "tiny",
    "loss": "analytic",
    "budget": 1.0,
    "steps": 2,
}  # steps_budget.json


CHECK_DUMP = ["check", "--budget", "good_budget.json", "--dump"]


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
    write_typed_fixtures(root)
    write_entry_fixtures(root)


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


def write_typed_fixtures(root: Path) -> None:
    """Other systems' exports with one field of the wrong type (each written in its system's layout by
    native_fixtures.py), budgets whose fields disagree or are mistyped, and recorded points that are not."""
    from native_fixtures import (
        make_truth,
        write_prime_rl,
        write_slime_main,
        write_trl,
        write_verl,
        write_vllm,
    )

    def edit_pt(path: Path, **fields) -> None:
        data = torch.load(path, weights_only=True)
        torch.save({**data, **{k: f(data) for k, f in fields.items()}}, path)

    def edit_jsonl(path: Path, edit) -> None:
        record = json.loads(path.read_text().splitlines()[0])
        edit(record)
        path.write_text(json.dumps(record) + "\n")

    truth = make_truth(steps=(0,))
    write_verl(root / "verl_good", truth)
    edit_pt(write_verl(root / "verl_nan", truth) / "step_0.pt", responses=lambda d: d["responses"] * math.nan)
    edit_pt(
        write_verl(root / "verl_i64", truth) / "step_0.pt", old_log_probs=lambda d: d["old_log_probs"].long()
    )
    edit_pt(write_trl(root / "trl_main", truth) / "step_0_rank_0.pt", process_index=lambda d: "main")
    edit_pt(write_slime_main(root / "slime_str", truth) / "0.pt", samples=lambda d: "samples")
    edit_pt(write_slime_main(root / "slime_ints", truth) / "0.pt", samples=lambda d: [1, 2, 3])
    prime = write_prime_rl(root / "prime_str", truth) / "step_0" / "rank_0.jsonl"
    edit_jsonl(prime, lambda r: r.update(token_ids=[str(t) for t in r["token_ids"]]))
    prime = write_prime_rl(root / "prime_big", truth) / "step_0" / "rank_0.jsonl"
    edit_jsonl(prime, lambda r: r["trainer_logprobs"].__setitem__(-1, -(10**400)))
    edit_jsonl(
        write_vllm(root / "vllm_outputs", truth) / "step_0.jsonl", lambda r: r["engine"].update(outputs=5)
    )
    row = {"7": -0.5}  # a bare float where vLLM writes a Logprob {logprob, rank, decoded_token}
    edit_jsonl(
        write_vllm(root / "vllm_float", truth) / "step_0.jsonl",
        lambda r: r["engine"]["outputs"][0]["logprobs"].__setitem__(0, row),
    )
    budgets = {
        "analytic_tis2.json": {**GOOD_BUDGET, "tis_cap": 2},
        "ci_backwards.json": {**GOOD_BUDGET, "budget": 3.0, "budget_ci": {**CI, "lo": 5.0, "hi": 1.0}},
        "ci_below.json": {**GOOD_BUDGET, "budget": 0.5, "budget_ci": {**CI, "lo": 1.0, "hi": 2.0}},
        "str_center.json": {**GOOD_BUDGET, "loss": "sampled", "center_advantages": "yes"},
        "center_analytic.json": {**GOOD_BUDGET, "train_settings": {"center_advantages": True}},
        "garbage_points.json": {**GOOD_BUDGET, "points": [{"garbage": 1}]},
        "str_fit.json": {**GOOD_BUDGET, "fit": {"mismatch": "x", "quality_loss": []}},
        "ragged_fit.json": {**GOOD_BUDGET, "fit": {"mismatch": [0.0, 1.0], "quality_loss": [0.0]}},
        "other_loss_settings.json": {**GOOD_BUDGET, "train_settings": {"loss": "sampled"}},
        "bool_lr.json": {**GOOD_BUDGET, "train_settings": {"lr": True}},
        "str_noise.json": {**GOOD_BUDGET, "noise": {**NOISE, "eval_sd_by_prompts": {"16": {"sd": "low"}}}},
        "garbage_validation.json": {**VALIDATION_OF_STEPS_BUDGET, "points": [{"garbage": 1}]},
    }
    for name, content in budgets.items():
        (root / name).write_text(json.dumps(content))


def write_good_dump(path: Path) -> None:
    """8 sequences of 5 tokens in the project's dump format (port/dumps.py), tiny's token ids."""
    rng = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        engine = -torch.rand(5, generator=rng) * 2 - 0.01
        trainer = (engine + (torch.rand(5, generator=rng) - 0.5) * 0.1).clamp(max=-1e-6)
        ids = torch.randint(0, 15, (5,), generator=rng)
        rows.append(
            {
                "engine_logprobs": engine.tolist(),
                "train_logprobs": trainer.tolist(),
                "token_ids": ids.tolist(),
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_entry_fixtures(root: Path) -> None:
    """For the entry points' own causes: a good dump in the project's format, tokenizer folders that load
    nothing, an audit folder whose audit.png is a folder, and a pair folder whose teacher is a file."""
    write_good_dump(root / "good.jsonl")
    (root / "emptytok").mkdir()
    (root / "garbagetok").mkdir()
    (root / "garbagetok" / "tokenizer.json").write_text("not a tokenizer")
    (root / "pngdir" / "audit.png").mkdir(parents=True)
    (root / "pairdir").mkdir()
    (root / "pairdir" / "teacher").write_text("a file where the teacher's folder goes\n")


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
    # another run's checkpoint of the same settings and shapes, copied in: its own weights and run id
    other = {"run_id": "0" * 32}
    copy(
        "otherrun", checkpoint=lambda s: {**other, "student": {k: v + 0.01 for k, v in s["student"].items()}}
    )
    copy("noidckpt", checkpoint=lambda state: {"run_id": None})  # a checkpoint from before run ids
    copy("intid", config={"run_id": 5})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the fixtures and a finished 2-step tiny run (runs/done) and a corrupt copy of it."""
    import train
    from lab.train_args import pair_config

    root = tmp_path_factory.mktemp("bad")
    write_fixtures(root)
    cfg = pair_config(
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
    # a budget: calibrated for this pair and loss, and the only thing --over-budget stop can watch
    (
        ["--budget", str(ROOT / "budgets/smollm2/budget.json")],
        "calibrated for pair 'smollm2', not --pair tiny",
    ),
    (
        ["--budget", str(ROOT / "budgets/tiny/budget.json"), "--loss", "sampled"],
        "calibrated for loss analytic",
    ),
    (["--budget", str(ROOT / "budgets/tiny/budget.json"), "--loss", "grpo"], "--budget with --loss grpo"),
    (["--over-budget", "stop"], "--over-budget stop: needs --budget"),
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
    ("lab.kv_capacity", ["--memory-gb", "nan"], "--memory-gb"),
    ("lab.kv_capacity", ["--memory-gb", "inf"], "--memory-gb"),
    ("lab.kv_capacity", ["--memory-gb", "0"], "--memory-gb"),
    ("lab.kv_capacity", ["--pairs", "foo"], "'foo'"),
    ("admit", ["check", "--budget", "good_budget.json", "--probes", "0"], "--probes"),
    ("admit", ["check", "--budget", "good_budget.json", "--probes", "-3"], "--probes"),
    ("admit", ["check", "--budget", "missing.json"], "missing.json"),
    ("admit", ["check", "--budget", "nokeys.json"], "budget is None"),
    ("admit", ["check", "--budget", "good_budget.json", "--loss", "sampler"], "calibrated for loss analytic"),
    ("admit", ["check", "--budget", "sampled_budget.json", "--tis-cap", "2"], "for loss sampled;"),
    ("admit", ["check", "--budget", "noloss_budget.json"], "loss is None"),
    ("admit", ["check", "--budget", "infcap_budget.json", "--tis-cap", "-1"], "--tis-cap"),
    ("lab.calibrate", ["--tis-cap", "2"], "analytic loss has no importance weights"),
    ("lab.calibrate", ["--center-advantages"], "analytic loss has no advantages to centre"),
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
    ("lab.sample", ["--n", "-2"], "--n"),
    ("lab.sample", ["--top-p", "2"], "--top-p"),
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
    ("lab.sample", ["--temperature", "1e-310"], "--temperature"),
    ("lab.sample", ["--seed", str(2**64)], "--seed"),
    ("lab.sample", ["--n", "99999999"], "--n"),
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
    # other systems' exports: one typed schema per layout, checked before any value is converted
    ("admit", [*CHECK_DUMP, "prime_str", "--format", "prime-rl"], "token_ids[0] is '"),
    (
        "admit",
        [*CHECK_DUMP, "prime_big", "--format", "prime-rl"],
        "is an integer of 401 digits",
    ),
    ("admit", [*CHECK_DUMP, "slime_str", "--format", "slime"], "samples is 'samples'; expected a list"),
    ("admit", [*CHECK_DUMP, "slime_ints", "--format", "slime"], "sample 0 is 1; expected a dict"),
    ("admit", [*CHECK_DUMP, "verl_nan", "--format", "verl"], "responses is a tensor of torch.float32"),
    ("admit", [*CHECK_DUMP, "verl_i64", "--format", "verl"], "old_log_probs is a tensor of torch.int64"),
    ("admit", [*CHECK_DUMP, "trl_main", "--format", "trl"], "process_index is 'main'"),
    ("admit", [*CHECK_DUMP, "vllm_outputs", "--format", "vllm"], "outputs is 5; expected a list"),
    ("admit", [*CHECK_DUMP, "vllm_float", "--format", "vllm"], "logprobs[0]['7'] is -0.5"),
    ("admit", [*CHECK_DUMP, "verl_good", "--steps", "²"], "--steps '²'"),
    ("admit", [*CHECK_DUMP, "verl_good", "--steps", "0-99999999999"], "beyond any step number"),
    ("admit", ["audit", "--budget", "good_budget.json", "--dump", "vllm_float", "--out", "a"], "is -0.5"),
    (
        "admit",
        ["audit", "--budget", "good_budget.json", "--dump", "verl_good", "--steps", "9-2", "--out", "a"],
        "backwards",
    ),
    # budget files: one validation (budget.read_budget) for every reader: check, audit, the study, calibrate
    ("admit", ["check", "--budget", "analytic_tis2.json"], "tis_cap is 2 with loss analytic"),
    ("admit", ["check", "--budget", "ci_backwards.json"], "expected lo <= budget <= hi"),
    ("admit", ["check", "--budget", "ci_below.json"], "budget_ci is [1.0, 2.0] and budget 0.5"),
    ("admit", ["check", "--budget", "str_center.json"], "center_advantages is 'yes'"),
    ("admit", ["check", "--budget", "center_analytic.json"], "center_advantages is true with loss analytic"),
    ("admit", ["check", "--budget", "garbage_points.json"], "points[0] has no field 'source'"),
    ("admit", ["check", "--budget", "str_fit.json"], "fit.mismatch is 'x'"),
    ("admit", ["check", "--budget", "ragged_fit.json"], "fit has 2 mismatches and 1 quality losses"),
    ("admit", ["check", "--budget", "other_loss_settings.json"], "train_settings.loss is 'sampled'"),
    ("admit", ["check", "--budget", "bool_lr.json"], "train_settings.lr is True"),
    ("admit", ["check", "--budget", "str_noise.json"], "noise.eval_sd_by_prompts.16.sd is 'low'"),
    (
        "admit",
        ["audit", "--budget", "ci_backwards.json", "--dump", "verl_good", "--out", "a"],
        "lo <= budget",
    ),
    ("study.__main__", ["validate", "--budget", "analytic_tis2.json"], "tis_cap is 2 with loss analytic"),
    ("study.__main__", ["validate", "--budget", "steps_budget.json"], "fewer than two noise points"),
    ("study.__main__", ["drift", "--budget", "good_budget.json"], "missing field points"),
    ("study.__main__", ["drift", "--budget", "str_fit.json"], "fit.mismatch is 'x'"),
    # recorded points taken as input: checked before any run (calibrate --reuse, validate --reuse)
    (
        "lab.calibrate",
        ["--reuse", "garbage_points.json"],
        "--reuse garbage_points.json: points[0] has no field",
    ),
    ("lab.calibrate", ["--reuse", "good_budget.json"], "missing field points.source"),
    (
        "study.__main__",
        ["validate", "--budget", "steps_budget.json", "--reuse", "garbage_validation.json"],
        "--reuse garbage_validation.json: points[0] has no field 'label'",
    ),
]
AUDIT = ["audit", "--budget", "good_budget.json", "--dump"]
BAD = "\udcff"  # how Python hands over a byte that is not UTF-8 (b"\xff") in argv or a file name
# The entry points' own causes, each a table of (module, argv, needle).
BY_CAUSE = {
    # every output target, tokenizer and input checked before any work: the export named here is broken, so
    # a refusal that names the target (not the export) shows the target was checked first
    "checked before work": [
        ("admit", [*AUDIT, "broken.pt", "--out", "afile/audit"], "afile is a file"),
        ("admit", [*AUDIT, "broken.pt", "--out", "aud", "--tokenizer", "emptytok"], "no tokenizer loads"),
        ("admit", [*AUDIT, "broken.pt", "--out", "aud", "--tokenizer", "garbagetok"], "(JSONDecodeError)"),
        ("admit", [*AUDIT, "broken.pt", "--out", "aud", "--tokenizer", "afile"], "not a folder"),
        ("admit", [*AUDIT, "broken.pt", "--out", "pngdir"], "audit.png: a folder"),
        ("tools.build_tiny", ["--out", "afile/pairs"], "afile is a file"),
        ("tools.build_tiny", ["--out", "pairdir"], "pairdir/teacher: exists and is not a folder"),
        ("tools.gpu_check", ["--dry-run", "--out", "afile"], "exists and is not a folder"),
    ],
    # numbers bounded by what a run can mean, counts by what exists, flags by the mode that reads them, a
    # checkpoint by the run that wrote it
    "bounds": [
        ("train", ["--pair", "tiny", "--noise", "10.5"], "--noise: '10.5': expected a relative weight noise"),
        ("train", ["--pair", "tiny", "--noise", "1e30"], "in [0, 10]"),
        ("opd_minimal", ["--noise", "999"], "in [0, 10]"),
        ("mismatch", ["--noise", "11"], "in [0, 10]"),
        ("admit", ["check", "--budget", "good_budget.json", "--noise", "1e30"], "in [0, 10]"),
        ("study.__main__", ["sources", "--noise", "100"], "in [0, 10]"),
        ("lab.calibrate", ["--noise-grid", "0.1,30"], "noises in [0, 10]"),
        ("admit", ["check", "--budget", "good_budget.json", "--steps", "3"], "--steps without --dump"),
        ("admit", ["check", "--budget", "good_budget.json", "--format", "verl"], "--format without --dump"),
        (
            "admit",
            ["check", "--budget", "good_budget.json", "--dump", "good.jsonl", "--weights", "fp8"],
            "--weights",
        ),
        (
            "admit",
            [*CHECK_DUMP, "good.jsonl", "--probes", "8", "--noise", "0.1"],
            "--probes, --noise: set a live",
        ),
        ("study.__main__", ["sources", "--probes", "100000000"], "the tiny pair has 256 held-out prompts"),
        ("study.__main__", ["sensitivity", "--probes", "257"], "--probes 257: the tiny pair has 256"),
        ("mismatch", ["--probes", "257"], "expected at most 256"),
        (
            "mismatch",
            ["--prompts", "pairprompts.jsonl", "--probes", "4"],
            "every line of --prompts is a probe",
        ),
        ("lab.sample", ["--n", "300"], "--n 300: the tiny pair has 256"),
        ("lab.calibrate", ["--probes", "257", "--steps", "1", "--out", "cal"], "--probes 257: the tiny pair"),
        ("train", ["--pair", "tiny", "--resume", "--name", "otherrun"], "belongs to another run (0000"),
        ("train", ["--pair", "tiny", "--resume", "--name", "noidckpt"], "belongs to another run (no run id"),
        ("train", ["--pair", "tiny", "--resume", "--name", "intid"], "run_id is 5"),
    ],
    # a file or folder name that is not valid text, refused by every flag that names one (cli.path_text)
    "not text": [
        ("train", ["--pair", "tiny", "--name", f"r{BAD}"], "argument --name: 'r\\udcff': not valid UTF-8"),
        ("train", ["--pair", "tiny", "--out-dir", f"runs{BAD}"], "--out-dir"),
        ("train", ["--pair", "tiny", "--prompts", f"p{BAD}.jsonl"], "--prompts"),
        ("train", ["--pair", "tiny", "--budget", f"b{BAD}.json"], "--budget"),
        ("train", ["--teacher", f"t{BAD}", "--student", "s"], "--teacher"),
        ("train", ["--teacher", "t", "--student", f"s{BAD}"], "--student"),
        ("mismatch", ["--dump-out", f"d{BAD}.jsonl"], "--dump-out"),
        ("mismatch", ["--prompts", f"p{BAD}.jsonl"], "--prompts"),
        ("admit", ["check", "--budget", f"b{BAD}.json"], "--budget"),
        ("admit", [*CHECK_DUMP, f"d{BAD}.jsonl"], "--dump"),
        ("admit", ["check", "--budget", "good_budget.json", "--teacher", f"t{BAD}"], "--teacher"),
        ("admit", ["check", "--budget", "good_budget.json", "--student", f"s{BAD}"], "--student"),
        ("admit", ["check", "--budget", "good_budget.json", "--prompts", f"p{BAD}"], "--prompts"),
        ("admit", [*AUDIT, f"d{BAD}", "--out", "aud"], "--dump"),
        ("admit", ["audit", "--budget", f"b{BAD}", "--dump", "good.jsonl", "--out", "aud"], "--budget"),
        ("admit", [*AUDIT, "good.jsonl", "--out", f"o{BAD}"], "--out"),
        ("admit", [*AUDIT, "good.jsonl", "--out", "aud", "--tokenizer", f"t{BAD}"], "--tokenizer"),
        ("lab.calibrate", ["--out", f"c{BAD}"], "--out"),
        ("lab.calibrate", ["--reuse", f"r{BAD}.json"], "--reuse"),
        ("lab.calibrate", ["--teacher", f"t{BAD}"], "--teacher"),
        ("lab.calibrate", ["--student", f"s{BAD}"], "--student"),
        ("lab.calibrate", ["--prompts", f"p{BAD}"], "--prompts"),
        ("study.__main__", ["sensitivity", "--out", f"s{BAD}"], "--out"),
        ("study.__main__", ["validate", "--budget", f"b{BAD}.json"], "--budget"),
        ("study.__main__", ["validate", "--reuse", f"r{BAD}.json"], "--reuse"),
        ("study.__main__", ["drift", "--budget", f"b{BAD}.json"], "--budget"),
        ("tools.build_tiny", ["--out", f"p{BAD}"], "--out"),
        ("tools.gpu_check", ["--dry-run", "--out", f"g{BAD}"], "--out"),
    ],
}
# (module, argv, needle, environment): causes that come from the environment
ENV_CASES = [
    ("models", ["info", "--pair", "smollm2"], "is not a folder", {"OPD_CACHE": "afile"}),
    ("models", ["info", "--pair", "smollm2"], "afile is a file", {"OPD_CACHE": "afile/cache"}),
    ("models", ["info", "--pair", "smollm2"], "cached conversion cannot be read", {"OPD_CACHE": "cache"}),
]
CASES = (
    [
        (
            "train",
            ["--pair", "tiny", *argv] if "--pair" not in argv and "--teacher" not in argv else argv,
            needle,
        )
        for argv, needle in TRAIN
    ]
    + OTHERS
    + [case for cases in BY_CAUSE.values() for case in cases]
)


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
    "lab.kv_capacity",
    "admit",
    "lab.calibrate",
    "study.__main__",
    "lab.sample",
    "models",
    "opd_minimal",
    "tools.bench_sampler",
    "tools.bench_check",
    "tools.bench_noise",
    "tools.build_tiny",
    "tools.gpu_check",
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


def parser_actions(parser, sub: str | None = None):
    """(subcommand or None, action) of every option of a parser and of its subcommands' parsers."""
    for action in parser._actions:
        if action.option_strings:
            yield sub, action
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parser_actions(child, sub=name)


def test_every_cause_covers_its_entry_points_and_every_path_flag_refuses_a_name_that_is_not_text():
    """Each cause has cases; every flag that names a file or folder (cli.path_text) in every parser has a
    case giving it a name that is not text; every --noise is bounded by cli.noise_sigma, the one converter."""
    import admit
    import lab.calibrate
    import mismatch
    import rollout
    import study.__main__
    import train
    from cli import BadInput, noise_sigma, path_text

    assert all(BY_CAUSE.values())
    entry = {m for cases in BY_CAUSE.values() for m, _, _ in cases}
    assert {"train", "admit", "lab.calibrate", "study.__main__", "tools.build_tiny", "opd_minimal"} <= entry
    with_subcommands = ("admit", "study.__main__")
    given = {
        (m, argv[0] if m in with_subcommands else None, argv[i - 1])
        for m, argv, _ in BY_CAUSE["not text"]
        for i, arg in enumerate(argv)
        if BAD in arg
    }
    parsers = {
        "train": train.build_parser(),
        "mismatch": mismatch.build_parser(),
        "admit": admit.build_parser(),
        "lab.calibrate": lab.calibrate.build_parser(),
        "study.__main__": study.__main__.build_parser(),
    }
    path_flags, noise = set(), []
    for module, parser in parsers.items():
        for sub, action in parser_actions(parser):
            if action.type is path_text:
                path_flags.add((module, sub, action.option_strings[0]))
            if "--noise" in action.option_strings:
                noise.append(action.type)
    assert path_flags and path_flags <= given, sorted(path_flags - given, key=str)
    assert noise and all(kind is noise_sigma for kind in noise), noise
    assert rollout.RolloutConfig(noise=10.0).noise == 10.0
    with pytest.raises(BadInput, match="noise 10.5: must be a relative weight noise"):
        rollout.RolloutConfig(noise=10.5)  # a config built in code or read back on resume: the same bound


# budget files: the one validation accepts every committed budget and record, with what each reader needs,
# and the real float range
def test_every_committed_budget_reads_with_what_each_reader_needs():
    from budget import read_budget
    from lab.calibrate import REUSE_NEEDS
    from study.losses import STUDY_NEEDS

    budgets = sorted(ROOT.glob("budgets/**/budget.json"))
    records = [p for p in sorted(ROOT.glob("results/*.json")) if '"schema_version": 2' in p.read_text()[:400]]
    assert len(budgets) >= 7 and len(records) >= 5, (budgets, records)
    for path in budgets + records:  # a record of a 60-step run has no noise measurement: not reusable
        for needs in (STUDY_NEEDS, ("pair", "points", "steps", "seeds"), *[REUSE_NEEDS] * (path in budgets)):
            b = read_budget(path, None, needs=needs)
            assert b["loss"] in ("analytic", "sampled", "sampler"), path
            # the centred one: budgets/<pair>/sampled-centered/budget.json, results/*sampled-centered*.json
            if path in budgets:
                centred = path.parent.name == "sampled-centered"
            else:
                centred = "sampled-centered" in path.stem
            assert b["center_advantages"] is centred, path


def test_a_budget_of_1e308_is_finite_and_one_of_2e308_is_not(tmp_path):
    """The rule is the float range (about 1.8e308), not abs < 1e308; the interval may be open above."""
    from budget import read_budget
    from cli import BadInput

    top = {**CI, "lo": 1.0, "hi": None}
    (tmp_path / "b.json").write_text(json.dumps({**GOOD_BUDGET, "budget": 1e308, "budget_ci": top}))
    assert read_budget(tmp_path / "b.json", "tiny")["budget"] == 1e308
    (tmp_path / "b.json").write_text(json.dumps({**GOOD_BUDGET, "budget": 2 * 10**308}))
    with pytest.raises(BadInput, match="budget is 2000.*expected a finite number"):
        read_budget(tmp_path / "b.json", "tiny")
    (tmp_path / "b.json").write_text(
        json.dumps({**GOOD_BUDGET, "loss": "sampled", "center_advantages": True})
    )
    assert read_budget(tmp_path / "b.json", "tiny")["center_advantages"] is True


# results the study report reads: a file that does not parse, or that holds other fields, is one line
# naming it; a budget without the fields the report draws is one line naming it and the field
REPORT_CASES = {
    "truncated coverage": (
        "results/coverage.json",
        '{"results": [{"pair": "tiny", "ce',
        "coverage.json: not a",
    ),
    "a list for a result": ("results/rl_tiny.json", "[1, 2]", "rl_tiny.json: holds a list"),
    "other fields": (
        "results/prefix_tiny.json",
        '{"rows": 5}',
        "prefix_tiny.json: not what `python -m study",
    ),
    "a drift without rows": ("results/drift_tiny_x.json", '{"pair": "tiny"}', "drift_tiny_x.json: not what"),
    "a budget without fit": (
        "budgets/tiny/budget.json",
        "nofit",
        "budgets/tiny/budget.json: missing field fit",
    ),
}


@pytest.mark.parametrize("case", REPORT_CASES)
def test_study_report_names_a_bad_result_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, case):
    from study.__main__ import main

    name, content, needle = REPORT_CASES[case]
    if content == "nofit":
        budget = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
        content = json.dumps({k: v for k, v in budget.items() if k != "fit"})
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_text(content)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert tree(tmp_path) == before, "a refused report drew or wrote something"


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
    from lab.train_args import TrainConfig

    monkeypatch.chdir(workdir)
    done = workdir / "runs" / "done"
    cfg = replace(load_config(done, TrainConfig), out_dir=str(workdir / "runs"), name="done")
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    """Every write goes through lab.atomic._open: the nth file opened whose name starts with target is full."""
    from lab import atomic

    real_open, count = atomic._open, []

    def open_(path, mode):
        f = real_open(path, mode)
        if Path(path).name.startswith(target):
            count.append(path)
            if len(count) == nth:
                return FullDisk(f)
        return f

    monkeypatch.setattr(atomic, "_open", open_)


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


# ---------------------------------------------------------------------------------------------------
# The entry points' own behaviours: targets checked before work, atomic figures and pairs, a run's id, names
# that are not text, and one signal rule for every command


def test_audit_checks_a_read_only_out_before_it_reads_the_export(workdir, tmp_path, monkeypatch, capsys):
    """A read-only --out (simulated, as access(2) answers on a read-only mount) is one line before the export
    is read: the reader is never called, and nothing is written."""
    import admit
    import cli
    from port import judge

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, m: False if Path(p).name == "ro" else real_access(p, m))
    read = []
    monkeypatch.setattr(judge, "read_native", lambda *a, **k: read.append(a))
    args = ["audit", "--budget", str(workdir / "good_budget.json"), "--dump", str(workdir / "good.jsonl")]
    args += ["--out", "ro/audit"]
    with pytest.raises(SystemExit) as exit_info:
        admit.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == f"error: --out ro/audit: {tmp_path / 'ro'} is not writable\n"
    assert not read and [p.name for p in tmp_path.rglob("*")] == ["ro"]


def test_a_full_disk_writing_an_audit_leaves_no_torn_figure_and_keeps_a_good_one(
    workdir, tmp_path, monkeypatch, capsys
):
    import admit

    monkeypatch.chdir(tmp_path)
    args = ["audit", "--budget", str(workdir / "good_budget.json"), "--dump", str(workdir / "good.jsonl")]
    args += ["--out", "aud", "--tokenizer", "tiny"]
    full_disk_at(monkeypatch, "audit.png")
    with pytest.raises(SystemExit) as exit_info:
        admit.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 5 and err.startswith("error: could not write aud/audit.png"), err
    assert list((tmp_path / "aud").iterdir()) == [], "no 0-byte or torn audit.png, no temporary file"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    admit.main(args)  # with room again: a good audit
    good = (tmp_path / "aud" / "audit.png").read_bytes()
    full_disk_at(monkeypatch, "audit.png")
    with pytest.raises(SystemExit) as exit_info:
        admit.main(args)
    assert exit_info.value.code == 5
    assert (tmp_path / "aud" / "audit.png").read_bytes() == good, "a good audit is never rewritten in place"
    assert sorted(p.name for p in (tmp_path / "aud").iterdir()) == ["audit.png", "report.md"]


def test_build_tiny_swaps_in_a_whole_new_pair_or_keeps_the_old_one(tmp_path, monkeypatch):
    """tools.build_tiny saves beside the pair, then swaps: a full disk while saving the student leaves the old
    teacher and student as they were (not a new teacher beside an old student), and no staged folder."""
    from transformers import LlamaForCausalLM

    from cli import WriteFailed
    from models import tiny_config, tiny_tokenizer
    from tools.build_tiny import save_pair

    def files() -> dict:
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    tokenizer, sizes = tiny_tokenizer(), ("teacher", "student")
    save_pair({s: LlamaForCausalLM(tiny_config(s)) for s in sizes}, tokenizer, out_dir=tmp_path, report={})
    first = files()
    assert {"teacher/model.safetensors", "student/model.safetensors", "build.json"} <= first.keys()
    new = {s: LlamaForCausalLM(tiny_config(s)) for s in sizes}
    real = LlamaForCausalLM.save_pretrained

    def full_disk(self, path, *a, **k):
        if "student" in str(path):
            raise OSError(28, "No space left on device")
        return real(self, path, *a, **k)

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full_disk)
    with pytest.raises(WriteFailed, match="its previous files are intact"):
        save_pair(new, tokenizer, out_dir=tmp_path, report={"again": True})
    assert files() == first
    monkeypatch.undo()
    save_pair(new, tokenizer, out_dir=tmp_path, report={"again": True})
    assert files()["teacher/model.safetensors"] != first["teacher/model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.json", "student", "teacher"]


def test_a_run_id_binds_each_checkpoint_and_a_folder_from_before_run_ids_still_resumes(
    workdir, tmp_path, monkeypatch, capsys
):
    """A fresh run writes one id into config.json and every checkpoint (another run's checkpoint is refused:
    the BY_CAUSE cases). A folder whose files carry no id, as before run ids, resumes with a note."""
    import train

    done = workdir / "runs" / "done"
    run_id = json.loads((done / "config.json").read_text())["run_id"]
    assert len(run_id) == 32 and torch.load(done / "checkpoint.pt", weights_only=True)["run_id"] == run_id
    run_dir = tmp_path / "runs" / "old"
    shutil.copytree(done, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "run_id"}))
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "run_id"}, run_dir / "checkpoint.pt")
    monkeypatch.chdir(tmp_path)
    train.main(["--name", "old", "--resume", "--steps", "3"])
    assert "has no run id (made before run ids were written)" in capsys.readouterr().err
    assert [r["step"] for r in metric_lines(run_dir)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_name_of_bytes_that_are_not_utf8_is_refused_before_any_work(tmp_path):
    """The bytes themselves on a real command line (train.py --name $'r\\xff'): one line, exit 2, nothing."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "train.py"), "--pair", "tiny", "--name", b"r\xff"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=300)
    err = done.stderr.decode("utf-8", "backslashreplace")
    assert done.returncode == 2 and err.count("\n") == 1 and "--name: 'r\\udcff': not valid UTF-8" in err, err
    assert list(tmp_path.iterdir()) == []


BUDGET = str(ROOT / "budgets" / "tiny" / "budget.json")
STUDY = ("validate", "lr", "rl", "prefix", "async", "sources", "sensitivity", "coverage", "report")
# every entry point, as a user starts it: a script, or a module with -m
ENTRY_POINTS = {
    "train": ["train.py", *TINY, "--steps", "2"],
    "opd_minimal": ["opd_minimal.py", "--steps", "2"],
    "mismatch": ["mismatch.py"],
    "lab.sample": ["-m", "lab.sample"],
    "lab.kv_capacity": ["-m", "lab.kv_capacity", "--pairs", "tiny"],
    "models": ["models.py", "info", "--pair", "tiny"],
    "admit check": ["admit.py", "check", "--budget", BUDGET],
    "admit audit": ["admit.py", "audit", "--budget", BUDGET, "--dump", "good.jsonl", "--out", "aud"],
    "lab.calibrate": ["-m", "lab.calibrate", "--steps", "1", "--seeds", "1", "--out", "cal"],
    **{f"study {e}": ["-m", "study", e] for e in STUDY},
    "study drift": ["-m", "study", "drift", "--budget", BUDGET],
    **{
        f"tools.{t}": ["-m", f"tools.{t}"]
        for t in ("bench_check", "bench_noise", "bench_sampler", "bench_step")
    },
    "tools.build_tiny": ["-m", "tools.build_tiny", "--out", "pairs"],
    "tools.gpu_check": ["-m", "tools.gpu_check", "--dry-run", "--out", "gpu"],
}


def start(argv: list[str], cwd: Path, **env) -> subprocess.Popen:
    """An entry point in its own process: a script by its path, a module with -m (found on PYTHONPATH)."""
    command = [sys.executable, *(argv if argv[0] == "-m" else [str(ROOT / argv[0]), *argv[1:]])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    env["TQDM_DISABLE"] = "1"  # progress bars (transformers' "Loading weights" too) would share stderr
    return subprocess.Popen(
        command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def has_its_handlers(pid: int) -> bool:
    """Has the process installed its SIGTERM handler (cli.exit_on_signals)? /proc/PID/status lists the
    signals it catches (SigCgt); Python itself catches SIGINT only."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def wait_for(proc: subprocess.Popen, ready, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while proc.poll() is None and time.time() < deadline and not ready():
        time.sleep(0.005)
    assert proc.poll() is None, (
        f"exited {proc.returncode} before it was signalled: {proc.stderr.read()[-2000:]}"
    )


def stopped(proc: subprocess.Popen, signum: int) -> str:
    """Send signum; the one line on stderr, after checking the exit code and that nothing else was said."""
    proc.send_signal(signum)
    err = proc.communicate(timeout=300)[1]
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + signum and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_a_signal_to_any_entry_point_is_one_line_and_128_plus_its_number(tmp_path, name, signum):
    """Sent as soon as the command has its handlers, while it still imports torch and transformers (where a
    KeyboardInterrupt traceback, or a silent 143, used to be): one line, exit 130 / 143, nothing written."""
    from cli import RERUN

    write_good_dump(tmp_path / "good.jsonl")
    before = tree(tmp_path)
    proc = start(ENTRY_POINTS[name], cwd=tmp_path)
    wait_for(proc, lambda: has_its_handlers(proc.pid), seconds=60)
    note = RERUN if name.startswith(("study", "lab.calibrate")) else "no file was left half-written"
    assert stopped(proc, signum) == f"interrupted by {signal.Signals(signum).name}; {note}"
    assert tree(tmp_path) == before


def test_stopping_at_once_never_leaves_a_file_half_written(tmp_path):
    """A program writing a 20 MB file again and again (lab.atomic.atomic_write_text), stopped by SIGTERM wherever it
    is: the file holds one whole version, and no temporary file is left."""
    program = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import cli
cli.exit_on_signals("__main__")
from pathlib import Path
from lab.atomic import atomic_write_text
for i in range(10**6):
    atomic_write_text(Path("out.txt"), f"{{i}}\\n" + "x" * 20_000_000)
"""
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=tmp_path, text=True, stderr=subprocess.PIPE)
    wait_for(proc, lambda: (tmp_path / "out.txt").exists(), seconds=60)
    time.sleep(0.05)  # into the next write
    assert stopped(proc, signal.SIGTERM) == "interrupted by SIGTERM; no file was left half-written"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    assert (tmp_path / "out.txt").read_text().split("\n", 1)[1] == "x" * 20_000_000


@pytest.mark.slow
def test_a_signal_mid_training_stops_opd_minimal_in_one_line(tmp_path):
    proc = start(["opd_minimal.py", "--steps", "50", "--batch", "8"], cwd=tmp_path, PYTHONUNBUFFERED="1")
    for line in proc.stdout:  # the table's first row: step 1 has trained
        if line.split()[:1] == ["1"]:
            break
    assert stopped(proc, signal.SIGINT) == "interrupted by SIGINT; no file was left half-written"
    assert list(tmp_path.iterdir()) == []


CALIBRATE = ["-m", "lab.calibrate", "--steps", "3", "--seeds", "1", "--noise-grid", "0.1", "--real", ""]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["in its first run", "after its first run"])
def test_a_signal_stops_a_calibration_in_a_run_or_between_runs(tmp_path, when):
    """In a run, the run stops after its step with a checkpoint (train.run's safe point); between runs, at
    once. Either way one line saying to rerun the command, exit 130, no lock or temporary file left, and no
    budget written."""
    from cli import RERUN

    first = tmp_path / "cal" / "runs" / "baseline-seed0"
    marker = first / ("metrics.jsonl" if when == "in its first run" else "curves.png")
    proc = start([*CALIBRATE, "--probes", "8", "--out", "cal"], cwd=tmp_path)
    wait_for(proc, lambda: marker.exists() and marker.stat().st_size > 0)
    line = stopped(proc, signal.SIGINT)
    assert line.endswith(RERUN), line
    left = [p.name for p in (tmp_path / "cal").rglob("*")]
    assert not [n for n in left if n.endswith((".tmp", ".new")) or n.startswith(".lock")], left
    assert "budget.json" not in left and (first / "checkpoint.pt").is_file()
    if when == "in its first run":
        assert line.startswith("interrupted at step 1; "), line
        assert torch.load(first / "checkpoint.pt", weights_only=True)["step"] == 1
