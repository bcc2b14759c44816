"""Judging another system's export against a budget: `admit.py check --dump` and `admit.py audit`.

Reads the export (port/native.py), estimates each step and the judged steps' pool (port/estimate.py) and
judges them with verdict.judge, per step: the dump's verdict is its worst step's, never an ADMIT its unsampled
tokens could overturn, and UNCERTAIN when a flag finds a misread or its columns are not the sampled
distribution. `audit` writes the audit page (port/audit.py) beside that verdict. Also the export flags
(--dump, --format, --steps, ...) and the printing of an export's per-step table and notes.
"""

import time
from pathlib import Path

from transformers import AutoTokenizer

from budget import CALIBRATABLE, budget_band
from cli import BadInput, cap_float, check_output_dir, check_output_file, fraction, path_text
from cli import temperature as temperature_value
from lab.atomic import atomic_write_text
from models import tiny_tokenizer
from port.audit import draw, origins, report, token_estimates, top_tokens
from port.estimate import MAX_LOG_RATIO, dump_estimate, tokens_to_see
from port.native import FORMATS, merge, read_native, sampling_check, select_steps, shown_settings
from verdict import CI_KEYS, band_edge_note, json_band, judge


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
            f"step {r['step']}'s lower bound {r['ci_low']:.3e} > "
            f"{band_edge_note(budget['budget'], b_hi, 'upper')} "
            f"(its interval [{r['ci_low']:.3e}, {r['ci_high']:.3e}]); a dump's verdict is its worst step's"
        )
        return {"verdict": "reject", "reason": reason, "worst_step": r["step"]}
    if decision["verdict"] == "admit" and (short := [r for r in rows if r["verdict"] != "admit"]):
        r = max(short, key=lambda r: r["ci_high"])
        reason = (
            f"the pooled steps admit ({decision['reason']}), but step {r['step']}'s interval "
            f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}] reaches "
            f"{band_edge_note(budget['budget'], b_lo, 'lower')} "
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
        f"at up to {MAX_LOG_RATIO:.2f} nats each), is not below "
        f"{band_edge_note(budget['budget'], b_lo, 'lower')}: "
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
        except Exception as e:  # noqa: BLE001
            # an empty or foreign folder: transformers raises ValueError, OSError, ...
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


# check's flags that only its --dump mode reads (admit.LIVE_ONLY: those only live probes read)
DUMP_ONLY = ("format", "steps", "temperature", "top_p")


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
