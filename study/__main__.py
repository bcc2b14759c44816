"""The study's command line: `python -m study <experiment>` (see study/__init__.py for what each does).

python -m study lr --pair tiny           # each loss's learning rate: 90 runs, ~3.3 h on a 2-core CPU
python -m study validate --pair tiny     # ~23 min on a 2-core CPU
python -m study rl                       # ~1 h 45 min on a 2-core CPU
python -m study prefix                   # ~7 min
python -m study async                    # smollm2, ~8 min
python -m study sources --pair tiny --weights fp8 --kv-cache fp8 --staleness 2
python -m study sensitivity --pair smollm2 --probes 8 --max-new-tokens 24
python -m study coverage --pair tiny --draws 200   # dump CI coverage, k3-only and top-k
python -m study drift --budget budgets/tiny/budget.json   # training (dump) vs probe mismatch
python -m study report
"""

import cli

# first, before the heavy imports below: a SIGINT/SIGTERM during them is one line too
cli.exit_on_signals(__name__, note=cli.RERUN)

from pathlib import Path

from cli import EXPECTED, Parser, fail, path_text, positive_float, positive_int, seed_int
from config import (
    CHAT_PAIR,
    CHAT_PAIR_HELP,
    CHECK_PROBES,
    DEFAULT_PAIR,
    DEFAULT_PAIR_HELP,
    DEFAULT_PROBES,
    DEVICES,
    PAIRS,
)
from lab.rollout_args import add_rollout_args
from mismatch import probe_defaults
from models import resolve_device
from quant import FP8_WEIGHTS
from rollout import RolloutConfig
from study.coverage import DRAWS, SIZE, run_coverage
from study.drift import drift, drift_table
from study.lr import LR_SEEDS, lr_sweep, lr_table
from study.opd_vs_rl import rl, rl_table
from study.prefix import prefix, prefix_table
from study.report import report
from study.sensitivity import run_sensitivity
from study.sources import run_sources
from study.time_to_quality import async_study, async_table
from study.validate import validate, validation_table


def add_measurement_parsers(sub) -> None:
    """The two experiments that measure without training a run of their own: sources and sensitivity."""
    src = sub.add_parser("sources", help="each mismatch source alone and combined, staleness included")
    src.add_argument(
        "--probes",
        type=positive_int,
        help=f"held-out probes (default: {probe_defaults()})",
    )
    src.add_argument("--json", action="store_true", help="print JSON rows")
    src.add_argument(
        "--seed", type=seed_int, default=RolloutConfig.seed, help="sampling and noise seed (default: 0)"
    )
    add_rollout_args(src.add_argument_group("rollout engine"), sampling=False)
    sens = sub.add_parser(
        "sensitivity", help="FP8 one decoder block at a time; ranking, bar plot, greedy recipe"
    )
    sens.add_argument("--weights", default="fp8", choices=FP8_WEIGHTS, help="(default: %(default)s)")
    sens.add_argument(
        "--probes", type=positive_int, default=DEFAULT_PROBES, help="held-out probes (default: %(default)s)"
    )
    sens.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="probe response length (default: %(default)s)"
    )
    sens.add_argument(
        "--target", type=positive_float, help="recipe target mismatch (default: half the all-FP8 one)"
    )
    sens.add_argument(
        "--out", type=path_text, default="results", help="folder for the plot and JSON (default: %(default)s)"
    )
    for sp in (src, sens):
        sp.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)


def add_validate_parser(sub) -> None:
    """validate: the check's verdicts against real training runs."""
    v = sub.add_parser(
        "validate", help="admission check verdicts vs real training runs on held-out configurations"
    )
    v.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    v.add_argument("--budget", type=path_text, help="budget.json (default: budgets/<pair>/budget.json)")
    v.add_argument(
        "--seeds",
        type=positive_int,
        default=4,
        help="training seeds per candidate (default: %(default)s; "
        "near the knee, 2 seeds cannot resolve the tolerance)",
    )
    v.add_argument(
        "--probes",
        type=positive_int,
        default=CHECK_PROBES,
        help="most probe prompts for each check (default: %(default)s)",
    )
    v.add_argument(
        "--reuse",
        type=path_text,
        help="a results/validation_*.json of the same budget: its training runs are taken as recorded and "
        "only the checks run again",
    )


def build_parser() -> Parser:
    parser = Parser(prog="python -m study", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_validate_parser(sub)
    for name, helptext, seeds in (
        ("rl", "OPD vs GRPO (tiny); seeds beyond the first only for study.opd_vs_rl.RL_SPREAD", 3),
        ("prefix", "per-token vs prefix shift, with and without TIS (tiny)", 3),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument(
            "--seeds", type=positive_int, default=seeds, help="seeds per run (default: %(default)s)"
        )
    lr = sub.add_parser(
        "lr", help="each loss's clean baseline at several learning rates; the rate it trains at"
    )
    lr.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    lr.add_argument("--seeds", type=positive_int, help="seeds per loss and rate (default: 3 tiny, 2 others)")
    a = sub.add_parser("async", help="sync/async × bf16/fp8 time-to-quality")
    a.add_argument("--pair", default=CHAT_PAIR, choices=PAIRS, help=CHAT_PAIR_HELP)
    a.add_argument("--steps", type=positive_int, default=8, help="steps per run (default: %(default)s)")
    add_measurement_parsers(sub)
    cov = sub.add_parser("coverage", help="how often a dump's CI misses the exact KL (k3-only and top-k)")
    cov.add_argument(
        "--pair", default="both", choices=("tiny", "smollm2", "both"), help="(default: %(default)s)"
    )
    cov.add_argument(
        "--draws", type=positive_int, default=DRAWS, help="draws per cell (default: %(default)s)"
    )
    cov.add_argument("--smollm2-draws", type=positive_int, help="draws per smollm2 cell (default: --draws)")
    cov.add_argument(
        "--size", type=positive_int, default=SIZE, help="sequences a draw (default: %(default)s)"
    )
    d = sub.add_parser("drift", help="training mismatch (what a dump reads) vs the probe measurement")
    d.add_argument(
        "--budget", type=path_text, required=True, help="budget.json whose calibration runs to read"
    )
    sub.add_parser("report", help="results/SUMMARY.md from the results")
    for sp in sub.choices.values():
        sp.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.cmd == "sources":
            return run_sources(args, device)
        if args.cmd == "sensitivity":
            return run_sensitivity(args, device)
        if args.cmd == "coverage":
            return run_coverage(args, device)
        if args.cmd == "validate":
            budget = Path(args.budget or f"budgets/{args.pair}/budget.json")
            reuse = Path(args.reuse) if args.reuse else None
            result = validate(
                args.pair, budget, seeds=args.seeds, probes=args.probes, device=device, reuse=reuse
            )
            print(validation_table(result))
        elif args.cmd == "lr":
            result = lr_sweep(args.pair, args.seeds or LR_SEEDS[args.pair], device)
            print(lr_table(result))
        elif args.cmd == "rl":
            print(rl_table(rl(args.seeds, device)))
        elif args.cmd == "prefix":
            print(prefix_table(prefix(args.seeds, device)))
        elif args.cmd == "drift":
            print(drift_table(drift(Path(args.budget))))
        elif args.cmd == "async":
            print(async_table(async_study(args.pair, args.steps, device)))
        print(f"wrote {report()}")
    except EXPECTED as e:
        fail(e)


if __name__ == "__main__":
    main()
