"""Command-line conventions every entry point shares: errors a person can act on, and typed converters.

A bad value ends the program with one line that names it and what is accepted, exit code 2, before any
output is created or changed:

    error: argument --lr: 'nan': expected a finite number > 0

Exit codes: 0 done; 2 bad input (`BadInput`, or a value argparse refuses); 3 a run halted on a non-finite
value (`NonFinite`: a NaN loss or gradient, or an engine whose weights or logits are not finite); 5 a file
could not be written (`WriteFailed`: a full disk; the file's previous version is intact, so a run can resume
once there is room); 6 a run stopped over its mismatch budget (`OverBudget`: `train.py --budget B
--over-budget stop`, with a checkpoint at that step). `admit.py check` also exits 1 on a REJECT verdict and 4
on UNCERTAIN, so a CI job can gate on it.

Converters check one value each and bound it by what the machine and the models can hold (a seed below
2**63, a batch of at most MAX_BATCH rows, a temperature of 0 or at least MIN_TEMPERATURE); flags with a fixed
set of values use argparse `choices=`.

Every output goes through one guarded path: `check_output_dir` / `check_output_file` refuse a target that
cannot be written (under a file, not writable, a FIFO or a device) before any work starts, and
`lab.atomic` writes it so that a full disk is one `WriteFailed` line (exit 5) with nothing
half-written. A file or folder named on the command line is text (`path_text`): a name with bytes that are
not UTF-8 cannot go into config.json, a plot title or a report, so it is refused before any work.

Signals, one rule for every entry point: an entry script calls `exit_on_signals(__name__)` before its heavy
imports, so SIGINT and SIGTERM stop it at once with one line and exit 130 / 143 (every write is atomic, so
stopping anywhere leaves nothing half-written); inside `StopSignals` (a training run) they only ask the
program to stop at its next safe point (`Interrupted`: a checkpoint first, then the same line and code).
"""

import argparse
import atexit
import contextlib
import logging
import math
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

# transformers imports torchao, which logs "Failed to load ...so" for its CUDA kernels on CPU-only machines,
# and torch warns about a torchao Enum; both are harmless and would bury our own messages. Every module of
# the project imports this one before transformers, so this is the one place these loggers are set.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_WRITE_FAILED, EXIT_OVER_BUDGET = 2, 3, 5, 6
_IMPORTED = time.time()


class BadInput(ValueError):
    """A user-facing input error: the entry points print its message as one line and exit with 2."""


class NonFinite(RuntimeError):
    """A NaN or infinity where training or sampling needs a number: one line, exit 3."""


class WriteFailed(RuntimeError):
    """A checkpoint or result could not be written (a full disk): one line, exit 5. The temporary file is
    removed and the previous version stays as it was."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM stopped the program at a safe point: one line, exit 128 + the signal number. A
    BaseException, as KeyboardInterrupt is: no `except Exception` on its way up may swallow it or report it
    as another error (a write that failed, a file that cannot be read)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class OverBudget(RuntimeError):
    """A run's running mismatch interval ended above its budget's interval, and the run was asked to stop
    there (train.py --over-budget stop): one line, exit 6, the checkpoint of that step kept for --resume."""


# the errors every entry point reports as one line
EXPECTED = (BadInput, NonFinite, WriteFailed, Interrupted, OverBudget)


class Parser(argparse.ArgumentParser):
    """argparse, but a refused value is one line on stderr (no usage block) and exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)


def fail(error: BaseException) -> None:
    """Print one of the EXPECTED errors as one line and exit with its code. After a stop signal (a library
    swallowed its SystemExit and the program went on into this error) the signal's line was the one line:
    exit with its code, silently."""
    if _AT_ONCE["stopping"]:
        sys.exit(_AT_ONCE["code"])
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, Interrupted):  # not an error: the user asked the program to stop
        sys.stderr.write(f"{first_line}\n")
        sys.exit(error.code)
    sys.stderr.write(f"error: {first_line}\n")
    codes = {NonFinite: EXIT_NON_FINITE, WriteFailed: EXIT_WRITE_FAILED, OverBudget: EXIT_OVER_BUDGET}
    sys.exit(codes.get(type(error), EXIT_BAD_INPUT))


def process_seconds() -> float:
    """Wall seconds since this process started (Linux /proc; elsewhere since this module was imported)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def _converter(kind, ok, accepted: str):
    """An argparse `type=` that parses with `kind`, then refuses values for which ok(x) is false."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}")
        return value

    convert.__name__ = accepted
    return convert


MAX_INT = 2**31 - 1  # steps, intervals, sizes: no count this project uses comes near it
MAX_BATCH = 4096  # rows a batch may hold (prompts, samples per prompt, probes)
MAX_TOKENS = 2**16  # a response-length limit; each model's context bounds it further (models.check_prompts)
MIN_TEMPERATURE = 1e-4  # below it, logits / T overflow fp32 to inf and the sampler's softmax is NaN
MAX_TEMPERATURE = 1e4
MAX_LR = 1e6  # no run trains above it, and past fp32's 3.4e38 AdamW cannot even hold the value

positive_int = _converter(int, lambda x: 1 <= x <= MAX_INT, f"an integer in [1, {MAX_INT}]")
nonneg_int = _converter(int, lambda x: 0 <= x <= MAX_INT, f"an integer in [0, {MAX_INT}]")
batch_int = _converter(int, lambda x: 1 <= x <= MAX_BATCH, f"an integer in [1, {MAX_BATCH}]")
length_int = _converter(int, lambda x: 1 <= x <= MAX_TOKENS, f"an integer in [1, {MAX_TOKENS}]")
seed_int = _converter(int, lambda x: 0 <= x < 2**63, "an integer in [0, 2**63)")
temperature = _converter(
    float,
    lambda x: x == 0 or MIN_TEMPERATURE <= x <= MAX_TEMPERATURE,
    f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
)
learning_rate = _converter(float, lambda x: 0 < x <= MAX_LR, f"a number in (0, {MAX_LR:g}]")
positive_float = _converter(float, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
nonneg_float = _converter(float, lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")
fraction = _converter(float, lambda x: 0 < x <= 1, "a number in (0, 1]")
open_fraction = _converter(float, lambda x: 0 < x < 1, "a number in (0, 1)")
# an importance-weight cap: 0 = none, a number, or inf for the uncapped ratio
cap_float = _converter(float, lambda x: x >= 0 and not math.isnan(x), "a number >= 0, or inf (uncapped)")
# The engine's weight noise is relative: W + σ · rms(W) · ε (engine.add_weight_noise). The signal's share
# of the noisy weights' power is 1 / (1 + σ²): 1% at σ = 10, where the engine is an unrelated random model
# and a larger σ measures nothing more (the study's largest is 3). Past it, a run only trains on noise.
MAX_NOISE = 10.0
noise_sigma = _converter(
    float, lambda x: 0 <= x <= MAX_NOISE, f"a relative weight noise in [0, {MAX_NOISE:g}] (0 = none)"
)


def noise_levels(text: str) -> list[float]:
    """ "0.003,0.01" -> [0.003, 0.01]: a grid of weight-noise levels σ, each as `noise_sigma` bounds it."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated numbers such as 0.003,0.01"
        ) from None
    if not values or not all(0 <= v <= MAX_NOISE for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated relative weight noises in [0, {MAX_NOISE:g}]"
        )
    return values


def is_text(text: str) -> bool:
    """Is a str valid text: encodable as UTF-8 (no lone surrogate, which is how Python hands over bytes of a
    command line or a file name that are not UTF-8: b'\\xff' -> '\\udcff')?"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def path_text(text: str) -> str:
    """A file or folder named on the command line (an argparse `type=`): valid text. A name that is not
    cannot be written into config.json, a plot title or a report, so it is refused before any work instead
    of failing after it."""
    if not is_text(text):
        raise argparse.ArgumentTypeError(f"{text!r}: not valid UTF-8; expected a name or path that is text")
    return text


path_text.__name__ = "a name or path that is valid UTF-8 text"


def given_dests(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The dests of the flags the command line spelled out, whatever their values (not the defaults)."""
    unset = object()
    dests = vars(parser.parse_args(argv))
    given = parser.parse_args(argv, namespace=argparse.Namespace(**{d: unset for d in dests}))
    return {d for d, v in vars(given).items() if v is not unset}


def recheck(value, convert, name: str, where: str) -> None:
    """Run a value read from a file (config.json on resume) through its flag's converter: the same bounds
    as on the command line, and exact types (a bool or a string is not a number)."""
    kind = convert.__name__
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if wrong_type or (kind.startswith("an integer") and not isinstance(value, int)):
        raise BadInput(f"{where}: {name} is {value!r}; expected {kind}")
    try:
        convert(repr(value))
    except argparse.ArgumentTypeError:
        raise BadInput(f"{where}: {name} is {value!r}; expected {kind}") from None


def recheck_flags(obj, flags, choices: dict, where: str) -> None:
    """A config read from a file gets the command line's checks: `flags` is [(flag, converter, ...)] of
    obj's fields (--batch-size -> obj.batch_size), `choices` {field: allowed values}."""
    for flag, kind, *_ in flags:
        value = getattr(obj, flag[2:].replace("-", "_"))
        if kind is path_text:  # a name or path: text, as on the command line (None: not given)
            if value is not None and not (isinstance(value, str) and is_text(value)):
                raise BadInput(f"{where}: {flag[2:]} is {value!r}; expected {path_text.__name__}")
        elif kind is not str:
            recheck(value, kind, name=flag[2:], where=where)
    for key, allowed in choices.items():
        if getattr(obj, key) not in allowed:
            raise BadInput(f"{where}: {key} is {getattr(obj, key)!r}; expected one of {', '.join(allowed)}")


# ---------------------------------------------------------------------------------------------------
# Outputs: checked before work starts, written through one guarded path


NAME_MAX = 255  # bytes in one path component (Linux, macOS)


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_names(path: Path, flag: str) -> None:
    for part in Path(path).parts:
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise BadInput(
                f"{flag} {str(path)[:60]}...: a path component of {len(part)} characters; "
                f"at most {NAME_MAX} bytes each"
            )


def check_output_dir(path: str | Path, flag: str) -> Path:
    """A folder that exists and is writable, or that can be created: its nearest existing ancestor is a
    writable folder (not a file). Checked up front: no work is wasted on an output that cannot be written."""
    path = Path(path)
    _check_names(path, flag)
    if path.exists() and not path.is_dir():
        raise BadInput(f"{flag} {path}: exists and is not a folder")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise BadInput(f"{flag} {path}: {base} is a file, so no folder can be made under it")
    if not os.access(base, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: {base} is not writable")
    return path


def check_output_file(path: str | Path, flag: str) -> Path:
    """A file path whose folder exists and is writable, and which is a regular file if it exists (a FIFO
    would block the write forever, a device would swallow or refuse it)."""
    path = Path(path)
    _check_names(path, flag)
    if path.exists() or path.is_symlink():
        mode = os.stat(path).st_mode if path.exists() else 0
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or broken link)"
            raise BadInput(f"{flag} {path}: {what}; expected a file path")
    parent = Path(os.path.abspath(path)).parent
    if not parent.is_dir():
        raise BadInput(f"{flag} {path}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: its folder {parent} is not writable")
    return path


# ---------------------------------------------------------------------------------------------------
# Signals

SIGNALS = (signal.SIGINT, signal.SIGTERM)
UNWIND_SECONDS = 10.0  # how long a stopped program may unwind (finally blocks, lock release) before it ends
_AT_ONCE = {"note": "", "stopping": False, "code": 0, "writes": 0}
# what a stopped command that drives many runs says (lab.calibrate, the study; train.run_or_resume)
RERUN = "rerun the same command to continue (finished runs are reused, an interrupted one resumes)"


def _stop_at_once(signum: int, frame) -> None:
    """The handler outside StopSignals: one line, then the program ends with 128 + signum. With no atomic
    write under way (`writing`) it ends at once (os._exit: no `finally` runs, and no library's broad
    `except` can let it go on; a run's lock is an flock, which the OS releases). During a write it raises
    SystemExit instead, so atomic_write removes its temporary file on the way out; should something swallow
    that SystemExit, the exit code is kept (atexit) and the program ends UNWIND_SECONDS later at the latest.
    A further signal while it unwinds ends the process at once, without a second line."""
    if _AT_ONCE["stopping"]:
        os._exit(128 + signum)
    _AT_ONCE["stopping"], _AT_ONCE["code"] = True, 128 + signum
    sys.stderr.write(f"interrupted by {signal.Signals(signum).name}; {_AT_ONCE['note']}\n")
    sys.stderr.flush()
    if not _AT_ONCE["writes"]:  # nothing to unwind (no atomic write under way): end here, whatever catches
        os._exit(128 + signum)  # SystemExit below (a library's broad except would let the program go on)
    # a write under way removes its temporary file as SystemExit passes; should something swallow it, the
    # program still ends UNWIND_SECONDS from now at the latest, and with this code whenever it does
    atexit.register(os._exit, 128 + signum)
    watchdog = threading.Timer(UNWIND_SECONDS, os._exit, args=(128 + signum,))
    watchdog.daemon = True
    watchdog.start()
    raise SystemExit(128 + signum)


def exit_on_signals(module: str, note: str = "no file was left half-written") -> None:
    """The first statement of an entry script, before its heavy imports: `exit_on_signals(__name__)`. When
    that script is the program (module == "__main__"), SIGINT and SIGTERM stop it at once from here on,
    during `import torch` too: one line, "interrupted by SIGINT; <note>", exit 130 (SIGTERM: 143). Inside
    `with StopSignals()` they wait for its safe point instead. Imported as a library (by a test, a notebook,
    another entry point) it changes nothing: the importer owns its signals."""
    if module != "__main__" or threading.current_thread() is not threading.main_thread():
        return
    _AT_ONCE["note"] = note
    for s in SIGNALS:
        signal.signal(s, _stop_at_once)


@contextlib.contextmanager
def writing():
    """Marks an atomic write under way (lab.atomic), which a stop signal lets finish its cleanup."""
    _AT_ONCE["writes"] += 1
    try:
        yield
    finally:
        _AT_ONCE["writes"] -= 1


class StopSignals:
    """Within `with StopSignals() as stop:`, SIGINT and SIGTERM set `stop.signum` instead of killing the
    program, which stops at its next safe point (`stop.check(...)`). A second signal stops it at once (every
    write is atomic, so that is safe too). Only the main thread can own signal handlers; elsewhere this does
    nothing. On leaving, the handlers before it (exit_on_signals's, in an entry script) are back, and a
    signal that arrived after the last check is raised again for them: it is never lost."""

    SIGNALS = SIGNALS

    def __init__(self):
        self.signum, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise Interrupted(f"interrupted by a second {signal.Signals(signum).name}", signum)
        self.signum = signum

    def check(self, message: str) -> None:
        """Raise Interrupted(message) if a signal arrived."""
        if self.signum is not None:
            raise Interrupted(message, self.signum)

    def __exit__(self, exc_type, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.previous and self.signum is not None and exc_type is None:
            # it came after the last safe point (a run's final plot, say): the caller stops on it instead
            signal.raise_signal(self.signum)
        return False
