"""A run folder, runs/<name>/: its lock, config, metrics, checkpoints and plots.

    .lock            {"pid", "host"} of the process that owns the folder, held with flock(2) while it runs
    config.json      every setting (lab.train_args.TrainConfig, RolloutConfig inside) and the run id
    metrics.jsonl    one strict-JSON object per step, appended and fsync'ed (a non-finite number is null)
    checkpoint.pt    weights, AdamW state, the engine's batches, the config, a copy of the metric records and
                     the run id (a resume refuses a checkpoint of another run: `check_run_id`);
                     written to checkpoint.pt.tmp, then renamed: a reader sees the old one or the new one
    curves.png       training curves

Safe by construction:
- the lock is taken before anything is decided: its content is written to a private file first and linked
  into place (os.link fails if .lock exists), so .lock is never seen empty or half-written; whether its owner
  is alive is asked of the kernel (flock), never guessed from the content or a PID;
- under the lock, `claim` decides: a fresh run needs a folder holding no run files (a folder holding only a
  dead run's .lock is fresh), a resumed one needs config.json; a finished run is never overwritten;
- a run name is one path component (`check_run_name`), and what is read back on resume is typed: config.json
  (`load_config`), the checkpoint (`load_checkpoint`), and the metrics against the checkpoint's copy
  (`reconcile_metrics`);
- every write goes through lab.atomic (atomic_write, append_text): a full disk is one line, exit 5, and
  nothing half-written.
"""

import dataclasses
import fcntl
import json
import math
import os
import shlex
import socket
import sys
import threading
import types
import typing
import uuid
from pathlib import Path

import torch
from matplotlib.figure import Figure

from cli import BadInput, WriteFailed, check_output_dir
from lab.atomic import append_text, atomic_write, atomic_write_text

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "curves.png")


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename: the old checkpoint or the new one, never half of one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_savefig(fig: Figure, path: Path, dpi: int = 110) -> None:
    """A PNG, written like every other file (a full disk leaves the old plot, not a torn one)."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def strict(value):
    """JSON has no NaN or infinity: they become null (a metric that was not a number is not a number)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps_strict(obj) -> str:
    return json.dumps(strict(obj), allow_nan=False)


def read_metrics(path: Path, upto: int) -> list[dict]:
    """Metric lines with step <= upto; a torn last line from a killed run is dropped."""
    if not path.exists():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path} cannot be read ({type(e).__name__}); expected a run's metrics file") from None
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a torn last line (or one that is not ours)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= upto:
            records.append(rec)
    return records


def append_metrics(path: Path, record: dict) -> None:
    append_text(path, dumps_strict(record) + "\n")


def reconcile_metrics(path: Path, upto: int, saved: list[dict] | None) -> list[dict]:
    """The records of steps 0..upto for a resume, with a note on stderr when metrics.jsonl must be repaired.

    The checkpoint holds its own copy of them (`saved`): a metrics file cut mid-way, or one with a line
    missing or repeated, is rewritten from it. A checkpoint without a copy needs the file to hold each of the
    steps 0..upto exactly once; otherwise the resume is refused."""
    records = read_metrics(path, upto)
    steps = [r["step"] for r in records]
    if saved is not None:
        if [strict(r) for r in saved] != [strict(r) for r in records]:
            print(
                f"note: {path} held steps {_ranges(steps)}, not the checkpoint's 0..{upto}; rewritten "
                "from the checkpoint's copy",
                file=sys.stderr,
            )
        return list(saved)
    if steps != list(range(upto + 1)):
        raise BadInput(
            f"--resume: {path} holds steps {_ranges(steps)} where 0..{upto} are expected once "
            "each, and the checkpoint has no copy to repair it from; start the run again"
        )
    return records


def refuse_finished(run_dir: Path, steps: int) -> None:
    """A run whose metrics reach its `steps` finished; without its checkpoint (killed before its last save,
    or an experiment's run, whose checkpoint drop_checkpoint deleted) it cannot be continued, and starting it
    again would overwrite it: refused."""
    records = read_metrics(run_dir / "metrics.jsonl", upto=steps)
    if records and records[-1]["step"] == steps:
        raise BadInput(
            f"--resume: {run_dir} finished its {steps} steps and has no checkpoint to continue "
            "from; it is kept as it is (choose another --name, or delete the folder to train it again)"
        )


def start_files(run_dir: Path, records: list[dict], config: dict) -> None:
    """What a (re)started run writes first: metrics.jsonl holding `records` (a resume keeps the steps up to
    its checkpoint; later ones are redone exactly), and config.json."""
    if records:
        atomic_write_text(run_dir / "metrics.jsonl", "".join(dumps_strict(r) + "\n" for r in records))
    else:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh folder, or a resume before a checkpoint
    atomic_write_text(run_dir / "config.json", json.dumps(config, indent=2) + "\n")


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 4, 4] -> '0-2, 4, 4'."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(f"{steps[i]}-{steps[j]}" if j > i else str(steps[i]))
        i = j + 1
    return ", ".join(parts) or "none"


def load_checkpoint(path: Path, device) -> dict:
    """A checkpoint, or one BadInput line saying why it cannot be used."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file: pickle, zip and tensor errors all land here
        raise BadInput(
            f"--resume: {path} cannot be read ({type(e).__name__}); remove it to restart that run from step 0"
        ) from None
    if not isinstance(state, dict) or not {"step", "student", "optimizer"} <= state.keys():
        raise BadInput(f"--resume: {path} is not a checkpoint of train.py (missing step/student/optimizer)")
    step, student, records = state["step"], state["student"], state.get("records")
    problems = [
        (isinstance(step, int) and not isinstance(step, bool) and step >= 0, f"step is {step!r}"),
        (
            isinstance(student, dict) and all(isinstance(v, torch.Tensor) for v in student.values()),
            "student is not a dict of tensors",
        ),
        (isinstance(state["optimizer"], dict), "optimizer is not a dict"),
        (
            records is None or (isinstance(records, list) and all(isinstance(r, dict) for r in records)),
            "records is not a list of objects",
        ),
        (isinstance(state.get("config", {}), dict), "config is not an object"),
        (isinstance(state.get("run_id"), (str, type(None))), f"run_id is {state.get('run_id')!r}"),
    ]
    for ok, what in problems:
        if not ok:
            raise BadInput(f"--resume: {path}: {what}; not a checkpoint of train.py (remove it to restart)")
    return state


def new_run_id() -> str:
    """A fresh run's id, written into its config.json and every checkpoint.pt: a resume then tells the run's
    own checkpoint from another run's of the same settings and shapes (a copied-in file)."""
    return uuid.uuid4().hex


def saved_run_id(run_dir: Path) -> str | None:
    """The run id in run_dir/config.json; None for a folder made before run ids were written."""
    path = run_dir / "config.json"
    try:
        run_id = json.loads(path.read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, RecursionError, AttributeError) as e:
        raise BadInput(f"--resume: {path} cannot be read ({type(e).__name__}); nothing to resume") from None
    if not isinstance(run_id, (str, type(None))):
        raise BadInput(f"--resume: {path}: run_id is {run_id!r}; expected the string a run was made with")
    return run_id


def check_run_id(state: dict, run_id: str | None, source: Path) -> None:
    """A checkpoint resumes only the run that wrote it: its run_id must be config.json's. A folder and a
    checkpoint made before run ids were written (neither has one) resume as before, with a note."""
    if state.get("run_id") != run_id:
        theirs, ours = state.get("run_id") or "no run id", run_id or "no run id"
        raise BadInput(
            f"--resume: {source} belongs to another run ({theirs}; config.json: {ours}): its weights are "
            "not this run's; put this run's own checkpoint back, or remove it to restart from step 0"
        )
    if run_id is None:
        print(
            f"note: --resume: {source.parent} has no run id (made before run ids were written); "
            "its checkpoint is taken as its own",
            file=sys.stderr,
        )


def load_cached(path: Path, device):
    """A cached torch file ($OPD_CACHE/trajectories), or one BadInput line: a zero-byte or truncated file is
    named, with the remedy (it is rebuilt once removed)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # empty, truncated or foreign: pickle, zip and tensor errors all land here
        raise BadInput(
            f"{path}: a cached file that cannot be read ({type(e).__name__}); remove it and it is made again"
        ) from None


def clean_leftovers(run_dir: Path) -> None:
    """Remove *.tmp files a killed save left behind (they are never read), with a note. Another process's
    lock file in the making (.lock.*) is not ours to remove."""
    for tmp in (p for p in run_dir.glob("*.tmp") if not p.name.startswith(".lock.")):
        print(
            f"note: removing {tmp} ({tmp.stat().st_size / 2**20:.0f} MiB), left by an interrupted save",
            file=sys.stderr,
        )
        tmp.unlink()


def summary(records: list[dict]) -> str:
    evals = [r for r in records if r.get("eval_rkl") is not None]
    first, last = evals[0], evals[-1]
    drop = 1 - last["eval_rkl"] / first["eval_rkl"] if first["eval_rkl"] > 0 else 0.0
    text = f"held-out reverse KL {first['eval_rkl']:.3f} -> {last['eval_rkl']:.3f} nats/token "
    text += f"({drop:.0%} lower)" if drop >= 0 else f"({-drop:.0%} higher: the student moved away)"
    if "eval_acc" in first:
        text += f"; held-out accuracy {first['eval_acc']:.3f} -> {last['eval_acc']:.3f}"
    return text + f"; {run_seconds(records):.0f}s"


def run_seconds(records: list[dict]) -> float:
    """Wall-clock seconds of a run: its training steps and its evaluations."""
    return sum(r["seconds"] + r.get("eval_seconds", 0.0) for r in records)


# ---------------------------------------------------------------------------------------------------
# One process per run folder


class RunLock:
    """runs/<name>/.lock: taken before anything in the folder is read or written, and held with flock(2) on
    its open file for the life of the run, so the kernel releases it when the process dies (kill -9 too).

    Taking it: write {"pid", "host"} to a private file, flock that file, then os.link it to .lock, which fails
    if .lock exists: the lock appears with its content, or not at all. An existing .lock whose flock is free
    has no living owner (whatever its content, an empty file included) and is replaced by ours in one
    rename while its flock is held, so two processes cannot both take over the same stale lock."""

    def __init__(self, run_dir: Path):
        self.path, self.fd = Path(run_dir) / ".lock", None
        self.made: list[Path] = []  # the folders `claim` created for this run (removed if it writes nothing)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        mine = self.path.with_name(f".lock.{os.getpid()}.{threading.get_ident()}.new")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n"
        try:
            atomic_write(mine, lambda f: f.write(record.encode()))
        except WriteFailed as e:  # a full disk before the start: nothing is left behind
            reason = str(e).split(" (", 1)[1].split(");", 1)[0]
            raise WriteFailed(
                f"could not write {self.path} ({reason}); nothing was started: free space and run again"
            ) from e
        fd = os.open(mine, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file yet
            for _ in range(3):
                try:
                    os.link(mine, self.path)
                    self.fd = fd
                    return
                except FileExistsError:
                    if self._take_over_if_stale(mine):
                        self.fd = fd
                        return
            raise BadInput(f"{self.path.parent}: could not take the run lock {self.path}; try again")
        except BaseException:
            os.close(fd)
            raise
        finally:
            mine.unlink(missing_ok=True)

    def _owner(self) -> str:
        try:
            owner = json.loads(self.path.read_text())
            return f"PID {int(owner['pid'])} on host {owner['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process"

    def _take_over_if_stale(self, mine: Path) -> bool:
        """Replace a .lock nobody holds by `mine` (True); False if .lock changed meanwhile (try again)."""
        if self.path.is_dir() or (self.path.exists() and not self.path.is_file()):
            raise BadInput(f"{self.path} is not a lock file; remove it if no run is using {self.path.parent}")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # released meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BadInput(
                    f"{self.path.parent} is in use by {self._owner()}; wait for it, or choose another --name"
                ) from None
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return False
            owner = self._owner()
            if owner != "a process" and not owner.endswith(f"on host {socket.gethostname()}"):
                raise BadInput(
                    f"{self.path.parent} is locked by {owner}; flock cannot tell across hosts, so "
                    f"if that run is dead, remove {self.path}"
                )
            os.replace(mine, self.path)
            print(f"note: took over {self.path} from {owner}, which no longer holds it", file=sys.stderr)
            return True
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()  # before the flock goes, so a waiter never takes a lock still ours
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def check_run_name(name: str) -> str:
    """A run name is one path component: not empty, no '/', not '.' or '..', at most 255 bytes."""
    bad = not name or name in (".", "..") or any(c in name for c in "/\\\0")
    if bad:
        raise BadInput(f"--name {name!r}: a run name is one folder name (no '/', not '.' or '..', not empty)")
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise BadInput(f"--name {name[:40]}...: {len(name)} characters; a run name is at most 255 bytes")
    return name


def run_files(run_dir: Path) -> list[str]:
    """What a run has put in its folder: everything but a lock and the temporary files of a killed save."""
    if not run_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in run_dir.iterdir()
        if not (p.name == ".lock" or p.name.startswith(".lock.") or p.name.endswith(".tmp"))
    )


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A fresh run needs a folder with no run files in it (a lock-only folder is fresh); a resumed one needs
    config.json. The run files that exist must be regular files. Called before loading (for a fast refusal)
    and again under the lock (the decision that counts)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise BadInput(f"--name {run_dir.name}: {run_dir} is a file, not a run folder")
    for name in RUN_FILES:
        if (run_dir / name).exists() and not (run_dir / name).is_file():
            raise BadInput(f"{run_dir / name} is not a regular file; a run folder holds files only")
    existing = run_files(run_dir)
    if not resume and existing:
        raise BadInput(
            f"--name {run_dir.name}: {run_dir} already exists ({', '.join(existing[:4])}); pass "
            "--resume to continue it, or choose another --name (a run is never overwritten)"
        )
    if resume and not (run_dir / "config.json").is_file():
        raise BadInput(
            f"--resume: {run_dir} has no config.json; nothing to resume (start it without --resume)"
        )


def resume_command(cfg) -> str:
    """The command that resumes the run of cfg (a lab.train_args.TrainConfig), for the line an interrupted
    run ends."""
    return shlex.join(["python", "train.py", "--out-dir", cfg.out_dir, "--name", cfg.name, "--resume"])


def check_target(out_dir: str, name: str, resume: bool) -> Path:
    """out_dir/name, checked before any work: a writable --out-dir, a one-component name, the folder's
    state (check_run_dir)."""
    check_output_dir(out_dir, "--out-dir")
    run_dir = Path(out_dir) / check_run_name(name)
    check_run_dir(run_dir, resume)
    return run_dir


def claim(run_dir: Path, resume: bool) -> RunLock:
    """Make the folder, take its lock, then check it under the lock (check_run_dir). On any refusal the lock
    is released and the folders this call made are removed again: nothing is left behind."""
    made = [d for d in [run_dir, *run_dir.parents] if not d.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--out-dir: cannot create {run_dir} ({e.strerror or type(e).__name__})") from None
    lock = RunLock(run_dir)
    try:
        lock.acquire()
        check_run_dir(run_dir, resume)
    except BaseException:
        lock.release()
        remove_made(made)
        raise
    lock.made = made
    return lock


def remove_made(made: list[Path]) -> None:
    """Remove the folders `claim` made, deepest first, where they are still empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            return


# ---------------------------------------------------------------------------------------------------
# Typed reading of config.json


def _fits(value, hint) -> bool:
    """Does a JSON value have the type a dataclass field declares? No bools for numbers, finite floats."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None) or isinstance(value, bool) or hint is bool:
        return value is None if hint is type(None) else (hint is bool and isinstance(value, bool))
    if hint is int:
        return isinstance(value, int) and abs(value) < 2**63
    if hint is float:
        return isinstance(value, (int, float)) and abs(value) < 1e308 and math.isfinite(value)
    if hint in (tuple, list):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return hint is str and isinstance(value, str)


def typed(obj, cls, where: str):
    """A dataclass `cls` from a JSON object, every field of its declared type (nested dataclasses too); a
    missing field takes its default, an unknown key is ignored, a wrong type is one BadInput line. Floats
    are finite, except +inf in a field whose metadata says {"inf": True}."""
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected an object, got {type(obj).__name__}")
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            continue
        value, hint = obj[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = typed(value, hint, where=f"{where}: {f.name}")
        elif _fits(value, hint) or (f.metadata.get("inf") and value == math.inf):  # e.g. an uncapped ratio
            values[f.name] = value
        else:
            shown = getattr(hint, "__name__", str(hint))
            raise BadInput(f"{where}: {f.name} is {str(value)[:40]!r}; expected {shown}")
    return cls(**values)


def load_config(run_dir: Path, cls):
    """runs/<name>/config.json as a `cls`, typed (see `typed`)."""
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise BadInput(f"--resume: {path} cannot be read ({type(e).__name__}); nothing to resume") from None
    return typed(saved, cls, where=f"--resume: {path}")


def flat(settings: dict, prefix: str = "") -> dict:
    """{"lr": .., "rollout": {"seed": ..}} -> {"lr": .., "rollout.seed": ..}; tuples as lists (as in JSON)."""
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix=f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def changes(old: dict, new: dict) -> dict[str, tuple]:
    """{key: (old, new)} for the flattened keys where two settings dicts differ."""
    a, b = flat(old), flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def refuse_unsafe(differ: dict, source: Path, safe: tuple) -> None:
    """One line naming every setting not in `safe` in differ ({key: (saved, asked)})."""
    unsafe = {k: v for k, v in differ.items() if k not in safe}
    if unsafe:
        shown = ", ".join(f"{k} {new!r} (saved: {old!r})" for k, (old, new) in unsafe.items())
        raise BadInput(
            f"--resume: {shown} differ from {source}; only {', '.join(safe[:5])} may change on "
            "resume (start a new --name for other settings)"
        )


def resume_changes(saved: dict, asked: dict, given: set[str], safe: tuple, source: Path) -> dict:
    """What a --resume's flags change in the saved settings: {key: new} for the keys whose flag was given
    (`given`: argparse dests) and whose value differs. Refuses any that is not `safe` (the resumed run notes
    the others once it has checked its checkpoint: `note_changes`)."""
    have, want = flat(saved), flat(asked)
    pair_given = bool(given & {"pair", "teacher", "student"})
    pair_keys = ("pair", "teacher", "student") if pair_given else ()
    keys = [k for k in have if k.split(".")[-1] in given or k in pair_keys]
    differ = {k: (have[k], want.get(k)) for k in keys if have[k] != want.get(k)}
    refuse_unsafe(differ, source=source, safe=safe)
    return {k: new for k, (old, new) in differ.items()}


def note_changes(differ: dict) -> None:
    """One note per changed setting; where the folder lies (name, out_dir) is not a setting."""
    for key, (old, new) in differ.items():
        if key in ("name", "out_dir"):
            continue
        print(f"note: --resume: {key} {new!r} (was {old!r}); recorded in config.json", file=sys.stderr)


def restore_state(state: dict, source: Path, model, optimizer, batches) -> None:
    """Load a checkpoint's weights, AdamW state and batches; one that does not fit is one BadInput line."""
    try:
        model.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        batches.restore(state.get("batches", {"snapshots": [], "pending": None}))
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise BadInput(
            f"--resume: {source} does not fit this run's model ({first}); remove it to restart from step 0"
        ) from None


def reusable_run(run_dir: Path, settings: dict, step: int) -> bool:
    """May a calibration reuse the run in run_dir for its point at `step`? Only if config.json holds exactly
    `settings` (every key given, nested rollout keys and steps included; keys not given are not compared),
    the run finished (its metrics reach config.json's steps), and it has a finite held-out evaluation
    (eval_rkl) at `step`. Anything unreadable is False: the caller runs again rather than guess."""
    try:
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        records = read_metrics(run_dir / "metrics.jsonl", upto=sys.maxsize)
    except (OSError, ValueError, RecursionError, BadInput):
        return False
    if not isinstance(saved, dict):
        return False
    wanted, have = flat(json.loads(json.dumps(settings))), flat(saved)
    if any(k not in have or have[k] != v for k, v in wanted.items()):
        return False
    steps = saved.get("steps")
    finished = bool(records) and records[-1]["step"] == steps
    evals = [r.get("eval_rkl") for r in records if r["step"] == step]
    evaluated = any(isinstance(v, (int, float)) and math.isfinite(v) for v in evals)
    return finished and evaluated


def drop_checkpoint(run_dir: Path) -> None:
    """Deletes a finished experiment run's checkpoint.pt (calibrations and study sweeps): such a run is
    reused from its config.json and metrics.jsonl alone (reusable_run), so nothing reads the checkpoint
    again; smollm2's are 0.9 GB each, and a calibration's 20 to 40 of them would fill a laptop's disk."""
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# Plots


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    train = [r for r in records if r.get("rkl") is not None]
    evals = [r for r in records if r.get("eval_rkl") is not None]
    has_acc = any("eval_acc" in r for r in evals)
    # A bare Figure (no pyplot): nothing global changes, so a notebook's inline plots keep working.
    fig = Figure(figsize=(10 if has_acc else 5.5, 4))
    axes = fig.subplots(1, 2 if has_acc else 1, squeeze=False)
    ax = axes[0, 0]
    ax.plot(
        [r["step"] for r in train],
        [r["rkl"] for r in train],
        label="train reverse KL (on-policy batch)",
        alpha=0.6,
    )
    ax.plot([r["step"] for r in evals], [r["eval_rkl"] for r in evals], "o-", label="held-out reverse KL")
    ax.set(xlabel="step", ylabel="nats / token", title=title)
    ax.legend()
    if has_acc:
        acc = [r for r in evals if "eval_acc" in r]
        axes[0, 1].plot([r["step"] for r in acc], [r["eval_acc"] for r in acc], "o-", color="C2")
        axes[0, 1].set(
            xlabel="step", ylabel="exact-match accuracy (greedy)", title="held-out accuracy", ylim=(0, 1)
        )
    fig.tight_layout()
    atomic_savefig(fig, path)
