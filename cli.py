"""Command-line conventions every entry point shares: errors a person can act on, and typed converters.

A bad value ends the program with one line that names it and what is accepted, exit code 2, before any
output is created or changed:

    error: argument --lr: 'nan': expected a finite number > 0

Exit codes: 0 done; 2 bad input (`BadInput`, or a value argparse refuses); 3 a run halted on a non-finite
value (`NonFinite`: a NaN loss or gradient, or an engine whose weights or logits are not finite); 5 a file
could not be written (`WriteFailed`: a full disk; the file's previous version is intact, so a run can resume
once there is room). `admit.py check` also exits 1 on a REJECT verdict and 4 on UNCERTAIN, so a CI job can
gate on it.

Converters check one value each; flags with a fixed set of values use argparse `choices=`.
"""

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

# transformers imports torchao, which logs "Failed to load ...so" for its CUDA kernels on CPU-only machines,
# and torch warns about a torchao Enum; both are harmless and would bury our own messages. Every module of
# the project imports this one before transformers, so this is the one place these loggers are set.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_WRITE_FAILED = 2, 3, 5
_IMPORTED = time.time()


class BadInput(ValueError):
    """A user-facing input error: the entry points print its message as one line and exit with 2."""


class NonFinite(RuntimeError):
    """A NaN or infinity where training or sampling needs a number: one line, exit 3."""


class WriteFailed(RuntimeError):
    """A checkpoint or result could not be written (a full disk): one line, exit 5. The temporary file is
    removed and the previous version stays as it was."""


EXPECTED = (BadInput, NonFinite, WriteFailed)  # the errors every entry point reports as one line


class Parser(argparse.ArgumentParser):
    """argparse, but a refused value is one line on stderr (no usage block) and exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)


def fail(error: Exception) -> None:
    """Print one of the EXPECTED errors as one line and exit with its code."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    sys.stderr.write(f"error: {first_line}\n")
    codes = {NonFinite: EXIT_NON_FINITE, WriteFailed: EXIT_WRITE_FAILED}
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


positive_int = _converter(int, lambda x: x >= 1, "an integer >= 1")
nonneg_int = _converter(int, lambda x: x >= 0, "an integer >= 0")
positive_float = _converter(float, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
nonneg_float = _converter(float, lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")
fraction = _converter(float, lambda x: 0 < x <= 1, "a number in (0, 1]")
open_fraction = _converter(float, lambda x: 0 < x < 1, "a number in (0, 1)")
# an importance-weight cap: 0 = none, a number, or inf for the uncapped ratio
cap_float = _converter(float, lambda x: x >= 0 and not math.isnan(x), "a number >= 0, or inf (uncapped)")


def comma_floats(text: str) -> list[float]:
    """ "0.003,0.01" -> [0.003, 0.01]: finite, non-negative numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated numbers such as 0.003,0.01"
        ) from None
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated finite numbers >= 0")
    return values
