"""The harness that makes runs safe and budgets reproducible, around the method in the top-level core.

runfiles   the run folder: atomic writes, strict metrics, checkpoints, the lock, the resume diff
calibrate  budgets from short training runs (`python -m lab.calibrate --pair tiny --out budgets/tiny`)
"""
