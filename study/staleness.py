"""staleness: the staleness axis per loss. For each committed budget of a pair, what training with an engine
K versions behind (staleness K) lost, pooled over every seed the study trained it with: the calibration's
own stale runs (budget points "staleness K") and, for seeds the calibration did not run, the stale
candidates of that very budget's validation (results/validation_<pair>[_<loss>].json, whose budget equals
the committed one). A calibration the noise gate refused (results/refused_<pair>_*.json) at a recipe no
committed budget of its loss holds gives rows too, marked: no budget came of it, but its stale runs are
measurements of that loss at that recipe all the same. A run's loss is paired with the same-seed baseline
of the same record:
    loss_s = eval_rkl(staleness K, seed s) − eval_rkl(baseline, seed s)
and a staleness is within when the mean over seeds is at most the budget's tolerance.

python -m study report    # the table is a section of results/SUMMARY.md
"""

import json
import statistics
from pathlib import Path

from budget import read_budget
from cli import BadInput
from study.common import RESULTS
from study.losses import BUDGETS, STUDY_NEEDS, label_of, pair_budgets, settings_of
from study.validate import validation_name

STALENESS = (1, 2, 4)  # the versions behind the study trains


def validation_of(pair: str, b: dict, root: Path = RESULTS) -> dict | None:
    """The validation record of budget b (results/validation_<pair>[_<loss>].json), if it validated this
    very budget (the same number); None otherwise."""
    path = root / f"{validation_name(pair, label_of(b))}.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # also UnicodeDecodeError
        raise BadInput(
            f"{path}: not a readable validation record ({type(e).__name__}); rerun its validate"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("points"), list):
        raise BadInput(
            f"{path}: not a validation record (expected an object with points); rerun its validate"
        )
    return record if record.get("budget") == b["budget"] else None


def stale_losses(b: dict, validation: dict | None, k: int) -> dict[int, tuple[float, str]]:
    """seed -> (paired quality loss, where it was trained: "calibration" or "validation") of staleness k."""
    label = f"staleness {k}"
    out = {p["seed"]: (p["quality_loss"], "calibration") for p in b["points"] if p["source"] == label}
    for p in (validation or {}).get("points", []):
        if p["label"] == label and p["seed"] not in out and p.get("delta_eval_rkl") is not None:
            out[p["seed"]] = (p["delta_eval_rkl"], "validation")
    return out


def refused_records(pair: str, budgets: list[dict], results: Path = RESULTS) -> list[dict]:
    """The pair's refused calibrations (results/refused_<pair>_*.json, read as budgets are) whose loss and
    settings (study.losses.settings_of) no budget in `budgets` shares; one that a later calibration with more
    seeds turned into a budget is that budget's subset, left out."""
    held = [(label_of(b), settings_of(b)) for b in budgets]
    records = [
        read_budget(path, pair, needs=STUDY_NEEDS, flag="")
        for path in sorted(results.glob(f"refused_{pair}_*.json"))
    ]
    return [r for r in records if (label_of(r), settings_of(r)) not in held]


def staleness_rows(pair: str, root: Path = BUDGETS, results: Path = RESULTS) -> list[dict]:
    """One row per committed budget of the pair (then per refused calibration, refused_records) and staleness
    in STALENESS that any of its runs trained: loss, rate, K, seeds, each seed's loss, their mean, the
    tolerance, the outcome, and which record ("budget" or "refused")."""
    rows = []
    budgets = [b for _, b in pair_budgets(pair, root)]
    records = [(b, "budget") for b in budgets] + [
        (r, "refused") for r in refused_records(pair, budgets, results)
    ]
    for b, record in records:
        validation = validation_of(pair, b, results) if record == "budget" else None
        tol = b["tolerance"]["nats"]
        for k in STALENESS:
            by_seed = stale_losses(b, validation, k)
            if not by_seed:
                continue
            losses = [by_seed[s][0] for s in sorted(by_seed)]
            mean = statistics.fmean(losses)
            rows.append(
                {
                    "pair": pair,
                    "loss": label_of(b),
                    "lr": b["train_settings"]["lr"],
                    "staleness": k,
                    "seeds": sorted(by_seed),
                    "from_validation": sorted(s for s, (_, src) in by_seed.items() if src == "validation"),
                    "losses": losses,
                    "mean": mean,
                    "tolerance_nats": tol,
                    "outcome": "within" if mean <= tol else "beyond",
                    "record": record,
                }
            )
    return rows


def staleness_table(rows: list[dict]) -> str:
    """Markdown: the staleness axis, one row per loss and staleness."""
    lines = [
        (
            "| pair | loss (lr) | staleness | seeds (from the validation) | quality loss per seed | mean "
            "| tolerance | outcome |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        valid = f" ({', '.join(map(str, r['from_validation']))})" if r["from_validation"] else ""
        refused = ", refused: no budget" if r["record"] == "refused" else ""
        lines.append(
            f"| {r['pair']} | {r['loss']} ({r['lr']:g}){refused} | {r['staleness']} | "
            f"{len(r['seeds'])}{valid} | "
            + ", ".join(f"{x:+.2f}" for x in r["losses"])
            + f" | {r['mean']:+.3f} | {r['tolerance_nats']:.3f} | {r['outcome']} |"
        )
    return "\n".join(lines)
