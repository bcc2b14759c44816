"""The budget file: reading it (its schema: lab/budget_schema.py), and the OPD loss it holds for.

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
from lab.budget_schema import (
    MAX_BUDGET_BYTES,
    SCHEMA,
    check_consistent,
    check_needs,
    check_numbers,
    check_schema,
)

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
    if loss == "analytic" and cap > 0:  # the analytic loss never sees the engine's probabilities (loss.py)
        raise BadInput(f"{where}: tis_cap is {cap:g} with loss analytic; the analytic loss takes no cap (0)")
    for key, value in (("loss", loss), ("tis_cap", cap)):
        recorded = settings.get(key, value)
        if (math.inf if recorded == "inf" else recorded) != value:
            raise BadInput(
                f"{where}: train_settings.{key} is {recorded!r}, {key} is {value!r}; they must agree"
            )
    return loss, float(cap)


def budget_center(budget: dict, where: str) -> bool:
    """Whether the budget's loss centres its advantages (train.py --center-advantages): the budget's own
    center_advantages, else its train_settings', else False; true or false only, and true only for the
    sampled-token losses, the only ones that have advantages."""
    settings = budget.get("train_settings") or {}
    center = budget.get("center_advantages", settings.get("center_advantages", False))
    if not isinstance(center, bool) or center != settings.get("center_advantages", center):
        raise BadInput(
            f"{where}: center_advantages is {center!r} (train_settings: "
            f"{settings.get('center_advantages', 'absent')!r}); expected true or false, the same in both"
        )
    if center and budget_loss(budget, where)[0] == "analytic":
        raise BadInput(f"{where}: center_advantages is true with loss analytic, which has no advantages")
    return center


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
    return loss_label(loss, tis_cap, center=budget.get("center_advantages") is True)


def budget_band(budget: dict) -> tuple[float, float]:
    """The budget's own 95% interval [B_lo, B_hi] over the calibration's seeds (calibrate.budget_ci), which
    admit.py's verdict and train.py --budget decide against: B_hi is +inf where the interval reaches above
    the largest mismatch tried, and for a lower-bound budget ("all-within": the fitted quality loss never
    reached the tolerance). A budget fitted to one seed, or written before the interval was recorded, is its
    own interval."""
    b, ci = budget["budget"], budget.get("budget_ci") or {}
    b_lo = min(b, ci["lo"]) if ci.get("lo") is not None else b
    b_hi = max(b, ci["hi"]) if ci.get("hi") is not None else (math.inf if ci else b)
    return b_lo, math.inf if budget["how"] == "all-within" else b_hi


def pair_flags(pair: str, files: dict) -> str:
    """A pair as the command line names it: --pair NAME, or --teacher T --student S for a custom pair."""
    if pair != "custom":
        return f"--pair {pair}"
    return f"--teacher {files.get('teacher')} --student {files.get('student')}"


def match_pair(
    budget: dict, pair: str, files: dict, where: str, probes: bool = False, prompts_sha256: str | None = None
) -> None:
    """A budget holds for the pair it was calibrated on; one line (BadInput) otherwise. `pair` and `files`
    are the candidate's: an embedded pair's name, or "custom" and its models (lab.hf_pairs.pair_files:
    absolute folders or hub ids), compared with the budget's "pair", "teacher" and "student". `probes`: the
    candidate is measured on the held-out tenth of its prompts (a live check), so its prompts must be the
    calibration's too, the budget's scale being measured on its own probes: `prompts_sha256` (of --prompts;
    None: the pair's own) against the budget's."""
    b_pair, b_files = budget.get("pair"), {k: budget.get(k) for k in ("teacher", "student")}
    if b_pair == "custom" and pair != "custom":
        raise BadInput(
            f"{where} was calibrated for {pair_flags(b_pair, b_files)}; give the same --teacher/--student "
            "(and --prompts), not --pair"
        )
    if b_pair != pair:
        raise BadInput(f"{where} was calibrated for pair {b_pair!r}, not {pair_flags(pair, files)}")
    if pair == "custom" and b_files != {k: files.get(k) for k in b_files}:
        raise BadInput(
            f"{where} was calibrated for {pair_flags(b_pair, b_files)}, not {pair_flags(pair, files)}; a "
            "budget holds only for its own models"
        )
    if probes and budget.get("prompts_sha256") != prompts_sha256:
        theirs = f"--prompts {budget['prompts']}" if budget.get("prompts") else "the pair's own prompts"
        mine = f"--prompts {files['prompts']}" if files.get("prompts") else "the pair's own prompts"
        raise BadInput(
            f"{where} was calibrated on the held-out tenth of {theirs}, not of {mine} (other bytes): its "
            "scale is measured on its own probes"
        )


POWER_RULE = 3  # a budget is powered when a configuration's mean quality loss has SE <= tolerance / 3


def budget_power(budget: dict) -> dict:
    """Whether a budget meets the power rule: with se = the standard error of one configuration's mean
    paired quality loss over the calibration's seeds (noise.paired_loss_se) and tol = tolerance.nats,
        powered  iff  se <= tol / POWER_RULE.
    A budget without a measured se (one seed, or no configuration near the tolerance on two seeds) is
    under-powered: nothing shows its noise is small."""
    noise = budget.get("noise") if isinstance(budget.get("noise"), dict) else {}
    se, tol = noise.get("paired_loss_se"), (budget.get("tolerance") or {}).get("nats")
    ratio = se / tol if isinstance(se, (int, float)) and isinstance(tol, (int, float)) and tol > 0 else None
    return {
        "se_over_tolerance": ratio,
        "rule": f"SE of a configuration's mean quality loss <= tolerance / {POWER_RULE}",
        "under_powered": ratio is None or ratio > 1 / POWER_RULE,
    }


def read_budget(path: Path, pair: str | None, needs: tuple = (), flag: str = "--budget") -> dict:
    """A budget.json (or a refused.json: the same record), checked once for every reader: schema, pair
    (None: any, for dumps), typed numbers where numbers go (no bools, finite, budget >= 0, tolerance > 0,
    seconds_per_run > 0), every other field calibrate writes typed where present (SCHEMA), the interval
    around the budget, the loss it holds for (tis_cap only where the loss has importance weights,
    center_advantages only where it has advantages), and the fields `needs` names present (check_needs).
    Every refusal is one line starting with `flag` and the path."""
    where = f"{flag} {path}".strip()
    if not path.is_file():
        raise BadInput(f"{where}: no such file (make one with `python -m lab.calibrate`)")
    if path.stat().st_size > MAX_BUDGET_BYTES:
        raise BadInput(f"{where}: {path.stat().st_size} bytes; a budget.json is under 1 MiB")
    try:
        budget = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
        raise BadInput(f"{where}: not JSON ({getattr(e, 'msg', type(e).__name__)})") from None
    version = budget.get("schema_version") if isinstance(budget, dict) else None
    if version != SCHEMA_VERSION:
        raise BadInput(f"{where}: schema_version {version!r}, this admit.py reads {SCHEMA_VERSION}")
    if pair is not None and budget.get("pair") != pair:
        raise BadInput(f"{where} was calibrated for pair {budget.get('pair')!r}, not --pair {pair!r}")
    check_numbers(budget, where=where)
    if budget.get("how") not in BUDGET_HOWS:
        raise BadInput(f"{where}: how is {budget.get('how')!r}; expected one of {', '.join(BUDGET_HOWS)}")
    check_schema(budget, SCHEMA, where, at="")
    check_consistent(budget, where=where)
    check_needs(budget, needs, where=where)
    budget["center_advantages"] = budget_center(budget, where=where)
    budget["loss"], budget["tis_cap"] = budget_loss(budget, where=where)
    if isinstance(budget.get("train_settings"), dict) and "tis_cap" in budget["train_settings"]:
        # the settings a stale candidate's trajectory is trained with: the cap as a number, "inf" read back
        budget["train_settings"]["tis_cap"] = budget["tis_cap"]
    if isinstance(budget.get("train_settings"), dict):  # a budget made before centring existed: off
        budget["train_settings"].setdefault("center_advantages", bool(budget.get("center_advantages", False)))
    return budget
