"""kl.py, the formulas of the one scale, each against a slow direct computation from its definition."""

import math

import torch
from conftest import assert_close

from kl import KL_ROWS, bootstrap_ci, prefix_shift_kl, sampled_token_metrics, token_kl
from models import format_prompt
from rollout import RolloutConfig, generate


def direct_kl(engine_row: list[float], train_row: list[float]) -> float:
    """KL(π_e ‖ π_train) of one position from its logits, one vocabulary entry at a time in Python floats:
    π(v) = e^{x_v − m} / Σ_u e^{x_u − m}, then Σ_v π_e(v) (log π_e(v) − log π_train(v))."""

    def log_softmax(xs):
        m = max(xs)
        log_z = m + math.log(sum(math.exp(x - m) for x in xs))
        return [x - log_z for x in xs]

    logp_e, logp_t = log_softmax(engine_row), log_softmax(train_row)
    return sum(math.exp(a) * (a - b) for a, b in zip(logp_e, logp_t))


def test_token_kl_equals_a_direct_float64_sum():
    torch.manual_seed(0)
    engine_N_V = 3 * torch.randn(6, 11)
    train_N_V = engine_N_V + torch.randn_like(engine_N_V)
    expected = torch.tensor([direct_kl(e.tolist(), t.tolist()) for e, t in zip(engine_N_V, train_N_V)])
    kl_N = token_kl(engine_N_V, train_N_V)
    assert kl_N.dtype == torch.float64
    assert_close(kl_N, expected, atol=1e-12, what="token_kl")
    assert (kl_N > 0).all() and token_kl(engine_N_V, engine_N_V).abs().max() < 1e-12


def test_token_kl_in_blocks_equals_one_pass():
    """kl.token_kl works KL_ROWS rows at a time; the same numbers as one float64 pass over every row."""
    torch.manual_seed(0)
    engine_N_V = torch.randn(3 * KL_ROWS + 5, 300)
    train_N_V = engine_N_V + 0.01 * torch.randn_like(engine_N_V)
    logp_e, logp_t = torch.log_softmax(engine_N_V.double(), -1), torch.log_softmax(train_N_V.double(), -1)
    assert torch.equal(token_kl(engine_N_V, train_N_V), (logp_e.exp() * (logp_e - logp_t)).sum(-1))
    assert token_kl(engine_N_V[:0], train_N_V[:0]).shape == (0,)


def test_sampled_token_metrics_equal_their_formulas():
    """k1 = mean r, k3 = mean (ρ − 1 − log ρ) with r = log π_e(y) − log π_train(y), ρ = e^{−r}; the per-
    sequence sums and the IS-ratio statistics, each written out directly over Python floats."""
    gen = torch.Generator().manual_seed(0)
    logp_e_N = -torch.rand(9, generator=gen) * 3
    logp_t_N = logp_e_N + 0.5 * torch.randn(9, generator=gen)
    seq_N = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    m = sampled_token_metrics(logp_e_N, logp_t_N, seq_N)
    r = [a - b for a, b in zip(logp_e_N.double().tolist(), logp_t_N.double().tolist())]
    rho = [math.exp(-x) for x in r]
    assert math.isclose(m["k1"], sum(r) / 9, rel_tol=1e-12)
    assert math.isclose(m["k3"], sum(p - 1 - math.log(p) for p in rho) / 9, rel_tol=1e-9)
    assert math.isclose(m["chi2"], sum((p - 1) ** 2 for p in rho) / 9, rel_tol=1e-9)
    assert math.isclose(m["ratio_mean"], sum(rho) / 9, rel_tol=1e-12)
    assert math.isclose(m["ess"], sum(rho) ** 2 / (9 * sum(p * p for p in rho)), rel_tol=1e-12)
    seq_sums = [sum(r[:3]), sum(r[3:5]), sum(r[5:])]
    assert math.isclose(m["seq_kl"], sum(seq_sums) / 3, rel_tol=1e-12)
    assert math.isclose(m["logppl_diff"], (seq_sums[0] / 3 + seq_sums[1] / 2 + seq_sums[2] / 4) / 3)
    weights = [math.exp(-s) for s in seq_sums]
    assert math.isclose(m["seq_ess"], sum(weights) ** 2 / (3 * sum(w * w for w in weights)), rel_tol=1e-9)


def test_k1_and_k3_match_the_exact_kl_in_expectation():
    """On a 5-token vocabulary, E_{y~π_e}[k3] and E[k1] equal the exact KL(π_e ‖ π_train) (enumeration)."""
    torch.manual_seed(0)
    logp_e, logp_t = torch.log_softmax(torch.randn(5), -1), torch.log_softmax(torch.randn(5), -1)
    exact = (logp_e.exp() * (logp_e - logp_t)).sum()
    p = logp_e.exp()
    per_y = [
        sampled_token_metrics(logp_e[y : y + 1], logp_t[y : y + 1], torch.zeros(1, dtype=torch.long))
        for y in range(5)
    ]
    assert_close((p * torch.tensor([m["k3"] for m in per_y])).sum(), exact, atol=1e-6, what="E[k3]")
    assert_close((p * torch.tensor([m["k1"] for m in per_y])).sum(), exact, atol=1e-6, what="E[k1]")


def test_prefix_shift_kl_is_the_running_sum_of_earlier_token_kls(tiny_pair):
    rollout = generate(
        tiny_pair.student,
        tiny_pair.tokenizer,
        [format_prompt(tiny_pair.tokenizer, "12+34=")] * 2 + [format_prompt(tiny_pair.tokenizer, "5+600=")],
        RolloutConfig(max_new_tokens=5),
        generator=torch.Generator().manual_seed(0),
    )
    mask_B_T = rollout.response_mask[:, 1:].bool()
    kl_N = torch.rand(int(mask_B_T.sum()))
    expected, i = [], 0
    for row in mask_B_T:  # the direct loop: per response, the sum of the KLs of its earlier tokens
        n = int(row.sum())
        expected += [kl_N[i : i + j].sum() for j in range(n)]
        i += n
    assert_close(prefix_shift_kl(kl_N, rollout), torch.stack(expected), atol=1e-6, what="prefix KL")


def width(interval: tuple[float, float]) -> float:
    return interval[1] - interval[0]


Z95 = 1.959964  # the standard normal's 97.5% quantile


def test_bootstrap_ci_resamples_whole_sequences():
    """Tokens of one sequence that share its value (a sequence-level KL, as a prefix makes it): the mean's
    standard error is that of S sequence means, sd(m)/√S, not that of S·L tokens. The interval's width is
    close to 2 · 1.96 · that SE; a token-level bootstrap (each token a sequence) is √L times too narrow."""
    S, L = 200, 25
    gen = torch.Generator().manual_seed(0)
    seq_mean_S = torch.rand(S, generator=gen, dtype=torch.float64)
    kl_N = seq_mean_S.repeat_interleave(L) + 0.01 * torch.rand(S * L, generator=gen, dtype=torch.float64)
    seq_N = torch.arange(S).repeat_interleave(L)
    means_S = kl_N.view(S, L).mean(1)
    se = math.sqrt(
        ((means_S - means_S.mean()) ** 2).mean().item() / S
    )  # the plug-in SE the bootstrap targets
    ours = bootstrap_ci(kl_N, seq_N, n_boot=4000)
    assert ours[0] < kl_N.mean().item() < ours[1]
    assert abs(width(ours) / (2 * Z95 * se) - 1) < 0.1, (width(ours), 2 * Z95 * se)
    by_token = bootstrap_ci(kl_N, torch.arange(S * L), n_boot=4000)
    assert width(ours) > 3 * width(by_token), (ours, by_token)


def test_bootstrap_ci_with_groups_resamples_the_draws_first():
    """G weight-noise draws, each shifting its sequences by one value g_k: the spread between draws has G
    independent values, so the two-stage interval's width is close to 2 · 1.96 · sd(g)/√G, several times
    what resampling the G·S sequences as if independent gives."""
    G, S, L = 25, 8, 3
    gen = torch.Generator().manual_seed(1)
    g_G = torch.randn(G, generator=gen, dtype=torch.float64)
    kl_N = g_G.repeat_interleave(S * L)
    seq_N = torch.arange(G * S).repeat_interleave(L)
    group_of_seq = torch.arange(G).repeat_interleave(S)
    se = math.sqrt(((g_G - g_G.mean()) ** 2).mean().item() / G)
    two_stage = bootstrap_ci(kl_N, seq_N, n_boot=4000, group_of_seq=group_of_seq)
    assert abs(width(two_stage) / (2 * Z95 * se) - 1) < 0.15, (width(two_stage), 2 * Z95 * se)
    one_stage = bootstrap_ci(kl_N, seq_N, n_boot=4000)
    assert width(two_stage) > 2 * width(one_stage), (two_stage, one_stage)
