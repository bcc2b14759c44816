"""The admission check: a candidate rollout configuration's mismatch, measured in seconds, against a budget.

check  Measures a candidate configuration's canonical mismatch on held-out probe prompts (in doubling
       batches, FIRST_PROBES first, until the interval decides), with a bootstrap confidence interval
       [lo, hi], and compares it with the budget B that `lab/calibrate.py` fitted and its own 95% interval
       [B_lo, B_hi] over the calibration's seeds:
           admit      if hi < B_lo
           reject     if lo > B_hi
           uncertain  otherwise, with the number of extra probes likely to settle it.
       Or reads another system's log dump (port/dumps.py) and judges its k3 or top-k estimate the same way.

    python admit.py check --budget budgets/tiny/budget.json --pair tiny --weights fp8 --kv-cache fp8
"""

import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from port.audit import draw, origins, report, token_estimates, top_tokens
from budget import CALIBRATABLE, loss_label, match_loss, read_budget, source_staleness
from cli import EXPECTED, BadInput, Parser, cap_float, fail, positive_int, process_seconds, seed_int
from kl import bootstrap_ci
from port.estimate import dump_estimate
from mismatch import measure_config
from models import (
    DEVICES,
    PAIRS,
    cache_dir,
    format_prompt,
    load_pair,
    n_params,
    resolve_device,
    tiny_tokenizer,
)
from port.native import FORMATS, merge, read_native, select_steps
from quant import FP8_WEIGHTS, fp8_linear_size, kv_bytes_per_token
from rollout import RolloutConfig, add_rollout_args, rollout_config_from_args
from lab.runfiles import atomic_save, atomic_write_text, load_cached
from train import trajectory

# ---------------------------------------------------------------------------------------------------
# The verdict (pure)


def verdict(
    lo: float,
    hi: float,
    mean: float,
    budget: float,
    n_probes: int,
    available: int | None = None,
    band: tuple[float, float] | None = None,
) -> dict:
    """admit if hi < B_lo, reject if lo > B_hi, else uncertain with an estimate of the probes needed.

    [B_lo, B_hi] is `band`, the budget's own interval (default [budget, budget]): a candidate whose mismatch
    the calibration cannot place on one side of the budget is not decided by more probes. Otherwise the
    interval's half-width shrinks like 1/sqrt(n) and must shrink below the gap to the nearer edge:
        n_needed ≈ n · (half-width / gap)², extra = n_needed − n,
    and never more than the `available` probes that remain (None: no limit known).
    """
    b_lo, b_hi = band or (budget, budget)
    if hi < b_lo:
        return {"verdict": "admit", "reason": f"upper bound {hi:.3e} < {edge(budget, b_lo, 'lower')}"}
    if lo > b_hi:
        return {"verdict": "reject", "reason": f"lower bound {lo:.3e} > {edge(budget, b_hi, 'upper')}"}
    reason = f"interval [{lo:.3e}, {hi:.3e}] contains budget {budget:.3e}"
    if b_lo < b_hi:
        reason = f"interval [{lo:.3e}, {hi:.3e}] overlaps the budget's 95% interval [{b_lo:.3e}, {b_hi:.3e}]"
    if b_lo <= mean <= b_hi:  # inside the budget's own uncertainty (or on it): probes cannot decide
        if b_lo < b_hi:
            reason += "; the mean lies inside it, where more calibration seeds, not probes, would decide"
        return {"verdict": "uncertain", "reason": reason, "extra_probes": None}
    half, gap = (hi - lo) / 2, (b_lo - mean if mean < b_lo else mean - b_hi)
    extra = math.ceil(n_probes * (half / gap) ** 2) - n_probes
    if available is not None and extra > available - n_probes:
        reason += f"; it would take about {extra} more probes and only {available - n_probes} remain"
        extra = None
    return {"verdict": "uncertain", "reason": reason, "extra_probes": extra}


def edge(budget: float, end: float, which: str) -> str:
    """How a verdict's reason names the threshold: the budget itself, or an end of its interval."""
    if end == budget:
        return f"budget {budget:.3e}"
    return f"{end:.3e}, the {which} end of budget {budget:.3e}'s 95% interval"


# ---------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------
# Stale candidates


def stale_versions(pair, k: int, settings: dict, device) -> tuple[list[dict], dict]:
    """The weights of versions 0..k for a stale candidate: k real OPD steps (seed 0) with the training
    `settings` (a budget's train_settings; the evaluation's prompt count does not shape the weights) on a
    copy of the untrained student (train.trajectory). The one source of stale weights for check,
    calibration and the study. Cached in $OPD_CACHE/trajectories, so only the first use of a pair, k and
    settings pays for the steps. Returns (versions, {"cached": bool, "seconds": ...})."""
    over = {key: v for key, v in settings.items() if key != "eval_prompts"}
    tag = "-".join(f"{key}{value}" for key, value in sorted(over.items()))
    path = cache_dir() / "trajectories" / f"{pair.name}-{k}-{tag or 'defaults'}.pt"
    t0 = time.time()
    if path.is_file():
        return load_cached(path, device), {"cached": True, "seconds": time.time() - t0}
    if pair.teacher is None:  # loaded for the check alone: the k real steps need the teacher
        pair = load_pair(pair.name, device=device)
    versions = trajectory(pair, k, device, **over)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(versions, path)
    return versions, {"cached": False, "seconds": time.time() - t0}


VERDICT_EXIT = {"admit": 0, "reject": 1, "uncertain": 4}  # exit codes of `check`, for gating a CI job
CI_KEYS = ("mismatch_kl", "ci_low", "ci_high")  # the per-step numbers of a multi-step export
FIRST_PROBES = 8  # sequential probing: 8 probes, then doubling (8, 16, 32, 64, ...) up to the cap


def what_it_buys(student, cfg: RolloutConfig) -> dict:
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


def budget_band(budget: dict) -> tuple[float, float]:
    """The budget's own 95% interval [B_lo, B_hi] over the calibration's seeds (calibrate.budget_ci), which
    the verdict decides against: B_hi is +inf where the interval reaches above the largest mismatch tried,
    and for a lower-bound budget ("all-within": no calibration run lost quality). A budget fitted to one
    seed, or written before the interval was recorded, is its own interval."""
    b, ci = budget["budget"], budget.get("budget_ci") or {}
    b_lo = min(b, ci["lo"]) if ci.get("lo") is not None else b
    b_hi = max(b, ci["hi"]) if ci.get("hi") is not None else (math.inf if ci else b)
    return b_lo, math.inf if budget["how"] == "all-within" else b_hi


def json_band(budget: dict) -> list:
    """budget_band for a result's JSON: [B_lo, B_hi], B_hi None where open above."""
    b_lo, b_hi = budget_band(budget)
    return [b_lo, None if b_hi == math.inf else b_hi]


def beyond_lower_bound(budget: dict, m: dict) -> bool:
    """True when the budget's interval is open above and the whole CI lies above its lower end: uncertain
    whatever more probes show, so probing stops."""
    b_lo, b_hi = budget_band(budget)
    return b_hi == math.inf and m["ci_low"] > b_lo


def judge(budget: dict, m: dict, n: int, available: int | None) -> dict:
    """verdict() on a measurement against the budget's interval, which can never reject where it is open
    above (a lower-bound budget, or a crossing some seeds put beyond the grid)."""
    band = budget_band(budget)
    lo, hi, mean = m["ci_low"], m["ci_high"], m["mismatch_kl"]
    decision = verdict(lo, hi, mean, budget=budget["budget"], n_probes=n, available=available, band=band)
    if beyond_lower_bound(budget, m):
        where = (
            "the largest calibrated mismatch, where no run lost quality"
            if budget["how"] == "all-within"
            else "the lower end of the budget's interval, which some seeds put beyond the largest mismatch "
            "calibrated"
        )
        decision = {
            "verdict": "uncertain",
            "extra_probes": None,
            "reason": f"lower bound {m['ci_low']:.3e} is beyond {where} ({band[0]:.3e}): no number of "
            "probes can reject; calibrate with larger mismatch to decide",
        }
    return decision


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


def calibration_staleness(budget: dict) -> dict[int, tuple[float, float, int]]:
    """The calibration's stale runs by staleness k: (mean probe mismatch, mean quality loss, seeds)."""
    groups: dict[int, list[dict]] = {}
    for p in budget["points"]:
        if k := source_staleness(p["source"]):
            groups.setdefault(k, []).append(p)
    return {
        k: (
            statistics.fmean(p["mismatch"] for p in g),
            statistics.fmean(p["quality_loss"] for p in g),
            len(g),
        )
        for k, g in sorted(groups.items())
    }


def stale_axis(budget: dict, staleness: int) -> dict | None:
    """A stale candidate against a sampled-token budget, judged on its own axis. These losses feel staleness
    (an error along the last updates) far more than weight noise of the same per-token KL, so the scale, which
    the noise grid calibrates, cannot place it (DESIGN.md, "A budget holds for one loss"). With the
    calibration's stale runs (quality loss q_j at staleness j), and more staleness losing at least as much:
        reject     some j <= staleness has q_j > tolerance
        None       some j >= staleness has q_j <= tolerance: the scale decides, as for any candidate
        uncertain  neither (calibrate with --real staleness-K to decide).
    None as well for the analytic loss (the scale ranks staleness there) and for a fresh engine."""
    if budget["loss"] == "analytic" or not staleness:
        return None
    tol, ran = budget["tolerance"]["nats"], calibration_staleness(budget)
    label = loss_label(budget["loss"], budget["tis_cap"])
    runs = "; ".join(
        f"staleness {k}: {m:.2g} nats/token, quality loss {q:+.3f} ({n} seeds)"
        for k, (m, q, n) in ran.items()
    )
    seen = f"the calibration's stale runs: {runs or 'none'}; tolerance {tol:.3f} nats"
    if any(k <= staleness and q > tol for k, (_, q, _) in ran.items()):
        why = (
            f"staleness {staleness} is at least as stale as a calibration run that lost beyond the tolerance"
        )
        return {"verdict": "reject", "extra_probes": None, "reason": f"{why} ({label} loss; {seen})"}
    if any(k >= staleness and q <= tol for k, (_, q, _) in ran.items()):
        return None
    why = f"the {label} loss feels staleness beyond its per-token KL; no calibration run brackets {staleness}"
    return {
        "verdict": "uncertain",
        "extra_probes": None,
        "reason": f"{why} ({seen}); calibrate with --real staleness-{staleness} to decide",
    }


def with_stale_axis(decision: dict, axis: dict | None) -> dict:
    """The scale's decision, overruled by the staleness axis where that one rejects, or cannot vouch for an
    admit or an uncertain the scale gave."""
    if axis and (axis["verdict"] == "reject" or decision["verdict"] != "reject"):
        return axis
    return decision


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
        **what_it_buys(pair.student, cfg),
    }
    if stale is not None:
        out["stale_trajectory"] = {
            "steps": cfg.staleness,
            "on": "the budget's training settings, seed 0, from the untrained student",
            **stale,
        }
    return out


def check_dump(budget: dict, path: Path, fmt: str | None = None, steps: str | None = None) -> dict:
    """The verdict from another system's export (port/native.py): k3 (or top-k) estimate with a sequence CI,
    on the steps `steps` selects (None: all), and each step's own estimate under "per_step"."""
    return judge_steps(budget, *read_native(str(path), fmt), spec=steps)


def judge_steps(budget: dict, fmt: str, steps: list, spec: str | None) -> dict:
    t0 = time.time()
    chosen = select_steps(steps, spec)
    merged = merge(chosen).dump
    m = dump_estimate(merged)
    per_step = [
        {"step": s.step, "sequences": s.dump.sequences, **{k: e[k] for k in ("tokens", *CI_KEYS)}}
        for s in steps
        for e in [dump_estimate(s.dump)]
    ]
    decision = judge(budget, m, merged.sequences, available=None)
    if m["warnings"]:  # never admit (nor reject) on a dump that cannot be read as it is
        decision = {"verdict": "uncertain", "reason": "unreadable dump: " + "; ".join(m["warnings"])}
    return {
        **decision,
        **m,
        "budget": budget["budget"],
        "budget_interval": json_band(budget),
        "format": fmt,
        "steps": [s.step for s in chosen],
        "per_step": per_step,
        "seconds": time.time() - t0,
    }


def run_audit(budget: dict, args, command: str, loss: str) -> dict:
    """admit.py audit: the verdict as check --dump gives it, plus DIR/audit.png and DIR/report.md."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a folder")
    decode = None
    if args.tokenizer == "tiny":
        decode = tiny_tokenizer().decode
    elif args.tokenizer:
        if not Path(args.tokenizer).is_dir():
            raise BadInput(f"--tokenizer {args.tokenizer}: expected tiny or a local tokenizer folder")
        decode = AutoTokenizer.from_pretrained(args.tokenizer).decode
    fmt, steps = read_native(args.dump, args.format)
    result = {**judge_steps(budget, fmt, steps, spec=args.steps), "loss": loss}
    chosen = select_steps(steps, args.steps)
    merged = merge(chosen)
    tops = top_tokens(merged, token_estimates(merged.dump), origins(chosen), decode=decode)
    out.mkdir(parents=True, exist_ok=True)
    draw(out / "audit.png", merged, result["per_step"], result=result, tops=tops)
    atomic_write_text(out / "report.md", report(result, tops, command=command, figure="audit.png"))
    return {**result, "wrote": [str(out / "audit.png"), str(out / "report.md")]}


# ---------------------------------------------------------------------------------------------------
# Command line


def add_audit_parser(sub, chk) -> None:
    """The audit subcommand, and the export flags (--dump, --format, --steps) it shares with check."""
    aud = sub.add_parser("audit", help="judge an export and write audit.png and report.md (port/audit.py)")
    aud.add_argument("--dump", required=True, help="the export: a file, a folder or a glob (port/native.py)")
    aud.add_argument("--budget", required=True, help="budget.json from python -m lab.calibrate")
    aud.add_argument("--out", required=True, help="folder for audit.png and report.md")
    aud.add_argument(
        "--tokenizer", help="decode the top tokens: tiny, or a local tokenizer folder (default: ids only)"
    )
    aud.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.add_argument(
        "--dump", help="judge another system's export instead (port/native.py): a file, folder or glob"
    )
    for sp in (chk, aud):
        sp.add_argument(
            "--format", choices=FORMATS, help="the export's format with --dump (default: told by its fields)"
        )
        sp.add_argument("--steps", help="steps to judge with --dump, e.g. 3 or 2-5 or 0,4-6 (default: all)")
        sp.add_argument(
            "--loss",
            choices=CALIBRATABLE,
            help="the OPD loss the candidate trains with (default: the budget's)",
        )
        sp.add_argument(
            "--tis-cap", type=cap_float, help="its importance-weight cap: 0, C or inf (default: the budget's)"
        )


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser(
        "check",
        help="measure a candidate (or read a log dump) and judge it against a budget; "
        "exit 0 admit, 1 reject, 4 uncertain",
    )
    chk.add_argument("--budget", required=True, help="budget.json from python -m lab.calibrate")
    chk.add_argument("--pair", default="tiny", choices=PAIRS, help="the pair (default: %(default)s)")
    chk.add_argument(
        "--probes",
        type=positive_int,
        default=64,
        help="most held-out probes to use (default: %(default)s); probing stops as soon as the CI decides",
    )
    chk.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.add_argument(
        "--seed", type=seed_int, default=RolloutConfig.seed, help="sampling and noise seed (default: 0)"
    )
    add_rollout_args(chk.add_argument_group("candidate rollout engine (train.py's flags)"), sampling=False)
    add_audit_parser(sub, chk)
    for sp in (chk,):
        sp.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    return parser


def print_check(result: dict) -> None:
    extra = (
        f"; about {result['extra_probes']} more probes would likely settle it"
        if result.get("extra_probes")
        else ""
    )
    print(f"{result['verdict'].upper()} for the {result['loss']} loss: {result['reason']}{extra}")
    if len(result.get("per_step", [])) > 1:
        print(f"{'step':>8} {'seqs':>6} {'tokens':>8}  mismatch (nats/token)  95% CI  ({result['format']})")
        for r in result["per_step"]:
            mark = "*" if r["step"] in result["steps"] else " "
            print(
                f"{r['step']:>7}{mark} {r['sequences']:>6} {r['tokens']:>8}  {r['mismatch_kl']:.3e}  "
                f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}]"
            )
        print(f"* judged: steps {', '.join(map(str, result['steps']))}")
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
        device = resolve_device(args.device)
        budget = read_budget(Path(args.budget), None if args.dump else args.pair)
        loss = match_loss(budget, args.loss, args.tis_cap)
        if args.dump:
            result = check_dump(budget, Path(args.dump), fmt=args.format, steps=args.steps)
        else:
            cfg = rollout_config_from_args(args, pair=args.pair)
            t0 = time.time()
            pair = load_pair(args.pair, device=device, student_only=True)  # check never uses the teacher
            result = check(budget, pair, cfg, cap=args.probes, device=device, load_seconds=time.time() - t0)
            result.update(import_seconds=imported, wall_seconds=imported + time.time() - started)
        result["loss"] = loss  # the verdict holds for this loss only
    except EXPECTED as e:
        fail(e)
    print(json.dumps(result, indent=2)) if args.json else print_check(result)
    sys.exit(VERDICT_EXIT[result["verdict"]])


if __name__ == "__main__":
    main()
