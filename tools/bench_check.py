"""Benchmark: what `admit.py check` costs against one calibration run, on the ten candidates of RESULTS.md.

Each candidate runs as its own process (`python admit.py check --budget B --pair P FLAGS --json`), as a user
runs it; the table gives its verdict, the probes it needed, and its time in three parts: starting Python and
importing torch and transformers, loading the student, measuring. The cost is loading plus measuring against
the budget's seconds per calibration run (what check itself prints), then the whole wall time against it.
A stale candidate's first check also trains its k steps; the trajectory is cached, and this benchmark runs
each candidate once beforehand (not timed) so that every row is a check as users see it after the first.

    python -m tools.bench_check                     # smollm2, ten candidates, about 3 min on a 2-core CPU
    python -m tools.bench_check --pair tiny
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import json
import statistics
import subprocess
import sys
from pathlib import Path

from budget import read_budget
from cli import EXPECTED, BadInput, Parser, fail
from config import CHAT_PAIR, CHAT_PAIR_HELP
from tools.machine import cpu_facts

CANDIDATES = [
    "--weights fp8",
    "--kv-cache fp8",
    "--kv-cache fp8 --kv-scales unit",
    "--weights bf16",
    "--weights fp8-emu",
    "--noise 0.01",
    "--noise 0.1",
    "--noise 0.3",
    "--noise 1",
    "--staleness 2",
]


def run_check(budget: str, pair: str, flags: str) -> dict:
    cmd = [sys.executable, "admit.py", "check", "--budget", budget, "--pair", pair, *flags.split(), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1, 4):
        raise BadInput(f"`{' '.join(cmd[1:])}` failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=CHAT_PAIR, choices=("tiny", "smollm2"), help=CHAT_PAIR_HELP)
    args = p.parse_args(argv)
    budget = f"budgets/{args.pair}/budget.json"
    try:
        per_run = read_budget(Path(budget), args.pair)["seconds_per_run"]
        for flags in CANDIDATES:
            if "--staleness" in flags:
                run_check(budget, args.pair, flags)  # trains and caches the stale trajectory once
        rows = [(flags, run_check(budget, args.pair, flags)) for flags in CANDIDATES]
    except EXPECTED as e:
        fail(e)
    print(f"{args.pair}: `admit.py check` against {budget} (one calibration run: {per_run:.0f} s)")
    print(cpu_facts())
    print(
        f"{'candidate':<34}{'verdict':>10}{'probes':>7}{'import s':>9}{'load s':>8}{'measure s':>10}"
        f"{'of a run':>9}{'wall s':>8}{'wall/run':>9}"
    )
    cost, wall = [], []
    for flags, r in rows:
        cost.append((r["load_seconds"] + r["seconds"]) / per_run)
        wall.append(r["wall_seconds"] / per_run)
        print(
            f"{flags:<34}{r['verdict']:>10}{r['probes']:>7}{r['import_seconds']:>9.1f}"
            f"{r['load_seconds']:>8.1f}{r['seconds']:>10.1f}{cost[-1]:>9.1%}{r['wall_seconds']:>8.1f}"
            f"{wall[-1]:>9.1%}"
        )
    print(
        f"loading + measuring: median {statistics.median(cost):.1%}, max {max(cost):.1%} of a calibration "
        f"run; whole wall time: median {statistics.median(wall):.1%}, max {max(wall):.1%}"
    )


if __name__ == "__main__":
    main()
