"""Reference answers to the course's exercises (one module per notebook: nb01 … nb07), planted wrong answers
(`mistakes`), and `run_check`, the runner every check cell calls.

Each exercise cell ships a stub that raises NotImplementedError with a hint. With OPD_SOLUTIONS=1 in the
environment (the test suite sets it; a stuck student may too) the cell imports the answer from here instead.
With OPD_MISTAKES=1 the exercises that have one import a planted wrong answer from `mistakes` (the classic
mistake the exercise exists for), so the suite can ask that each such check names its mistake.
`run_check(check, what)` runs a check function and prints one line: correct, not written yet (the stub's
NotImplementedError), or wrong with the check's message (its AssertionError). With OPD_SOLUTIONS=1 anything
but correct raises, so the suite fails when a reference answer and its check part ways; with OPD_MISTAKES=1
too, a wrong answer is what the planted ones must give, and does not raise.
"""

import os

SOLUTIONS = os.environ.get("OPD_SOLUTIONS") == "1"
MISTAKES = os.environ.get("OPD_MISTAKES") == "1"


def run_check(check, what: str) -> None:
    """Run check() and print its outcome on one line."""
    try:
        check()
    except NotImplementedError as e:
        print(f"… {what}: not written yet ({e})")
        outcome = "not written"
    except AssertionError as e:
        print(f"✗ {what}: wrong. {e}")
        outcome = "wrong"
    else:
        print(f"✓ {what}: correct")
        return
    if SOLUTIONS and not (MISTAKES and outcome == "wrong"):
        raise AssertionError(f"{what}: the reference answer is {outcome} (OPD_SOLUTIONS=1)")
