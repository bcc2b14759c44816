"""The budget file: its schema, reading and checking it, and the OPD loss it holds for.

A budget (budget.json, written by lab/calibrate.py) is the mismatch, on the one scale, beyond which OPD with
one loss loses more than the tolerance in quality on one pair. It names that loss: `loss` (analytic |
sampled | sampler, loss.py) and `tis_cap` (0 = none, a number, or "inf" for the uncapped importance ratio). A
verdict against it holds for that loss only: the analytic loss never sees the engine's per-token
probabilities, the sampled ones see them in every term.
"""

import json
import math
from pathlib import Path

from cli import BadInput

SCHEMA_VERSION = 2  # 2: the budget is on the probe measurement (version 1 used the training-mean mismatch)
SCALE = (
    "mean per-token KL(pi_engine || pi_train), nats/token, exact over the vocabulary, "
    "on the engine's samples of held-out probe prompts, against the untrained student (what check measures)"
)


BUDGET_HOWS = ("crossing", "all-within", "none-within")


CALIBRATABLE = ("analytic", "sampled", "sampler")  # the OPD estimators (loss.py) a budget is calibrated for


def loss_label(loss: str, tis_cap: float, center: bool = False) -> str:
    """A budget's loss in one word, also its default folder: analytic, sampled, sampled-tis2, sampler-is,
    sampled-centered (the advantages centred on the batch mean, loss.py)."""
    label = loss
    if tis_cap > 0:
        label += "-is" if math.isinf(tis_cap) else f"-tis{tis_cap:g}"
    return label + ("-centered" if center else "")


def source_staleness(source: str) -> int:
    """k of a calibration point whose source is "staleness k" (calibrate.calibration_configs); 0 otherwise."""
    kind, _, k = source.partition(" ")
    return int(k) if kind == "staleness" else 0


def json_cap(tis_cap: float) -> float | str:
    """JSON has no infinity: an uncapped importance weight is recorded as "inf"."""
    return "inf" if math.isinf(tis_cap) else tis_cap


def budget_loss(budget: dict, where: str) -> tuple[str, float]:
    """(estimator, tis_cap) a budget was calibrated with: its "loss" and "tis_cap", or, in a budget that
    predates them, its train_settings' (tis_cap 0 where absent: the only cap calibrate used then)."""
    settings = budget.get("train_settings") or {}
    loss = budget.get("loss", settings.get("loss"))
    cap = budget.get("tis_cap", settings.get("tis_cap", 0.0))
    if loss not in CALIBRATABLE:
        raise BadInput(f"{where}: loss is {loss!r}; expected one of {', '.join(CALIBRATABLE)}")
    if cap == "inf":
        cap = math.inf
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0:
        raise BadInput(f'{where}: tis_cap is {cap!r}; expected a number >= 0 or "inf"')
    return loss, float(cap)


def match_loss(budget: dict, loss: str | None, tis_cap: float | None) -> str:
    """The loss label the verdict holds for; one line (BadInput) when the candidate's loss is another."""
    b_loss, b_cap = budget["loss"], budget["tis_cap"]
    loss, tis_cap = b_loss if loss is None else loss, b_cap if tis_cap is None else tis_cap
    if (loss, tis_cap) != (b_loss, b_cap):
        raise BadInput(
            f"--loss {loss_label(loss, tis_cap)}: the budget was calibrated for loss "
            f"{loss_label(b_loss, b_cap)}; a budget holds only for its loss "
            f"(python -m lab.calibrate --loss {loss} --tis-cap {tis_cap:g})"
        )
    return loss_label(loss, tis_cap)


MAX_BUDGET_BYTES = 2**20  # a budget.json is a few KB; a larger file is not one


def check_numbers(budget: dict, where: str) -> None:
    """Typed numbers where a budget has numbers: budget >= 0, seconds_per_run > 0, tolerance.nats > 0."""
    tolerance = budget.get("tolerance")
    numbers = {  # key: (value, smallest allowed, whether the smallest is allowed)
        "budget": (budget.get("budget"), 0, True),
        "seconds_per_run": (budget.get("seconds_per_run"), 0, False),
        "tolerance.nats": (tolerance.get("nats") if isinstance(tolerance, dict) else tolerance, 0, False),
    }
    for key, (value, low, closed) in numbers.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e308
        if not number or not math.isfinite(value) or value < low or (value == low and not closed):
            shown = str(value)[:40] if isinstance(value, int) else repr(value)[:40]
            raise BadInput(
                f"{where}: {key} is {shown}; expected a finite number {'>=' if closed else '>'} {low}"
            )


def read_budget(path: Path, pair: str | None) -> dict:
    """A budget.json, checked: schema, pair (None: any, for dumps), typed numbers where numbers go (no bools,
    finite, budget >= 0, tolerance > 0, seconds_per_run > 0) and the loss it holds for."""
    if not path.is_file():
        raise BadInput(f"--budget {path}: no such file (make one with `python -m lab.calibrate`)")
    if path.stat().st_size > MAX_BUDGET_BYTES:
        raise BadInput(f"--budget {path}: {path.stat().st_size} bytes; a budget.json is under 1 MiB")
    try:
        budget = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
        raise BadInput(f"--budget {path}: not JSON ({getattr(e, 'msg', type(e).__name__)})") from None
    version = budget.get("schema_version") if isinstance(budget, dict) else None
    if version != SCHEMA_VERSION:
        raise BadInput(f"--budget {path}: schema_version {version!r}, this admit.py reads {SCHEMA_VERSION}")
    if pair is not None and budget.get("pair") != pair:
        raise BadInput(f"--budget {path} was calibrated for pair {budget.get('pair')!r}, not --pair {pair!r}")
    check_numbers(budget, where=f"--budget {path}")
    if budget.get("how") not in BUDGET_HOWS:
        raise BadInput(
            f"--budget {path}: how is {budget.get('how')!r}; expected one of {', '.join(BUDGET_HOWS)}"
        )
    budget["loss"], budget["tis_cap"] = budget_loss(budget, where=f"--budget {path}")
    if isinstance(budget.get("train_settings"), dict) and "tis_cap" in budget["train_settings"]:
        # the settings a stale candidate's trajectory is trained with: the cap as a number, "inf" read back
        budget["train_settings"]["tis_cap"] = budget["tis_cap"]
    return budget
