"""The admission check: a candidate rollout configuration's mismatch, measured in seconds, against a budget.

check  Measures a candidate configuration's canonical mismatch on held-out probe prompts (in doubling
       batches, config.FIRST_PROBES first, until the interval decides), with a bootstrap confidence interval
       [lo, hi], and compares it with the budget B that `lab/calibrate.py` fitted and its own 95% interval
       [B_lo, B_hi] over the calibration's seeds:
           admit      if hi < B_lo
           reject     if lo > B_hi
           uncertain  otherwise, with the number of extra probes likely to settle it.
       Or reads another system's log dump (port/dumps.py) and judges its k3 or top-k estimate the same way,
       per step: the dump's verdict is its worst step's, never an ADMIT its unsampled tokens could overturn,
       and UNCERTAIN when a flag finds a misread or its columns are not the sampled distribution.

Here: the live measurement and the command line; the verdict rule is verdict.py's, an export's judging (and
`audit`) port/judge.py's.

    python admit.py check --budget budgets/tiny/budget.json --pair tiny --weights fp8 --kv-cache fp8
    python admit.py check --budget budgets/mine/budget.json --teacher T --student S --prompts my.jsonl
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from budget import budget_power, match_loss, match_pair, read_budget
from cli import EXPECTED, BadInput, Parser, fail, path_text, positive_int, process_seconds, seed_int
from config import CHECK_PROBES, DEFAULT_PAIR, DEFAULT_PAIR_HELP, DEVICES, FIRST_PROBES, PAIRS
from kl import bootstrap_ci
from lab.hf_pairs import cache_dir, pair_files, prompts_sha256
from lab.rollout_args import add_rollout_args, rollout_config_from_args
from lab.runfiles import atomic_save, load_cached
from mismatch import measure_config
from models import format_prompt, load_pair, n_params, resolve_device
from port.judge import DUMP_ONLY, add_audit_parser, check_dump, print_dump_notes, print_steps, run_audit
from quant import FP8_WEIGHTS, fp8_linear_size, kv_bytes_per_token
from rollout import RolloutConfig
from train import trajectory
from verdict import VERDICT_EXIT, beyond_lower_bound, json_band, judge, stale_axis, with_stale_axis

# ---------------------------------------------------------------------------------------------------
# The live check: a candidate measured on held-out probes (the verdict itself: verdict.py)


def stale_versions(pair, k: int, settings: dict, device) -> tuple[list[dict], dict]:
    """The weights of versions 0..k for a stale candidate: k real OPD steps (seed 0) with the training
    `settings` (a budget's train_settings; the evaluation's prompt count does not shape the weights) on a
    copy of the untrained student (train.trajectory). The one source of stale weights for check,
    calibration and the study. Cached in $OPD_CACHE/trajectories under the pair's key (models.Pair.key: its
    name, and a digest of its models and prompts where given), so only the first use of a pair, k and
    settings pays for the steps. Returns (versions, {"cached": bool, "seconds": ...})."""
    over = {key: v for key, v in settings.items() if key != "eval_prompts"}
    tag = "-".join(f"{key}{value}" for key, value in sorted(over.items()))
    path = cache_dir() / "trajectories" / f"{pair.key}-{k}-{tag or 'defaults'}.pt"
    t0 = time.time()
    if path.is_file():
        return load_cached(path, device), {"cached": True, "seconds": time.time() - t0}
    if pair.teacher is None:  # loaded for the check alone: the k real steps need the teacher
        pair = load_pair(pair.name, device=device, **pair.files)
    versions = trajectory(pair, k, device, **over)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(versions, path)
    return versions, {"cached": False, "seconds": time.time() - t0}


def engine_bytes(student, cfg: RolloutConfig) -> dict:
    """The engine copy's weight bytes and KV bytes per token, in its real dtypes (fp8 weights: the Linear
    layers not skipped, 1 byte each plus an fp32 scale per row), against the trainer's fp32 copy."""
    high = 2 if cfg.weights in ("bf16", "fp8-dyn") else 4  # fp8-dyn engines compute in bf16 (rollout.py)
    fp8_elems, fp8_rows = fp8_linear_size(student, cfg.fp8_skip) if cfg.weights in FP8_WEIGHTS else (0, 0)
    n = n_params(student)
    return {
        "weight_bytes": (n - fp8_elems) * high + fp8_elems + 4 * fp8_rows,
        "weight_bytes_fp32": n * 4,
        "kv_bytes_per_token": kv_bytes_per_token(student.config, cfg.kv_cache, dtype_bytes=high),
        "kv_bytes_per_token_fp32": kv_bytes_per_token(student.config, "model", dtype_bytes=4),
    }


def sequential_measure(pair, cfg: RolloutConfig, cap: int, budget: dict, versions) -> tuple[dict, int, int]:
    """Probe in doubling batches until the CI decides or `cap` probes are used. A noisy candidate gets a fresh
    noise draw per batch (training redraws at every version), and the CI resamples draws, then probes within
    them, so the draw-to-draw spread is in it. Returns (measurement, probes used, draws)."""
    kl, seq, group, n, batch = [], [], [], 0, 0
    while n < cap:
        take = min(FIRST_PROBES * 2 ** max(batch - 1, 0), cap - n)
        probes = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[n : n + take]]
        row = replace(cfg, seed=cfg.seed + batch) if cfg.noise > 0 else cfg
        s = measure_config(pair, row, probes, versions=versions, keep=True)["scored"]
        kl.append(s.kl_R)
        seq.append(s.seq_id_R + n)
        group += [batch] * take
        n, batch = n + take, batch + 1
        kl_R, seq_R = torch.cat(kl), torch.cat(seq)
        groups = torch.tensor(group) if cfg.noise > 0 else None
        lo, hi = bootstrap_ci(kl_R, seq_R, seed=cfg.seed, group_of_seq=groups)
        m = {"mismatch_kl": kl_R.mean().item(), "ci_low": lo, "ci_high": hi}
        if judge(budget, m, n, available=cap)["verdict"] != "uncertain" or beyond_lower_bound(budget, m):
            break
    return m, n, batch


def check(budget: dict, pair, cfg: RolloutConfig, cap: int, device: str, load_seconds: float = 0.0) -> dict:
    """The verdict on a candidate configuration of this pair, with the numbers behind it. `load_seconds`:
    what loading the pair took, counted with the measuring against one calibration run."""
    t0 = time.time()
    cap = min(cap, len(pair.eval_prompts))
    settings = budget["train_settings"]
    versions, stale = (
        stale_versions(pair, cfg.staleness, settings, device=device) if cfg.staleness else (None, None)
    )
    m, n, draws = sequential_measure(pair, cfg, cap, budget=budget, versions=versions)
    seconds = time.time() - t0
    out = {
        **with_stale_axis(judge(budget, m, n, available=cap), stale_axis(budget, cfg.staleness)),
        **m,
        "budget": budget["budget"],
        "budget_interval": json_band(budget),
        "probes": n,
        "probe_cap": cap,
        "noise_draws": draws if cfg.noise > 0 else 0,
        "seconds": seconds,
        "load_seconds": load_seconds,
        "seconds_vs_calibration_run": (seconds + load_seconds) / budget["seconds_per_run"],
        **engine_bytes(pair.student, cfg),
    }
    if stale is not None:
        out["stale_trajectory"] = {
            "steps": cfg.staleness,
            "on": "the budget's training settings, seed 0, from the untrained student",
            **stale,
        }
    return out


# ---------------------------------------------------------------------------------------------------
# Command line (the dump side's flags, judging and printing: port/judge.py)


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser(
        "check",
        help="measure a candidate (or read a log dump) and judge it against a budget; "
        "exit 0 admit, 1 reject, 4 uncertain",
    )
    chk.add_argument(
        "--budget", type=path_text, required=True, help="budget.json from python -m lab.calibrate"
    )
    chk.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    chk.add_argument(
        "--teacher",
        type=path_text,
        help="live probes of your own pair: as train.py (with --student, --prompts)",
    )
    chk.add_argument(
        "--student", type=path_text, help="HF id or local folder of the student (the budget's own)"
    )
    chk.add_argument(
        "--prompts",
        type=path_text,
        help="the JSONL the budget was calibrated with: its held-out tenth are the probes",
    )
    chk.add_argument(
        "--probes",
        type=positive_int,
        default=CHECK_PROBES,
        help="most held-out probes to use (default: %(default)s); probing stops as soon as the CI decides",
    )
    chk.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.add_argument(
        "--seed", type=seed_int, default=RolloutConfig.seed, help="sampling and noise seed (default: 0)"
    )
    add_rollout_args(chk.add_argument_group("candidate rollout engine (train.py's flags)"), sampling=False)
    add_audit_parser(sub, chk)
    chk.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def check_live(budget: dict, args, device: str) -> dict:
    """check on live probes of the pair the flags name (--pair, or --teacher/--student/--prompts as train.py
    reads them), which must be the budget's, prompts included (budget.match_pair); loaded without its
    teacher, which only a stale candidate's trajectory needs (stale_versions loads it then)."""
    pair_name = "custom" if args.teacher else args.pair
    files = pair_files(args.teacher, args.student, args.prompts)
    sha = prompts_sha256(files["prompts"]) if "prompts" in files else None
    match_pair(budget, pair_name, files, where=f"--budget {args.budget}", probes=True, prompts_sha256=sha)
    # --temperature/--top-p describe an export (refuse_unread keeps them off a live check): probes sample at 1
    live = SimpleNamespace(**{k: v for k, v in vars(args).items() if k not in ("temperature", "top_p")})
    cfg = rollout_config_from_args(live, pair=pair_name)
    t0 = time.time()
    pair = load_pair(pair_name, device=device, student_only=True, **files)
    return check(budget, pair, cfg, cap=args.probes, device=device, load_seconds=time.time() - t0)


def print_check(result: dict) -> None:
    extra = (
        f"; about {result['extra_probes']} more probes would likely settle it"
        if result.get("extra_probes")
        else ""
    )
    print(f"{result['verdict'].upper()} for the {result['loss']} loss: {result['reason']}{extra}")
    if len(result.get("per_step", [])) > 1:
        print_steps(result)
    on = (
        f"{result['probes']} probes"
        if "probes" in result
        else f"{result['sequences']} logged sequences ({result['estimator']})"
    )
    print(
        f"mismatch {result['mismatch_kl']:.3e} nats/token, "
        f"95% CI [{result['ci_low']:.3e}, {result['ci_high']:.3e}] on {on}"
    )
    if "coverage_rule" in result:
        print(f"interval: {result['coverage_rule']}")
        print_dump_notes(result)
    power = result.get("power") or {}
    if power.get("under_powered"):
        ratio = power["se_over_tolerance"]
        measured = f"SE = {ratio:.2f} x tolerance" if ratio is not None else "no SE measured"
        print(f"the budget is UNDER-POWERED ({measured}; rule: {power['rule']}): its interval may move")
    if "weight_bytes" in result:
        print(
            f"buys: weights {result['weight_bytes'] / 2**20:.1f} MiB "
            f"(fp32: {result['weight_bytes_fp32'] / 2**20:.1f}), "
            f"KV {result['kv_bytes_per_token']:,.0f} B/token "
            f"(fp32: {result['kv_bytes_per_token_fp32']:,.0f})"
        )
        print(
            f"measuring took {result['seconds']:.1f} s and loading the student "
            f"{result['load_seconds']:.1f} s: "
            f"{result['seconds_vs_calibration_run']:.1%} of one calibration run; before them, starting "
            f"Python and importing torch and transformers took {result['import_seconds']:.1f} s "
            f"({result['wall_seconds']:.1f} s wall in all)"
        )


# check's flags that only its live mode reads (port.judge.DUMP_ONLY: those only an export with --dump reads)
LIVE_ONLY = ("pair", "teacher", "student", "prompts", "probes", "seed")
LIVE_ONLY += ("max_new_tokens", "weights", "fp8_skip", "kv_cache", "kv_scales", "staleness", "noise")


def refuse_unread(args) -> None:
    """A flag of check's other mode would be ignored in silence: refused by name. Given means set to other
    than its default (a default spelled out changes nothing)."""
    defaults = build_parser().parse_args(["check", "--budget", args.budget])
    unread = [d for d in (LIVE_ONLY if args.dump else DUMP_ONLY) if getattr(args, d) != getattr(defaults, d)]
    if not unread:
        return
    flags = ", ".join("--" + d.replace("_", "-") for d in unread)
    if args.dump:
        raise BadInput(
            f"{flags}: set a live candidate's probes or engine, but --dump judges an export as it was "
            "logged; drop them, or drop --dump to measure the candidate"
        )
    raise BadInput(
        f"{flags} without --dump: only an export has steps, a format and the run's sampling settings (a live "
        "check measures probes at temperature 1); "
        f"give --dump, or drop {flags}"
    )


def main(argv=None) -> None:
    # interpreter start and imports, before check's own work (in /proc's 10 ms ticks); the rest on one clock
    imported, started = process_seconds(), time.time()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "audit":
            command = shlex.join(["python", "admit.py", *argv])
            budget = read_budget(Path(args.budget), None)
            result = run_audit(
                budget, args, command=command, loss=match_loss(budget, args.loss, args.tis_cap)
            )
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                print_check(result)
                print(f"wrote {' and '.join(result['wrote'])}")
            return
        refuse_unread(args)
        device = resolve_device(args.device)
        budget = read_budget(Path(args.budget), None)  # its pair: check_live's (a dump names none)
        loss = match_loss(budget, args.loss, args.tis_cap)
        if args.dump:
            sampled = {"temperature": args.temperature, "top_p": args.top_p}
            result = check_dump(budget, Path(args.dump), fmt=args.format, steps=args.steps, **sampled)
        else:
            result = check_live(budget, args, device=device)
            result.update(import_seconds=imported, wall_seconds=imported + time.time() - started)
        result["loss"] = loss  # the verdict holds for this loss only
        result["power"] = budget_power(budget)
    except EXPECTED as e:
        fail(e)
    print(json.dumps(result, indent=2)) if args.json else print_check(result)
    sys.exit(VERDICT_EXIT[result["verdict"]])


if __name__ == "__main__":
    main()
