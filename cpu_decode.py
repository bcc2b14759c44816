"""The CPU decode fast path: the same decode step as rollout.decode (the HF forward), faster for a few rows.

Two changes, each equal to the reference (tests/test_rollout.py compares them):
    small_batch_linears  every plain nn.Linear computes as `W @ x.T` for up to SMALL_BATCH rows;
    llama_decode         a Llama model's decode step through its own modules, without the HF forward's
                         per-call machinery (bit for bit the HF forward's logits).
rollout.generate uses them where they apply (`fast_path_applies`); rollout.decode stays the reference.
"""

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from models import head

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # isort: skip

SMALL_BATCH = 16  # rows up to which `W @ x.T` beats F.linear's GEMM on CPU (measured: 1.7–2.5× at 4 rows)


def _small_batch_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward for a few rows, as `W @ x.T`: on CPU this product streams W at memory speed, where
    F.linear's small-M GEMM reaches half of it ([4, 576] @ [576, 49152]: 9 ms vs 23 ms). Other inputs, GPU
    inputs (the gap was measured on CPU only) and quantized weights (a torchao tensor subclass) take
    F.linear."""
    rows = x.numel() // module.in_features
    if rows > SMALL_BATCH or type(module.weight) is not torch.nn.Parameter or x.device.type != "cpu":
        return F.linear(x, module.weight, module.bias)
    x_N_I = x.reshape(rows, module.in_features)
    if rows == 1:  # one row takes the matrix-vector kernel, 3× slower here than a 2-row product: pad
        return _small_batch_linear(module, x_N_I.expand(2, -1).contiguous())[:1].reshape(*x.shape[:-1], -1)
    out_N_O = (module.weight @ x_N_I.T).T
    if module.bias is not None:
        out_N_O = out_N_O + module.bias
    return out_N_O.reshape(*x.shape[:-1], module.out_features)


@contextmanager
def small_batch_linears(model):
    """Within the block, every plain nn.Linear of `model` computes as _small_batch_linear (an instance
    attribute that shadows the class's forward; removed on exit, also after an error)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for m in linears:
        m.forward = partial(_small_batch_linear, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _one_query_attention(attn, q_B_Hq_1_D, k_B_Hk_T_D, v_B_Hk_T_D, mask_B_1_1_T) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v for one query token, [B, 1, Hq·D], as HF's sdpa attention computes it:
    without a mask SDPA's own grouped-query mode; with one, the query heads that share a key/value head laid
    out as that head's queries (no repeated keys)."""
    B, D = q_B_Hq_1_D.shape[0], attn.head_dim
    if mask_B_1_1_T is None:
        o_B_Hq_1_D = F.scaled_dot_product_attention(
            q_B_Hq_1_D, k_B_Hk_T_D, v_B_Hk_T_D, scale=attn.scaling, enable_gqa=attn.num_key_value_groups > 1
        )
        return o_B_Hq_1_D.transpose(1, 2).reshape(B, 1, -1)
    o_B_Hk_G_D = F.scaled_dot_product_attention(
        q_B_Hq_1_D.reshape(B, -1, attn.num_key_value_groups, D),
        k_B_Hk_T_D,
        v_B_Hk_T_D,
        attn_mask=mask_B_1_1_T,
        scale=attn.scaling,
    )
    return o_B_Hk_G_D.reshape(B, 1, -1)


def llama_decode(model, token_B, attn_B_T, cache) -> torch.Tensor:
    """One decode step of a Llama model through its own submodules (embedding, rotary, norms, projections,
    MLP, head) and the transformers Cache, computing what LlamaModel.forward computes for one new token:
        h = embed(y);  per layer:  h += o_proj(attn(rope(q), rope(k), v; mask));  h += mlp(norm(h));
        logits = head(norm(h)).
    What it leaves out is per-call machinery that one query token does not need: building a 4-D causal mask
    (one query attends to every cached position that is not padding), kwarg plumbing, output capture. Its
    logits equal the HF forward's bit for bit (tests/test_rollout.py): a seeded run samples the same tokens.
    """
    inner = model.model
    B = attn_B_T.shape[0]
    pos_B_1 = attn_B_T.long().sum(-1, keepdim=True) - 1
    h_B_1_H = inner.embed_tokens(token_B[:, None])
    cos_sin = inner.rotary_emb(h_B_1_H, pos_B_1)
    mask_B_1_1_T = None if bool(attn_B_T.all()) else attn_B_T.bool()[:, None, None, :]
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attn = layer.self_attn
        x_B_1_H = layer.input_layernorm(h_B_1_H)
        q_B_Hq_1_D = attn.q_proj(x_B_1_H).view(B, 1, -1, attn.head_dim).transpose(1, 2)
        k_B_Hk_1_D = attn.k_proj(x_B_1_H).view(B, 1, -1, attn.head_dim).transpose(1, 2)
        v_B_Hk_1_D = attn.v_proj(x_B_1_H).view(B, 1, -1, attn.head_dim).transpose(1, 2)
        q_B_Hq_1_D, k_B_Hk_1_D = apply_rotary_pos_emb(q_B_Hq_1_D, k_B_Hk_1_D, *cos_sin)
        k_B_Hk_T_D, v_B_Hk_T_D = cache.update(k_B_Hk_1_D, v_B_Hk_1_D, attn.layer_idx)
        o_B_1_HD = _one_query_attention(
            attn, q_B_Hq_1_D, k_B_Hk_T_D, v_B_Hk_T_D=v_B_Hk_T_D, mask_B_1_1_T=mask_B_1_1_T
        )
        h_B_1_H = h_B_1_H + attn.o_proj(o_B_1_HD)
        h_B_1_H = h_B_1_H + layer.mlp(layer.post_attention_layernorm(h_B_1_H))
    return head(model, inner.norm(h_B_1_H)[:, -1])


def fast_path_applies(model) -> bool:
    """llama_decode reproduces the HF forward for Llama models with SDPA attention, nothing else."""
    return model.config.model_type == "llama" and model.config._attn_implementation == "sdpa"
