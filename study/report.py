"""report: results/SUMMARY.md from the study's JSON files, the budgets and the sensitivity results.

python -m study report
"""

import json
from pathlib import Path

from cli import BadInput
from config import PAIRS
from lab.atomic import atomic_write_text
from lab.calibrate import paired_loss_gate
from study.answer import answer_rows, answer_section
from study.common import RESULTS
from study.coverage import coverage_table
from study.drift import drift_table
from study.losses import (
    budget_interval,
    budget_text,
    interval_text,
    label_of,
    losses_table,
    pair_budgets,
    plot_losses,
    reference_budgets,
)
from study.lr import lr_table
from study.opd_vs_rl import rl_table
from study.prefix import prefix_table
from study.staleness import staleness_rows, staleness_table
from study.time_to_quality import async_table
from study.validate import VALIDATION, validation_name, validation_table

# ---------------------------------------------------------------------------------------------------
# report


def noise_line(budget: dict) -> str:
    """How far a budget's quality axis can be trusted (calibrate.quality_noise); for a budget.json that
    predates the record, the paired loss's SE computed here from its points (calibrate.paired_loss_gate)."""
    noise = budget.get("noise")
    if not noise:
        return gate_line(budget)
    sds = ", ".join(f"{v['sd']:.3f} on {n} prompts" for n, v in noise["eval_sd_by_prompts"].items())
    line = f"\nEvaluation noise (SD over {noise['eval_seeds']} evaluation seeds, one checkpoint): {sds}."
    if noise["paired_loss_se"] is not None:
        line += (
            f" Paired quality loss: SD {noise['paired_loss_sd']:.3f} across seeds, "
            f"SE {noise['paired_loss_se']:.3f} (tolerance = {noise['tolerance_over_se']:.1f} SE)."
        )
    return line + "\n"


def gate_line(budget: dict) -> str:
    """The noise gate read from a budget's recorded points (calibrate.paired_loss_gate); "" without two seeds
    of a configuration near the tolerance."""
    tol, seeds = budget["tolerance"]["nats"], budget["seeds"]
    gate = paired_loss_gate(budget["points"], tol=tol, seeds=seeds, loss=budget["loss"])
    if gate["paired_loss_se"] is None:
        return ""
    under = ": under the 2 SE that calibrate requires before it writes a budget"
    verdict = "" if gate["tolerance_at_least_2se"] else under
    return (
        f"\nPaired quality loss, computed here from the recorded points (the budget.json predates the "
        f"record): SD {gate['paired_loss_sd']:.4f} across seeds, "
        f"tolerance = {gate['tolerance_over_se']:.2f} SE{verdict}.\n"
    )


def ci_line(budget: dict) -> str:
    """The budget's 95% seed-bootstrap interval as a sentence (study.losses.budget_interval); "" without
    one."""
    ci, refitted = budget_interval(budget)
    if ci is None:
        return ""
    source = " (refitted here from the recorded points: the budget.json predates it)" if refitted else ""
    return (
        f"95% interval over training seeds (bootstrap, {ci['draws']} draws): "
        f"{interval_text(budget, beyond='beyond the largest mismatch tried')}; "
        f"{ci['beyond_largest_mismatch']:.0%} of draws do not cross the tolerance{source}.\n"
    )


def trained_on(b: dict) -> str:
    """Where a budget's reused points trained, when it says and that is not where it was written."""
    reused = b.get("reused") or {}
    where = reused.get("trained_on")
    return f"; {reused['points']} of its runs trained on {where}" if where and where != b["device"] else ""


def budget_section(path: Path, b: dict) -> str:
    """One budget's paragraph: its command, value, tolerance, runs, interval and noise."""
    lower = b["how"] == "all-within"  # the fit stays within the tolerance: the budget is a lower bound
    how = "a lower bound: the fitted quality loss stays within the tolerance" if lower else b["how"]
    return (
        f"### {label_of(b)}\n\n"
        f"`{b.get('command') or 'python -m lab.calibrate --pair ' + b['pair']}`: "
        f"budget **{budget_text(b)} nats/token** ({how}); "
        f"tolerance {b['tolerance']['nats']:.4f} nats "
        f"({b['tolerance']['fraction']:.0%} of the baseline's "
        f"{b['baseline']['improvement']:.3f}-nat improvement); "
        f"{len(b['points'])} runs of {b['steps']} steps; "
        f"device {b['device']}{trained_on(b)}. Plot: `{path.with_suffix('.png')}`.\n"
        + ci_line(b)
        + noise_line(b)
    )


def budget_sections(pair: str, budgets: list, references: list) -> list[str]:
    """A pair's budgets, one per loss (study.losses.pair_budgets, and the analytic references): the
    side-by-side table, the overlay figure, then each budget."""
    if not budgets:
        return []
    figure = RESULTS / f"budgets_{pair}.png"
    plot_losses(pair, budgets + references, figure)  # a reference drawn too: the fit its rows compare with
    table = losses_table(budgets, references)
    return [
        f"## Budgets: {pair}\n\n{table}\n\nEach loss's fit: `{figure}`.\n",
        *(budget_section(path, b) for path, b in budgets),
    ]


def coverage_block(d: dict) -> str:
    """results/coverage.json's table, as the command prints it."""
    return f"```\n{coverage_table(d['results'])}\n```"


def budget_losses(pair: str) -> list[str]:
    """The losses of `pair`'s committed budgets, analytic first (also without a budget): one validation
    section each, reading results/<validation_name>.json or saying how to run it. Other records, such as
    one kept from a budget that a calibration at another rate replaced, are RESULTS.md's to read."""
    return ["analytic", *sorted({label_of(b) for _, b in pair_budgets(pair)} - {"analytic"})]


def staleness_section(pairs: list[str]) -> str:
    """The staleness axis per loss (study.staleness): what stale weights cost each committed budget's loss,
    and each refused calibration's."""
    rows = [r for pair in pairs for r in staleness_rows(pair)]
    return (
        "## The staleness axis per loss\n\n"
        "Each committed budget's loss trained with an engine K versions behind, pooled over the "
        "calibration's stale runs and, for other seeds, that budget's validation (marked); then the stale "
        "runs of calibrations the noise gate refused at a recipe no budget holds (marked refused: "
        "`results/refused_<pair>_*.json`). Quality loss paired with the same-seed baseline, within when the "
        "mean is at most the record's tolerance (`study.staleness`).\n\n" + staleness_table(rows) + "\n"
    )


def validated_budget_line(result: dict, pair: str, loss: str) -> str:
    """Nothing when a validation record checked the pair's committed budget of its loss; else one line
    saying which budget it checked (a reference calibration's, when one holds that number) and that today's
    budget is not validated, so a reader does not take the record's agreement for today's budget's."""
    committed = next((b for _, b in pair_budgets(pair) if label_of(b) == loss), None)
    if committed is not None and committed["budget"] == result["budget"]:
        return ""
    kept = [
        (p, b) for p, b in reference_budgets(pair) if b["budget"] == result["budget"] and label_of(b) == loss
    ]
    where = "".join(f" (`{p}`, lr {b['train_settings']['lr']:g})" for p, b in kept[:1])
    today = "none" if committed is None else f"{budget_text(committed)} nats/token"
    return (
        f"**This validation checked another budget**, {result['budget']:.3g} nats/token{where}; the "
        f"committed {pair} {loss} budget ({today}) is not validated yet.\n\n"
    )


def read_result(path: Path, command: str) -> dict:
    """A results/*.json the report reads, parsed; one line naming the file, and the command that writes it,
    when it does not parse (a run cut short, a hand edit) or holds no object."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # also UnicodeDecodeError, a 5000-digit integer
        why = getattr(e, "msg", type(e).__name__)
        raise BadInput(f"{path}: not a readable result ({why}); `{command}` writes it again") from None
    if not isinstance(result, dict):
        raise BadInput(f"{path}: holds a {type(result).__name__}, not a result; `{command}` writes it again")
    return result


def rendered(path: Path, command: str, render) -> str:
    """render(the result at `path`); one line naming the file when its fields are not those `command`
    writes (the file is outside the report's control, so any field may be missing or of another type)."""
    result = read_result(path, command)
    try:
        return render(result)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise BadInput(f"{path}: not what `{command}` writes ({type(e).__name__}: {e})") from None


def sensitivity_section(path: Path, s: dict) -> str:
    """A results/sensitivity_*.json as its section."""
    top = ", ".join(f"{b} ({s['per_block'][b]:.2g})" for b in s["ranking"][:5])
    return (
        f"## Sensitivity: {path.stem}\n\n"
        "Made by `python -m study sensitivity` (RESULTS.md gives each pair's flags). "
        f"Most sensitive blocks (mismatch with that block alone in FP8): {top}; "
        f"all blocks FP8: {s['all_fp8']:.3g}; keeping blocks "
        f"{s['kept_high_precision']} in high precision: {s['recipe_mismatch']:.3g}. File: `{path}`.\n"
    )


def drift_section(d: dict) -> str:
    """A results/drift_*.json as its section."""
    return (
        f"## Dumps from training vs probes: {d['pair']}, {d['loss']}\n\n"
        f"`python -m study drift --budget {d['budget']}`.\n\n{drift_table(d)}\n"
    )


def report() -> Path:
    """results/SUMMARY.md from what the commands above wrote; sections whose results are missing say so.
    Every budget and result is read and checked before anything is drawn or written: a bad one is one
    line naming its file, and nothing changes."""
    budgets = {pair: (pair_budgets(pair), reference_budgets(pair)) for pair in PAIRS}
    results = result_sections()
    RESULTS.mkdir(exist_ok=True)
    parts = [
        "# Results\n",
        "Regenerate: `python -m study report` (each section names the command that made its numbers).\n",
    ]
    parts.append(answer_section(answer_rows([pair for pair in PAIRS if budgets[pair][0]])))
    for pair in PAIRS:
        parts += budget_sections(pair, *budgets[pair])
    parts.append(staleness_section([pair for pair in PAIRS if budgets[pair][0]]))
    out = RESULTS / "SUMMARY.md"
    atomic_write_text(out, "\n".join(parts + results))
    return out


def result_sections() -> list[str]:
    """The sections made from results/*.json, in the report's order: sensitivity, drift, then the
    validations, coverage, OPD vs RL, prefix and async (rendered, so a bad file is refused here)."""
    parts = [
        rendered(path, "python -m study sensitivity", lambda s, p=path: sensitivity_section(p, s))
        for path in sorted(RESULTS.glob("sensitivity_*.json"))
    ]
    sections = [
        *[
            (
                validation_name(p, loss),
                f"Validation of the admission check: {p}, {loss}",
                f"python -m study validate --pair {p}"
                + ("" if loss == "analytic" else f" --budget budgets/{p}/{loss}/budget.json"),
                lambda r, p=p, loss=loss: validated_budget_line(r, p, loss) + validation_table(r),
            )
            for p in VALIDATION
            for loss in budget_losses(p)
        ],
        *[
            (f"lr_{p}", f"Each loss's learning rate: {p}", f"python -m study lr --pair {p}", lr_table)
            for p in ("tiny", "smollm2")
        ],
        ("coverage", "Dump coverage", "python -m study coverage", coverage_block),
        ("rl_tiny", "OPD vs GRPO", "python -m study rl", rl_table),
        ("prefix_tiny", "Per-token vs prefix shift", "python -m study prefix", prefix_table),
        ("async_smollm2", "FP8 + async time-to-quality", "python -m study async", async_table),
    ]
    parts += [
        rendered(path, "python -m study drift", drift_section)
        for path in sorted(RESULTS.glob("drift_*.json"))
    ]
    for name, title, command, table in sections:
        path = RESULTS / f"{name}.json"
        body = rendered(path, command, table) if path.exists() else f"(not run yet: `{command}`)"
        plot = f" Plot: `results/{name}.png`." if (RESULTS / f"{name}.png").exists() else ""
        parts.append(f"## {title}\n\n`{command}`.{plot}\n\n{body}\n")
    return parts
