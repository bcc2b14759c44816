"""The RL baseline (rl.py and opd_loss's grpo estimator) against direct computations."""

import statistics

import pytest
import torch
from conftest import assert_close

from engine import RolloutEngine
from loss import opd_loss
from models import format_prompt, tiny_problems
from rl import exact_match_rewards, group_advantages
from rollout import RolloutConfig, positions


def test_exact_match_rewards():
    assert exact_match_rewards([" 12", "13", "1"], ["12", "12", "1"]).tolist() == [1.0, 0.0, 1.0]


def test_group_advantages_equal_direct_computation():
    torch.manual_seed(0)
    rewards = (torch.rand(24) < 0.4).float()
    adv = group_advantages(rewards, group=4)
    for g in range(6):
        r = rewards[4 * g : 4 * g + 4].tolist()
        mean, std = statistics.fmean(r), statistics.pstdev(r)
        expected = torch.tensor([(x - mean) / (std + 1e-6) for x in r])
        assert_close(adv[4 * g : 4 * g + 4], expected, atol=1e-5, what=f"group {g}")


def test_group_advantages_zero_for_uniform_groups_and_bad_sizes():
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), group=2)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # all-right and all-wrong groups carry no signal
    assert adv[4] > 0 > adv[5] and abs(adv[4] + adv[5]) < 1e-6
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.ones(6), group=4)


def test_grpo_loss_equals_direct_computation(tiny_pair):
    """−mean_t w_t · A_i · log p_s(y_t), with and without TIS, from full logits of a noisy engine's batch."""
    engine = RolloutEngine(tiny_pair.student, tiny_pair.tokenizer, RolloutConfig(max_new_tokens=6, noise=0.2))
    engine.sync(tiny_pair.student, 0)
    problems = [p for p in tiny_problems(4, seed=3, held_out=False) for _ in range(3)]
    rollout = engine.generate(
        [format_prompt(tiny_pair.tokenizer, p.text) for p in problems],
        generator=torch.Generator().manual_seed(1),
    )
    adv_B = torch.randn(len(problems))
    kw = dict(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
    )
    logp_s_B_T = (
        torch.log_softmax(tiny_pair.student(**kw).logits[:, :-1], -1)
        .gather(-1, rollout.tokens[:, 1:, None])
        .squeeze(-1)
    )
    mask_B_T = rollout.response_mask[:, 1:].float()
    for cap in (0.0, 1.5):
        w_B_T = (
            (logp_s_B_T.detach() - rollout.logprobs[:, 1:]).exp().clamp(max=cap)
            if cap
            else torch.ones_like(mask_B_T)
        )
        expected = -(w_B_T * adv_B[:, None] * logp_s_B_T * mask_B_T).sum() / mask_B_T.sum()
        (g_expected,) = torch.autograd.grad(
            expected, tiny_pair.student.model.layers[0].mlp.up_proj.weight, retain_graph=True
        )
        loss, _ = opd_loss(
            tiny_pair.student,
            tiny_pair.teacher,
            rollout,
            estimator="grpo",
            tis_cap=cap,
            advantages_B=adv_B,
            chunk=5,
        )
        (g,) = torch.autograd.grad(loss, tiny_pair.student.model.layers[0].mlp.up_proj.weight)
        assert_close(loss, expected, atol=1e-5, what=f"grpo loss, cap {cap}")
        assert_close(g, g_expected, atol=1e-5, what=f"grpo gradient, cap {cap}")
