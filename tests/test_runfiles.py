"""lab/runfiles.py's pure pieces: strict JSON, metrics read up to a step and reconciled with a checkpoint's
copy, the resume diff, and writes that leave the old file or the new one, never a temporary file."""

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from cli import BadInput, WriteFailed
from lab.atomic import atomic_write_text
from lab.runfiles import (
    append_metrics,
    atomic_save,
    changes,
    dumps_strict,
    flat,
    read_metrics,
    reconcile_metrics,
    resume_changes,
    strict,
)


def refuse_constants(name: str):
    raise AssertionError(f"{name} in strict JSON")


def test_strict_json_has_no_nan_or_infinity():
    record = {"step": 1, "loss": math.nan, "kl": [math.inf, 0.5, (-math.inf, 2)], "more": {"x": math.nan}}
    text = dumps_strict(record)
    assert json.loads(text, parse_constant=refuse_constants) == {
        "step": 1,
        "loss": None,
        "kl": [None, 0.5, [None, 2]],
        "more": {"x": None},
    }
    assert strict(0.25) == 0.25 and strict("nan") == "nan", "only non-finite floats become null"
    with pytest.raises(ValueError):
        json.dumps(record, allow_nan=False)  # what dumps_strict guards against


def write_lines(path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_read_metrics_keeps_the_steps_up_to_upto_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path, upto=5) == [], "no file: no records"
    for step in range(5):
        append_metrics(path, {"step": step, "loss": 1.0 / (step + 1)})
    with path.open("a") as f:
        f.write('[1, 2]\n{"step": "3"}\n{"step": 9, "lo')  # not a record, a step that is no int, a torn line
    assert [r["step"] for r in read_metrics(path, upto=2)] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(path, upto=100)] == [0, 1, 2, 3, 4]
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(BadInput, match="cannot be read"):
        read_metrics(path, upto=1)


def test_reconcile_metrics_trusts_the_checkpoints_copy(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    saved = [{"step": s, "loss": float(s)} for s in range(3)]
    write_lines(path, [json.dumps(r) for r in saved] + ['{"step": 3, "loss": 3.0}'])
    assert reconcile_metrics(path, 2, saved) == saved and capsys.readouterr().err == "", "in agreement"
    write_lines(
        path, [json.dumps(saved[0]), json.dumps(saved[2]), json.dumps(saved[2])]
    )  # one lost, one twice
    assert reconcile_metrics(path, 2, saved) == saved
    err = capsys.readouterr().err
    assert "held steps 0, 2, 2, not the checkpoint's 0..2; rewritten" in err, err


def test_reconcile_metrics_without_a_copy_needs_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s} for s in range(4)]
    write_lines(path, [json.dumps(r) for r in records])
    assert reconcile_metrics(path, 3, None) == records
    write_lines(path, [json.dumps(r) for r in records[:2] + records[3:]])
    with pytest.raises(BadInput, match=r"holds steps 0-1, 3 where 0\.\.3 are expected once"):
        reconcile_metrics(path, 3, None)


def test_the_resume_diff_flattens_nested_settings_and_names_what_changed():
    old = {"lr": 1e-3, "rollout": {"seed": 0, "fp8_skip": ("lm_head",)}, "name": "a"}
    new = {"lr": 1e-3, "rollout": {"seed": 1, "fp8_skip": ["lm_head"]}, "steps": 9, "name": "a"}
    assert flat(old) == {"lr": 1e-3, "rollout.seed": 0, "rollout.fp8_skip": ["lm_head"], "name": "a"}
    assert changes(old, new) == {"rollout.seed": (0, 1), "steps": (None, 9)}, "a tuple equals its JSON list"
    asked, source = {**new, "lr": 5e-4}, Path("c.json")
    # only the flags given on the command line count; a nested key is found by its last part
    kept = resume_changes(old, asked, given={"seed"}, safe=("rollout.seed",), source=source)
    assert kept == {"rollout.seed": 1}
    assert resume_changes(old, asked, given=set(), safe=(), source=source) == {}
    with pytest.raises(BadInput, match=r"--resume: lr 0\.0005 \(saved: 0\.001\) differ from c\.json; only"):
        resume_changes(old, asked, given={"lr", "seed"}, safe=("rollout.seed",), source=source)


class Unpicklable:
    """An object torch.save fails on part-way through writing the file."""

    def __reduce__(self):
        raise pickle.PicklingError("not this one")


def test_atomic_writes_leave_the_new_file_or_the_old_one_and_no_temporary_file(tmp_path):
    path = tmp_path / "config.json"
    atomic_write_text(path, "first\n")
    atomic_write_text(path, "second\n")
    assert path.read_text() == "second\n" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    ckpt = tmp_path / "checkpoint.pt"
    atomic_save({"step": 1, "w": torch.ones(2)}, ckpt)
    with pytest.raises(pickle.PicklingError):
        atomic_save({"step": 2, "w": torch.ones(2), "bad": Unpicklable()}, ckpt)
    assert torch.load(ckpt, weights_only=True)["step"] == 1, "the old checkpoint stays whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "config.json"]


def test_a_failed_write_raises_write_failed_naming_the_file(tmp_path):
    folder = tmp_path / "missing"  # the temporary file cannot be created: the OSError of a full disk
    with pytest.raises(WriteFailed, match="could not write .*missing/config.json"):
        atomic_write_text(folder / "config.json", "x")
    assert not folder.exists() and list(tmp_path.iterdir()) == []


def test_a_signal_after_the_last_safe_point_is_raised_again_for_the_handler_before():
    """StopSignals: a signal that arrives inside the block but after its last check is not lost: on leaving,
    the handler that was there before gets it (between a calibration's runs, the entry script's, which
    stops the command); one acted on inside the block (an exception leaving it) is not raised twice."""
    import os
    import signal

    from cli import Interrupted, StopSignals

    seen = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT and seen == []  # held for the next safe point
        assert seen == [signal.SIGINT]  # none came: the handler before gets it on leaving
        with pytest.raises(Interrupted):
            with StopSignals() as stop:
                os.kill(os.getpid(), signal.SIGINT)
                stop.check("stopped at its safe point")
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)
