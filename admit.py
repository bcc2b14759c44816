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

    python admit.py check --budget budgets/tiny/budget.json --pair tiny --weights fp8 --kv-cache fp8
    python admit.py check --budget budgets/mine/budget.json --teacher T --student S --prompts my.jsonl
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from port.audit import draw, origins, report, token_estimates, top_tokens
from budget import (
    CALIBRATABLE,
    budget_band,
    budget_power,
    loss_label,
    match_loss,
    match_pair,
    read_budget,
    source_staleness,
)
from cli import (
    EXPECTED,
    BadInput,
    Parser,
    cap_float,
    check_output_dir,
    check_output_file,
    fail,
    fraction,
    given_dests,
    path_text,
    positive_int,
    process_seconds,
    seed_int,
)
from cli import temperature as temperature_value
from config import CHECK_PROBES, DEFAULT_PAIR, DEFAULT_PAIR_HELP, DEVICES, FIRST_PROBES, PAIRS
from kl import bootstrap_ci
from port.estimate import MAX_LOG_RATIO, dump_estimate, tokens_to_see
from mismatch import measure_config
from models import (
    cache_dir,
    format_prompt,
    load_pair,
    n_params,
    pair_files,
    prompts_sha256,
    resolve_device,
    tiny_tokenizer,
)
from port.native import FORMATS, merge, read_native, sampling_check, select_steps, shown_settings
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
# Stale candidates


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


VERDICT_EXIT = {"admit": 0, "reject": 1, "uncertain": 4}  # exit codes of `check`, for gating a CI job
CI_KEYS = ("mismatch_kl", "ci_low", "ci_high")  # the per-step numbers of a multi-step export


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


def check_dump(
    budget: dict,
    path: Path,
    fmt: str | None = None,
    steps: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
) -> dict:
    """The verdict from another system's export (port/native.py): k3 (or top-k) estimate with a sequence CI,
    on the steps `steps` selects (None: all), and each step's own estimate under "per_step"; `temperature`
    and `top_p` are the run's sampling settings where the export does not record them."""
    fmt, read = read_native(str(path), fmt)
    return judge_steps(budget, fmt, read, spec=steps, temperature=temperature, top_p=top_p)


def worst_step(decision: dict, budget: dict, rows: list[dict]) -> dict:
    """A dump's verdict is its worst judged step's (rows: the judged steps, each with its own verdict):
        reject     some step's interval lies above the budget's (its lower end above B_hi), whatever the pool
                   of all steps reads: a mean over steps can hide one bad step;
        admit      only when the pool admits and so does every judged step;
        uncertain  the pool admits but some step does not, or as the pool's decision says.
    "worst_step" names the step that decides (None where the pool decides)."""
    b_lo, b_hi = budget_band(budget)
    if len(rows) < 2:  # one step is the pool
        return {**decision, "worst_step": None}
    if rejects := [r for r in rows if r["verdict"] == "reject"]:
        r = max(rejects, key=lambda r: r["ci_low"])
        reason = (
            f"step {r['step']}'s lower bound {r['ci_low']:.3e} > {edge(budget['budget'], b_hi, 'upper')} "
            f"(its interval [{r['ci_low']:.3e}, {r['ci_high']:.3e}]); a dump's verdict is its worst step's"
        )
        return {"verdict": "reject", "reason": reason, "worst_step": r["step"]}
    if decision["verdict"] == "admit" and (short := [r for r in rows if r["verdict"] != "admit"]):
        r = max(short, key=lambda r: r["ci_high"])
        reason = (
            f"the pooled steps admit ({decision['reason']}), but step {r['step']}'s interval "
            f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}] reaches {edge(budget['budget'], b_lo, 'lower')} "
            f"(steps not admitted: {', '.join(str(x['step']) for x in short)}); a dump admits only if every "
            "judged step does"
        )
        return {"verdict": "uncertain", "reason": reason, "extra_probes": None, "worst_step": r["step"]}
    return {**decision, "worst_step": None}


def blind_spot(decision: dict, budget: dict, m: dict) -> dict:
    """No ADMIT that the dump's blind spot could overturn. Its interval ends at hi, and up to blind_kl more
    can sit on tokens no sample drew (port.estimate.blind_kl: ε·L for N sampled tokens, ε = 1 − 0.05^(1/N),
    L = 103.28 nats; less with top-k rows), so ADMIT needs
        hi + blind_kl < B_lo,
    and a budget whose lower end lies below blind_kl is never admitted from sampled log-probs alone: top-k
    rows, whose tail mass bounds the blind spot, or more tokens (estimate.tokens_to_see) can admit."""
    b_lo, _ = budget_band(budget)
    if decision["verdict"] != "admit" or m["ci_high"] + m["blind_kl"] < b_lo:
        return decision
    need = tokens_to_see(b_lo - m["ci_high"])
    more = f"about {need:,} sampled tokens" if need else "no number of sampled tokens"
    reason = (
        f"upper bound {m['ci_high']:.3e} plus {m['blind_kl']:.3e}, the KL that {m['tokens']} sampled tokens "
        f"cannot rule out (engine mass {m['blind_mass']:.2e} on tokens never drawn, from {m['blind_from']}, "
        f"at up to {MAX_LOG_RATIO:.2f} nats each), is not below {edge(budget['budget'], b_lo, 'lower')}: "
        f"these log-probs alone cannot admit against it; top-k rows of both sides, or {more}, can"
    )
    return {"verdict": "uncertain", "reason": reason, "extra_probes": None}


def judge_steps(budget: dict, fmt: str, steps: list, spec: str | None, temperature=None, top_p=None) -> dict:
    """The verdict on the steps `spec` selects: the pool's (judge), the worst judged step's (worst_step),
    never an ADMIT the blind spot could hide (blind_spot), and neither ADMIT nor REJECT on a dump whose
    columns are not the sampled distribution (native.sampling_check) or that a flag calls unreadable
    (estimate.dump_flags, on the pool and on each judged step)."""
    t0 = time.time()
    chosen = select_steps(steps, spec)
    sampling = sampling_check(fmt, chosen, temperature=temperature, top_p=top_p)
    merged = merge(chosen).dump
    m = dump_estimate(merged)
    judged, per_step, warnings, flags = {s.step for s in chosen}, [], list(m["warnings"]), list(m["flags"])
    for s in steps:
        e = dump_estimate(s.dump)
        row = {"step": s.step, "sequences": s.dump.sequences, **{k: e[k] for k in ("tokens", *CI_KEYS)}}
        row["flags"], row["verdict"] = e["flags"], None
        if s.step in judged:
            row["verdict"] = judge(budget, e, s.dump.sequences, available=None)["verdict"]
            new = [(f, w) for f, w in zip(e["flags"], e["warnings"]) if f not in m["flags"]]
            warnings += [f"step {s.step}: {w}" for _, w in new]
            flags += [f for f, _ in new if f not in flags]
        per_step.append(row)
    decision = judge(budget, m, merged.sequences, available=None)
    decision = worst_step(decision, budget, [r for r in per_step if r["verdict"]])
    decision = blind_spot(decision, budget, m)
    problems = ["unreadable dump: " + "; ".join(warnings)] if warnings else []
    problems += [f"sampling: {sampling['reason']}"] if not sampling["same"] else []
    if problems:  # never admit (nor reject) on a dump that cannot be read as it is
        decision = {"verdict": "uncertain", "reason": "; ".join(problems), "worst_step": None}
    return {
        **m,
        **decision,
        "flags": flags + ["sampling"] * (not sampling["same"]),
        "sampling": sampling,
        "budget": budget["budget"],
        "budget_interval": json_band(budget),
        "format": fmt,
        "steps": [s.step for s in chosen],
        "per_step": per_step,
        "seconds": time.time() - t0,
    }


def audit_decoder(tokenizer: str | None):
    """--tokenizer as a function token id -> text (None: ids only), loaded before any work: tiny, or a local
    folder a tokenizer loads from. An id outside its vocabulary decodes to None (shown as the id)."""
    if tokenizer is None:
        return None
    if tokenizer == "tiny":
        tok = tiny_tokenizer()
    elif not Path(tokenizer).is_dir():
        raise BadInput(f"--tokenizer {tokenizer}: not a folder; expected tiny or a local tokenizer folder")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        except Exception as e:  # an empty or foreign folder: transformers raises ValueError, OSError, ...
            raise BadInput(
                f"--tokenizer {tokenizer}: no tokenizer loads from this folder ({type(e).__name__}); "
                "expected tiny or a folder holding tokenizer.json or tokenizer_config.json"
            ) from None
    vocab = len(tok)
    return lambda tid: tok.decode([tid]) if 0 <= tid < vocab else None


def audit_targets(out: str) -> Path:
    """--out checked before any work: a folder that is or can be made, and audit.png and report.md in it
    regular files if they exist (cli.check_output_dir / check_output_file)."""
    folder = check_output_dir(out, "--out")
    if folder.is_dir():
        for name in ("audit.png", "report.md"):
            check_output_file(folder / name, "--out")
    return folder


def run_audit(budget: dict, args, command: str, loss: str) -> dict:
    """admit.py audit: the verdict as check --dump gives it, plus DIR/audit.png and DIR/report.md, each
    written atomically (a full disk leaves the previous audit as it was). --out and --tokenizer are checked
    before the export is read."""
    out = audit_targets(args.out)
    decode = audit_decoder(args.tokenizer)
    fmt, steps = read_native(args.dump, args.format)
    sampled = {"temperature": args.temperature, "top_p": args.top_p}
    result = {**judge_steps(budget, fmt, steps, spec=args.steps, **sampled), "loss": loss}
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
    aud.add_argument(
        "--dump",
        type=path_text,
        required=True,
        help="the export: a file, a folder or a glob (port/native.py)",
    )
    aud.add_argument(
        "--budget", type=path_text, required=True, help="budget.json from python -m lab.calibrate"
    )
    aud.add_argument("--out", type=path_text, required=True, help="folder for audit.png and report.md")
    aud.add_argument(
        "--tokenizer",
        type=path_text,
        help="decode the top tokens: tiny, or a local tokenizer folder (default: ids only)",
    )
    aud.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.add_argument(
        "--dump",
        type=path_text,
        help="judge another system's export instead (port/native.py): a file, folder or glob",
    )
    for sp in (chk, aud):
        sp.add_argument(
            "--format", choices=FORMATS, help="the export's format with --dump (default: told by its fields)"
        )
        sp.add_argument("--steps", help="steps to judge with --dump, e.g. 3 or 2-5 or 0,4-6 (default: all)")
        sp.add_argument(
            "--temperature",
            type=temperature_value,
            help="the temperature the run sampled at, where the export does not record it (port/native.py)",
        )
        sp.add_argument(
            "--top-p",
            type=fraction,
            help="the top-p the run sampled with, where the export does not record it",
        )
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


def print_steps(result: dict) -> None:
    """The per-step table of an export: each step's estimate and interval, each judged step's own verdict
    (* judged), and the step that decides the dump's verdict marked <- worst."""
    print(f"{'step':>8} {'seqs':>6} {'tokens':>8}  mismatch (nats/token)  95% CI  ({result['format']})")
    for r in result["per_step"]:
        mark = "*" if r["step"] in result["steps"] else " "
        verdict = (r.get("verdict") or "").upper()
        worst = "  <- worst" if r["step"] == result.get("worst_step") else ""
        flags = f"  flags: {', '.join(r['flags'])}" if r.get("flags") else ""
        print(
            f"{r['step']:>7}{mark} {r['sequences']:>6} {r['tokens']:>8}  {r['mismatch_kl']:.3e}  "
            f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}]  {verdict:<9}{worst}{flags}".rstrip()
        )
    print(f"* judged: steps {', '.join(map(str, result['steps']))} (the dump's verdict is its worst step's)")


def print_dump_notes(result: dict) -> None:
    """What an export's verdict rests on beyond its interval: the sampling settings, the blind spot, the
    flags raised."""
    sm = result.get("sampling")
    if sm:
        held = ""
        if sm["engine"]:
            engine, train = shown_settings(sm["engine"]), shown_settings(sm["train"])
            held = f"; the engine column holds {engine}, the trainer's {train}"
        state = "both columns are the sampled distribution" if sm["same"] else "not judged"
        print(f"sampling: {shown_settings((sm['temperature'], sm['top_p']))} ({sm['source']}){held}: {state}")
    print(
        f"blind spot: {result['tokens']} tokens cannot rule out {result['blind_kl']:.3e} nats/token on "
        f"tokens never sampled (mass {result['blind_mass']:.2e} from {result['blind_from']}, x "
        f"{MAX_LOG_RATIO:.2f} nats at most each): no ADMIT unless the upper bound plus it lies below the "
        "budget's interval"
    )
    if result.get("flags"):
        print(f"flags: {', '.join(result['flags'])}")


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


# check's flags that only one of its two modes reads (an export with --dump, else live probes)
DUMP_ONLY = ("format", "steps", "temperature", "top_p")
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
