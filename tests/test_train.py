"""train.py end to end: CLI smoke test, exact resume, bad input, and opd_minimal.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--pair",
    "tiny",
    "--batch-size",
    "4",
    "--samples-per-prompt",
    "2",
    "--eval-prompts",
    "8",
    "--eval-every",
    "2",
]


def cli(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_time(records):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in records]


@pytest.mark.slow
def test_two_step_smoke(tmp_path):
    result = cli(*TINY, "--steps", "2", "--name", "smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = tmp_path / "runs" / "smoke"
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert {"step", "loss", "rkl", "tokens", "seconds"} <= r.keys()
    assert {"eval_rkl", "eval_acc"} <= records[0].keys() & records[2].keys()  # step 0 and every 2nd step
    assert "eval_rkl" not in records[1]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["pair"] == "tiny" and config["rollout"]["temperature"] == 1.0
    assert (run_dir / "curves.png").stat().st_size > 0 and (run_dir / "checkpoint.pt").exists()
    assert "held-out reverse KL" in result.stdout


@pytest.mark.slow
def test_resume_repeats_an_uninterrupted_run(tmp_path):
    full = cli(*TINY, "--steps", "4", "--name", "full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-2000:]
    part = cli(*TINY, "--steps", "2", "--name", "part", cwd=tmp_path)
    assert part.returncode == 0, part.stderr[-2000:]
    # Simulate a kill after step 3 was logged but before its checkpoint: a logged step and a torn line.
    with (tmp_path / "runs" / "part" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n" + '{"step": 4, "lo')
    resumed = cli("--name", "part", "--resume", "--steps", "4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert without_time(metrics(tmp_path / "runs" / "part")) == without_time(
        metrics(tmp_path / "runs" / "full")
    )


@pytest.mark.slow
def test_a_run_with_the_uncapped_ratio_resumes(tmp_path):
    """tinker's loss (--tis-cap inf) writes an infinite cap into config.json; --resume reads it back, while an
    infinite value in a field that takes only finite numbers is still refused."""
    from lab.runfiles import typed
    from lab.train_args import TrainConfig

    first = cli(*TINY, "--steps", "1", "--loss", "sampler", "--tis-cap", "inf", "--name", "is", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = cli("--name", "is", "--resume", "--steps", "2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path / "runs" / "is")][-1] == 2
    assert typed({"loss": "sampler", "tis_cap": float("inf")}, TrainConfig, where="x").tis_cap == float("inf")
    with pytest.raises(Exception, match="lr is 'inf'; expected float"):
        typed({"lr": float("inf")}, TrainConfig, where="x")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--pair", "nope"], "--pair"),  # argparse refuses it (choices=)
        (["--pair", "tiny", "--prompts", "missing.jsonl"], "missing.jsonl"),  # BadInput from the project
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    """The real command line, end to end: argparse's refusal and the project's (BadInput) are one line and
    exit 2 from a real process. tests/test_bad_input.py holds every refusal, in-process, grouped by cause."""
    result = cli(*args, "--name", "bad", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_opd_minimal_runs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "opd_minimal.py"), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step" in result.stdout and "reverse KL" in result.stdout


def short_tiny(tmp_path: Path, name: str, steps: int, **over):
    """The TrainConfig of a short tiny run in tmp_path/name: 4 prompts × 2 samples a step, 8 held-out
    prompts, no evaluation between its ends."""
    from lab.train_args import pair_config

    return pair_config(
        "tiny",
        steps=steps,
        batch_size=4,
        samples_per_prompt=2,
        eval_every=0,
        eval_prompts=8,
        name=name,
        out_dir=str(tmp_path),
        **over,
    )


def stale_twin(tmp_path: Path, name: str, steps: int, staleness: int = 0, **over) -> list[dict]:
    """A short tiny run's step records (step 0 left out); staleness 1 (sync, an engine one version behind)
    is the async runs' twin."""
    from dataclasses import replace

    from train import run

    cfg = short_tiny(tmp_path, name, steps, **over)
    cfg.rollout = replace(cfg.rollout, staleness=staleness)
    return [r for r in run(cfg, quiet=True) if r["step"] > 0]


def same_steps(a_steps: list[dict], b_steps: list[dict]) -> None:
    """Two runs' steps drew the same batches and losses: loss, rkl, mismatch_kl and tokens within 1e-5."""
    for a, b in zip(a_steps, b_steps):
        for key in ("loss", "rkl", "mismatch_kl", "tokens"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_async_batches_are_exactly_one_version_stale(tmp_path):
    """Async mode serves version max(s − 2, 0) at step s (sync: s − 1), and its batches and losses are the
    ones sync mode with staleness 1 draws: the same weights, prompts and sampling seeds."""
    sync = stale_twin(tmp_path, "sync", steps=5)
    asyn = stale_twin(tmp_path, "async", steps=5, async_rollout=True)
    stale1 = stale_twin(tmp_path, "stale1", steps=5, staleness=1)
    assert [r["engine_version"] for r in sync] == [0, 1, 2, 3, 4]
    assert [r["engine_version"] for r in asyn] == [max(s - 2, 0) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    same_steps(asyn, stale1)
    assert asyn[-1]["mismatch_kl"] > 0  # the trainer really is a version ahead of the batch


def finished_metrics(run_dir: Path) -> list[dict]:
    return without_time(metrics(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--async"], ["--staleness", "2"]], ids=["async", "staleness2"])
def test_kill_9_then_resume_is_exact_for_stale_and_async_runs(tmp_path, mode):
    """kill -9 at a random step, then --resume: every metric equals the uninterrupted run's, because the
    checkpoint carries the engine's old snapshots and the batch the async worker had prepared."""
    import random
    import signal
    import time

    args = [*TINY, "--steps", "7", "--ckpt-every", "1", "--eval-every", "3", *mode]
    full = cli(*args, "--name", "full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-2000:]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, "--name", "killed"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target, path = random.Random(0).randint(3, 5), tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:  # kill once `target` steps are logged
        if path.exists() and len(path.read_text().splitlines()) > target:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    resumed = cli("--name", "killed", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert finished_metrics(tmp_path / "runs" / "killed") == finished_metrics(tmp_path / "runs" / "full")


@pytest.mark.slow
def test_nan_halts_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    import torch

    result = cli(
        *TINY,
        "--steps",
        "30",
        "--lr",
        "1e6",
        "--grad-clip",
        "0",
        "--ckpt-every",
        "1",
        "--name",
        "nan",
        cwd=tmp_path,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert (
        line.startswith("error: step ")
        and "not" not in line.split(":")[0]
        and "Traceback" not in result.stderr
    )
    run_dir = tmp_path / "runs" / "nan"
    records = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]  # strict JSON throughout
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["step"] == records[-1]["step"], "the checkpoint is the last logged step"
    assert all(torch.isfinite(t).all() for t in state["student"].values()), "no NaN reaches a checkpoint"


@pytest.mark.slow
def test_a_second_process_on_a_live_run_folder_is_refused(tmp_path):
    import socket

    from lab.runfiles import RunLock

    first = cli(*TINY, "--steps", "1", "--name", "locked", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    lock = tmp_path / "runs" / "locked" / ".lock"
    holder = RunLock(lock.parent)  # this test process holds the folder, as a running train.py would
    holder.acquire()
    second = cli("--name", "locked", "--resume", "--steps", "2", cwd=tmp_path)
    assert second.returncode == 2 and f"in use by PID {os.getpid()}" in second.stderr, second.stderr
    holder.release()
    lock.write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))  # its owner died
    third = cli("--name", "locked", "--resume", "--steps", "2", cwd=tmp_path)
    assert third.returncode == 0 and "took over" in third.stderr, third.stderr[-2000:]
    assert not lock.exists(), "the lock is released at the end"


def test_a_full_disk_at_a_checkpoint_is_one_line_exit_5_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """torch.save fails the way it does on a full disk (this happened to a calibration): the half-written
    temporary file is removed, the previous checkpoint is kept, one line, exit 5; with room again the run
    resumes to the end."""
    import torch

    import train

    monkeypatch.chdir(tmp_path)
    real_save, saves = torch.save, []

    def disk_full_on_second_save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) == 2:
            f.write(b"half a checkpoint")  # runfiles saves into an open temporary file
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4532 vs 4531")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_second_save)
    args = [*TINY, "--steps", "3", "--ckpt-every", "1", "--name", "full"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    err = capsys.readouterr().err  # the progress bar's lines, then the error
    line = err.strip().splitlines()[-1]
    assert exit_info.value.code == 5 and line.startswith("error: could not write ") and "Traceback" not in err
    run_dir = tmp_path / "runs" / "full"
    assert not (run_dir / "checkpoint.pt.tmp").exists(), "the half-written file is removed"
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == 1, (
        "the step-1 checkpoint stays"
    )
    monkeypatch.setattr(torch, "save", real_save)
    train.main([*args, "--resume"])
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3], "step 2 is redone once, not logged twice"


def test_the_summary_line_says_which_way_the_held_out_kl_moved():
    from lab.runfiles import summary

    def records(end):
        return [{"step": 0, "eval_rkl": 3.0, "seconds": 0.0}, {"step": 1, "eval_rkl": end, "seconds": 1.0}]

    assert "(67% lower)" in summary(records(1.0))
    assert "(233% higher" in summary(records(10.0)) and "lower" not in summary(records(10.0))


# ---------------------------------------------------------------------------------------------------
# train.py --budget: the running mismatch against a budget's interval


def budget_file(tmp_path: Path, budget: float, lo: float, hi: float, name: str = "b.json") -> Path:
    """tiny's committed analytic budget with its number and interval replaced: a valid budget.json."""
    record = json.loads((ROOT / "budgets" / "tiny" / "budget.json").read_text())
    record.update(budget=budget, how="crossing")
    record["budget_ci"] = {**record["budget_ci"], "lo": lo, "hi": hi}
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: step ")]


@pytest.mark.slow
def test_a_run_over_its_budget_warns_once_and_records_it(tmp_path):
    """An engine with weight noise σ = 0.1 (about 0.25 nats/token on tiny) against a budget of 1e-6: the
    running interval is above the budget's from step 1; one line names the step, the budget and the
    source, and every step's metrics carry over_budget with the running interval."""
    tight = budget_file(tmp_path, 1e-6, 5e-7, 2e-6)
    args = [*TINY, "--steps", "3", "--noise", "0.1", "--budget", str(tight), "--name", "over"]
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = warnings(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("warning: step 1: running mismatch "), result.stderr
    assert "source: --noise 0.1" in lines[0] and str(tight) in lines[0] and "2.000e-06]" in lines[0]
    steps = [r for r in metrics(tmp_path / "runs" / "over") if r["step"] > 0]
    assert [r["over_budget"] for r in steps] == [True, True, True]
    for r in steps:
        assert (
            r["mismatch_run_lo"] > 2e-6
            and r["mismatch_run_lo"] <= r["mismatch_run_mean"] <= r["mismatch_run_hi"]
        )
        assert r["mismatch_se"] > 0
    assert [r["mismatch_run_steps"] for r in steps] == [1, 2, 3]
    assert steps[0]["mismatch_run_mean"] == pytest.approx(steps[0]["mismatch_kl"])


@pytest.mark.slow
def test_over_budget_stop_exits_6_with_a_checkpoint_that_resumes(tmp_path):
    """--over-budget stop: the run stops at the step whose running interval crosses the budget's, exit 6,
    with a checkpoint of that step (tiny checkpoints only every 100 steps otherwise); --resume with
    --over-budget warn goes on from it to the end."""
    import torch

    tight = budget_file(tmp_path, 1e-6, 5e-7, 2e-6)
    args = [*TINY, "--steps", "3", "--noise", "0.1", "--budget", str(tight), "--name", "stop"]
    stopped = cli(*args, "--over-budget", "stop", cwd=tmp_path)
    assert stopped.returncode == 6, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1: the running mismatch is above --budget") and "--resume" in last
    assert "Traceback" not in stopped.stderr
    run_dir = tmp_path / "runs" / "stop"
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == 1
    assert [r["step"] for r in metrics(run_dir)] == [0, 1] and metrics(run_dir)[-1]["over_budget"] is True
    resumed = cli("--name", "stop", "--resume", "--over-budget", "warn", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3]
    assert warnings(resumed.stderr) == [], "still over: the crossing was already reported at step 1"


@pytest.mark.slow
def test_a_run_within_a_huge_budget_never_warns(tmp_path):
    huge = budget_file(tmp_path, 1e6, 5e5, 2e6)
    args = [*TINY, "--steps", "2", "--noise", "0.1", "--budget", str(huge), "--over-budget", "stop"]
    result = cli(*args, "--name", "within", cwd=tmp_path)
    assert result.returncode == 0 and warnings(result.stderr) == [], result.stderr[-2000:]
    steps = [r for r in metrics(tmp_path / "runs" / "within") if r["step"] > 0]
    assert [r["over_budget"] for r in steps] == [False, False]


def test_mismatch_se_is_the_ratio_estimators_over_responses():
    """Two responses of 2 and 1 tokens: S = (0.3, 0.6), n = (2, 1), m = 0.3; the residuals S − m·n are
    (−0.3, 0.3), so se = √(2 · 0.18) / 3 = 0.2."""
    import torch

    from kl import mismatch_se
    from lab.watch import running_mismatch

    class Rollout:
        response_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])  # [:, 1:]: 2 targets, then 1

    assert mismatch_se(torch.tensor([0.1, 0.2, 0.6]), Rollout) == pytest.approx(0.2)
    rows = [{"mismatch_kl": 1.0, "mismatch_se": 0.3}, {"mismatch_kl": 3.0, "mismatch_se": 0.4}]
    interval = running_mismatch([{"step": 0}, *rows])  # √(0.09 + 0.16) / 2 = 0.25
    assert interval["mean"] == 2.0 and interval["hi"] == pytest.approx(2.0 + 1.959964 * 0.25)


def test_opd_minimal_and_the_engine_add_the_same_weight_noise(random_model):
    """One definition of weight noise, W + σ·rms(W)·ε: opd_minimal.add_noise and engine.add_weight_noise
    give the same weights from the same generator state."""
    import copy

    from engine import add_weight_noise
    from opd_minimal import add_noise

    ours, engine = copy.deepcopy(random_model), copy.deepcopy(random_model)
    add_noise(ours, 0.3, torch.Generator().manual_seed(5))
    add_weight_noise(engine, 0.3, torch.Generator().manual_seed(5))
    for (name, a), b in zip(ours.named_parameters(), engine.parameters()):
        assert_close(a, b, atol=1e-6, what=name)
    assert not torch.equal(next(ours.parameters()), next(random_model.parameters()))


@pytest.mark.slow
def test_the_config_enters_at_most_eight_modules(tmp_path):
    """The modules whose functions receive the run's TrainConfig or a RolloutConfig (the whole object, a
    copy of it, or its rollout part) during a two-step run: the path of `cfg` through the calls."""
    import threading

    import train
    from lab.train_args import TrainConfig, pair_config
    from rollout import RolloutConfig

    cfg = pair_config(
        "tiny",
        steps=2,
        batch_size=4,
        samples_per_prompt=2,
        eval_prompts=8,
        eval_every=2,
        out_dir=str(tmp_path),
        name="walk",
    )
    entered = set()

    def profile(frame, event, _arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(str(ROOT)):
            return
        args = frame.f_code.co_varnames[: frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(a), (TrainConfig, RolloutConfig)) for a in args):
            entered.add(Path(path).relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    threading.setprofile(profile)  # the rollout prefetch thread too
    try:
        train.run(cfg, quiet=True)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert "train.py" in entered and "batches.py" in entered  # the probe sees the calls it counts
    # DESIGN.md names these: the modules that run a step, and the two harness modules that watch and name it
    step = {"train.py", "batches.py", "engine.py", "rollout.py", "evaluate.py"}
    assert entered <= step | {"lab/watch.py", "lab/runfiles.py"}, sorted(entered)
    assert len(entered) <= 8


@pytest.mark.slow
def test_an_experiments_finished_run_without_its_checkpoint_is_reused_or_refused_in_one_line(tmp_path):
    """train.run_or_resume, as calibrations and study sweeps call it: a finished run whose checkpoint was
    dropped is reused at its own settings; asked for more steps it cannot be continued, and the line says so
    and how to train it again (its files are kept)."""
    from cli import BadInput
    from train import run_or_resume

    def cfg(steps):
        return short_tiny(tmp_path, "exp", steps)

    first = run_or_resume(cfg(1))
    run_dir = tmp_path / "exp"
    (run_dir / "checkpoint.pt").unlink()
    assert run_or_resume(cfg(1)) == first, "reused from its record"
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(BadInput, match=r"finished its 1 steps .* delete the folder to train it again"):
        run_or_resume(cfg(2))
    assert (run_dir / "metrics.jsonl").read_text() == before
