"""The sampler: our own sampling loop over a Hugging Face causal LM, returning a `Rollout`.

How it works: one *prefill* call runs the whole (left-padded) prompt batch through the model's decoder and
fills a transformers `Cache`; then one *decode* call per new token feeds only the token just sampled. The
output head is applied to the last position only, as `W @ h.T` (on CPU `F.linear` of a [4, 576] batch
with the [49152, 576] head takes 2.5× as long), and the loop stops as soon as every row has emitted EOS.
Because the KV cache is a transformers `Cache`, a different cache (the FP8 one) swaps in untouched.

Which distribution the log-probs come from (every mismatch number depends on this):
    logprobs[b, t] = log q(y_t | prefix), where q is the distribution the token was actually drawn from:
        q = softmax(logits / temperature), then, if top_p < 1, restricted to the nucleus (the smallest
        set of most likely tokens whose mass reaches top_p) and renormalised over it.
    With temperature 1 and top_p 1 (the training defaults), q is exactly the policy π(·|prefix).
    Greedy (temperature 0) has a degenerate q, so it reports log π(y_t | prefix) at temperature 1.
    engine_logits[n, :] = the engine's fp32 logits at the n-th response token (row-major), recorded while
        decoding: the exact policy the token was drawn from (at temperature 1), so mismatch.py computes
        KL(π_engine ‖ π_train) from what the engine really computed, not from a re-scoring (a one-pass
        re-scoring rounds differently under bf16 or FP8: up to 7% off the KL). Cost: 4·V bytes a token
        (smollm2: 197 KB; a batch of 8 × 48 tokens, 75 MB); above RolloutConfig.record_gb the engine records
        nothing and the caller must re-score (approximately).

The engine that serves it a changed copy of the student is engine.py; its command-line flags are
`lab/rollout_args.py`; a few samples printed with their log-probs:

    python -m lab.sample --pair tiny --n 4    # sample a few responses and print them with their log-probs
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from cli import MAX_NOISE, MAX_TEMPERATURE, MAX_TOKENS, MIN_TEMPERATURE, BadInput, NonFinite
from config import MAX_NEW_TOKENS
from cpu_decode import fast_path_applies, llama_decode, small_batch_linears
from models import cache_arg

from transformers import DynamicCache  # isort: skip

WEIGHTS = ("fp32", "bf16", "fp8", "fp8-dyn", "fp8-emu")  # engine weight precision (quant.py has the FP8 ones)
KV_CACHES = ("model", "fp8")  # model = keys/values in the engine's compute dtype; fp8 = quant.Fp8KVLayer
KV_SCALES = ("calibrated", "unit")


@dataclass
class RolloutConfig:
    """Everything that decides how the engine samples. Saved with every run; each CLI default is read here.
    A pair's own values (its response length) come from config.py: RolloutConfig.for_pair."""

    temperature: float = 1.0  # 0 = greedy (argmax); 1 = the policy itself
    top_p: float = 1.0  # nucleus sampling; 1 = no truncation
    # response length limit (EOS usually ends a row earlier); each pair sets its own (config.MAX_NEW_TOKENS,
    # for_pair): this default is a --teacher/--student pair's
    max_new_tokens: int = MAX_NEW_TOKENS["custom"]
    seed: int = 0  # seeds the sampling generator when the caller passes none, and the weight noise
    ignore_eos: bool = False  # keep sampling past EOS (for benchmarks that need a fixed length)
    weights: str = (
        "fp32"  # engine weight precision: fp32 | bf16 | fp8 (weight-only) | fp8-dyn (W8A8, CUDA) | fp8-emu
    )
    fp8_skip: tuple = ("lm_head",)  # module-name patterns (fnmatch) kept in high precision under fp8 weights
    kv_cache: str = "model"  # KV cache storage: model (engine compute dtype) | fp8 (e4m3, per-head scales)
    kv_scales: str = "calibrated"  # fp8 KV scales: calibrated (amax/448 on probe prompts) | unit (1.0)
    staleness: int = 0  # optimizer steps the engine's weights lag behind the trainer; 0 = synchronous
    noise: float = 0.0  # relative std of Gaussian noise on the engine's weights; 0 = none
    record_gb: float = 2.0  # largest recorded engine distributions per batch (GiB); beyond it, re-score

    def __post_init__(self):
        checks = [
            (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
                (
                    f"temperature {self.temperature}: must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                    f"{MAX_TEMPERATURE:g}]"
                ),
            ),
            (0 < self.top_p <= 1, f"top_p {self.top_p}: must be in (0, 1]"),
            (
                1 <= self.max_new_tokens <= MAX_TOKENS,
                f"max_new_tokens {self.max_new_tokens}: must be in [1, {MAX_TOKENS}]",
            ),
            (0 <= self.seed < 2**63, f"seed {self.seed}: must be in [0, 2**63)"),
            (self.weights in WEIGHTS, f"weights {self.weights!r}: choose one of {', '.join(WEIGHTS)}"),
            (self.kv_cache in KV_CACHES, f"kv_cache {self.kv_cache!r}: choose one of {', '.join(KV_CACHES)}"),
            (
                self.kv_scales in KV_SCALES,
                f"kv_scales {self.kv_scales!r}: choose one of {', '.join(KV_SCALES)}",
            ),
            (self.staleness >= 0, f"staleness {self.staleness}: must be >= 0 (0 = synchronous)"),
            (
                0 <= self.noise <= MAX_NOISE,
                f"noise {self.noise}: must be a relative weight noise in [0, {MAX_NOISE:g}] (0 = no noise)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInput(message)
        self.fp8_skip = tuple(self.fp8_skip)  # a list after a JSON round trip

    @classmethod
    def for_pair(cls, pair: str, **fields) -> "RolloutConfig":
        """A config with the pair's response length (config.MAX_NEW_TOKENS: a max_new_tokens that is absent
        or None takes it), then the other `fields`."""
        if fields.get("max_new_tokens") is None:
            fields["max_new_tokens"] = MAX_NEW_TOKENS[pair]
        return cls(**fields)


@dataclass
class Rollout:
    """A batch of prompts with sampled responses. P = padded prompt length, N = response slots.

    tokens[B, P+N]: left-padded prompts, then responses (pad after EOS).
    attention_mask[B, P+N]: 1 on real prompt tokens and response tokens up to and including EOS.
    response_mask[B, P+N]: 1 on sampled tokens up to and including EOS.
    logprobs[B, P+N]: the engine's log-prob of each sampled token (0 elsewhere); see the module docstring.
    version: the trainer step whose weights the engine used.
    engine_logits[R, V]: the engine's fp32 logits at each of the R response tokens, in row-major order
        (the order of response_mask[:, 1:].bool()); None when it was not recorded.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    version: int
    prompt_len: int
    engine_logits: torch.Tensor | None = None

    def responses(self, tokenizer) -> list[str]:
        """Decoded response texts (special tokens such as EOS dropped)."""
        resp = self.tokens[:, self.prompt_len :]
        mask = self.response_mask[:, self.prompt_len :].bool()
        return [tokenizer.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(resp, mask)]

    def targets(self) -> torch.Tensor:
        """[B, T−1] bool: which next tokens are response tokens (position t−1's output predicts token t)."""
        return self.response_mask[:, 1:].bool()

    def to(self, device) -> "Rollout":
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.__dict__.items()}
        return Rollout(**moved)


# ---------------------------------------------------------------------------------------------------
# Sampling one token


def sample_next(logits_B_V: torch.Tensor, cfg: RolloutConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (token_B, logprob_B) with logprob from the sampling distribution q."""
    logits_B_V = logits_B_V.float()
    if not torch.isfinite(logits_B_V).all():
        raise NonFinite(
            "the rollout engine produced non-finite logits (NaN or inf): its weights are broken "
            "(too much --noise, or a diverged student)"
        )
    if cfg.temperature == 0:
        token_B = logits_B_V.argmax(-1)
        return token_B, torch.log_softmax(logits_B_V, -1).gather(-1, token_B[:, None]).squeeze(-1)
    logq_B_V = torch.log_softmax(logits_B_V / cfg.temperature, -1)
    if cfg.top_p < 1:  # draw among the nucleus only: no full-vocabulary sort in the common case
        ids_B_K, logq_B_K = nucleus(logq_B_V, cfg.top_p)
        pick_B_1 = torch.multinomial(logq_B_K.exp(), 1, generator=generator)
        return ids_B_K.gather(-1, pick_B_1).squeeze(-1), logq_B_K.gather(-1, pick_B_1).squeeze(-1)
    token_B = torch.multinomial(logq_B_V.exp(), 1, generator=generator).squeeze(-1)
    return token_B, logq_B_V.gather(-1, token_B[:, None]).squeeze(-1)


def nucleus(logp_B_V: torch.Tensor, top_p: float, k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p_filter's nucleus, found among the k most likely tokens (topk, not a sort of the vocabulary).

    Returns the candidates' ids [B, K] and their log-probs renormalised over the nucleus (−inf outside it).
    When the K most likely tokens of some row hold less than top_p, K grows eightfold, up to the whole
    vocabulary (a flat policy at temperature 1: smollm2's top 1024 tokens often hold under 95%, its top 8192
    over 99%; a topk of 8192 costs a fifth of a full sort).
    """
    V = logp_B_V.shape[-1]
    k = min(k, V)
    sorted_B_K, ids_B_K = logp_B_V.topk(k, -1)  # sorted, most likely first
    while k < V and (sorted_B_K.exp().sum(-1) < top_p).any():
        k = min(8 * k, V)
        sorted_B_K, ids_B_K = logp_B_V.topk(k, -1) if k < V else logp_B_V.sort(-1, descending=True)
    mass_before_B_K = sorted_B_K.exp().cumsum(-1) - sorted_B_K.exp()  # mass of strictly more likely tokens
    kept_B_K = sorted_B_K.masked_fill(mass_before_B_K >= top_p, float("-inf"))
    return ids_B_K, kept_B_K - kept_B_K.logsumexp(-1, keepdim=True)


def top_p_filter(logp_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise; others get -inf.
    The slow, obvious twin of `nucleus` (a test holds them equal)."""
    sorted_B_V, order_B_V = logp_B_V.sort(-1, descending=True)
    mass_before_B_V = sorted_B_V.exp().cumsum(-1) - sorted_B_V.exp()  # mass of strictly more likely tokens
    drop_sorted_B_V = mass_before_B_V >= top_p  # the first token always stays (mass before it is 0)
    drop_B_V = drop_sorted_B_V.scatter(-1, order_B_V, drop_sorted_B_V)
    kept_B_V = logp_B_V.masked_fill(drop_B_V, float("-inf"))
    return kept_B_V - kept_B_V.logsumexp(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------------
# The output head, and scoring a rollout under a model


def response_hidden(model, rollout: Rollout, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict response tokens, and those tokens, in one pass.

    Returns h_N_H and y_N, N = response tokens in the batch (row-major). `cache`: an empty KV cache to score
    through (the engine's FP8 cache, so its rounding is included).
    """
    decoder = model.get_decoder()
    out = decoder(
        input_ids=rollout.tokens,
        attention_mask=rollout.attention_mask,
        position_ids=positions(rollout.attention_mask),
        **cache_arg(decoder, cache),
        use_cache=cache is not None,
    )
    target_B_T = rollout.targets()
    return out.last_hidden_state[:, :-1][target_B_T], rollout.tokens[:, 1:][target_B_T]


# ---------------------------------------------------------------------------------------------------
# The prefill/decode loop


def positions(attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: the first real token is position 0 (as HF generate does)."""
    pos_B_T = attention_mask_B_T.long().cumsum(-1) - 1
    return pos_B_T.masked_fill(attention_mask_B_T == 0, 1)


def prefill(model, ids_B_P, attn_B_P, cache) -> torch.Tensor:
    """Run the prompts through the model, filling `cache`; return the last position's logits [B, V]."""
    pos_B_P = positions(attn_B_P)
    out = model(
        input_ids=ids_B_P,
        attention_mask=attn_B_P,
        position_ids=pos_B_P,
        **cache_arg(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]


def decode(model, token_B, attn_B_T, cache) -> torch.Tensor:
    """Feed one new token per row (its mask bit is already in attn_B_T); return next-token logits [B, V].
    The reference decode step, the HF forward; cpu_decode.llama_decode computes the same logits faster."""
    pos_B_1 = attn_B_T.long().sum(-1, keepdim=True) - 1
    out = model(
        input_ids=token_B[:, None],
        attention_mask=attn_B_T,
        position_ids=pos_B_1,
        **cache_arg(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]


def encode_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for already-formatted prompt texts."""
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    cfg: RolloutConfig,
    generator: torch.Generator | None = None,
    version: int = 0,
    cache=None,
    record: bool = False,
    fast: bool = True,
) -> Rollout:
    """Sample one response per (already formatted) prompt with our prefill/decode loop.

    `cache`: another transformers Cache (default DynamicCache). `record`: keep the engine's logits at every
    response token (Rollout.engine_logits), unless B × max_new_tokens × V × 4 bytes exceeds cfg.record_gb.
    The model is used as is: the caller owns its dtype and device. `fast`: decode through cpu_decode's fast
    path where it applies (the same logits as the reference `decode`); False runs the reference alone.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed) if generator is None else generator
    ids_B_P, attn_B_P = encode_prompts(tokenizer, prompts, device)
    B, P = ids_B_P.shape
    N, eos = cfg.max_new_tokens, tokenizer.eos_token_id
    cache = DynamicCache(config=model.config) if cache is None else cache
    record = record and B * N * model.config.vocab_size * 4 <= cfg.record_gb * 2**30
    tokens_B_N = torch.full((B, N), tokenizer.pad_token_id, dtype=torch.long, device=device)
    logprobs_B_N = torch.zeros(B, N, device=device)
    alive_B_N = torch.zeros(B, N, dtype=torch.bool, device=device)  # response mask: sampled, up to EOS
    alive_B = torch.ones(B, dtype=torch.bool, device=device)
    # Generated positions stay attended even after EOS (as HF generate does); only the final mask hides them.
    attn_B_T = torch.cat([attn_B_P, torch.ones(B, N, dtype=attn_B_P.dtype, device=device)], dim=1)
    recorded = []  # [B, V] fp32 logits per step

    fast = fast and fast_path_applies(model)
    step = llama_decode if fast else decode
    with small_batch_linears(model) if fast else nullcontext():  # a few rows: the fast small-batch product
        logits_B_V = prefill(model, ids_B_P, attn_B_P, cache=cache)
        for t in range(N):
            token_B, logprob_B = sample_next(logits_B_V, cfg, generator)
            if record:
                recorded.append(logits_B_V.float())
            tokens_B_N[:, t] = torch.where(alive_B, token_B, tokenizer.pad_token_id)
            logprobs_B_N[:, t] = torch.where(alive_B, logprob_B, 0.0)
            alive_B_N[:, t] = alive_B
            if not cfg.ignore_eos:
                alive_B = alive_B & (token_B != eos)
            if t == N - 1 or not alive_B.any():
                break
            logits_B_V = step(model, tokens_B_N[:, t], attn_B_T[:, : P + t + 1], cache=cache)

    engine_logits = torch.stack(recorded, 1)[alive_B_N[:, : len(recorded)]] if record else None  # [R, V]
    return Rollout(
        tokens=torch.cat([ids_B_P, tokens_B_N], dim=1),
        attention_mask=torch.cat([attn_B_P.bool(), alive_B_N], dim=1).long(),
        response_mask=torch.cat([torch.zeros_like(attn_B_P, dtype=torch.bool), alive_B_N], dim=1).long(),
        logprobs=torch.cat([torch.zeros(B, P, device=device), logprobs_B_N], dim=1),
        version=version,
        prompt_len=P,
        engine_logits=engine_logits,
    )
