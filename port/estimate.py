"""The one scale estimated from a dump: sampled-token (k3, k1) and top-k estimates, their sequence-bootstrap
intervals, the flags of a dump that cannot be read as it claims, and the KL its sampled tokens cannot see
(kl.py has the formulas on full distributions; this module, what a log of sampled and top-k log-probs allows).
"""

import math

import torch

from kl import bootstrap_ci, sampled_token_metrics
from port.dumps import Dump


def topk_token_kl(d: Dump) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimate and lower bound of KL(π_e ‖ π_t) from a dump with top-k log-probs of both sides.

    With S the engine's top-k set at a position, m_e = 1 − Σ_S p_e and m_t = 1 − Σ_S p_t the tail masses:
        KL_t = Σ_S p_e log(p_e/p_t) + Σ_{v∉S} p_e log(p_e/p_t),   and the tail sum equals
               Σ_{v∉S} p_e k3(v) − (m_t − m_e),   k3(v) = ρ_v − 1 − log ρ_v, ρ_v = p_t(v)/p_e(v).
    The sampled token y ~ π_e gives 1[y∉S]·k3(y), an unbiased estimate of Σ_{v∉S} p_e k3, so
        est_t   = Σ_S p_e (log p_e − log p_t) − (m_t − m_e) + 1[y∉S]·k3(y)
    is unbiased, exact when S holds all of the engine's mass, and random only through tail samples.
        lower_t = Σ_S p_e (log p_e − log p_t) + m_e log(m_e / m_t)  <= KL_t   (log-sum inequality)
    needs no sampling at all. Returns (est_R, lower_R), float64.
    """
    p_e_R_K, p_t_R_K = d.top_engine_R_K.exp(), d.top_train_R_K.exp()
    filled_R_K = torch.isfinite(d.top_engine_R_K)
    diff_R_K = torch.where(filled_R_K, d.top_engine_R_K - d.top_train_R_K, torch.zeros_like(p_e_R_K))
    head_R = (p_e_R_K * diff_R_K).sum(-1)
    m_e_R = (1 - p_e_R_K.sum(-1)).clamp(min=0.0)
    m_t_R = (1 - p_t_R_K.sum(-1)).clamp(min=1e-300)
    rho_R = torch.exp(d.train_R - d.engine_R)
    k3_R = rho_R - 1 - torch.log(rho_R)
    est_R = head_R - (m_t_R - m_e_R) + torch.where(d.in_top_R, torch.zeros_like(k3_R), k3_R)
    lower_R = head_R + torch.where(
        m_e_R > 0, m_e_R * torch.log(m_e_R.clamp(min=1e-300) / m_t_R), torch.zeros_like(m_e_R)
    )
    return est_R, lower_R


def k1_token_kl(d: Dump) -> torch.Tensor:
    """The k1 twin of the per-token estimate [R], float64: r_t = log π_e(y_t) − log π_t(y_t) from a k3-only
    dump (E_e[r] = KL), or with top-k  Σ_S p_e (log p_e − log p_t) + 1[y∉S]·r_t  (the tail's KL from the
    sampled token, no tail-mass term). Unbiased like k3, with lighter tails: a rare token with π_t ≫ π_e adds
    ρ − 1 + r to k3 but only r = −log ρ to k1."""
    r_R = d.engine_R - d.train_R
    if d.top_engine_R_K is None:
        return r_R
    filled_R_K = torch.isfinite(d.top_engine_R_K)
    diff_R_K = torch.where(filled_R_K, d.top_engine_R_K - d.top_train_R_K, torch.zeros_like(r_R)[:, None])
    head_R = (d.top_engine_R_K.exp() * diff_R_K).sum(-1)
    return head_R + torch.where(d.in_top_R, torch.zeros_like(r_R), r_R)


def seq_mean_se(x_R: torch.Tensor, seq_id_R: torch.Tensor) -> tuple[float, float]:
    """Token mean m = Σ_b X_b / Σ_b n_b of per-sequence sums X_b over n_b tokens, and its standard error
    se = sqrt(S/(S−1) Σ_b (X_b − m n_b)²) / Σ_b n_b (sequences independent, tokens within one correlated)."""
    n_seq = int(seq_id_R.max()) + 1
    sums = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_R, x_R.double())
    lens = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_R, torch.ones_like(x_R).double())
    m = (sums.sum() / lens.sum()).item()
    if n_seq < 2:
        return m, math.inf
    return m, (n_seq / (n_seq - 1) * ((sums - m * lens) ** 2).sum()).sqrt().item() / lens.sum().item()


FLAG_Z = 4.0  # standard errors a dump's statistic must stand from what correct columns give to be flagged


def padding_tokens(d: Dump) -> int:
    """Tokens in trailing runs of exact (0, 0) log-prob pairs, counted only where every sequence has one
    length and >= 2 sequences end in such a run of >= 2 tokens: rows zero-padded to a fixed length and not
    masked (each padded token reads as KL 0). A real sequence rarely ends in two tokens both sides are
    certain of to the last bit, and real sequences stop at different lengths."""
    lens = torch.bincount(d.seq_id_R)
    if len(lens) < 2 or bool((lens != lens[0]).any()):
        return 0
    zero_S_T = ((d.engine_R == 0) & (d.train_R == 0)).view(len(lens), -1)
    run_S = zero_S_T.flip(1).long().cumprod(1).sum(1)  # length of each sequence's trailing run
    return int(run_S.sum()) if int((run_S >= 2).sum()) >= 2 else 0


# The range a log-prob of a sampled token can take. A sampler draws from probabilities it holds in fp32 (or
# bf16), and the smallest positive fp32 is the subnormal 2^-149, so a drawn token's log-prob is at least
#     log(2^-149) = −149 log 2 = −103.28    (bf16: smallest subnormal 2^-133, log = −92.19).
# Below LOG_MIN_FP32 the value cannot come from either dtype's softmax. Between two such probabilities
#     |log π_e(v) − log π_t(v)| <= MAX_LOG_RATIO = −LOG_MIN_FP32 = 103.28 nats.
LOG_MIN_FP32 = -149 * math.log(2)
LOG_MIN_BF16 = -133 * math.log(2)
MAX_LOG_RATIO = -LOG_MIN_FP32
# An engine log-prob of exactly 0.0 at a kept token where the trainer's is below ZERO_TRAIN_LOGP (fewer than
# half the trainer's mass), on more than ZERO_FRACTION of the kept tokens, reads as a fill value.
ZERO_TRAIN_LOGP = math.log(0.5)
ZERO_FRACTION = 0.01


def engine_zero_tokens(d: Dump) -> int:
    """Kept tokens whose engine log-prob is exactly 0.0 while the trainer's is below log(1/2), in runs of two
    or more such tokens of one sequence.

    An fp32 log_softmax, z_y − max z − log Σ_v exp(z_v − max z), is exactly 0.0 only when the sum rounds to
    1, i.e. the other tokens hold under 2^-24 ≈ 6e-8 of the mass: π_e(y) > 1 − 6e-8. A trainer that gives the
    same token under 1/2 disagrees at that position by KL >= (1 − 6e-8)·log 2 ≈ 0.69 nats, from logits 16
    nats apart. A broken engine does that at single tokens: ours at weight noise σ = 1 (half the weights'
    power noise) ends 5% of its responses at once on an EOS it is that sure of (study/coverage.py's draws).
    Runs of such tokens are what a fill leaves: TRL sets the engine log-prob of every tool-result token to
    0.0, and a hook that drops `tool_mask` keeps the whole span (a tool's output is tens of tokens, so a
    dropped tool mask puts far more than ZERO_FRACTION = 1% of a tool-using run's tokens in such runs)."""
    zero_R = (d.engine_R == 0) & (d.train_R < ZERO_TRAIN_LOGP)
    pair_R = zero_R[1:] & zero_R[:-1] & (d.seq_id_R[1:] == d.seq_id_R[:-1])  # t and t + 1 both, one sequence
    run_R = torch.zeros_like(zero_R)
    run_R[1:] |= pair_R
    run_R[:-1] |= pair_R
    return int(run_R.sum())


def below_dtype_tokens(d: Dump) -> int:
    """Log-probs (either column, and the finite top-k entries) below LOG_MIN_FP32: no fp32 or bf16 softmax
    gives a drawn token such a probability, so the value is a fill (−1e4 for a masked slot, a −inf clipped)
    or another tensor's."""
    values = [d.engine_R, d.train_R]
    if d.top_engine_R_K is not None:
        values += [d.top_engine_R_K[torch.isfinite(d.top_engine_R_K)]]
        values += [d.top_train_R_K[torch.isfinite(d.top_train_R_K)]]
    return sum(int((v < LOG_MIN_FP32).sum()) for v in values)


def misread_lines(tokens: int, identical: bool, zeros: int, low: int) -> list[str]:
    """The lines of dump_flags' identical, zeros and range flags, each naming the field and the likely
    cause."""
    lines = []
    if identical:
        lines.append(
            f"identical: engine and trainer log-probs are equal at all {tokens} kept tokens, which reads KL "
            "0 whatever the engine did: the trainer's column is likely a copy of the engine's (verl in "
            "bypass mode copies rollout_log_probs into old_log_probs: set "
            "algorithm.rollout_correction.bypass_mode=false); a bitwise on-policy setup reads the same, "
            "and a dump cannot tell them apart"
        )
    if zeros > ZERO_FRACTION * tokens:
        lines.append(
            f"zeros: the engine log-prob is exactly 0.0 at {zeros} of {tokens} kept tokens, in runs, where "
            "the trainer gives each under 1/2: 0.0 written where the engine computed nothing, most likely "
            "tool-result tokens kept because the tool mask was dropped (TRL writes 0.0 there: save and "
            "apply tool_mask)"
        )
    if low:
        lines.append(
            f"range: {low} log-probs lie below log(2^-149) = {LOG_MIN_FP32:.2f}, the smallest that an fp32 "
            f"softmax gives a drawn token (bf16: {LOG_MIN_BF16:.2f}): a fill value for masked slots, a "
            "clipped -inf, or another tensor's values in a log-prob field"
        )
    return lines


def dump_flags(d: Dump) -> dict:
    """What makes a dump unreadable, with the statistics behind each flag (a line per raised flag, opening
    with the flag's name; "flags" lists the names):
    padding   padding_tokens > 0;
    columns   correct columns give E_e[ρ] = Σ_v π_t(v) = 1 and E_e[k1] = KL >= 0; swapped columns give
              E[ρ] = 1 + χ²(π_e ‖ π_t) > 1 and k1 = −KL, and so does an engine column that is not the
              distribution the tokens were drawn from (a sampling temperature or top-p applied on one side
              only, e.g. vLLM's raw log-probs beside a trainer at the sampling temperature). Flagged when
              the k1 mean lies FLAG_Z standard errors below 0, or the ρ mean FLAG_Z above 1;
    identical engine and trainer log-probs equal at every kept token: reads KL 0 with a zero-width
              interval whatever the engine did. verl in bypass mode copies rollout_log_probs into
              old_log_probs; a bitwise on-policy setup gives the same columns, and a dump cannot tell
              the two apart;
    zeros     engine_zero_tokens > ZERO_FRACTION of the kept tokens (a dropped tool mask);
    range     below_dtype_tokens > 0 (a log-prob below log(2^-149) = −103.28)."""
    r_R = d.engine_R - d.train_R
    k1, k1_se = seq_mean_se(r_R, d.seq_id_R)
    rho, rho_se = seq_mean_se(torch.exp(-r_R), d.seq_id_R)
    k1_z = k1 / k1_se if k1_se > 0 else 0.0
    rho_z = (rho - 1) / rho_se if rho_se > 0 else 0.0
    pad = padding_tokens(d)
    identical = bool(len(r_R)) and bool((d.engine_R == d.train_R).all())
    zeros, low = engine_zero_tokens(d), below_dtype_tokens(d)
    warnings = misread_lines(len(r_R), identical=identical, zeros=zeros, low=low)
    if pad:
        warnings.append(
            f"padding: {pad} of {len(r_R)} tokens sit in trailing runs with both log-probs exactly 0 in "
            "rows of one length: unmasked padding reads as KL 0 and lowers the estimate; mask it "
            "(.pt: mask 0; JSONL: leave the padded tokens out)"
        )
    if k1_z < -FLAG_Z or rho_z > FLAG_Z:
        warnings.append(
            f"columns: k1 = {k1:.3g} ({k1_z:+.1f} SE) and mean IS ratio {rho:.3g} ({rho_z:+.1f} SE from 1); "
            "correct columns give k1 >= 0 and ratio 1: engine and trainer columns swapped, or a temperature "
            "or top-p applied on one side only (both log-probs must be of the policies at temperature 1)"
        )
    flags = [w.split(":", 1)[0] for w in warnings]
    return {
        "padding_tokens": pad,
        "k1_z": k1_z,
        "ratio_z": rho_z,
        "identical_columns": identical,
        "engine_zero_tokens": zeros,
        "below_dtype_tokens": low,
        "flags": flags,
        "warnings": warnings,
    }


MISS_PROBABILITY = 0.05  # the chance blind_kl allows that every sampled token missed the hidden mass


def blind_kl(tokens: int, tail_mass: float | None = None) -> dict:
    """The KL(π_e ‖ π_t) per token that `tokens` sampled tokens cannot rule out, at 95%.

    An engine can put mass ε_t at position t on tokens no sample drew. All N draws (each from its own
    position's π_e) miss such mass with probability Π_t (1 − ε_t) <= (1 − ε̄)^N (AM-GM), so a mean mass
        ε = 1 − MISS_PROBABILITY^(1/N)   (≈ 3/N)
    or more is sampled at least once with probability >= 95%, and a mass below it can hide. Each unit of it
    carries at most L = MAX_LOG_RATIO = 103.28 nats (log π_e − log π_t of two probabilities fp32 can hold),
        hidden <= ε · L   nats/token.
    The rare-token engine of this bound: π_e(r) = ε on a token the trainer gives ε·e^−95 holds 94ε nats.
    With top-k rows the mass outside the logged set is known, m_e,t = 1 − Σ_{v∈S} π_e(v), and only it can
    hide: hidden <= L · min(ε, mean_t m_e,t) (`tail_mass` = that mean). Returns the bound and its parts."""
    eps = 1 - MISS_PROBABILITY ** (1 / tokens) if tokens else 1.0
    mass = eps if tail_mass is None else min(eps, tail_mass)
    return {
        "blind_kl": mass * MAX_LOG_RATIO,
        "blind_mass": mass,
        "blind_eps": eps,
        "blind_from": "top-k tail mass" if mass < eps else "sampled tokens",
    }


def tokens_to_see(kl: float) -> int | None:
    """The sampled tokens N whose blind_kl (no top-k) is below `kl`: (1 − ε)^N = 5% at ε = kl / L;
    None when no number of tokens gets there (kl <= 0)."""
    if kl <= 0:
        return None
    if kl >= MAX_LOG_RATIO:
        return 1
    return math.ceil(math.log(MISS_PROBABILITY) / math.log1p(-kl / MAX_LOG_RATIO))


COVERAGE_RULE = (
    "union: the interval spans the {est} and the k1 sequence-bootstrap 95% intervals (both unbiased for the "
    "KL; {est} alone under-covers when rare tokens with π_train ≫ π_engine are unsampled, k1 does not)"
)


def dump_estimate(d: Dump, seed: int = 0) -> dict:
    """The one scale from another system's dump: k3 per token (E[k3] under engine samples = the exact KL), or
    the top-k estimate when both sides logged top-k log-probs; the metrics beside; the readability flags;
    blind_kl, the KL its tokens cannot rule out.

    The interval (COVERAGE_RULE): [max(0, min(lo, lo_k1)), max(hi, hi_k1)] of the estimator's and
    k1_token_kl's sequence-bootstrap intervals (KL >= 0). The estimator's percentile interval alone misses
    the exact KL from above far more often than 2.5% on our own engine; the union does not
    (`python -m study coverage`, results/coverage.json; tests/test_coverage.py holds it on tiny)."""
    rho_R = torch.exp(d.train_R - d.engine_R)
    est_R, extra = rho_R - 1 - torch.log(rho_R), {"estimator": "k3"}
    if d.top_engine_R_K is not None:
        est_R, lower_R = topk_token_kl(d)
        extra = {
            "estimator": f"top-{d.top_engine_R_K.shape[1]} + k3 tail",
            "kl_lower_bound": lower_R.mean().item(),
        }
    tail = None
    if d.top_engine_R_K is not None:  # the engine's mass outside its logged top-k, per position
        tail = (1 - d.top_engine_R_K.exp().sum(-1)).clamp(min=0.0).mean().item()
    lo, hi = bootstrap_ci(est_R, d.seq_id_R, seed=seed)
    lo1, hi1 = bootstrap_ci(k1_token_kl(d), d.seq_id_R, seed=seed)
    return {
        "mismatch_kl": est_R.mean().item(),
        "ci_low": max(0.0, min(lo, lo1)),
        "ci_high": max(hi, hi1),
        "ci_estimator": [lo, hi],
        "ci_k1": [lo1, hi1],
        "coverage_rule": COVERAGE_RULE.format(est=extra["estimator"]),
        "tokens": len(est_R),
        "sequences": d.sequences,
        **extra,
        **blind_kl(len(est_R), tail_mass=tail),
        **sampled_token_metrics(d.engine_R, d.train_R, d.seq_id_R),
        **dump_flags(d),
    }
