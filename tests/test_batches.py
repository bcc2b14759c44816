"""batches.py: a step's batch depends only on (seed, step) and the served weights; one-step-off async mode
draws the batches sync mode with staleness + 1 draws. A few steps of the tiny pair, 2 prompts × 2 samples,
with a fixed perturbation of the student standing in for each optimizer update."""

import copy

import pytest
import torch

from batches import Batches, make_engine
from lab.train_args import TrainConfig
from rollout import RolloutConfig

STEPS = 3


def config(staleness: int = 0, async_rollout: bool = False, seed: int = 0) -> TrainConfig:
    rollout = RolloutConfig(max_new_tokens=6, staleness=staleness)
    return TrainConfig(
        pair="tiny",
        steps=STEPS,
        batch_size=2,
        samples_per_prompt=2,
        seed=seed,
        async_rollout=async_rollout,
        rollout=rollout,
    )


def update(student, step: int) -> None:
    """A stand-in for step's optimizer update: a fixed small change of every weight, seeded by the step."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=gen))


def draw(pair, cfg: TrainConfig, steps=range(1, STEPS + 1)) -> list:
    """(rollout, prompts) of each step, driven as train.train_step drives Batches: get, prefetch, update."""
    student = copy.deepcopy(pair.student)
    batches = Batches(pair, make_engine(pair, cfg), cfg, "cpu")
    out = []
    try:
        for step in steps:
            out.append(batches.get(student, step))
            batches.prefetch(student, step)
            update(student, step)
    finally:
        batches.close()
    return out


def same(a, b) -> bool:
    (ra, pa), (rb, pb) = a, b
    same_rows = torch.equal(ra.tokens, rb.tokens) and torch.equal(ra.logprobs, rb.logprobs)
    return pa == pb and ra.version == rb.version and same_rows


def test_the_same_seed_and_step_give_the_same_batch(tiny_pair):
    """Twice from scratch, and a step drawn alone (as a resumed run draws it) equals the same step drawn in
    sequence; another seed or step draws another batch."""
    first, again = draw(tiny_pair, config()), draw(tiny_pair, config())
    assert all(same(a, b) for a, b in zip(first, again))
    assert [r.version for r, _ in first] == [0, 1, 2]
    assert not same(first[0], first[1]) and not same(first[0], draw(tiny_pair, config(seed=1), [1])[0])
    rows = config().batch_size * config().samples_per_prompt
    assert len(first[0][1]) == rows == len(first[0][0].tokens)
    prompts = first[0][1]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3], "a prompt's samples are consecutive rows"


@pytest.mark.parametrize("staleness", [0, 1])
def test_async_draws_the_batches_of_sync_with_one_more_step_of_staleness(tiny_pair, staleness):
    """At step s, async mode samples from the weights entering step s − 1 (version max(s − 2 − k, 0)): the
    batch sync mode with staleness k + 1 draws, and not the batch sync mode with staleness k draws."""
    asyn = draw(tiny_pair, config(staleness=staleness, async_rollout=True))
    twin = draw(tiny_pair, config(staleness=staleness + 1))
    assert [r.version for r, _ in asyn] == [max(s - 2 - staleness, 0) for s in range(1, STEPS + 1)]
    assert all(same(a, b) for a, b in zip(asyn, twin))
    sync = draw(tiny_pair, config(staleness=staleness))
    assert not same(asyn[-1], sync[-1]), "the async batch really is one version staler"
