"""The OPD loss against direct computations."""

import pytest
import torch
from conftest import assert_close

from loss import opd_loss, reverse_kl_terms
from models import format_prompt, tiny_problems
from rollout import RolloutConfig, generate


def direct_kl(p_s: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """KL(p_s ‖ p_t) from the definition, one row at a time."""
    return torch.stack([sum(a * (a.log() - b.log()) for a, b in zip(rs, rt)) for rs, rt in zip(p_s, p_t)])


def test_analytic_kl_equals_direct_computation():
    torch.manual_seed(0)
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    y = torch.randint(7, (5,))
    kl, logp_s, logp_t = reverse_kl_terms(s, t, y)
    assert_close(kl, direct_kl(s.softmax(-1).double(), t.softmax(-1).double()), atol=1e-6, what="KL")
    assert_close(logp_s, s.softmax(-1)[torch.arange(5), y].log(), atol=1e-6, what="log p_s(y)")
    assert_close(logp_t, t.softmax(-1)[torch.arange(5), y].log(), atol=1e-6, what="log p_t(y)")
    # Reverse KL, not forward: swapping the arguments changes the value.
    assert not torch.allclose(kl, reverse_kl_terms(t, s, y)[0])


def test_kl_zero_for_identical_distributions():
    s = torch.randn(4, 11)
    kl, _, _ = reverse_kl_terms(s, s.clone(), torch.zeros(4, dtype=torch.long))
    assert_close(kl, torch.zeros(4), atol=1e-6, what="KL(p ‖ p)")


def test_sampled_estimator_expectation_matches_analytic():
    """Enumerate every token of a small vocabulary: E_{y~p_s}[value] and E[gradient] match the analytic KL."""
    torch.manual_seed(1)
    V = 6
    teacher = torch.randn(1, V)
    student = torch.randn(1, V, requires_grad=True)
    kl, _, _ = reverse_kl_terms(student, teacher, torch.zeros(1, dtype=torch.long))
    (grad_analytic,) = torch.autograd.grad(kl.sum(), student)

    p_s = student.detach().softmax(-1)[0]
    value, grad = torch.zeros(()), torch.zeros(1, V)
    for y in range(V):
        _, logp_s, logp_t = reverse_kl_terms(student, teacher, torch.tensor([y]))
        advantage = -(logp_s - logp_t).detach()
        surrogate = -(advantage * logp_s).sum()  # the sampled-token loss for this y
        (g,) = torch.autograd.grad(surrogate, student)
        value += p_s[y] * (logp_s - logp_t).detach().sum()  # k1 estimate of KL
        grad += p_s[y] * g
    assert_close(value, kl.detach().sum(), atol=1e-6, what="E[k1] vs KL")
    assert_close(grad, grad_analytic, atol=1e-6, what="E[policy gradient] vs analytic gradient")


def batch_rollout(pair, n=6, seed=0):
    prompts = [format_prompt(pair.tokenizer, p.text) for p in tiny_problems(n, seed=seed, held_out=False)]
    return generate(
        pair.student,
        pair.tokenizer,
        prompts,
        RolloutConfig(max_new_tokens=6),
        generator=torch.Generator().manual_seed(seed),
    )


def direct_opd_loss(student, teacher, rollout):
    """Oracle: full logits of both models, KL at every position, masked token mean."""
    kw = dict(input_ids=rollout.tokens, attention_mask=rollout.attention_mask)
    from rollout import positions

    kw["position_ids"] = positions(rollout.attention_mask)
    logp_s = torch.log_softmax(student(**kw).logits[:, :-1], -1)
    with torch.no_grad():
        logp_t = torch.log_softmax(teacher(**kw).logits[:, :-1], -1)
    kl_B_T = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    mask = rollout.response_mask[:, 1:].float()
    return (kl_B_T * mask).sum() / mask.sum()


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_chunked_loss_and_gradient_equal_direct(tiny_pair, monkeypatch, recompute):
    """Both memory plans (chunks kept until backward, or recomputed in it) give the direct loss and gradient."""
    import loss as loss_module

    monkeypatch.setattr(loss_module, "RECOMPUTE_BYTES", 0 if recompute else 2**62)
    rollout = batch_rollout(tiny_pair)
    student = tiny_pair.student
    expected = direct_opd_loss(student, tiny_pair.teacher, rollout)
    (g_expected,) = torch.autograd.grad(expected, student.model.layers[0].mlp.up_proj.weight)
    for chunk in (3, 1000):  # many small chunks, and one chunk holding everything
        loss, stats = opd_loss(student, tiny_pair.teacher, rollout, chunk=chunk)
        (g,) = torch.autograd.grad(loss, student.model.layers[0].mlp.up_proj.weight)
        assert_close(loss, expected, atol=1e-5, what=f"loss, chunk {chunk}")
        assert_close(g, g_expected, atol=1e-5, what=f"gradient, chunk {chunk}")
        assert abs(stats["rkl"] - expected.item()) < 1e-5
        assert stats["tokens"] == int(rollout.response_mask.sum())


def test_loss_zero_when_student_is_teacher(tiny_pair):
    rollout = batch_rollout(tiny_pair)
    loss, stats = opd_loss(tiny_pair.teacher, tiny_pair.teacher, rollout)
    assert abs(loss.item()) < 1e-6 and abs(stats["rkl"]) < 1e-6


def test_tis_weights_and_weighted_loss_equal_direct_computation(tiny_pair):
    from engine import RolloutEngine
    from loss import tis_weights
    from rollout import positions

    assert_close(
        tis_weights(torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-1.0, -1.0, -1.0]), cap=2.0),
        torch.tensor([2.0, 1.0, torch.e**-2]),
        atol=1e-6,
        what="min(p_train/p_engine, C)",
    )
    assert torch.equal(tis_weights(torch.zeros(3), torch.ones(3), cap=0), torch.ones(3))

    engine = RolloutEngine(tiny_pair.student, tiny_pair.tokenizer, RolloutConfig(max_new_tokens=6, noise=0.2))
    engine.sync(tiny_pair.student, 0)
    prompts = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_problems(8, seed=0, held_out=False)]
    rollout = engine.generate(prompts, generator=torch.Generator().manual_seed(0))
    kw = dict(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
    )
    with torch.no_grad():
        logp_s = torch.log_softmax(tiny_pair.student(**kw).logits[:, :-1], -1)
        logp_t = torch.log_softmax(tiny_pair.teacher(**kw).logits[:, :-1], -1)
    mask = rollout.response_mask[:, 1:].bool()
    pick = lambda logp: logp.gather(-1, rollout.tokens[:, 1:, None]).squeeze(-1)[mask]  # noqa: E731
    logp_s_y, logp_t_y = pick(logp_s), pick(logp_t)
    w = (logp_s_y - rollout.logprobs[:, 1:][mask]).exp().clamp(max=1.5)
    assert (w < 1.5).any() and (w == 1.5).any(), (
        "the noisy engine should give weights on both sides of the cap"
    )
    with torch.no_grad():
        loss, _ = opd_loss(
            tiny_pair.student, tiny_pair.teacher, rollout, estimator="sampled", tis_cap=1.5, chunk=7
        )
    surrogate = -(w * -(logp_s_y - logp_t_y) * logp_s_y).mean()
    assert_close(loss, surrogate, atol=1e-5, what="TIS-weighted sampled-token loss")


def expected_gradient(student, teacher, engine, estimator: str, tis_cap: float) -> torch.Tensor:
    """E_{y ~ π_engine}[∇ of loss.sampled_terms], by enumerating every token of a small vocabulary."""
    from loss import sampled_terms

    q = engine.softmax(-1)[0]
    logq = engine.log_softmax(-1)[0]
    grad = torch.zeros_like(student)
    for y in range(student.shape[1]):
        _, logp_s, logp_t = reverse_kl_terms(student, teacher, torch.tensor([y]))
        term = sampled_terms(logp_s, logp_t, logq[y : y + 1], estimator=estimator, tis_cap=tis_cap)
        (g,) = torch.autograd.grad(term.sum(), student)
        grad += q[y] * g
    return grad


ESTIMATOR_CASES = [("sampled", 0.0), ("sampled", 2.0), ("sampled", float("inf")), ("sampler", float("inf"))]


@pytest.mark.parametrize("estimator, cap", ESTIMATOR_CASES)
def test_every_sampled_estimator_is_unbiased_without_mismatch(estimator, cap):
    """Engine = trainer: each sampled-token estimator's expected gradient is the analytic one."""
    torch.manual_seed(2)
    teacher, student = torch.randn(1, 6), torch.randn(1, 6, requires_grad=True)
    (analytic,) = torch.autograd.grad(
        reverse_kl_terms(student, teacher, torch.zeros(1).long())[0].sum(), student
    )
    grad = expected_gradient(student, teacher, student.detach(), estimator=estimator, tis_cap=cap)
    assert_close(grad, analytic, atol=1e-6, what=f"{estimator} cap {cap}: E[gradient] vs analytic")


def test_without_mismatch_three_sampled_estimators_are_one_gradient_sample_by_sample():
    """Engine = trainer (log π_engine = log π_train): the uncorrected, TIS-capped and tinker's estimators
    give the same loss term and gradient for every sampled token, not only in expectation (w = 1, and the
    sampler's log-prob is the trainer's), so their clean runs differ by rounding alone (`study lr`)."""
    from loss import sampled_terms

    torch.manual_seed(3)
    logp_s_C, logp_t_C = -torch.rand(32) * 4, -torch.rand(32) * 4
    out = []
    for estimator, cap in [("sampled", 0.0), ("sampled", 2.0), ("sampler", float("inf"))]:
        logp = logp_s_C.clone().requires_grad_()
        terms = sampled_terms(logp, logp_t_C, logp_s_C, estimator=estimator, tis_cap=cap)
        (grad,) = torch.autograd.grad(terms.sum(), logp)
        out.append((terms.detach(), grad))
    for terms, grad in out[1:]:
        assert torch.equal(terms, out[0][0]) and torch.equal(grad, out[0][1])
    # an engine log-prob 1e-3 off: the three part, so a clean run's rounding can separate their runs
    terms = sampled_terms(logp_s_C, logp_t_C, logp_s_C + 1e-3, estimator="sampler", tis_cap=float("inf"))
    assert not torch.equal(terms, out[0][0])


def test_a_mismatched_engine_biases_each_estimator_as_its_formula_says():
    """A fixed engine π_e ≠ π_train: the expected gradients follow loss.py's formulas, and they differ.
    Full IS (sampled, cap inf) removes the per-token bias; tinker's sampler-IS keeps log π_e in the
    advantage, so the engine's error enters every term; without IS the sampled estimator is biased too."""
    torch.manual_seed(3)
    teacher, student = torch.randn(1, 6), torch.randn(1, 6, requires_grad=True)
    engine = student.detach() + 0.8 * torch.randn(1, 6)
    (analytic,) = torch.autograd.grad(
        reverse_kl_terms(student, teacher, torch.zeros(1).long())[0].sum(), student
    )
    p, q = student.softmax(-1)[0], engine.softmax(-1)[0]
    logp, logq, logt = student.log_softmax(-1)[0], engine.log_softmax(-1)[0], teacher.log_softmax(-1)[0]
    # closed forms: Σ_y weight(y) · ∇ log p(y), ∇ log p(y) = e_y − p
    eye = torch.eye(6)

    def closed(weight_V):
        return (weight_V.detach()[:, None] * (eye - p.detach())).sum(0, keepdim=True)

    grads = {case: expected_gradient(student, teacher, engine, *case) for case in ESTIMATOR_CASES}
    assert_close(grads[("sampled", 0.0)], closed(q * (logp - logt)), atol=1e-6, what="sampled, no IS")
    assert_close(grads[("sampled", float("inf"))], analytic, atol=1e-6, what="sampled, full IS")
    assert_close(grads[("sampler", float("inf"))], closed(p * (logq - logt)), atol=1e-6, what="sampler-IS")
    capped = torch.minimum(p / q, torch.tensor(2.0))
    assert_close(
        grads[("sampled", 2.0)], closed(q * capped * (logp - logt)), atol=1e-6, what="sampled, TIS 2"
    )
    gap = {case: (g - analytic).norm().item() for case, g in grads.items()}
    assert gap[("sampled", 0.0)] > 0.05 and gap[("sampler", float("inf"))] > 0.05, gap


def enumerated_gradient(student, teacher, engine_logp, *, estimator, weights, b):
    """E_{y~π_e}[∇ of one token's loss term −w(y)(A(y) − b) log p(y)], summed over the whole vocabulary."""
    from loss import advantage

    grad = torch.zeros_like(student)
    for y in range(student.shape[-1]):
        _, logp_s, logp_t = reverse_kl_terms(student, teacher, torch.tensor([y]))
        logp_e = engine_logp[:, y]
        adv = advantage(logp_s, logp_t, logp_e, estimator=estimator)
        w = (logp_s.detach() - logp_e).exp() if weights == "full" else torch.ones(1)
        (g,) = torch.autograd.grad(-(w * (adv - b) * logp_s).sum(), student)
        grad += engine_logp[0, y].exp() * g
    return grad


@pytest.mark.parametrize("estimator", ["sampled", "sampler"])
def test_centered_estimator_by_enumeration(estimator):
    """A constant baseline b leaves the expected gradient unbiased on-policy (π_e = p) and under full
    importance weights; under a mismatched engine with w = 1 it adds exactly −b·∇KL(π_e ‖ p) (loss.py)."""
    torch.manual_seed(2)
    V = 7
    teacher = torch.randn(1, V)
    student = torch.randn(1, V, requires_grad=True)
    kl, _, _ = reverse_kl_terms(student, teacher, torch.zeros(1, dtype=torch.long))
    (grad_analytic,) = torch.autograd.grad(kl.sum(), student)
    on_policy = torch.log_softmax(student.detach(), -1)
    for b in (-3.0, 0.7):
        g = enumerated_gradient(student, teacher, on_policy, estimator=estimator, weights="none", b=b)
        assert_close(g, grad_analytic, atol=1e-5, what=f"on-policy, b={b}")
    engine = torch.log_softmax(student.detach() + 0.8 * torch.randn(1, V), -1)
    g0 = enumerated_gradient(student, teacher, engine, estimator=estimator, weights="none", b=0.0)
    kl_ep = (engine.exp() * (engine - torch.log_softmax(student, -1))).sum()
    (grad_kl_ep,) = torch.autograd.grad(kl_ep, student)
    for b in (-3.0, 0.7):
        g = enumerated_gradient(student, teacher, engine, estimator=estimator, weights="none", b=b)
        assert_close(g, g0 - b * grad_kl_ep, atol=1e-5, what=f"mismatched engine, w = 1, b={b}")
        assert not torch.allclose(g, g0, atol=1e-3)  # the baseline does move it off-policy
        g_full = enumerated_gradient(student, teacher, engine, estimator=estimator, weights="full", b=b)
        g_full0 = enumerated_gradient(student, teacher, engine, estimator=estimator, weights="full", b=0.0)
        assert_close(g_full, g_full0, atol=1e-5, what=f"mismatched engine, w = p/π_e, b={b}")
    if estimator == "sampled":  # full IS corrects the uncorrected estimator exactly, with or without b
        assert_close(g_full, grad_analytic, atol=1e-5, what="w = p/π_e: the analytic gradient")


def test_centered_loss_in_opd_loss_subtracts_the_batch_mean(tiny_pair):
    """opd_loss(center=True) equals −mean_t (A_t − mean A) log p(y_t), in value and gradient, computed
    directly from the rollout's token log-probs; and chunking does not change it."""
    from rollout import positions

    rollout = batch_rollout(tiny_pair)
    student, teacher = tiny_pair.student, tiny_pair.teacher
    kw = dict(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
    )
    target = rollout.targets()
    y = rollout.tokens[:, 1:][target]
    logp_s = torch.log_softmax(student(**kw).logits[:, :-1][target], -1).gather(-1, y[:, None])[:, 0]
    with torch.no_grad():
        logp_t = torch.log_softmax(teacher(**kw).logits[:, :-1][target], -1).gather(-1, y[:, None])[:, 0]
    adv = -(logp_s - logp_t).detach()
    expected = -((adv - adv.mean()) * logp_s).mean()
    w = student.model.layers[0].mlp.up_proj.weight
    (g_expected,) = torch.autograd.grad(expected, w)
    for chunk in (5, 1000):
        loss, stats = opd_loss(student, teacher, rollout, estimator="sampled", center=True, chunk=chunk)
        (g,) = torch.autograd.grad(loss, w)
        assert_close(loss, expected, atol=1e-5, what=f"centred loss, chunk {chunk}")
        assert_close(g, g_expected, atol=1e-5, what=f"centred gradient, chunk {chunk}")
        assert abs(stats["advantage_mean"] - adv.mean().item()) < 1e-5
