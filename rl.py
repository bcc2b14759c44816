"""The RL baseline: GRPO-style policy gradient with a verifiable reward, through the same rollout engine.

OPD gets a dense signal (the teacher's log-probs at every token); RL gets one number per response. This
module holds the two pieces that differ from OPD; the loss itself runs through loss.opd_loss
(estimator "grpo"), so both see the same engine, the same batches and the same TIS option.

    reward       r_i = 1 if response i (stripped) equals its prompt's answer exactly, else 0
    advantage    per prompt g with G responses (a group):
                     A_gi = (r_gi − mean_j r_gj) / (std_j r_gj + eps)     std over the group (1/G)
                 a group whose responses all score the same has A = 0: it carries no signal
    loss         −(1/N) Σ_i Σ_t w_it · A_i · log π_train(y_it | x_<t)
                     token mean over the N response tokens
    TIS          w_it = min(π_train(y_it)/π_engine(y_it), C) with --tis-cap C; 1 when off

One gradient step is taken per batch, so GRPO's ratio π_θ/π_old equals 1 at the step and its clipping never
acts; it is left out. There is no KL penalty to a reference model (β = 0), as in recent GRPO recipes.
"""

import torch


def exact_match_rewards(responses: list[str], answers: list[str]) -> torch.Tensor:
    """r_B: 1.0 where the stripped response equals the answer, else 0.0."""
    return torch.tensor([float(r.strip() == a) for r, a in zip(responses, answers, strict=True)])


def group_advantages(rewards_B: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """A_B: rewards normalised within consecutive groups of `group` responses to the same prompt."""
    if rewards_B.numel() % group:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group}")
    r_G_S = rewards_B.float().view(-1, group)  # [prompts, samples per prompt]
    mean_G_1 = r_G_S.mean(1, keepdim=True)
    std_G_1 = r_G_S.std(1, keepdim=True, correction=0)
    return ((r_G_S - mean_G_1) / (std_G_1 + eps)).view(-1)
