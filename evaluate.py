"""Held-out evaluation of the student: exact reverse KL to the teacher on fresh samples, and, when the prompts
have answers (tiny), the exact-match rate of those samples and greedy accuracy.

`cfg` below is a lab.train_args.TrainConfig (eval_prompts, kl_chunk, seed, rollout).
"""

import torch

from batches import step_generator
from config import MAX_NEW_TOKENS
from loss import opd_loss
from models import Prompt, format_prompt
from rl import exact_match_rewards
from rollout import RolloutConfig, generate


def exact_match_accuracy(
    model, tokenizer, problems: list[Prompt], max_new_tokens: int = MAX_NEW_TOKENS["tiny"]
) -> float:
    """Exact-match accuracy of greedy answers (real decoding through our sampler, no teacher forcing); the
    response length defaults to the tiny pair's, whose answers are short sums."""
    texts = [format_prompt(tokenizer, p.text) for p in problems]
    rollout = generate(
        model, tokenizer, texts, cfg=RolloutConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    rewards = exact_match_rewards(rollout.responses(tokenizer), [p.answer for p in problems])
    return rewards.sum().item() / len(problems)


@torch.no_grad()
def evaluate(pair, cfg, device) -> dict:
    """Held-out quality: exact reverse KL of fresh student samples (fixed seed, temperature 1); when the
    prompts have answers, also the exact-match rate of those samples (eval_reward: what the RL baseline
    maximises) and greedy accuracy (eval_acc)."""
    pair.student.eval()
    prompts = pair.eval_prompts[: cfg.eval_prompts]
    texts = [format_prompt(pair.tokenizer, p.text) for p in prompts]
    gen = step_generator(cfg.seed + 7919, 0, device)
    rollout = generate(pair.student, pair.tokenizer, texts, cfg=cfg.rollout, generator=gen)
    _, stats = opd_loss(pair.student, pair.teacher, rollout, chunk=cfg.kl_chunk)
    result = {"eval_rkl": stats["rkl"]}
    if all(p.answer is not None for p in prompts):
        answers = [p.answer for p in prompts]
        result["eval_reward"] = exact_match_rewards(rollout.responses(pair.tokenizer), answers).mean().item()
        n_new = cfg.rollout.max_new_tokens
        result["eval_acc"] = exact_match_accuracy(pair.student, pair.tokenizer, prompts, max_new_tokens=n_new)
    return result
