"""Answers to notebook 02: the k3 estimator, a sequence-bootstrap interval, the prefix-shift running sum."""

import torch


def my_k3(logp_engine, logp_train):
    """mean(ρ − 1 − log ρ), ρ = π_train/π_engine, in float64."""
    log_rho = (logp_train - logp_engine).double()
    return (log_rho.exp() - 1 - log_rho).mean().item()


def my_bootstrap_ci(kl_R, seq_id_R, n_boot=1000, level=0.95, seed=0):
    """Quantiles of the token-mean KL over resamples of whole sequences."""
    n_seq = int(seq_id_R.max()) + 1
    seq_sum = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_R, kl_R.double())
    ones_R = torch.ones(len(kl_R), dtype=torch.float64)
    seq_len = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_R, ones_R)
    draws = torch.randint(n_seq, (n_boot, n_seq), generator=torch.Generator().manual_seed(seed))
    means = seq_sum[draws].sum(1) / seq_len[draws].sum(1)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(means, q).tolist()
    return low, high


def my_prefix_kl(kl_R, seq_id_R):
    """Exclusive running sum of the KLs of the earlier tokens of the same response."""
    out = torch.zeros_like(kl_R)
    running = {}
    for i, (kl, seq) in enumerate(zip(kl_R.tolist(), seq_id_R.tolist())):
        out[i] = running.get(seq, 0.0)
        running[seq] = running.get(seq, 0.0) + kl
    return out
