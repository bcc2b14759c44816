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
    the largest mismatch tried, and for a lower-bound budget ("all-within": no calibration run lost
    quality). A budget fitted to one seed, or written before the interval was recorded, is its own
    interval."""
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


MAX_BUDGET_BYTES = 2**20  # a budget.json is a few KB; a larger file is not one


def is_finite(value) -> bool:
    """A JSON number that a float holds finitely: no bool, NaN or infinity, and no integer beyond the float
    range. The bound is the largest double (about 1.8e308): a budget of exactly 1e308 is finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer of 309 digits or more
        return False


def _is_count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**63


# What each kind of field accepts: (test, the words a refusal uses).
KINDS = {
    "number": (is_finite, "a finite number"),
    "number > 0": (lambda v: is_finite(v) and v > 0, "a finite number > 0"),
    "number >= 0": (lambda v: is_finite(v) and v >= 0, "a finite number >= 0"),
    "number or null": (lambda v: v is None or is_finite(v), "a finite number or null"),
    "number >= 0 or null": (lambda v: v is None or (is_finite(v) and v >= 0), "a finite number >= 0 or null"),
    "fraction": (lambda v: is_finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "numbers": (lambda v: isinstance(v, list) and all(map(is_finite, v)), "a list of finite numbers"),
    "integer >= 0": (lambda v: _is_count(v, 0), "an integer >= 0"),
    "integer >= 1": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "text": (lambda v: isinstance(v, str), "text"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "bool or null": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "list": (lambda v: isinstance(v, list), "a list"),
}
# A budget's fields beyond those read_budget checks itself (schema_version, pair, budget, how, loss, tis_cap,
# seconds_per_run, tolerance.nats, center_advantages), as calibrate writes them. A key marked "?" may be
# absent; the others must be there whenever the object holding them is. A dict is an object of those
# fields, ("list", X) a list of X, ("every", X) an object whose every value is X, ("or null", X) X or null.
POINT = {  # one calibration run (calibrate.calibration_points)
    "source": "text",
    "seed": "integer >= 0",
    "mismatch": "number",
    **{f"?{k}": "number" for k in ("prefix_kl", "train_mismatch", "eval_rkl_start", "eval_rkl")},
    **{f"?{k}": "number or null" for k in ("eval_acc_start", "eval_acc", "eval_reward_start", "eval_reward")},
    "?seconds": "number >= 0",
    "?quality_loss": "number",
    "?mismatch_ci": "numbers",
    "?eval_rkl_by_step": "list",
    "?reused": "bool",
    "?noise": "number >= 0",  # the rollout settings of the point's configuration (calibration_configs)
    "?staleness": "integer >= 0",
    **{f"?{k}": "text" for k in ("weights", "kv_cache", "kv_scales")},
}
SCHEMA = {
    **{f"?{k}": "text" for k in ("pair", "command", "scale", "device", "method", "fitted_to", "note")},
    "?tolerance": {"nats": "number > 0", "?fraction": "fraction", "?of": "text"},
    "?baseline": {"eval_rkl_start": "number", "eval_rkl_final": "number", "improvement": "number > 0"},
    "?budget_ci": (
        "or null",
        {
            "lo": "number >= 0 or null",
            "hi": "number >= 0 or null",
            "draws": "integer >= 1",
            "beyond_largest_mismatch": "number >= 0",
            "?level": "fraction",
            "?method": "text",
        },
    ),
    "?fit": {"mismatch": "numbers", "quality_loss": "numbers"},
    **{f"?{k}": "integer >= 1" for k in ("steps", "seeds", "probes")},
    "?train_settings": {
        **{f"?{k}": "integer >= 1" for k in ("batch_size", "samples_per_prompt", "eval_prompts")},
        "?lr": "number > 0",
        **{f"?{k}": "number >= 0" for k in ("weight_decay", "grad_clip")},
        "?warmup": "integer >= 0",
        "?schedule": "text",
        "?center_advantages": "bool",
    },
    "?noise": {
        "eval_sd_by_prompts": ("every", {"sd": "number >= 0", "?eval_rkl": "numbers"}),
        "eval_seeds": "integer >= 1",
        **{k: "number >= 0 or null" for k in ("paired_loss_sd", "paired_loss_se", "tolerance_over_se")},
        "?baseline_sd_across_training_seeds": "number >= 0 or null",
        "?tolerance_at_least_2se": "bool or null",
        "?paired_loss_pooled_over": "text",
    },
    "?reused": {"points": "integer >= 0", "?from": "text", "?trained_on": "text"},
    "?power": {"rule": "text", "max_seeds": "integer >= 1", "rounds": "list"},
    "?points": ("list", POINT),
}


def _shown(value) -> str:
    return str(value)[:40] if isinstance(value, int) else repr(value)[:40]


def check_schema(value, schema, where: str, at: str) -> None:
    """value against a SCHEMA entry (a KINDS name, a dict of fields, or a ("list" | "every" | "or null", X)
    pair); the first field that does not fit is one line naming its path `at` and what it accepts."""
    if isinstance(schema, str):
        test, words = KINDS[schema]
        if not test(value):
            raise BadInput(f"{where}: {at} is {_shown(value)}; expected {words}")
    elif isinstance(schema, tuple):
        mode, inner = schema
        if mode == "or null" and value is not None:
            check_schema(value, inner, where, at=at)
        elif mode == "list":
            check_schema(value, "list", where, at=at)
            for i, item in enumerate(value):
                check_schema(item, inner, where, at=f"{at}[{i}]")
        elif mode == "every":
            if not isinstance(value, dict):
                raise BadInput(f"{where}: {at} is {_shown(value)}; expected an object")
            for key, item in value.items():
                check_schema(item, inner, where, at=f"{at}.{key}")
    else:
        if not isinstance(value, dict):
            raise BadInput(f"{where}: {at} is {_shown(value)}; expected an object")
        for key, inner in schema.items():
            name = key.removeprefix("?")
            if name in value:
                check_schema(value[name], inner, where, at=f"{at}.{name}".removeprefix("."))
            elif not key.startswith("?"):
                raise BadInput(f"{where}: {at} has no field {name!r}; a budget calibrate writes has it")


def check_consistent(budget: dict, where: str) -> None:
    """What the fields must say together: the interval holds the budget (lo <= budget <= hi, a null end
    open), and the fit has one quality loss per mismatch."""
    ci, b = budget.get("budget_ci"), budget["budget"]
    if ci is not None:
        lo, hi = (-math.inf if ci["lo"] is None else ci["lo"]), (math.inf if ci["hi"] is None else ci["hi"])
        if not lo <= b <= hi:
            raise BadInput(
                f"{where}: budget_ci is [{ci['lo']}, {ci['hi']}] and budget {b}; expected lo <= budget <= hi"
            )
    fit = budget.get("fit")
    if fit is not None and len(fit["mismatch"]) != len(fit["quality_loss"]):
        raise BadInput(
            f"{where}: fit has {len(fit['mismatch'])} mismatches and {len(fit['quality_loss'])} quality "
            "losses; expected one per mismatch"
        )


def check_needs(budget: dict, needs: tuple, where: str) -> None:
    """The fields a reader needs beyond any budget's (a path "a.b"; "points.x" in every point), present."""
    for need in needs:
        values = [budget]
        for part in need.split("."):  # a null object (one seed's budget_ci) needs nothing
            values = [v for x in values for v in (x if isinstance(x, list) else [x]) if v is not None]
            if missing := [v for v in values if part not in v]:
                at = need if len(values) == 1 else f"{need} (in {len(missing)} of {len(values)})"
                raise BadInput(f"{where}: missing field {at}; this command reads it (calibrate writes it)")
            values = [v[part] for v in values]


def check_numbers(budget: dict, where: str) -> None:
    """Typed numbers where a budget has numbers: budget >= 0, seconds_per_run > 0, tolerance.nats > 0."""
    tolerance = budget.get("tolerance")
    numbers = {  # key: (value, smallest allowed, whether the smallest is allowed)
        "budget": (budget.get("budget"), 0, True),
        "seconds_per_run": (budget.get("seconds_per_run"), 0, False),
        "tolerance.nats": (tolerance.get("nats") if isinstance(tolerance, dict) else tolerance, 0, False),
    }
    for key, (value, low, closed) in numbers.items():
        if not is_finite(value) or value < low or (value == low and not closed):
            shown = str(value)[:40] if isinstance(value, int) else repr(value)[:40]
            raise BadInput(
                f"{where}: {key} is {shown}; expected a finite number {'>=' if closed else '>'} {low}"
            )


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
