"""Answers to notebook 05: the verdict rule, the staleness axis."""


def my_verdict(lo, hi, b_lo, b_hi):
    """admit if hi < B_lo, reject if lo > B_hi, else uncertain."""
    if hi < b_lo:
        return "admit"
    if lo > b_hi:
        return "reject"
    return "uncertain"


def my_stale_verdict(runs, tol, k):
    """A stale engine k versions behind under a sampled-token loss, from the calibration's stale runs
    {j: mean quality loss}: reject if a run at least as fresh lost beyond tol; None (the scale decides) if a run
    at least as stale stayed within; else uncertain."""
    if any(j <= k and q > tol for j, q in runs.items()):
        return "reject"
    if any(j >= k and q <= tol for j, q in runs.items()):
        return None
    return "uncertain"
