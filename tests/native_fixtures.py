"""Exports in each system's own layout, written from the field names in port/native.py's docstring (each read in
that system's source), never by our own writer: the readers are tested against these.

A `truth` is {step: [(rank, [Seq, ...]), ...]}: per response, the engine's and the trainer's log-probs of
each token, the token ids, and which response tokens the system masks (tool results, then EOS padding).
Every writer stores the same truth; masked positions hold values a reader must never use (0.0 engine
log-probs on tool tokens as TRL writes them, positive junk in padding).

    python -m tests.native_fixtures --example results/audit_example   # the PORTING.md example (tiny pair)
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

JUNK = 0.5  # a positive "log-prob" in masked slots: reading one is a bad-input error, so it cannot hide


@dataclass
class Seq:
    prompt: list[int]
    ids: list[int]  # response tokens, tool-result tokens included
    engine: list[float]  # per response token
    train: list[float]
    kept: list[bool]  # False on tool-result tokens


def make_truth(steps=(3, 4), ranks=2, per_rank=2, seed=0, tool=True, noise=0.3) -> dict:
    """Random sequences with float32-exact log-probs; each has a 2-token tool span when tool=True. The
    trainer's log-prob is the engine's plus N(0, noise²) (noise: one number, or {step: number})."""
    g = torch.Generator().manual_seed(seed)
    truth = {}
    for step in steps:
        rows = []
        sd = noise[step] if isinstance(noise, dict) else noise
        for rank in range(ranks):
            seqs = []
            for _ in range(per_rank):
                n = int(torch.randint(4, 9, (1,), generator=g))
                engine = (-3 * torch.rand(n, generator=g)).float()
                train = (engine + sd * torch.randn(n, generator=g)).clamp(max=0).float()
                kept = [True] * n
                if tool:
                    kept[1:3] = [False, False]
                    engine[1:3] = 0.0  # TRL's engine log-prob on tool tokens
                seqs.append(
                    Seq(
                        torch.randint(5, 50, (3,), generator=g).tolist(),
                        torch.randint(5, 50, (n,), generator=g).tolist(),
                        engine.tolist(),
                        train.tolist(),
                        kept,
                    )
                )
            rows.append((rank, seqs))
        truth[step] = rows
    return truth


def expected(truth: dict) -> dict:
    """{step: (engine, train, ids, positions)} of the kept tokens, ranks in order."""
    out = {}
    for step, rows in truth.items():
        e, t, i, p = [], [], [], []
        for _, seqs in rows:
            for s in seqs:
                idx = [j for j, k in enumerate(s.kept) if k]
                e += [s.engine[j] for j in idx]
                t += [s.train[j] for j in idx]
                i += [s.ids[j] for j in idx]
                p += [j - idx[0] for j in idx]
        out[step] = (e, t, i, p)
    return out


# ---------------------------------------------------------------------------------------------------
# One writer per system


def write_prime_rl(root: Path, truth: dict) -> Path:
    """<root>/token_exports/step_<N>/rank_<R>.jsonl + STABLE (prime-rl token_export.py)."""
    for step, rows in truth.items():
        folder = root / "token_exports" / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        for rank, seqs in rows:
            lines = []
            for k, s in enumerate(seqs):
                P, n = len(s.prompt), len(s.ids)
                lines.append(
                    {
                        "schema_version": 1,
                        "step": step,
                        "rank": rank,
                        "micro_step": 0,
                        "micro_sequence_idx": k,
                        "export_sequence_idx": k,
                        "env_name": "fixture",
                        "token_ids": s.prompt + s.ids,
                        "position_ids": list(range(P + n)),
                        "loss_mask": [False] * P + s.kept,
                        "advantages": [0.0] * (P + n),
                        "inference_logprobs": [0.0] * P + s.engine,
                        "trainer_logprobs": ([-math.log(64)] + [-1.0] * (P - 1) if P else []) + s.train,
                        "entropy": [1.0] * (P + n),
                        "mismatch_kl": [None] * (P + n),
                        "rl_weights": [None] * (P + n),
                        "ce_weights": [None] * (P + n),
                        "ref_kl_weights": [None] * (P + n),
                    }
                )
            (folder / f"rank_{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (folder / "STABLE").touch()
    return root / "token_exports"


def _slime_sample(s: Seq) -> dict:
    return {
        "tokens": torch.tensor(s.prompt + s.ids),
        "response_lengths": len(s.ids),
        "loss_masks": torch.tensor([int(k) for k in s.kept], dtype=torch.int),
        "rollout_log_probs": torch.tensor(s.engine, dtype=torch.float32),
        "log_probs": torch.tensor(s.train, dtype=torch.float32),
    }


def _cp_offsets(total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """slime v0.3.1 `cp_utils.get_logits_and_tokens_offset_with_cp`, with the rank and size passed in: the
    sequence cut into 2·cp_size chunks; rank r holds chunks r and 2·cp_size − 1 − r, and the logits at
    positions [prompt − 1, total − 1) score the response."""
    prompt_length = total_length - response_length
    chunk_size = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunk_0 = (cp_rank * chunk_size, (cp_rank + 1) * chunk_size)
    chunk_1 = ((2 * cp_size - cp_rank - 1) * chunk_size, (2 * cp_size - cp_rank) * chunk_size)
    logits_0 = (max(chunk_0[0], prompt_length - 1), min(chunk_0[1], total_length - 1))
    logits_1 = (max(chunk_1[0], prompt_length - 1), min(chunk_1[1], total_length - 1))
    if not logits_0[0] < logits_0[1]:
        logits_0 = (0, 0)
    if not logits_1[0] < logits_1[1]:
        logits_1 = (0, 0)
    return logits_0, logits_1


def slice_log_prob_with_cp(log_prob, total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """slime v0.3.1 `cp_utils.slice_log_prob_with_cp`: the response log-probs CP rank `cp_rank` holds (its
    `rollout_log_probs` after `_get_rollout_data`, and the `log_probs` its forward extracts)."""
    if cp_size == 1:
        return log_prob
    prompt_length = total_length - response_length
    logits_offset = _cp_offsets(total_length, response_length, cp_rank, cp_size)
    chunk_1 = log_prob[logits_offset[0][0] - (prompt_length - 1) : logits_offset[0][1] - (prompt_length - 1)]
    chunk_2 = log_prob[logits_offset[1][0] - (prompt_length - 1) : logits_offset[1][1] - (prompt_length - 1)]
    return torch.cat([chunk_1, chunk_2], dim=0)


def write_slime_v031(root: Path, truth: dict, tp=1, cp=1, pp=1, details=False, split=None) -> Path:
    """--dump-details <root>: train_data/{rollout_id}_{rank}.pt, {rollout_id, rank, rollout_data} (v0.3.1),
    one file per global rank, Megatron's order tp-cp-ep-dp-pp (`initialize.py`): rank = tp + TP·(cp + CP·(dp
    + DP·pp)), the truth's ranks being the data-parallel ranks. Every rank holds its DP rank's samples with
    full `tokens` and `loss_masks`; `rollout_log_probs` is sliced for its CP rank (`_get_rollout_data`), and
    `log_probs` exists on the last pipeline stage only (`forward_only` stores it there), sliced the same way.
    details=True also writes rollout_data/{rollout_id}.pt ({rollout_id, samples: Sample.to_dict()}), as
    --dump-details does. split(log_prob, total, n, cp_rank, cp_size) replaces the zigzag slicing."""
    folder = root / "train_data"
    folder.mkdir(parents=True, exist_ok=True)
    split = split or slice_log_prob_with_cp
    index = 0
    for step, rows in truth.items():
        data_by_dp = []
        for _, seqs in rows:
            samples = [_slime_sample(s) for s in seqs]
            data = {k: [x[k] for x in samples] for k in samples[0]}
            data["sample_indices"] = list(range(index, index + len(seqs)))
            data["total_lengths"] = [len(s.prompt) + len(s.ids) for s in seqs]
            index += len(seqs)
            data_by_dp.append(data)
        dp = len(rows)
        for rank in range(tp * cp * dp * pp):
            cp_rank, dp_rank, stage = (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
            data = dict(data_by_dp[dp_rank])
            lengths = list(zip(data["total_lengths"], data["response_lengths"]))
            for key in ("rollout_log_probs", "log_probs"):
                data[key] = [split(x, t, n, cp_rank, cp) for x, (t, n) in zip(data[key], lengths)]
            if stage != pp - 1:
                del data["log_probs"]
            torch.save({"rollout_id": step, "rank": rank, "rollout_data": data}, folder / f"{step}_{rank}.pt")
        if details:
            write_slime_rollout_dump(root, step, [s for _, seqs in rows for s in seqs])
    return folder


def write_slime_rollout_dump(root: Path, step: int, seqs: list[Seq]) -> None:
    """rollout_data/{rollout_id}.pt as slime v0.3.1's `_save_debug_rollout_data` writes it: the samples'
    `Sample.to_dict()` (no trainer log-probs)."""
    (root / "rollout_data").mkdir(parents=True, exist_ok=True)
    samples = [
        {
            "index": i,
            "tokens": s.prompt + s.ids,
            "response_length": len(s.ids),
            "loss_mask": [int(k) for k in s.kept],
            "rollout_log_probs": s.engine,
            "status": "completed",
        }
        for i, s in enumerate(seqs)
    ]
    torch.save({"rollout_id": step, "samples": samples}, root / "rollout_data" / f"{step}.pt")


def write_slime_main(root: Path, truth: dict) -> Path:
    """train_data/{rollout_id}.pt from the single writer, format_version 2 (slime main 624b824)."""
    folder = root / "train_data"
    folder.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        samples = []
        for rank, seqs in rows:
            for s in seqs:
                samples.append(
                    {"data_parallel_rank": rank, "rollout_position": len(samples), **_slime_sample(s)}
                )
        payload = {"format_version": 2, "rollout_id": step, "rank": 0, "samples": samples, "dp_shards": []}
        torch.save(payload, folder / f"{step}.pt")
    return folder


def _padded(seqs: list[Seq], values, fill=JUNK) -> torch.Tensor:
    """[B, T] right-padded with `fill`, from values(seq) -> list; every row gets a padding tail."""
    T = max(len(s.ids) for s in seqs) + 2
    return torch.tensor([values(s) + [fill] * (T - len(s.ids)) for s in seqs])


def _kept(s: Seq) -> list[int]:
    return [int(k) for k in s.kept]


def write_verl(root: Path, truth: dict, sampling: dict | None = None) -> Path:
    """step_<N>.pt per step: the v1 trainer's batch tensors (PORTING.md hook) and global_steps; `sampling`
    ({temperature, top_p}: the hook's copy of the rollout config) is written beside them when given."""
    root.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        seqs = [s for _, ss in rows for s in ss]
        torch.save(
            {
                "responses": _padded(seqs, lambda s: s.ids).long(),
                "rollout_log_probs": _padded(seqs, lambda s: s.engine).float(),
                "old_log_probs": _padded(seqs, lambda s: s.train).float(),
                "response_mask": _padded(seqs, _kept, fill=0).long(),  # 0 on tool results and padding
                "global_steps": step,
                **(sampling or {}),
            },
            root / f"step_{step}.pt",
        )
    return root


def write_trl(root: Path, truth: dict, sampling: dict | None = None, tool_mask: bool = True) -> Path:
    """step_<N>_rank_<R>.pt: GRPOTrainer outputs (completion_mask 1 on the completion, tool_mask 0 on tool
    results), global_step and process_index (PORTING.md hook); `sampling` ({temperature, top_p}, the hook's
    copy of GRPOConfig's) beside them when given; tool_mask=False: a hook that dropped tool_mask."""
    root.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        for rank, seqs in rows:
            out = {
                "prompt_ids": torch.tensor([s.prompt for s in seqs]),
                "completion_ids": _padded(seqs, lambda s: s.ids, fill=0).long(),
                "completion_mask": _padded(seqs, lambda s: [1] * len(s.ids), fill=0).long(),
                "tool_mask": _padded(seqs, _kept, fill=1).long(),  # TRL pads tool_mask with 1
                "sampling_per_token_logps": _padded(seqs, lambda s: s.engine, fill=0.0).float(),
                "old_per_token_logps": _padded(seqs, lambda s: s.train).float(),
                "global_step": step,
                "process_index": rank,
                **(sampling or {}),
            }
            if not tool_mask:
                del out["tool_mask"]
            torch.save(out, root / f"step_{step}_rank_{rank}.pt")
    return root


def write_project(root: Path, truth: dict) -> Path:
    """port/dumps.py's schema, one JSONL file per step, kept tokens only."""
    root.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        lines = []
        for _, seqs in rows:
            for s in seqs:
                idx = [j for j, k in enumerate(s.kept) if k]
                lines.append(
                    {
                        "engine_logprobs": [s.engine[j] for j in idx],
                        "train_logprobs": [s.train[j] for j in idx],
                        "token_ids": [s.ids[j] for j in idx],
                    }
                )
        (root / f"step_{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def _logprob_dict(ids_lp: list[tuple[int, float, int]]) -> dict:
    """{token_id: Logprob} as vLLM's Logprob fields (logprob, rank, decoded_token), keys as JSON strings."""
    return {str(i): {"logprob": lp, "rank": r, "decoded_token": f"t{i}"} for i, lp, r in ids_lp}


def write_vllm(root: Path, truth: dict, k: int = 0, sampling: dict | None = None) -> Path:
    """One JSONL file per step, {"engine": RequestOutput, "train": RequestOutput of the scoring prefill}, and
    the recipe's "sampling" ({temperature, top_p, logprobs_mode}) when given. k = 0: logprobs=0 (the sampled
    token only). k > 0 needs truth from make_vllm_truth (full dists)."""
    root.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        lines = []
        for _, seqs in rows:
            for s in seqs:
                idx = [j for j, kept in enumerate(s.kept) if kept]  # vLLM: no tool spans in one turn
                ids = [s.ids[j] for j in idx]
                eng = [_logprob_dict([(s.ids[j], s.engine[j], 1)]) for j in idx]
                trn = [_logprob_dict([(s.ids[j], s.train[j], 1)]) for j in idx]
                if k:
                    eng, trn = s.top_rows(idx, k)
                lines.append(
                    {
                        "engine": {
                            "request_id": "0",
                            "prompt_token_ids": s.prompt,
                            "prompt_logprobs": None,
                            "outputs": [
                                {"index": 0, "token_ids": ids, "logprobs": eng, "finish_reason": "stop"}
                            ],
                        },
                        "train": {
                            "request_id": "1",
                            "prompt_token_ids": s.prompt + ids,
                            "prompt_logprobs": [None]
                            + [_logprob_dict([(t, -1.0, 1)]) for t in s.prompt[1:]]
                            + trn,
                            "outputs": [
                                {"index": 0, "token_ids": [7], "logprobs": None, "finish_reason": "length"}
                            ],
                        },
                        **({"sampling": sampling} if sampling else {}),
                    }
                )
        (root / f"step_{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


@dataclass
class DistSeq(Seq):
    """A sequence sampled from full next-token distributions (for vLLM top-k)."""

    logp_e: list = None  # per token: [V] engine log-probs
    logp_t: list = None

    def top_rows(self, idx: list[int], k: int) -> tuple[list[dict], list[dict]]:
        """vLLM's dicts: engine top-k (+ the sampled token with its rank when below k); train: the same
        ids scored (prompt_logprob_token_ids) plus the actual token."""
        eng, trn = [], []
        for j in idx:
            le, lt, y = torch.tensor(self.logp_e[j]), torch.tensor(self.logp_t[j]), self.ids[j]
            order = le.argsort(descending=True).tolist()
            rank = {v: r + 1 for r, v in enumerate(order)}
            ids = order[:k] + ([y] if rank[y] > k else [])
            eng.append(_logprob_dict([(v, le[v].item(), rank[v]) for v in ids]))
            trn.append(_logprob_dict([(v, lt[v].item(), 0) for v in ids]))
        return eng, trn


def make_vllm_truth(steps=(0,), n_seqs=6, vocab=10, seed=1, noise=0.5) -> dict:
    """Sequences whose tokens are drawn from random engine distributions; the trainer's logits are the
    engine's plus N(0, noise²) (noise: one number, or {step: number})."""
    g = torch.Generator().manual_seed(seed)
    truth = {}
    for step in steps:
        seqs = []
        sd = noise[step] if isinstance(noise, dict) else noise
        for _ in range(n_seqs):
            n = 6
            logp_e = torch.log_softmax(2 * torch.randn(n, vocab, generator=g), -1).float()
            logp_t = torch.log_softmax(logp_e + sd * torch.randn(n, vocab, generator=g), -1).float()
            ids = torch.multinomial(logp_e.exp(), 1, generator=g).squeeze(-1).tolist()
            seqs.append(
                DistSeq(
                    [1, 2, 3],
                    ids,
                    [logp_e[j, y].item() for j, y in enumerate(ids)],
                    [logp_t[j, y].item() for j, y in enumerate(ids)],
                    [True] * n,
                    logp_e.tolist(),
                    logp_t.tolist(),
                )
            )
        truth[step] = [(0, seqs)]
    return truth


def make_rare_truth(n_seqs=64, length=4, eps=0.006, gap=95.0) -> dict:
    """The rare-token engine: at every position π_e = (0.7, 0.3 − ε, ε) over tokens (0, 1, 2) and the trainer
    gives token 2 only ε·e^−gap (the rest of that mass on token 0), so each position hides
        KL = Σ_v π_e log(π_e/π_t) ≈ ε·gap − ε ≈ 0.56 nats at ε = 0.006
    on a token that (1 − ε)^N of all draws of N tokens never sample (21% at N = 256). The sampled tokens are
    such a draw: 0 and 1 in turn, never 2."""
    logp_e = torch.tensor([0.7, 0.3 - eps, eps], dtype=torch.float64).log()
    p_t = torch.tensor(
        [0.7 + eps * (1 - math.exp(-gap)), 0.3 - eps, eps * math.exp(-gap)], dtype=torch.float64
    )
    logp_t = p_t.log()
    seqs = []
    for b in range(n_seqs):
        ids = [(b + j) % 2 for j in range(length)]
        seqs.append(
            DistSeq(
                [1, 2, 3],
                ids,
                [logp_e[y].item() for y in ids],
                [logp_t[y].item() for y in ids],
                [True] * length,
                [logp_e.tolist()] * length,
                [logp_t.tolist()] * length,
            )
        )
    return {0: [(0, seqs)]}


def rare_kl(eps=0.006, gap=95.0) -> float:
    """The exact per-token KL(π_e ‖ π_t) of make_rare_truth, from its two distributions."""
    p_e = torch.tensor([0.7, 0.3 - eps, eps], dtype=torch.float64)
    p_t = torch.tensor(
        [0.7 + eps * (1 - math.exp(-gap)), 0.3 - eps, eps * math.exp(-gap)], dtype=torch.float64
    )
    return (p_e * (p_e.log() - p_t.log())).sum().item()


def _each_seq(truth: dict, change) -> dict:
    """A copy of truth with change(seq) -> seq applied to every sequence."""
    return {step: [(rank, [change(s) for s in seqs]) for rank, seqs in rows] for step, rows in truth.items()}


def bypass(truth: dict) -> dict:
    """verl in bypass mode: old_log_probs is a copy of rollout_log_probs, so the trainer column is the
    engine's."""
    return _each_seq(truth, lambda s: Seq(s.prompt, s.ids, s.engine, list(s.engine), s.kept))


def tools_kept(truth: dict) -> dict:
    """A dropped tool mask: the tool-result tokens (engine 0.0, as TRL writes it) are kept."""
    return _each_seq(truth, lambda s: Seq(s.prompt, s.ids, s.engine, s.train, [True] * len(s.kept)))


def filled(truth: dict, value: float = -1e4) -> dict:
    """A fill value in both log-prob columns at each response's first token (a masked slot read as kept)."""
    return _each_seq(
        truth, lambda s: Seq(s.prompt, s.ids, [value] + s.engine[1:], [value] + s.train[1:], s.kept)
    )


WRITERS = {
    "project": write_project,
    "prime-rl": write_prime_rl,
    "slime": write_slime_v031,
    "verl": write_verl,
    "trl": write_trl,
    "vllm": write_vllm,
}


# ---------------------------------------------------------------------------------------------------
# The PORTING.md example: a prime-rl-layout export of the tiny pair, three "steps" of rising mismatch

EXAMPLE_STEPS = {0: {"weights": "bf16"}, 1: {"weights": "fp8"}, 2: {"weights": "fp8", "kv_cache": "fp8"}}


def tiny_truth(probes: int = 32) -> dict:
    """{step: [(0, [Seq, ...])]} from our own engine on the tiny pair (engine = EXAMPLE_STEPS[step])."""
    from mismatch import measure_config
    from models import format_prompt, load_pair
    from rollout import RolloutConfig

    pair = load_pair("tiny")
    prompts = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:probes]]
    truth = {}
    for step, over in EXAMPLE_STEPS.items():
        s = measure_config(pair, RolloutConfig(**over), prompts, keep=True)["scored"]
        r = s.rollout
        ids_R = r.tokens[:, 1:][r.targets()].cpu()
        seqs = []
        for b in range(len(prompts)):
            at = s.seq_id_R == b
            prompt = r.tokens[b][r.attention_mask[b].bool() & ~r.response_mask[b].bool()].tolist()
            n = int(at.sum())
            seqs.append(
                Seq(
                    prompt,
                    ids_R[at].tolist(),
                    s.logp_engine_R[at].tolist(),
                    s.logp_train_R[at].tolist(),
                    [True] * n,
                )
            )
        truth[step] = [(0, seqs)]
    return truth


def main(argv=None) -> None:
    import argparse

    import admit

    parser = argparse.ArgumentParser(description="write the PORTING.md audit example")
    parser.add_argument("--example", required=True, help="output folder, e.g. results/audit_example")
    parser.add_argument("--export", default="runs/audit_example", help="where the prime-rl export goes")
    args = parser.parse_args(argv)
    root = write_prime_rl(Path(args.export), tiny_truth())
    admit.main(
        [
            "audit",
            "--dump",
            str(root),
            "--budget",
            "budgets/tiny/budget.json",
            "--out",
            args.example,
            "--tokenizer",
            "tiny",
            "--top-p",
            "1",  # our engine samples at temperature 1, untruncated; prime-rl's export does not record it
        ]
    )


if __name__ == "__main__":
    main()
