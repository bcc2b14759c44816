"""Answers to notebook 06: predicting the admission check's verdicts, the groups that carry no GRPO signal,
and the expected TIS weight."""

import torch


def my_predictions():
    """Verdicts against the tiny budget (budgets/tiny/budget.json, a few nats/token): the real configurations
    measure 1e-4–1e-2, weight noise σ = 0.2 about 1.2 and σ = 1 about 10 (notebooks 02 and 04)."""
    return {
        "fp8 weights": "admit",
        "fp8 KV cache": "admit",
        "staleness 2": "admit",
        "noise 0.2": "admit",
        "noise 1.0": "reject",
    }


def my_dead_group_fraction(p, group):
    """P(all G responses score the same) = p^G + (1 − p)^G: such a group has advantage 0."""
    return p**group + (1 - p) ** group


def my_expected_tis_weight(logp_engine_V, logp_train_V, cap):
    """E_{y∼π_e}[min(π_t(y)/π_e(y), C)] = Σ_v min(π_t(v), C π_e(v))."""
    p_e, p_t = logp_engine_V.double().exp(), logp_train_V.double().exp()
    return torch.minimum(p_t, cap * p_e).sum().item()
