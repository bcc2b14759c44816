"""Answers to notebook 04: pool-adjacent-violators, the budget crossing."""


def my_isotonic(y):
    """The non-decreasing sequence closest to y in least squares."""
    blocks = []  # [mean, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, c2 = blocks.pop()
            v1, c1 = blocks.pop()
            blocks.append([(v1 * c1 + v2 * c2) / (c1 + c2), c1 + c2])
    return [v for v, c in blocks for _ in range(c)]


def my_budget(xs, fit, tol):
    """Where the monotone fit first crosses tol, interpolated; xs[-1] if never; 0 if at once."""
    if fit[0] > tol:
        return 0.0
    if fit[-1] <= tol:
        return xs[-1]
    j = next(i for i, f in enumerate(fit) if f > tol)
    x0, x1, f0, f1 = xs[j - 1], xs[j], fit[j - 1], fit[j]
    return x0 + (tol - f0) / (f1 - f0) * (x1 - x0) if f1 > f0 else x0
