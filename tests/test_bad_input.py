"""Every CLI refuses bad input with one line naming the value, exit code 2, no traceback, and no file
created or changed. Run in-process (each main(argv)), so ~80 cases cost seconds, not minutes."""

import importlib
import json
import math
from pathlib import Path

import pytest

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
    ("calibrate", ["--tis-cap", "2"], "analytic loss has no importance weights"),
    ("admit", ["check", "--budget", "nan_budget.json"], "budget is nan"),
    ("admit", ["check", "--budget", "v1_budget.json"], "schema_version 1"),
    ("admit", ["check", "--budget", "smollm2_budget.json"], "'smollm2'"),
    ("admit", ["check", "--budget", "bad_how.json"], "guess"),
    ("admit", ["check", "--budget", "afile"], "not JSON"),
    ("calibrate", ["--tolerance", "1.5"], "--tolerance"),
    ("calibrate", ["--noise-grid", "a,b"], "--noise-grid"),
    ("calibrate", ["--noise-grid", "nan"], "--noise-grid"),
    ("calibrate", ["--real", "bogus"], "bogus"),
    ("calibrate", ["--steps", "0"], "--steps"),
    ("admit", ["calibrate", "--steps", "2"], "python calibrate.py"),
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
]
CASES = [
    ("train", ["--pair", "tiny", *argv] if "--pair" not in argv and "--teacher" not in argv else argv, needle)
    for argv, needle in TRAIN
] + OTHERS


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("module, argv, needle", CASES, ids=[" ".join([m, *a]) for m, a, _ in CASES])
def test_bad_input_is_one_line_exit_2(workdir, monkeypatch, capsys, module, argv, needle):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = tree(workdir)
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert tree(workdir) == before, "a refused command created or changed files"


def test_there_are_at_least_60_cases():
    assert len(CASES) >= 60
