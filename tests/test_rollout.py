"""The sampler against its oracles: HF generate (greedy tokens) and a plain full forward (log-probs)."""

import pytest
import torch
from conftest import assert_close

from models import format_prompt, tiny_problems
from rollout import RolloutConfig, generate, positions, top_p_filter

SHORT = ["12+34=", "57+94=", "80+61="]  # shorter prompts, so every batch really is left-padded


def tiny_prompts(tokenizer, n=6, seed=3):
    texts = [p.text for p in tiny_problems(n, seed=seed, held_out=True)]
    texts[1 : 1 + len(SHORT)] = SHORT[: max(n - 2, 0)]
    return [format_prompt(tokenizer, t) for t in texts[:n]]


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    enc = tokenizer(prompts, padding=True, add_special_tokens=False, return_tensors="pt").to(model.device)
    out = model.generate(
        **enc,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return out[:, enc.input_ids.shape[1] :]


def ours_as_hf(rollout, tokenizer, width):
    """Our responses laid out the way HF generate pads them (pad after EOS, cut at the longest row)."""
    resp = rollout.tokens[:, rollout.prompt_len :]
    return resp[:, :width]


def test_greedy_matches_hf_generate_tiny(tiny_pair):
    prompts = tiny_prompts(tiny_pair.tokenizer, n=8)
    assert len({len(p) for p in prompts}) > 1, "want a left-padded batch"
    ours = generate(
        tiny_pair.student, tiny_pair.tokenizer, prompts, RolloutConfig(temperature=0, max_new_tokens=6)
    )
    theirs = hf_greedy(tiny_pair.student, tiny_pair.tokenizer, prompts, 6)
    assert torch.equal(ours_as_hf(ours, tiny_pair.tokenizer, theirs.shape[1]), theirs)


def test_greedy_matches_hf_generate_random_model_long(random_model, tokenizer):
    # A random model rarely emits EOS, so this exercises many decode steps on a padded batch.
    prompts = tiny_prompts(tokenizer, n=5)
    ours = generate(random_model, tokenizer, prompts, RolloutConfig(temperature=0, max_new_tokens=20))
    theirs = hf_greedy(random_model, tokenizer, prompts, 20)
    assert torch.equal(ours_as_hf(ours, tokenizer, theirs.shape[1]), theirs)


def full_forward_logprobs(model, rollout, temperature=1.0):
    """Oracle: one uncached forward over the whole sequence; log-softmax at each response token."""
    logits = model(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
    ).logits
    logp = (
        torch.log_softmax(logits[:, :-1].float() / temperature, -1)
        .gather(-1, rollout.tokens[:, 1:, None])
        .squeeze(-1)
    )
    return torch.nn.functional.pad(logp, (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_uncached_forward(random_model, tokenizer, temperature):
    rollout = generate(
        random_model,
        tokenizer,
        tiny_prompts(tokenizer),
        RolloutConfig(temperature=temperature, max_new_tokens=12),
    )
    with torch.no_grad():
        expected = full_forward_logprobs(random_model, rollout, temperature)
    mask = rollout.response_mask.bool()
    assert_close(rollout.logprobs[mask], expected[mask], atol=1e-4, what="engine vs uncached log-probs")
    assert (rollout.logprobs[~mask] == 0).all()


def test_seed_reproducible(random_model, tokenizer):
    prompts = tiny_prompts(tokenizer)
    cfg = RolloutConfig(max_new_tokens=10)
    a = generate(random_model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(1))
    b = generate(random_model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(1))
    c = generate(random_model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def test_temperature_zero_is_deterministic(random_model, tokenizer):
    prompts = tiny_prompts(tokenizer)
    cfg = RolloutConfig(temperature=0, max_new_tokens=8)
    a = generate(random_model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(1))
    b = generate(random_model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.tokens, b.tokens)


def test_eos_ends_rows_and_length_limit(tiny_pair):
    # The trained tiny student answers in a few tokens and then emits EOS.
    tok = tiny_pair.tokenizer
    rollout = generate(tiny_pair.student, tok, tiny_prompts(tok, n=16), RolloutConfig(max_new_tokens=6))
    resp = rollout.tokens[:, rollout.prompt_len :]
    mask = rollout.response_mask[:, rollout.prompt_len :].bool()
    assert resp.shape[1] <= 6
    for row, m in zip(resp, mask):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any(), "response mask must be a prefix"
        eos_at = (row[:n] == tok.eos_token_id).nonzero()
        if len(eos_at):
            assert eos_at[0].item() == n - 1, "EOS is the last response token"
        assert (row[n:] == tok.pad_token_id).all()
    assert (mask.sum(1) < 6).any(), "some row should stop at EOS before the limit"
    # The final attention mask covers prompt + response, nothing after EOS.
    assert torch.equal(
        rollout.attention_mask[:, rollout.prompt_len :], rollout.response_mask[:, rollout.prompt_len :]
    )


def test_ignore_eos_fills_the_length(tiny_pair):
    tok = tiny_pair.tokenizer
    rollout = generate(
        tiny_pair.student, tok, tiny_prompts(tok, n=4), RolloutConfig(max_new_tokens=9, ignore_eos=True)
    )
    assert (rollout.response_mask.sum(1) == 9).all()


def test_top_p_filter_keeps_the_nucleus():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(p.log(), top_p=0.7).exp()
    assert_close(kept, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]), atol=1e-6, what="nucleus 0.7")
    assert_close(
        top_p_filter(p.log(), top_p=0.1).exp(), torch.tensor([[1.0, 0, 0, 0]]), atol=1e-6, what="nucleus 0.1"
    )
    assert_close(top_p_filter(p.log(), top_p=1.0).exp(), p, atol=1e-6, what="nucleus 1.0")


def test_top_p_restricts_sampled_support(random_model, tokenizer):
    prompts = tiny_prompts(tokenizer, n=1) * 64
    full = generate(random_model, tokenizer, prompts, RolloutConfig(max_new_tokens=1, ignore_eos=True))
    cut = generate(
        random_model, tokenizer, prompts, RolloutConfig(max_new_tokens=1, ignore_eos=True, top_p=0.3)
    )
    with torch.no_grad():
        logits = random_model(**tokenizer(prompts[:1], add_special_tokens=False, return_tensors="pt")).logits[
            0, -1
        ]
    nucleus = set(
        torch.nonzero(top_p_filter(torch.log_softmax(logits, -1)[None], 0.3)[0] > float("-inf"))
        .flatten()
        .tolist()
    )
    sampled_cut = set(cut.tokens[:, -1].tolist())
    assert sampled_cut <= nucleus
    assert len(set(full.tokens[:, -1].tolist())) > len(nucleus), "without truncation the support is wider"
    # Renormalised: the reported log-probs are those of the truncated distribution, so >= the untruncated ones.
    assert (cut.logprobs[:, -1] >= torch.log_softmax(logits, -1)[cut.tokens[:, -1]] - 1e-6).all()


def test_bad_config_is_refused():
    from models import BadInput

    with pytest.raises(BadInput, match="top_p"):
        RolloutConfig(top_p=0)
    with pytest.raises(BadInput, match="weights"):
        RolloutConfig(weights="int3")


@pytest.mark.parametrize(
    "top_p, V, scales",
    [
        (0.5, 5000, [0.1, 1.0, 3.0, 8.0]),  # topk 1024 holds too little for the flat row: a full sort
        (0.95, 5000, [0.1, 1.0, 3.0, 8.0]),
        (0.999999, 5000, [0.1, 1.0, 3.0, 8.0]),
        (0.95, 20000, [3.0, 8.0]),  # topk 1024 holds too little, topk 8192 enough: the middle step
        (0.95, 20000, [8.0, 8.0]),  # topk 1024 is enough
    ],
)
def test_nucleus_equals_the_full_sort_filter(top_p, V, scales):
    """The fast nucleus (topk of 1024, widened eightfold, then to a full sort, while that holds too little
    mass) keeps exactly the tokens top_p_filter keeps, with the same renormalised log-probs."""
    from rollout import nucleus

    torch.manual_seed(0)
    logp_B_V = torch.log_softmax(torch.randn(len(scales), V) * torch.tensor(scales)[:, None], -1)
    ids_B_K, logq_B_K = nucleus(logp_B_V, top_p)
    scattered = torch.full_like(logp_B_V, float("-inf")).scatter(-1, ids_B_K, logq_B_K)
    expected = top_p_filter(logp_B_V, top_p)
    assert torch.equal(torch.isfinite(scattered), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    assert_close(scattered[finite], expected[finite], atol=1e-5, what=f"nucleus vs sort, top_p {top_p}")


@pytest.mark.parametrize(
    "kv_heads, rows, kv", [(4, 3, "model"), (2, 3, "model"), (2, 1, "model"), (2, 3, "fp8")]
)
def test_llama_decode_equals_the_hf_forward_bit_for_bit(tokenizer, kv_heads, rows, kv):
    """The Llama decode step (`cpu_decode.llama_decode`) against the HF forward it replaces, step after step on
    two caches filled by the same prefill: equal logits, with and without left padding (rows 3 / 1), with
    grouped-query attention (2 key/value heads for 4 query heads) and through the FP8 KV cache."""
    from transformers import DynamicCache, LlamaForCausalLM

    from cpu_decode import llama_decode, small_batch_linears
    from models import cache_arg, tiny_config
    from quant import KVScales, fp8_kv_cache
    from rollout import encode_prompts, prefill

    config = tiny_config("student")
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids_B_P, attn_B_T = encode_prompts(tokenizer, tiny_prompts(tokenizer, n=rows), "cpu")
    assert (rows > 1) == bool((attn_B_T == 0).any()), "rows > 1 are left-padded, one row is not"
    hf_cache, ours_cache = (
        DynamicCache(config=config) if kv == "model" else fp8_kv_cache(KVScales.unit(config)) for _ in "ab"
    )
    with torch.no_grad(), small_batch_linears(model):
        logits_B_V = prefill(model, ids_B_P, attn_B_T, hf_cache)
        prefill(model, ids_B_P, attn_B_T, ours_cache)
        for _ in range(5):
            token_B = torch.multinomial(logits_B_V.softmax(-1), 1).squeeze(-1)
            attn_B_T = torch.cat([attn_B_T, torch.ones_like(attn_B_T[:, :1])], 1)
            hf_B_V = model(
                input_ids=token_B[:, None],
                attention_mask=attn_B_T,
                position_ids=attn_B_T.sum(-1, keepdim=True) - 1,
                **cache_arg(model, hf_cache),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            ours_B_V = llama_decode(model, token_B, attn_B_T, ours_cache)
            assert torch.equal(ours_B_V, hf_B_V), (ours_B_V - hf_B_V).abs().max()
            logits_B_V = hf_B_V
