"""The OPD loss: per-token reverse KL to the teacher on the student's own samples, and what rides along.

    KL_t = Σ_v p_s(v | x_<t) (log p_s(v | x_<t) − log p_t(v | x_<t)),   loss = mean over response tokens

estimated in one of three ways, each treating every token's prefix as fixed (the usual OPD recipe):
    analytic  the full-vocabulary sum above, gradient through the student's logits (TRL GKD, beta=1);
    sampled   the sampled token alone, a policy gradient with the trainer's log-prob in the advantage:
                  A_t = −(log π_train(y_t | x_<t) − log p_t(y_t | x_<t)),
                  loss = −mean_t w_t · A_t · log π_train(y_t | x_<t)   (A_t and w_t detached);
    sampler   the same, with the sampler's (engine's) log-prob in the advantage, as tinker-cookbook's
              incorporate_kl_penalty computes it: A_t = −(log π_engine(y_t) − log p_t(y_t)).
              With tis_cap = inf this is tinker's recipe: its `importance_sampling` loss weighs each term
              by the uncapped ratio π_train(y_t)/π_engine(y_t).
w_t = min(π_train(y_t)/π_engine(y_t), C) for tis_cap C > 0 (C = inf: the uncapped ratio), else 1.
center (sampled and sampler) subtracts a baseline b = the batch's mean advantage (detached) from every
A_t: loss = −mean_t w_t (A_t − b) log π_train(y_t), the standard variance reduction of a policy gradient
(tinker-cookbook's RL KL penalty centres its advantages so; its distillation recipe does not).
Expected gradients under engine samples y ~ π_e, with p = π_train, t = the teacher, ∇ = ∇ log p(y):
    analytic  ∇ KL(p ‖ t) whatever π_e is (π_e only chooses the prefixes);
    sampled   Σ_y π_e(y) w(y) (log p − log t)(y) ∇;   = ∇ KL(p ‖ t) when π_e = p, or when w = p/π_e;
    sampler   Σ_y π_e(y) w(y) (log π_e − log t)(y) ∇; with w = p/π_e: Σ_y p(y)(log π_e − log t)(y) ∇,
              which is ∇ KL(p ‖ t) only when π_e = p: the engine's error enters every advantage.
    a baseline b (a constant) adds  b Σ_y π_e(y) w(y) ∇, which is −b ∇ KL(π_e ‖ p) when w = 1, and 0 when
              π_e = p or w = p/π_e (Σ_y p(y) ∇ log p(y) = 0): unbiased on-policy. Off-policy with w = 1, the
              uncentred gradient is the centred one plus b ∇ KL(π_e ‖ p); with b ≈ E[A] < 0 (the student
              is above the teacher's log-prob on its own samples), descending it pushes p away from the
              engine's policy, every sampled token down. Centring removes that term.
estimator "grpo" is the RL baseline's loss (rl.py): one advantage per response in place of the teacher's
per-token signal. The analytic loss equals
TRL's generalized_jsd_loss(beta=1) (token mean over response tokens).

The same student forward also gives the one scale, detached: KL(π_engine ‖ π_student) at every response token
from the distributions the engine recorded while sampling (kl.token_kl), so a step runs one student
forward+backward, one teacher forward and the engine's decode, nothing else.
"""

from functools import partial

import torch
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from kl import token_kl
from models import head
from rollout import response_hidden

ESTIMATORS = ("analytic", "sampled", "sampler", "grpo")
RECOMPUTE_BYTES = 2 * 2**30


def reverse_kl_terms(student_logits_N_V: torch.Tensor, teacher_logits_N_V: torch.Tensor, y_N: torch.Tensor):
    """For N scored positions: exact KL_n = Σ_v p_s(v)(log p_s(v) − log p_t(v)), log p_s(y_n),
    log p_t(y_n)."""
    logp_s_N_V = torch.log_softmax(student_logits_N_V.float(), -1)
    logp_t_N_V = torch.log_softmax(teacher_logits_N_V.float(), -1)
    kl_N = (logp_s_N_V.exp() * (logp_s_N_V - logp_t_N_V)).sum(-1)
    return kl_N, pick(logp_s_N_V, y_N), pick(logp_t_N_V, y_N)


def pick(logp_N_V: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
    """logp_N_V[n, y_n]: the log-prob of each sampled token."""
    return logp_N_V.gather(-1, y_N[:, None]).squeeze(-1)


def tis_weights(logp_train_N: torch.Tensor, logp_engine_N: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance sampling: w_t = min(π_train(y_t) / π_engine(y_t), cap), detached.

    It reweights each sampled token's loss term towards what the trainer's policy would have sampled,
    correcting the per-token part of the mismatch (not the prefix shift). cap <= 0 means no correction;
    cap = inf, the full importance ratio (tinker-cookbook's importance_sampling loss).
    """
    if cap <= 0:
        return torch.ones_like(logp_train_N)
    return torch.exp(logp_train_N.detach() - logp_engine_N).clamp(max=cap)


def sampled_terms(
    logp_s_C: torch.Tensor,
    logp_t_C: torch.Tensor,
    logp_e_C: torch.Tensor,
    *,
    estimator: str,
    tis_cap: float,
    adv_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sampled token's loss term −w_t · A_t · log π_train(y_t) (see the module docstring), from the
    log-probs of the sampled tokens under the trainer, the teacher and the engine; adv_C for "grpo"."""
    adv_C = advantage(logp_s_C, logp_t_C, logp_e_C, estimator=estimator, adv_C=adv_C)
    return -(tis_weights(logp_s_C, logp_e_C, tis_cap) * adv_C * logp_s_C)


def advantage(logp_s_C, logp_t_C, logp_e_C, *, estimator: str, adv_C=None) -> torch.Tensor:
    """Each sampled token's advantage A_t (detached: the gradient flows through log π_train(y_t) only)."""
    if estimator == "grpo":
        return adv_C
    logp_C = logp_s_C if estimator == "sampled" else logp_e_C  # the trainer's or the sampler's log-prob
    return -(logp_C - logp_t_C).detach()


def must_recompute(n_tokens: int, vocab: int) -> bool:
    """Recompute the vocabulary-sized chunks in backward only when keeping them (about six [N, V] fp32
    tensors live until backward) would pass RECOMPUTE_BYTES: smollm2's 400 tokens keep 0.5 GB and skip the
    recomputation (and its second output-head product); gemma3's 262k vocabulary recomputes."""
    return 6 * 4 * n_tokens * vocab > RECOMPUTE_BYTES


def chunk_terms(h_s_C_H, h_t_C_H, y_C, logp_e_C, adv_C, *, student, teacher, estimator: str, tis_cap: float):
    """One chunk of response tokens: (Σ loss terms, Σ −w·log π_train(y) (the baseline's multiplier),
    Σ A_t (detached), Σ exact KL_t (detached), the student's logits (detached)). Module level, so that
    torch.utils.checkpoint can recompute it in backward."""
    with torch.no_grad(), record_function("teacher forward"):
        teacher_logits_C_V = head(teacher, h_t_C_H)
    with record_function("student forward"):
        student_logits_C_V = head(student, h_s_C_H)
    kl_C, logp_s_C, logp_t_C = reverse_kl_terms(student_logits_C_V, teacher_logits_C_V, y_C)
    if estimator == "analytic":
        objective, score, adv = kl_C.sum(), torch.zeros(()), torch.zeros(())
    else:  # sampled_terms, with w and A kept for the baseline's sums
        w_C = tis_weights(logp_s_C, logp_e_C, tis_cap)
        a_C = advantage(logp_s_C, logp_t_C, logp_e_C, estimator=estimator, adv_C=adv_C)
        objective, score, adv = -(w_C * a_C * logp_s_C).sum(), -(w_C * logp_s_C).sum(), a_C.sum()
    # The detached logits leave the checkpointed region once, for the mismatch; the backward pass
    # recomputes them for the gradient anyway.
    return objective, score, adv.detach(), kl_C.detach().sum(), student_logits_C_V.detach()


def opd_loss(
    student,
    teacher,
    rollout,
    *,
    estimator: str = "analytic",
    chunk: int = 256,
    tis_cap: float = 0.0,
    center: bool = False,
    advantages_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The OPD loss over all response tokens of `rollout` (token mean), and its statistics.

    tis_cap > 0 (sampled, sampler and grpo) multiplies each token's term by tis_weights. The analytic loss
    needs no such correction: it sums over the whole vocabulary at each prefix, so how the engine drew y_t
    does not enter the term at t; only the prefixes it visits do (prefix shift). TIS assumes temperature 1,
    top-p 1. center (sampled, sampler) centres the advantages on the batch's mean: since
    −w(A − b) log p = −w·A·log p + b·w·log p, the loss is (Σ terms − b·Σ score) / N, one pass over chunks.

    Vocabulary-sized logits are formed `chunk` tokens at a time, recomputed in backward when must_recompute.
    stats: rkl = mean exact KL(p_s ‖ p_t) per token (whatever the estimator), tokens = N, mismatch_N =
    exact KL(π_engine ‖ π_student) per token (float64) when the rollout carries engine_logits, else None,
    and advantage_mean = the batch's mean advantage b (0 for the analytic loss).
    """
    with record_function("student forward"):  # named ranges: tools/bench_step.py times each phase
        h_s_N_H, y_N = response_hidden(student, rollout)
    with torch.no_grad(), record_function("teacher forward"):
        h_t_N_H, _ = response_hidden(teacher, rollout)
    target_B_T = rollout.targets()
    logp_engine_N = rollout.logprobs[:, 1:][target_B_T]  # same order as y_N
    n = len(y_N)
    adv_N = torch.zeros(n, device=y_N.device)
    if advantages_B is not None:  # each response's advantage, repeated over its tokens
        adv_N = advantages_B.to(y_N.device)[:, None].expand_as(target_B_T)[target_B_T]
    terms = partial(chunk_terms, student=student, teacher=teacher, estimator=estimator, tis_cap=tis_cap)
    recompute = torch.is_grad_enabled() and must_recompute(n, student.get_output_embeddings().weight.shape[0])
    sums, mismatch = [torch.zeros((), device=y_N.device)] * 4, []  # Σ terms, Σ score, Σ A, Σ KL
    for i in range(0, n, chunk):
        part = slice(i, i + chunk)
        args = (h_s_N_H[part], h_t_N_H[part], y_N[part], logp_engine_N[part], adv_N[part])
        *parts, student_logits_C_V = (
            checkpoint(terms, *args, use_reentrant=False) if recompute else terms(*args)
        )
        if rollout.engine_logits is not None:
            with record_function("mismatch KL"):
                mismatch.append(token_kl(rollout.engine_logits[part], student_logits_C_V))
        del student_logits_C_V
        sums = [s + p.to(s.device) for s, p in zip(sums, parts)]
    objective, score, adv_sum, kl_sum = sums
    b = adv_sum / max(n, 1) if center else torch.zeros(())
    loss = (objective - b * score) / max(n, 1)
    mismatch_N = torch.cat(mismatch) if rollout.engine_logits is not None and n else None
    stats = {"rkl": kl_sum.item() / max(n, 1), "tokens": n, "mismatch_N": mismatch_N}
    return loss, {**stats, "advantage_mean": adv_sum.item() / max(n, 1)}
