"""Answers to notebook 01: the reverse KL of two rows, top-p filtering, the analytic OPD loss over a masked
batch, the sampled-token loss with TIS, tinker's loss (the sampler's advantage, importance-weighted), and
one training step."""

import torch

from rollout import positions


def my_reverse_kl(student_logits, teacher_logits):
    """Σ_v p_s(v) (log p_s(v) − log p_t(v)) for two logit rows [V]."""
    logp_s = torch.log_softmax(student_logits.float(), -1)
    logp_t = torch.log_softmax(teacher_logits.float(), -1)
    return (logp_s.exp() * (logp_s - logp_t)).sum(-1)


def my_top_p(logp, top_p):
    """Keep the smallest most-likely set whose mass reaches top_p; renormalise; −inf elsewhere."""
    sorted_logp, order = logp.sort(descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    keep = torch.zeros_like(logp, dtype=torch.bool)
    keep[order[mass_before < top_p]] = True
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - kept.logsumexp(-1)


def my_opd_loss(student_logits_B_T_V, teacher_logits_B_T_V, mask_B_T):
    """Token mean over the masked positions of KL_t = Σ_v p_s (log p_s − log p_t)."""
    logp_s_B_T_V = torch.log_softmax(student_logits_B_T_V.float(), -1)
    logp_t_B_T_V = torch.log_softmax(teacher_logits_B_T_V.float(), -1)
    kl_B_T = (logp_s_B_T_V.exp() * (logp_s_B_T_V - logp_t_B_T_V)).sum(-1)
    mask_B_T = mask_B_T.float()
    return (kl_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1)


def my_sampled_loss(student_logits_B_T_V, teacher_logits_B_T_V, y_B_T, logp_engine_B_T, mask_B_T, tis_cap):
    """−mean_t w_t A_t log p_s(y_t), A_t = −(log p_s(y_t) − log p_t(y_t)) detached,
    w_t = min(p_s(y_t)/π_engine(y_t), C) detached (1 when C <= 0)."""
    logp_s_B_T = torch.log_softmax(student_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    logp_t_B_T = torch.log_softmax(teacher_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    advantage_B_T = -(logp_s_B_T - logp_t_B_T).detach()
    w_B_T = torch.ones_like(logp_s_B_T)
    if tis_cap > 0:
        w_B_T = torch.exp(logp_s_B_T.detach() - logp_engine_B_T).clamp(max=tis_cap)
    mask_B_T = mask_B_T.float()
    return -(w_B_T * advantage_B_T * logp_s_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1)


def my_sampler_loss(student_logits_B_T_V, teacher_logits_B_T_V, y_B_T, logp_sampler_B_T, mask_B_T):
    """tinker's loss: −mean_t w_t A_t log p_s(y_t), A_t = −(log π_sampler(y_t) − log p_t(y_t)) (the sampler's
    log-prob, not the trainer's), w_t = p_s(y_t)/π_sampler(y_t) uncapped; A_t and w_t detached."""
    logp_s_B_T = torch.log_softmax(student_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    logp_t_B_T = torch.log_softmax(teacher_logits_B_T_V.float(), -1).gather(-1, y_B_T[..., None]).squeeze(-1)
    advantage_B_T = -(logp_sampler_B_T - logp_t_B_T).detach()
    w_B_T = torch.exp(logp_s_B_T.detach() - logp_sampler_B_T)
    mask_B_T = mask_B_T.float()
    return -(w_B_T * advantage_B_T * logp_s_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1)


def my_train_step(student, teacher, ro, optimizer, lr, loss_fn=my_opd_loss):
    """One OPD step on the rollout ro: score with both models, the analytic loss, clip at 1, step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs = {
        "input_ids": ro.tokens,
        "attention_mask": ro.attention_mask,
        "position_ids": positions(ro.attention_mask),  # the prompts are left-padded
    }
    student.eval()  # no dropout: the sampled policy is the trained one
    student_logits_B_T_V = student(**inputs).logits[:, :-1]  # position t predicts token t + 1
    with torch.no_grad():
        teacher_logits_B_T_V = teacher(**inputs).logits[:, :-1]
    loss = loss_fn(student_logits_B_T_V, teacher_logits_B_T_V, ro.targets())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), max_norm=1.0)
    optimizer.step()
    return loss.item()
