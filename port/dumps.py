"""The log-dump format: per-token engine and trainer log-probs of sampled tokens, from any RL/OPD system.

JSONL, one sequence (one sampled response) per line, an object with
    engine_logprobs       [float, ...]  log π_engine(y_t | prefix) of each sampled response token, each <= 0
    train_logprobs        [float, ...]  log π_train(y_t | prefix) of the same tokens, under the policy being
                                        trained (no grad); same length
    token_ids             [int, ...]    optional: the sampled tokens, one per token, each in [0, MAX_TOKEN_ID]
                                        (needed with the top-k fields)
    engine_top_logprobs   [{id: logp}]  optional, one object per token: log-probs of the engine's top-k
    train_top_logprobs    [{id: logp}]  tokens under each side, over the same token ids (keys are strings);
                                        exactly the engine's k most likely tokens at every position. A row
                                        of k + 1 whose least likely entry is the sampled token (vLLM's
                                        logprobs=k adds it when it ranks below k) is trimmed to k; other
                                        sizes are refused
    id                    anything      optional, carried through
Also accepted: a torch .pt file holding a dict of padded [B, T] tensors `engine_logprobs`, `train_logprobs`
(floating point) and `mask` (bool, integer or floating; 1 on response tokens).

Limits, each refused with one line: log-probs are finite numbers in [MIN_LOGPROB, 0] (beyond that, the
differences behind k1 and k3 overflow); a dump holds at most MAX_SEQUENCES sequences and MAX_TOKENS tokens
(the bootstrap's memory grows with them); a .pt file is at most MAX_PT_BYTES.

Both log-probs must be of the policies themselves (temperature 1, no top-p). verl logs them as
`rollout_log_probs` and `old_log_probs` (PORTING.md has the recipes). mismatch.py writes this format from our
own engine (`--dump-out`), and `admit.py check --dump` judges one against a budget.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cli import BadInput
from lab.atomic import atomic_write_text

MIN_LOGPROB = -1e4  # a log-prob below it is below what fp32 softmax can produce (about -104 nats)
MAX_SEQUENCES = 100_000
MAX_TOKENS = 20_000_000
MAX_PT_BYTES = 2 * 2**30
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in every inference engine; a larger one is not an id


@dataclass
class Dump:
    """A dump flattened to its R response tokens (row-major); the top-k fields are None when absent.
    Top-k entries a sequence does not fill are -inf on both sides."""

    engine_R: torch.Tensor  # float64
    train_R: torch.Tensor
    seq_id_R: torch.Tensor  # long
    in_top_R: torch.Tensor | None = None  # bool: the sampled token is among the top-k ids
    top_engine_R_K: torch.Tensor | None = None
    top_train_R_K: torch.Tensor | None = None

    @property
    def sequences(self) -> int:
        return int(self.seq_id_R.max()) + 1 if len(self.seq_id_R) else 0


def is_number(v) -> bool:
    """A JSON number a log-prob can be: no bool, and no integer too large for a float to hold exactly (a
    JSON integer may have any length; float() of a 400-digit one overflows)."""
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53)


def logprob_problem(v) -> str | None:
    """Why v is not a log-prob, as the words after "holds" (None when it is one): the one rule of every
    reader, this file's and port/native.py's, for a number, finite, in [MIN_LOGPROB, 0]."""
    if not is_number(v):
        too_large = isinstance(v, int) and not isinstance(v, bool)
        return "an integer too large for a log-prob" if too_large else f"{str(v)[:40]!r}, not a number"
    if not math.isfinite(v):
        return "NaN or an infinity"
    if v > 1e-6:
        return f"a positive log-prob ({v:g}); log-probs are <= 0"
    if v < MIN_LOGPROB:
        return f"a log-prob of {v:g}; expected log-probs in [{MIN_LOGPROB:g}, 0]"
    return None


def _floats(values, where: str, what: str) -> list[float]:
    if not isinstance(values, list):
        raise BadInput(f"{where}: {what} must be a list of numbers")
    for v in values:
        if problem := logprob_problem(v):
            raise BadInput(f"{where}: {what} holds {problem}")
    return values


def is_token_id(i) -> bool:
    """A token id: an integer (no bool) in [0, MAX_TOKEN_ID]."""
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID


TENSOR_KINDS = {  # kind: (dtype test, the words a refusal uses)
    "logprobs": (lambda t: t.is_floating_point(), "a floating-point tensor"),
    "mask": (lambda t: not t.is_complex(), "a bool, integer or floating tensor"),
    "ids": (
        lambda t: not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
        "an integer tensor",
    ),
}


def check_tensor(t, key: str, kind: str, where: str) -> torch.Tensor:
    """A tensor field of a dump, typed before any value is read: log-probs floating point (an integer tensor
    is not log-probs), a mask bool, integer or floating and finite, token ids integer in [0, MAX_TOKEN_ID]."""
    test, words = TENSOR_KINDS[kind]
    if not isinstance(t, torch.Tensor) or not test(t):
        got = f"a tensor of {t.dtype}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise BadInput(f"{where}: {key} is {got}; expected {words}")
    if kind == "mask" and t.is_floating_point() and not bool(t.isfinite().all()):
        raise BadInput(f"{where}: {key} holds NaN or an infinity; expected a mask of 0 and 1")
    if kind == "ids" and t.numel() and not (0 <= int(t.min()) and int(t.max()) <= MAX_TOKEN_ID):
        raise BadInput(
            f"{where}: {key} holds {int(t.min())}..{int(t.max())}; token ids are in [0, {MAX_TOKEN_ID}]"
        )
    return t


def _top(obj, key: str, n: int, where: str) -> list[dict]:
    rows = obj.get(key)
    if not isinstance(rows, list) or len(rows) != n or not all(isinstance(r, dict) for r in rows):
        raise BadInput(f"{where}: {key} must be a list of {n} objects {{token_id: logprob}}")
    for r in rows:
        _floats(list(r.values()), where, key)
    return rows


def _line(obj, where: str) -> dict:
    """One validated sequence: engine, train, and (when present) in_top, top_engine, top_train lists."""
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected an object with engine_logprobs and train_logprobs")
    for key in ("engine_logprobs", "train_logprobs"):
        if key not in obj:
            raise BadInput(f"{where}: missing {key!r}")
    engine = _floats(obj["engine_logprobs"], where, "engine_logprobs")
    train = _floats(obj["train_logprobs"], where, "train_logprobs")
    if len(engine) != len(train) or not engine:
        raise BadInput(
            f"{where}: engine_logprobs has {len(engine)} tokens, train_logprobs {len(train)}; "
            "they must be equal and non-zero"
        )
    seq = {"engine": engine, "train": train}
    ids = obj.get("token_ids")
    if ids is not None and (
        not isinstance(ids, list) or len(ids) != len(engine) or not all(map(is_token_id, ids))
    ):
        raise BadInput(
            f"{where}: token_ids must be a list of token ids in [0, {MAX_TOKEN_ID}], one per token"
        )
    if "engine_top_logprobs" in obj or "train_top_logprobs" in obj:
        if ids is None:
            raise BadInput(f"{where}: the top-k fields need token_ids, one per token")
        top_e = _top(obj, "engine_top_logprobs", len(engine), where=where)
        top_t = _top(obj, "train_top_logprobs", len(engine), where=where)
        if any(e.keys() != t.keys() for e, t in zip(top_e, top_t)):
            raise BadInput(
                f"{where}: engine_top_logprobs and train_top_logprobs must cover the same token ids"
            )
        seq["in_top"] = [str(i) in e for i, e in zip(ids, top_e)]
        seq["y_at"] = [list(e).index(str(i)) if str(i) in e else None for i, e in zip(ids, top_e)]
        seq["top_engine"] = [list(e.values()) for e in top_e]
        seq["top_train"] = [[t[k] for k in e] for e, t in zip(top_e, top_t)]
    return seq


def _pad(rows: list[list[float]]) -> torch.Tensor:
    k = max(len(r) for r in rows)
    return torch.tensor([r + [-math.inf] * (k - len(r)) for r in rows], dtype=torch.float64)


TOP_HELP = (
    "write exactly the engine's k most likely tokens at every position (vLLM's logprobs=k adds the sampled "
    "token when it ranks below k: leave that entry out), or leave out the top-k fields to judge by k3"
)


def _exact_topk(seqs: list[dict], where: str) -> None:
    """Make every top-k row the engine's k largest, k = the smallest row: a row of k + 1 whose least likely
    entry is the sampled token loses it (vLLM's "up to logprobs+1 elements"), since a set that holds y
    because y was drawn biases the top-k estimator (port.estimate.topk_token_kl). Any other row size, or rows
    that all end in the sampled token (k cannot be told), is refused with one line."""
    rows = [(s, t) for s in seqs for t in range(len(s["top_engine"]))]
    k = min(len(s["top_engine"][t]) for s, t in rows)

    def y_last(s, t) -> bool:  # the sampled token is in the row and its least likely entry
        j = s["y_at"][t]
        return j is not None and s["top_engine"][t][j] == min(s["top_engine"][t])

    if len(rows) >= 8 and all(len(s["top_engine"][t]) == k and y_last(s, t) for s, t in rows):
        raise BadInput(f"{where}: every top-k row ends in the sampled token, so k cannot be told; {TOP_HELP}")
    for s, t in rows:
        if len(s["top_engine"][t]) == k:
            continue
        if len(s["top_engine"][t]) != k + 1 or not y_last(s, t):
            n = max(len(s["top_engine"][t]) for s, t in rows)
            raise BadInput(f"{where}: top-k rows hold {k} to {n} ids; {TOP_HELP}")
        j = s["y_at"][t]
        del s["top_engine"][t][j], s["top_train"][t][j]
        s["in_top"][t] = False


def _from_sequences(seqs: list[dict], where: str) -> Dump:
    def flat(key: str) -> list:
        return [x for s in seqs for x in s[key]]

    seq_id = torch.tensor([i for i, s in enumerate(seqs) for _ in s["engine"]])
    dump = Dump(
        torch.tensor(flat("engine"), dtype=torch.float64),
        torch.tensor(flat("train"), dtype=torch.float64),
        seq_id,
    )
    if all("in_top" in s for s in seqs):
        _exact_topk(seqs, where)
        dump.in_top_R = torch.tensor(flat("in_top"))
        dump.top_engine_R_K, dump.top_train_R_K = _pad(flat("top_engine")), _pad(flat("top_train"))
    return dump


def _read_pt(path: Path) -> list[dict]:
    if path.stat().st_size > MAX_PT_BYTES:
        raise BadInput(
            f"{path}: {path.stat().st_size / 2**30:.1f} GiB; a .pt dump is at most "
            f"{MAX_PT_BYTES / 2**30:g} GiB (split it)"
        )
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file: a pickle error, a truncated zip, ...
        raise BadInput(f"{path}: not a readable torch file ({type(e).__name__})") from None
    if not isinstance(data, dict) or not {"engine_logprobs", "train_logprobs", "mask"} <= data.keys():
        raise BadInput(
            f"{path}: expected a dict with engine_logprobs, train_logprobs and mask tensors [B, T]"
        )
    engine, train, mask = (
        check_tensor(data[k], k, kind, where=str(path))
        for k, kind in (("engine_logprobs", "logprobs"), ("train_logprobs", "logprobs"), ("mask", "mask"))
    )
    if not (engine.shape == train.shape == mask.shape) or engine.dim() != 2:
        raise BadInput(
            f"{path}: engine_logprobs {tuple(engine.shape)}, train_logprobs {tuple(train.shape)} and "
            f"mask {tuple(mask.shape)} must be the same [B, T] shape"
        )
    check_size(path, sequences=int((mask != 0).any(1).sum()), tokens=int((mask != 0).sum()))
    seqs = []
    for b in range(engine.shape[0]):
        m = mask[b].bool()
        if m.any():
            seqs.append(
                _line(
                    {"engine_logprobs": engine[b][m].tolist(), "train_logprobs": train[b][m].tolist()},
                    f"{path}: row {b}",
                )
            )
    return seqs


def read_dump(path: str | Path) -> Dump:
    """Read and validate a dump; any problem is one BadInput line naming the file, the line and the
    problem."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"--dump {path}: no such file")
    if path.suffix == ".pt":
        seqs = _read_pt(path)
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise BadInput(f"--dump {path}: not UTF-8 text (expected JSONL, or a .pt file)") from None
        check_size(path, sequences=sum(1 for line in lines if line.strip()), tokens=0)
        seqs = []
        for n, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:  # bad JSON, an integer of 5000 digits, deep nesting
                    why = getattr(e, "msg", type(e).__name__)
                    raise BadInput(f"{path}:{n}: not valid JSON ({why})") from None
                seqs.append(_line(obj, f"{path}:{n}"))
    if not seqs:
        raise BadInput(f"--dump {path}: no sequences (expected one JSON object per line)")
    check_size(path, sequences=len(seqs), tokens=sum(len(s["engine"]) for s in seqs))
    return _from_sequences(seqs, where=f"--dump {path}")


def check_size(path: Path, sequences: int, tokens: int) -> None:
    if sequences > MAX_SEQUENCES or tokens > MAX_TOKENS:
        raise BadInput(
            f"--dump {path}: {sequences} sequences, {tokens} tokens; at most {MAX_SEQUENCES} "
            f"sequences and {MAX_TOKENS} tokens (judge a random sample of them)"
        )


def write_dump(path: str | Path, scored) -> int:
    """Write mismatch.Scored samples (our own engine) in the JSONL schema, top-k included. Returns
    sequences."""
    lines = []
    for b in range(int(scored.seq_id_R.max()) + 1 if len(scored.seq_id_R) else 0):
        idx = (scored.seq_id_R == b).nonzero().squeeze(-1)
        ids_y = scored.rollout.tokens[:, 1:][scored.rollout.targets()].cpu()[idx].tolist()
        top = [
            {str(i): e for i, e in zip(ids, es)}
            for ids, es in zip(scored.top_ids_R_K[idx].tolist(), scored.top_engine_R_K[idx].tolist())
        ]
        top_t = [
            {str(i): t for i, t in zip(ids, ts)}
            for ids, ts in zip(scored.top_ids_R_K[idx].tolist(), scored.top_train_R_K[idx].tolist())
        ]
        lines.append(
            json.dumps(
                {
                    "id": b,
                    "engine_logprobs": scored.logp_engine_R[idx].tolist(),
                    "train_logprobs": scored.logp_train_R[idx].tolist(),
                    "token_ids": ids_y,
                    "engine_top_logprobs": top,
                    "train_top_logprobs": top_t,
                }
            )
        )
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))
    return len(lines)
