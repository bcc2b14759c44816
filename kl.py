"""The formulas of the one scale: pure functions of log-probs and distributions, no model, no engine, no CLI.

The canonical scale (nats per token):

    mismatch_kl = mean over response tokens t of  KL(π_engine(·|x_<t) ‖ π_train(·|x_<t))
                = mean_t Σ_v π_e(v|x_<t) (log π_e(v|x_<t) − log π_train(v|x_<t)),

taken on the engine's own samples, over the full vocabulary, in float64 (token_kl). From the sampled
tokens alone (what dumps from other systems give), with r_t = log π_e(y_t|x_<t) − log π_train(y_t|x_<t) and
ρ_t = π_train(y_t)/π_e(y_t) = e^{−r_t}: k1 = mean r_t, k3 = mean (ρ_t − 1) − log ρ_t (sampled_token_metrics,
dump_estimate, with the k1 twin k1_token_kl and the flags of an unreadable dump, dump_flags); the
prefix-shift part (prefix_shift_kl); the standard error of one step's mismatch over its responses
(mismatch_se); a sequence-bootstrap interval (bootstrap_ci).
mismatch.py measures engines with these; train.py logs them beside the loss; port/ judges dumps with them.
"""

import torch

KL_ROWS = 16  # token_kl's block: 16 × 49k float64 logits, ~6 MB, 4.8× faster than 256 rows on a 2-core CPU


def token_kl(engine_logits_N_V: torch.Tensor, train_logits_N_V: torch.Tensor) -> torch.Tensor:
    """Exact KL(π_e ‖ π_train) at N positions from the two sides' logits, in float64: kl_N.

    float64 because the KL of close policies is a small difference of large terms: in fp32 the rounding of
    each row's log-sum-exp alone (~1e-7 relative) moves a 1e-4 KL by 0.1%. Computed KL_ROWS rows at a time,
    so each block's float64 temporaries stay in the CPU's cache (the same numbers, several times faster).
    """
    if len(engine_logits_N_V) <= KL_ROWS:
        logp_e_N_V = torch.log_softmax(engine_logits_N_V.double(), -1)
        logp_train_N_V = torch.log_softmax(train_logits_N_V.double(), -1)
        return (logp_e_N_V.exp() * (logp_e_N_V - logp_train_N_V)).sum(-1)
    return torch.cat(
        [token_kl(e, t) for e, t in zip(engine_logits_N_V.split(KL_ROWS), train_logits_N_V.split(KL_ROWS))]
    )


def prefix_shift_kl(kl_N: torch.Tensor, rollout) -> torch.Tensor:
    """The prefix-shift part of the mismatch at every response token: KL between the engine's and the
    trainer's distributions of the response prefix y_<t (kl_N: exact per-token KLs, row-major order).

    By the chain rule of KL,  KL(P_engine(y_<t) ‖ P_train(y_<t)) = E_engine[Σ_{τ<t} KL_τ],  so the running
    sum of the earlier tokens' exact KLs on an engine sample estimates it without bias. The per-token part
    at t is KL_t itself: TIS can reweight the token drawn at t, but not the prefix it was drawn after.
    """
    target_B_T = rollout.response_mask[:, 1:].bool()
    kl_B_T = torch.zeros(target_B_T.shape, dtype=kl_N.dtype, device=kl_N.device).masked_scatter(
        target_B_T, kl_N
    )
    return (kl_B_T.cumsum(1) - kl_B_T)[target_B_T]  # exclusive running sum along each response


def mismatch_se(kl_N: torch.Tensor, rollout) -> float | None:
    """The standard error of a step's mismatch_kl over its sequences: with S_b and n_b the KL sum and token
    count of response b (of B with a token), m = Σ S_b / Σ n_b, the ratio estimator's (delta method)
        se = √(B / (B − 1) · Σ_b (S_b − m · n_b)²) / Σ_b n_b.
    Responses, not tokens, are the units: the tokens of one response are correlated. None below 2."""
    target_B_T = rollout.response_mask[:, 1:].bool().to(kl_N.device)
    kl_B_T = torch.zeros(target_B_T.shape, dtype=torch.float64, device=kl_N.device)
    kl_B_T = kl_B_T.masked_scatter(target_B_T, kl_N.double())
    n_B = target_B_T.sum(1).double()
    sum_B, n_B = kl_B_T.sum(1)[n_B > 0], n_B[n_B > 0]
    if len(n_B) < 2:
        return None
    m = sum_B.sum() / n_B.sum()
    return (len(n_B) / (len(n_B) - 1) * ((sum_B - m * n_B) ** 2).sum()).sqrt().item() / n_B.sum().item()


def sampled_token_metrics(
    logp_engine_N: torch.Tensor, logp_train_N: torch.Tensor, seq_id_N: torch.Tensor
) -> dict:
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
        "dlogp_mean": r.abs().mean().item(),
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


def bootstrap_ci(
    kl_N: torch.Tensor,
    seq_id_N: torch.Tensor,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    group_of_seq: torch.Tensor | None = None,
):
    """Confidence interval of the token-mean KL, resampling whole sequences (prompts) with replacement.

    Resampling sequences, not tokens, because tokens of one response are correlated. group_of_seq [S]: the
    group (a weight-noise draw) of each sequence; with two or more groups the resampling is two-stage (draws,
    then sequences within each drawn one), so the spread between draws is inside the interval too.
    """
    n_seq = int(seq_id_N.max()) + 1
    seq_sum = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, kl_N.double())
    seq_len = torch.zeros(n_seq, dtype=torch.float64).index_add_(
        0, seq_id_N, torch.ones_like(kl_N, dtype=torch.float64)
    )
    g = torch.Generator().manual_seed(seed)
    if group_of_seq is None or int(group_of_seq.max()) == 0:
        idx_R_S = torch.randint(n_seq, (n_boot, n_seq), generator=g)
        means_R = seq_sum[idx_R_S].sum(1) / seq_len[idx_R_S].sum(1)
    else:
        members = [torch.nonzero(group_of_seq == k).squeeze(-1) for k in range(int(group_of_seq.max()) + 1)]
        means = []
        for row in torch.randint(len(members), (n_boot, len(members)), generator=g).tolist():
            # groups differ in size, so each replicate is assembled on its own
            idx_S = torch.cat(
                [members[k][torch.randint(len(members[k]), (len(members[k]),), generator=g)] for k in row]
            )
            means.append(seq_sum[idx_S].sum() / seq_len[idx_S].sum())
        means_R = torch.stack(means)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means_R, q).tolist()
    return lo, hi
