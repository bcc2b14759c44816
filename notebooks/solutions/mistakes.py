"""Planted wrong answers: for five exercises, the classic mistake each exists for, so that a test can ask
that the exercise's check fails with a message naming it. With OPD_MISTAKES=1 those exercise cells import
these in place of the stub (notebooks 01, 02, 04 and 05). Every function here is WRONG on purpose."""

import torch


def my_opd_loss(student_logits_B_T_V, teacher_logits_B_T_V, mask_B_T):
    """01, Exercise 3. WRONG: each sequence's mean KL over its response tokens, then the mean over sequences
    (a short response weighs as much as a long one); the loss is the mean over all response tokens."""
    logp_s_B_T_V = torch.log_softmax(student_logits_B_T_V.float(), -1)
    logp_t_B_T_V = torch.log_softmax(teacher_logits_B_T_V.float(), -1)
    kl_B_T = (logp_s_B_T_V.exp() * (logp_s_B_T_V - logp_t_B_T_V)).sum(-1)
    mask_B_T = mask_B_T.float()
    tokens_B = mask_B_T.sum(1)
    per_sequence_B = (kl_B_T * mask_B_T).sum(1) / tokens_B.clamp(min=1)
    return per_sequence_B[tokens_B > 0].mean()


def my_sampler_loss(student_logits_B_T_V, teacher_logits_B_T_V, y_B_T, logp_sampler_B_T, mask_B_T):
    """01, Exercise 4b. WRONG: the advantage from the trainer's log-prob, A = −(log p_s(y) − log p_t(y)),
    where tinker's takes the sampler's, A = −(log π_sampler(y) − log p_t(y)). The weight is right."""
    logp_s_B_T = torch.log_softmax(student_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    logp_t_B_T = torch.log_softmax(teacher_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    advantage_B_T = -(logp_s_B_T - logp_t_B_T).detach()
    w_B_T = torch.exp(logp_s_B_T.detach() - logp_sampler_B_T)
    mask_B_T = mask_B_T.float()
    return -(w_B_T * advantage_B_T * logp_s_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1)


def my_bootstrap_ci(kl_R, seq_id_R, n_boot=1000, level=0.95, seed=0):
    """02, Exercise 2. WRONG: a token-level bootstrap, resampling tokens as if they were independent; tokens
    of one sequence are correlated, so the interval comes out too narrow."""
    n = len(kl_R)
    draws = torch.randint(n, (n_boot, n), generator=torch.Generator().manual_seed(seed))
    means = kl_R.double()[draws].mean(1)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(means, q).tolist()
    return low, high


def my_verdict(lo, hi, b_lo, b_hi):
    """05, Exercise 1. WRONG: `<=` and `>=` where the rule is strict, so an interval that only touches the
    budget's is decided."""
    if hi <= b_lo:
        return "admit"
    if lo >= b_hi:
        return "reject"
    return "uncertain"


def my_budget(xs, fit, tol):
    """04, Exercise 2. WRONG: no interpolation; at a crossing it returns the last mismatch tried within the
    tolerance instead of interpolating between it and the first one beyond."""
    if fit[0] > tol:
        return 0.0
    if fit[-1] <= tol:
        return xs[-1]
    j = next(i for i, f in enumerate(fit) if f > tol)
    return xs[j - 1]
