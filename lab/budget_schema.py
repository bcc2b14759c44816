"""The schema of a budget.json, checked once for every reader (budget.read_budget): every field calibrate
writes typed where present, the numbers finite where numbers go, the interval around the budget, the fields
a reader needs. A file that does not fit is one line (BadInput) naming the field and what it accepts.
"""

import math

from cli import BadInput

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
