"""Reference answers to the course's exercises (one module per notebook: nb01 … nb06) and `run_check`, the
runner every check cell calls.

Each exercise cell ships a stub that raises NotImplementedError with a hint. With OPD_SOLUTIONS=1 in the
environment (the test suite sets it; a stuck student may too) the cell imports the answer from here instead.
`run_check(check, what)` runs a check function and prints one line: correct, not written yet (the stub's
NotImplementedError), or wrong with the check's message (its AssertionError). With OPD_SOLUTIONS=1 anything
but correct raises, so the suite fails when a reference answer and its check part ways.
"""

import os

SOLUTIONS = os.environ.get("OPD_SOLUTIONS") == "1"


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
    if SOLUTIONS:
        raise AssertionError(f"{what}: the reference answer is {outcome} (OPD_SOLUTIONS=1)")
