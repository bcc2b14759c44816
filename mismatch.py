"""Measurement: how far the rollout engine's policy is from the policy being trained, on one scale.

The canonical scale (nats per token):

    mismatch_kl = mean over response tokens t of  KL(π_engine(·|x_<t) ‖ π_train(·|x_<t))
                = mean_t Σ_v π_e(v|x_<t) (log π_e(v|x_<t) − log π_t(v|x_<t)),

taken on the engine's own samples (x ~ π_engine), over the full vocabulary, where π_train is the trainer's
student at the engine's version. Both sides are read at temperature 1 with no top-p truncation: the
policies themselves, not the sampler's settings.

Beside it, from the sampled tokens alone (what dumps from other systems give you), with the per-token
log-ratio r_t = log π_e(y_t|x_<t) − log π_t(y_t|x_<t) and importance ratio ρ_t = π_t(y_t)/π_e(y_t) = e^{−r_t}:
    k1 = mean r_t                  unbiased for the KL, high variance, can be negative
    k3 = mean (ρ_t − 1) − log ρ_t  = mean e^{−r_t} − 1 + r_t; unbiased, always >= 0, low variance
    mean/max |Δp| = |π_e(y_t) − π_t(y_t)|
    chi2 = mean (ρ_t − 1)²         token-level χ²(π_t ‖ π_e) estimate
    ratio_mean/std/min/max of ρ_t, and ess = (Σρ)² / (n Σρ²) ∈ (0, 1], the effective sample fraction
    logppl_diff = mean over sequences of (log-perplexity under π_train − under π_engine)
                = mean_b (1/|b|) Σ_{t∈b} r_t  (k1 with every sequence weighted equally)

Two parts of mismatch:
    per-token     the canonical mismatch_kl: different next-token distributions at the same prefix.
                  Token-level importance weights (TIS) can correct it.
    prefix shift  how far the prefixes the engine visits are from the ones π_train would visit:
                  seq_kl = mean_b Σ_{t∈b} r_t, the sequence-level log-ratio log π_e(y_b)/π_t(y_b),
                  which estimates KL(π_e ‖ π_t) over whole responses (nats per sequence); and seq_ess,
                  the effective sample fraction of the sequence-level weights e^{−Σ_t r_t}. A token-level
                  correction leaves these untouched: they grow with length even at a fixed per-token error.

    python mismatch.py --pair tiny --weights bf16
"""

import torch

from train import head, response_hidden


def exact_token_kl(engine, train, rollout, chunk: int = 256) -> torch.Tensor:
    """Exact KL(π_engine ‖ π_train) at every response token of `rollout`: kl_N (row-major order).

    Vocabulary-sized logits are formed `chunk` tokens at a time, so gemma3's 262k vocabulary fits.
    """
    with torch.no_grad():
        h_e_N_H, _ = response_hidden(engine, rollout)
        h_t_N_H, _ = response_hidden(train, rollout)
        out = []
        for i in range(0, len(h_e_N_H), chunk):
            logp_e = torch.log_softmax(head(engine, h_e_N_H[i : i + chunk]).float(), -1)
            logp_t = torch.log_softmax(head(train, h_t_N_H[i : i + chunk].to(h_e_N_H.dtype)).float(), -1)
            out.append((logp_e.exp() * (logp_e - logp_t)).sum(-1))
        return torch.cat(out) if out else torch.zeros(0)


def sampled_token_metrics(logp_engine_N: torch.Tensor, logp_train_N: torch.Tensor, seq_id_N: torch.Tensor) -> dict:
    """k1, k3, |Δp|, χ², IS-ratio statistics, ESS and the prefix-shift numbers (see the module docstring)."""
    r = (logp_engine_N - logp_train_N).double()
    rho = torch.exp(-r)
    n_seq = int(seq_id_N.max()) + 1 if len(seq_id_N) else 0
    seq_sum = torch.zeros(n_seq, dtype=r.dtype).index_add_(0, seq_id_N, r)
    seq_len = torch.zeros(n_seq, dtype=r.dtype).index_add_(0, seq_id_N, torch.ones_like(r))
    seq_w = torch.exp(-(seq_sum - seq_sum.min()))  # shifted for stability; ESS is scale-free
    dp = (logp_engine_N.exp() - logp_train_N.exp()).abs()
    return {
        "k1": r.mean().item(),
        "k3": (rho - 1 - torch.log(rho)).mean().item(),
        "dp_mean": dp.mean().item(),
        "dp_max": dp.max().item(),
        "chi2": ((rho - 1) ** 2).mean().item(),
        "ratio_mean": rho.mean().item(),
        "ratio_std": rho.std().item() if len(rho) > 1 else 0.0,
        "ratio_min": rho.min().item(),
        "ratio_max": rho.max().item(),
        "ess": (rho.sum() ** 2 / (len(rho) * (rho**2).sum())).item(),
        "logppl_diff": (seq_sum / seq_len).mean().item(),
        "seq_kl": seq_sum.mean().item(),
        "seq_ess": (seq_w.sum() ** 2 / (n_seq * (seq_w**2).sum())).item(),
    }


def bootstrap_ci(kl_N: torch.Tensor, seq_id_N: torch.Tensor, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Confidence interval of the token-mean KL, resampling whole sequences (prompts) with replacement.

    Resampling sequences, not tokens, because tokens of one response are correlated.
    """
    n_seq = int(seq_id_N.max()) + 1
    seq_sum = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, kl_N.double())
    seq_len = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, torch.ones_like(kl_N, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    idx_R_S = torch.randint(n_seq, (n_boot, n_seq), generator=g)
    means_R = seq_sum[idx_R_S].sum(1) / seq_len[idx_R_S].sum(1)
    lo, hi = torch.quantile(means_R, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi
