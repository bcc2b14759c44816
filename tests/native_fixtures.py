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


def make_truth(steps=(3, 4), ranks=2, per_rank=2, seed=0, tool=True) -> dict:
    """Random sequences with float32-exact log-probs; each has a 2-token tool span when tool=True."""
    g = torch.Generator().manual_seed(seed)
    truth = {}
    for step in steps:
        rows = []
        for rank in range(ranks):
            seqs = []
            for _ in range(per_rank):
                n = int(torch.randint(4, 9, (1,), generator=g))
                engine = (-3 * torch.rand(n, generator=g)).float()
                train = (engine + 0.3 * torch.randn(n, generator=g)).clamp(max=0).float()
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


def write_slime_v031(root: Path, truth: dict) -> Path:
    """--dump-details <root>: train_data/{rollout_id}_{rank}.pt, {rollout_id, rank, rollout_data} (v0.3.1)."""
    folder = root / "train_data"
    folder.mkdir(parents=True, exist_ok=True)
    index = 0
    for step, rows in truth.items():
        for rank, seqs in rows:
            samples = [_slime_sample(s) for s in seqs]
            data = {k: [x[k] for x in samples] for k in samples[0]}
            data["sample_indices"] = list(range(index, index + len(seqs)))
            data["total_lengths"] = [len(s.prompt) + len(s.ids) for s in seqs]
            index += len(seqs)
            torch.save({"rollout_id": step, "rank": rank, "rollout_data": data}, folder / f"{step}_{rank}.pt")
    return folder


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


def write_verl(root: Path, truth: dict) -> Path:
    """step_<N>.pt per step: the v1 trainer's batch tensors (PORTING.md hook) and global_steps."""
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
            },
            root / f"step_{step}.pt",
        )
    return root


def write_trl(root: Path, truth: dict) -> Path:
    """step_<N>_rank_<R>.pt: GRPOTrainer outputs (completion_mask 1 on the completion, tool_mask 0 on tool
    results), global_step and process_index (PORTING.md hook)."""
    root.mkdir(parents=True, exist_ok=True)
    for step, rows in truth.items():
        for rank, seqs in rows:
            torch.save(
                {
                    "prompt_ids": torch.tensor([s.prompt for s in seqs]),
                    "completion_ids": _padded(seqs, lambda s: s.ids, fill=0).long(),
                    "completion_mask": _padded(seqs, lambda s: [1] * len(s.ids), fill=0).long(),
                    "tool_mask": _padded(seqs, _kept, fill=1).long(),  # TRL pads tool_mask with 1
                    "sampling_per_token_logps": _padded(seqs, lambda s: s.engine, fill=0.0).float(),
                    "old_per_token_logps": _padded(seqs, lambda s: s.train).float(),
                    "global_step": step,
                    "process_index": rank,
                },
                root / f"step_{step}_rank_{rank}.pt",
            )
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


def write_vllm(root: Path, truth: dict, k: int = 0) -> Path:
    """One JSONL file per step, {"engine": RequestOutput, "train": RequestOutput of the scoring prefill}.
    k = 0: logprobs=0 (the sampled token only). k > 0 needs truth from make_vllm_truth (full dists)."""
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


def make_vllm_truth(steps=(0,), n_seqs=6, vocab=10, seed=1) -> dict:
    """Sequences whose tokens are drawn from random engine distributions; train = engine + noise."""
    g = torch.Generator().manual_seed(seed)
    truth = {}
    for step in steps:
        seqs = []
        for _ in range(n_seqs):
            n = 6
            logp_e = torch.log_softmax(2 * torch.randn(n, vocab, generator=g), -1).float()
            logp_t = torch.log_softmax(logp_e + 0.5 * torch.randn(n, vocab, generator=g), -1).float()
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
        ]
    )


if __name__ == "__main__":
    main()
