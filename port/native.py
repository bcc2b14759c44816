"""Readers for the log-prob exports other RL systems write, into dumps.Dump objects, one per training step.

`admit.py check --dump PATH --format F` and `admit.py audit` read these. PATH is a file, a folder (read
recursively) or a glob. Per-rank files of one step are merged; steps are kept apart (a list of `Step`s,
oldest first). Every token kept is one the system itself trains on: its own masks are applied (loss masks,
tool masks, padding; the systems' response masks already end at EOS). Each format's field names were read
in that system's released source, cited below; the wrappers that are ours (a recipe's file name, a key
for the step) are marked as ours.

project   port/dumps.py's own schema (JSONL, or a .pt of padded tensors); one file is one step.
prime-rl  `trainer.enable_token_export = true` (main 559b447, 2026-08-21, v0.8.0 in pyproject;
          `src/prime_rl/trainer/rl/token_export.py`): `<output_dir>/token_exports/step_<N>/rank_<R>.jsonl`,
          one JSON object per packed sample, with aligned per-token lists `token_ids`, `loss_mask`,
          `inference_logprobs`, `trainer_logprobs` (shifted so index t is the log-prob of token t; a
          non-finite value is written as null), optional weight streams `rl_weights` / `ref_kl_weights`
          (all null when absent), scalars `step` and `rank`, and a `STABLE` file in the step folder once
          every rank has flushed. Kept: loss_mask, and where the weight streams exist only tokens with a
          nonzero rl or ref_kl weight (prime-rl's own mismatch mask in `trainer/rl/train.py`).
slime     `--save-debug-train-data PATH` or `--dump-details DIR` (`DIR/train_data/...`). Two layouts:
          v0.3.1 (`slime/utils/train_dump_utils.py`): one file per rank, `{rollout_id}_{rank}.pt`, a dict
          {rollout_id, rank, rollout_data}; main 624b824 (2026-08-21, `slime/observability/
          train_data_utils.py`): one file per step from a single writer, {format_version: 2, rollout_id,
          rank, samples: [...]}. Per sample: `tokens` (prompt + response), `response_lengths`,
          `loss_masks`, `rollout_log_probs` (SGLang) and `log_probs` (Megatron recompute), each over the
          response. In v0.3.1 `log_probs` exists only when slime recomputes them (`actor.py`: not with
          `--use-rollout-logprobs` unless `--get-mismatch-metrics`, and not when it reuses the training
          forward); main captures them from the training forward. Samples repeated across tensor-parallel
          ranks (v0.3.1) are kept once, by `sample_indices`.
verl      verl 0.9.1 writes no log-prob file of its own: this reads one `.pt` per step from the hook in
          PORTING.md (in `PPOTrainer._compute_old_log_prob`, `verl/trainer/ppo/v1/trainer_base.py`), a dict
          of the batch's own tensors [B, R]: `responses`, `rollout_log_probs` (the rollout engine),
          `old_log_probs` (the actor's recompute), `response_mask`; plus `global_steps` (the trainer's
          attribute; the key is ours). Kept: response_mask.
trl       TRL 1.16.0 writes no log-prob file either: one `.pt` per step and process from the
          GRPOTrainer hook in PORTING.md, holding `_generate_and_score_completions`' own outputs
          (`trl/trainer/grpo_trainer.py`): `completion_ids`, `completion_mask`, `sampling_per_token_logps`
          (vLLM; NaN where vLLM gave none), `old_per_token_logps`, and `tool_mask` in tool-using runs
          (0 on tool-result tokens, whose engine log-prob TRL sets to 0.0); plus `global_step` and
          `process_index` (keys ours, values TRL's `state.global_step` and accelerate's). Kept:
          completion_mask * tool_mask, minus NaN engine log-probs (TRL's own "no log-prob" marker).
vllm      vLLM 0.33.0 has no file format: one JSON object per line with two of its RequestOutputs as
          dicts, under our keys `engine` (the generating run, `SamplingParams(logprobs=k)`) and `train`
          (a prefill of `engine.prompt_token_ids + outputs[0].token_ids` under the trainer's weights with
          `prompt_logprobs`); inside, vLLM's names (`vllm/outputs.py`, `vllm/logprobs.py`):
          `prompt_token_ids`, `prompt_logprobs` (None, then one {token_id: Logprob} per prompt token),
          `outputs[0].token_ids`, `outputs[0].logprobs`, and Logprob's `logprob`, `rank`, `decoded_token`.
          With `logprobs=k`, vLLM adds the sampled token to a position's dict when it ranks below k
          (`sampling_params.py`: "up to logprobs+1 elements"); that extra entry is dropped here so the
          top-k set is exactly the k largest (`rank` <= k), as the top-k estimator requires. Top-k is used
          only when the train side scored every engine top-k id (e.g. `prompt_logprob_token_ids`);
          otherwise the step falls back to k3 on the sampled token. One file is one step.

    python admit.py check --budget budgets/tiny/budget.json --dump runs/x/token_exports --format prime-rl
"""

import glob
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cli import BadInput
from port.dumps import MAX_PT_BYTES, Dump, read_dump

FORMATS = ("project", "prime-rl", "slime", "verl", "trl", "vllm")
SUFFIXES = (".jsonl", ".json", ".pt")


@dataclass
class Step:
    """One training step of an export: its tokens as a Dump, each token's position in its response and,
    where the format has them, the sampled token ids."""

    step: int
    dump: Dump
    position_R: torch.Tensor  # long: 0 = the first kept token of its response
    token_ids_R: torch.Tensor | None  # long
    files: list[str]


@dataclass
class _Seq:
    """One response's kept tokens; top = (in_top, top_engine rows, top_train rows) when top-k is known."""

    engine: list[float]
    train: list[float]
    position: list[int]
    ids: list[int] | None
    top: tuple | None = None


# ---------------------------------------------------------------------------------------------------
# Files, values and masks


def expand(path: str) -> list[Path]:
    """The files PATH names: itself, a folder's dump files (recursively), or a glob's matches; sorted."""
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise BadInput(f"--dump {path}: no such file or folder")
    if not files:
        raise BadInput(f"--dump {path}: no dump files there (expected {', '.join(SUFFIXES)})")
    return files


def check_bytes(path: Path) -> None:
    """A dump file larger than a dump can sensibly be is refused before it is read (dumps.MAX_PT_BYTES)."""
    if path.stat().st_size > MAX_PT_BYTES:
        raise BadInput(f"{path}: {path.stat().st_size} bytes; at most {MAX_PT_BYTES} (judge a sample of it)")


def load_pt(path: Path):
    check_bytes(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file: a pickle error, a truncated zip, a non-tensor object
        raise BadInput(f"{path}: not a readable torch file ({type(e).__name__})") from None


def jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, object) for each non-empty line."""
    check_bytes(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not UTF-8 text (expected JSONL)") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except (ValueError, RecursionError) as e:  # bad JSON, a 5000-digit integer, deep nesting
                reason = getattr(e, "msg", type(e).__name__)
                raise BadInput(f"{path}:{n}: not valid JSON ({reason})") from None
    return out


def _list(obj: dict, key: str, where: str) -> list:
    """A per-token field as a plain list (tensors flattened), or one line naming what is missing."""
    if not isinstance(obj, dict) or key not in obj or obj[key] is None:
        raise BadInput(f"{where}: missing field {key!r}")
    value = obj[key]
    if torch.is_tensor(value):
        return value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{where}: {key} must be a list or a tensor, not {type(value).__name__}")
    return list(value)


def _aligned(obj: dict, keys: tuple, where: str, n: int | None = None) -> list[list]:
    """Several per-token fields that must have one entry per token; a ragged one is named."""
    cols = [_list(obj, k, where) for k in keys]
    n = len(cols[0]) if n is None else n
    for key, col in zip(keys, cols):
        if len(col) != n:
            raise BadInput(f"{where}: {key} has {len(col)} entries, expected {n} (one per token)")
    return cols


def _logprob(value, where: str, field: str) -> float:
    """One kept token's log-prob: a finite number <= 0 (a null is prime-rl's record of a NaN)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise BadInput(f"{where}: {field} is {value!r} at a kept token; expected a finite log-prob")
    if value > 1e-6:
        raise BadInput(f"{where}: {field} holds a positive log-prob ({value:g}); log-probs are <= 0")
    return float(value)


def _keep(keep: list[bool], engine: list, train: list, ids: list | None, names: tuple, where: str) -> _Seq:
    """The kept tokens of one response, validated; positions count from the response's first kept token."""
    idx = [t for t, k in enumerate(keep) if k]
    first = idx[0] if idx else 0
    return _Seq(
        [_logprob(engine[t], where, names[0]) for t in idx],
        [_logprob(train[t], where, names[1]) for t in idx],
        [t - first for t in idx],
        [int(ids[t]) for t in idx] if ids is not None else None,
    )


# ---------------------------------------------------------------------------------------------------
# Building steps


def _build(seqs: list[_Seq], step: int, files: list[str]) -> Step:
    seqs = [s for s in seqs if s.engine]
    if not seqs:
        raise BadInput(f"{files[0]}: step {step} has no token under the system's masks")

    def flat(get) -> list:
        return [x for s in seqs for x in get(s)]

    dump = Dump(
        torch.tensor(flat(lambda s: s.engine), dtype=torch.float64),
        torch.tensor(flat(lambda s: s.train), dtype=torch.float64),
        torch.tensor([i for i, s in enumerate(seqs) for _ in s.engine]),
    )
    if all(s.top is not None for s in seqs):
        k = max(len(row) for s in seqs for row in s.top[1])

        def pad(rows: list[list[float]]) -> list[list[float]]:  # unfilled top-k slots: -inf (port/dumps.py)
            return [r + [-math.inf] * (k - len(r)) for r in rows]

        dump.in_top_R = torch.tensor(flat(lambda s: s.top[0]))
        dump.top_engine_R_K = torch.tensor(pad(flat(lambda s: s.top[1])), dtype=torch.float64)
        dump.top_train_R_K = torch.tensor(pad(flat(lambda s: s.top[2])), dtype=torch.float64)
    ids = torch.tensor(flat(lambda s: s.ids)) if all(s.ids is not None for s in seqs) else None
    return Step(step, dump, torch.tensor(flat(lambda s: s.position)), ids, files)


def _steps(parts: list[tuple[int, int, str, list[_Seq]]], contiguous: bool) -> list[Step]:
    """Merge (step, rank, file, seqs) parts into steps. Every step must have the same rank files (and,
    where every rank writes, ranks 0..n-1): a missing rank file is named."""
    by_step: dict[int, dict[int, tuple[str, list[_Seq]]]] = {}
    for step, rank, file, seqs in parts:
        if rank in by_step.setdefault(step, {}):
            raise BadInput(f"{file}: step {step} rank {rank} also read from {by_step[step][rank][0]}")
        by_step[step][rank] = (file, seqs)
    ranks = set().union(*(set(r) for r in by_step.values()))
    expected = set(range(max(ranks) + 1)) if contiguous else ranks
    for step, files in sorted(by_step.items()):
        missing = sorted(expected - set(files))
        if missing:
            raise BadInput(
                f"{next(iter(files.values()))[0]}: step {step} has no file for rank {missing[0]} "
                f"(the export has ranks {', '.join(map(str, sorted(expected)))}): a rank file is missing"
            )
    return [
        _build([s for r in sorted(f) for s in f[r][1]], step, files=[f[r][0] for r in sorted(f)])
        for step, f in sorted(by_step.items())
    ]


def merge(steps: list[Step]) -> Step:
    """The selected steps as one Step (sequences renumbered); top-k kept only if every step has it."""
    offsets = torch.tensor([0] + [s.dump.sequences for s in steps]).cumsum(0)

    def cat(get) -> torch.Tensor:
        return torch.cat([get(s) for s in steps])

    dump = Dump(
        cat(lambda s: s.dump.engine_R),
        cat(lambda s: s.dump.train_R),
        torch.cat([s.dump.seq_id_R + offsets[i] for i, s in enumerate(steps)]),
    )
    if all(s.dump.top_engine_R_K is not None for s in steps):
        k = max(s.dump.top_engine_R_K.shape[1] for s in steps)

        def pad(t_R_K: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t_R_K, (0, k - t_R_K.shape[1]), value=-math.inf)

        dump.in_top_R = cat(lambda s: s.dump.in_top_R)
        dump.top_engine_R_K = cat(lambda s: pad(s.dump.top_engine_R_K))
        dump.top_train_R_K = cat(lambda s: pad(s.dump.top_train_R_K))
    ids = cat(lambda s: s.token_ids_R) if all(s.token_ids_R is not None for s in steps) else None
    return Step(steps[-1].step, dump, cat(lambda s: s.position_R), ids, [f for s in steps for f in s.files])


# ---------------------------------------------------------------------------------------------------
# One reader per format


def read_project(files: list[Path]) -> list[Step]:
    """dumps.read_dump per file (one step each); token ids from the JSONL lines when every line has them."""
    steps = []
    for n, path in enumerate(files):
        dump = read_dump(path)
        counts = torch.bincount(dump.seq_id_R, minlength=dump.sequences).tolist()
        position = torch.tensor([t for c in counts for t in range(c)])
        ids = None
        if path.suffix != ".pt":
            rows = [obj.get("token_ids") for _, obj in jsonl(path)]
            if all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in rows):
                ids = torch.tensor([i for r in rows for i in r])
        steps.append(
            Step(
                n, dump, position, ids if ids is not None and len(ids) == len(position) else None, [str(path)]
            )
        )
    return steps


def _prime_record(obj: dict, where: str) -> _Seq:
    keys = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
    ids, loss_mask, engine, train = _aligned(obj, keys, where)
    keep = [bool(m) for m in loss_mask]
    streams = [obj.get(k) for k in ("rl_weights", "ref_kl_weights")]
    streams = [s if isinstance(s, list) and any(w is not None for w in s) else None for s in streams]
    rl, ref = streams
    for key, stream in (("rl_weights", rl), ("ref_kl_weights", ref)):
        if stream is not None and len(stream) != len(keep):
            raise BadInput(f"{where}: {key} has {len(stream)} entries, expected {len(keep)} (one per token)")
    if rl is not None or ref is not None:  # prime-rl's mismatch mask: only tokens the policy sampled
        sampled = [
            (rl is None or bool(rl[t])) or (ref is not None and bool(ref[t])) for t in range(len(keep))
        ]
        keep = [k and s for k, s in zip(keep, sampled)]
    return _keep(keep, engine, train, ids=ids, names=("inference_logprobs", "trainer_logprobs"), where=where)


def read_prime_rl(files: list[Path]) -> list[Step]:
    parts = []
    for path in files:
        if not re.fullmatch(r"rank_\d+\.jsonl", path.name) or not re.fullmatch(r"step_\d+", path.parent.name):
            raise BadInput(f"{path}: prime-rl writes token_exports/step_<N>/rank_<R>.jsonl; this is not one")
        if not (path.parent / "STABLE").exists():
            raise BadInput(
                f"{path.parent}: no STABLE file; prime-rl writes it once every rank has flushed the step, "
                "so this step is incomplete (a rank file may be missing or cut short)"
            )
        records = jsonl(path)
        if not records:
            raise BadInput(f"{path}: no records")
        seqs = [_prime_record(obj, f"{path}:{n}") for n, obj in records]
        for n, obj in records:
            if (obj.get("step"), obj.get("rank")) != (records[0][1].get("step"), records[0][1].get("rank")):
                raise BadInput(f"{path}:{n}: step/rank differ from the file's first record")
        step, rank = (records[0][1].get(k) for k in ("step", "rank"))
        if not isinstance(step, int) or not isinstance(rank, int):
            raise BadInput(f"{path}:{records[0][0]}: missing field 'step' or 'rank'")
        parts.append((step, rank, str(path), seqs))
    return _steps(parts, contiguous=False)


def _slime_samples(obj, path: Path) -> tuple[int, int, list[dict]]:
    """(rollout_id, rank, samples) from either slime layout."""
    if not isinstance(obj, dict) or ("samples" not in obj and "rollout_data" not in obj):
        raise BadInput(f"{path}: missing field 'samples' (slime main) or 'rollout_data' (slime v0.3.1)")
    step, rank = obj.get("rollout_id"), obj.get("rank", 0)
    if not isinstance(step, int) or not isinstance(rank, int):
        raise BadInput(f"{path}: missing field 'rollout_id' or 'rank'")
    if "samples" in obj:
        return step, rank, list(obj["samples"])
    data = obj["rollout_data"]
    n = len(_list(data, "response_lengths", f"{path}: rollout_data"))
    per_sample = [k for k, v in data.items() if isinstance(v, (list, tuple)) and len(v) == n]
    return step, rank, [{k: data[k][i] for k in per_sample} for i in range(n)]


def read_slime(files: list[Path]) -> list[Step]:
    parts, seen, every_rank_writes = [], set(), True
    for path in files:
        obj = load_pt(path)
        every_rank_writes &= isinstance(obj, dict) and "rollout_data" in obj  # v0.3.1; main: one writer
        step, rank, samples = _slime_samples(obj, path)
        seqs = []
        for i, s in enumerate(samples):
            where = f"{path}: sample {i}"
            key = (step, s.get("sample_indices", s.get("sample_index")))
            if key[1] is not None and key in seen:
                continue  # the same sample from another tensor-parallel rank
            seen.add(key)
            if "log_probs" not in s:
                raise BadInput(
                    f"{where}: missing field 'log_probs' (slime v0.3.1 recomputes them only without "
                    "--use-rollout-logprobs, or with --get-mismatch-metrics)"
                )
            n = s.get("response_lengths")
            n = int(n) if isinstance(n, int) or (torch.is_tensor(n) and n.numel() == 1) else None
            engine, train, mask = _aligned(s, ("rollout_log_probs", "log_probs", "loss_masks"), where, n=n)
            tokens = _list(s, "tokens", where)
            ids = tokens[len(tokens) - len(mask) :] if len(tokens) >= len(mask) else None
            keep = [bool(m) for m in mask]
            seqs.append(
                _keep(keep, engine, train, ids=ids, names=("rollout_log_probs", "log_probs"), where=where)
            )
        parts.append((step, rank, str(path), seqs))
    return _steps(parts, contiguous=every_rank_writes)


def _padded(obj, path: Path, keys: tuple, step_key: str) -> tuple[int, list[list]]:
    """(step, [B, T] tensors as nested lists) from a dict of same-shape tensors."""
    if not isinstance(obj, dict):
        raise BadInput(f"{path}: expected a dict of tensors")
    for k in keys:
        if not torch.is_tensor(obj.get(k)) or obj[k].dim() != 2:
            raise BadInput(f"{path}: missing field {k!r} (a [B, T] tensor)")
    shape = obj[keys[0]].shape
    for k in keys:
        if obj[k].shape != shape:
            raise BadInput(f"{path}: {k} is {tuple(obj[k].shape)}, {keys[0]} is {tuple(shape)}; must match")
    step = obj.get(step_key)
    step = int(step) if isinstance(step, int) or (torch.is_tensor(step) and step.numel() == 1) else None
    if step is None:
        raise BadInput(f"{path}: missing field {step_key!r} (the step number the dump hook saves)")
    return step, [obj[k].float().tolist() if obj[k].is_floating_point() else obj[k].tolist() for k in keys]


def read_verl(files: list[Path]) -> list[Step]:
    keys = ("responses", "rollout_log_probs", "old_log_probs", "response_mask")
    parts = []
    for path in files:
        step, (ids, engine, train, mask) = _padded(load_pt(path), path, keys, step_key="global_steps")
        seqs = [
            _keep(
                [bool(m) for m in mask[b]],
                engine[b],
                train[b],
                ids=ids[b],
                names=keys[1:3],
                where=f"{path}: row {b}",
            )
            for b in range(len(mask))
        ]
        parts.append((step, 0, str(path), seqs))
    return _steps(parts, contiguous=True)


def read_trl(files: list[Path]) -> list[Step]:
    keys = ("completion_ids", "sampling_per_token_logps", "old_per_token_logps", "completion_mask")
    parts = []
    for path in files:
        obj = load_pt(path)
        step, (ids, engine, train, mask) = _padded(obj, path, keys, step_key="global_step")
        tool = obj.get("tool_mask")
        if tool is not None and (not torch.is_tensor(tool) or tool.shape != obj["completion_mask"].shape):
            raise BadInput(f"{path}: tool_mask must be a tensor shaped like completion_mask")
        tool = tool.tolist() if tool is not None else [[1] * len(r) for r in mask]
        rank = obj.get("process_index", 0)
        seqs = []
        for b in range(len(mask)):
            keep = [bool(m) and bool(u) and not math.isnan(e) for m, u, e in zip(mask[b], tool[b], engine[b])]
            seqs.append(
                _keep(keep, engine[b], train[b], ids=ids[b], names=keys[1:3], where=f"{path}: row {b}")
            )
        parts.append((step, int(rank), str(path), seqs))
    return _steps(parts, contiguous=True)


def _vllm_k(ids: list[int], rows: list[dict]) -> int | None:
    """k of SamplingParams(logprobs=k), from the sampled token's rank r in each position's dict of n
    entries: r < n means it is inside the top k (k = n); r > n means it was added (k = n - 1)."""
    for y, row in zip(ids, rows):
        rank, n = (row.get(str(y)) or {}).get("rank"), len(row)
        if not isinstance(rank, int):
            return None
        if rank != n:
            return n if rank < n else n - 1
    return None  # every position ambiguous: use k3


def _entry(row: dict, token: int):
    """The log-prob a vLLM {token_id: Logprob} dict holds for `token` (a message when it holds none)."""
    return (row.get(str(token)) or {}).get("logprob", f"no entry for token {token}")


def _vllm_line(obj: dict, where: str) -> _Seq:
    eng, trn = obj.get("engine"), obj.get("train")
    if not isinstance(eng, dict) or not isinstance(trn, dict):
        raise BadInput(f"{where}: missing field 'engine' or 'train' (a vLLM RequestOutput as a dict)")
    out = (eng.get("outputs") or [None])[0]
    ids, rows = _aligned(out, ("token_ids", "logprobs"), f"{where}: engine.outputs[0]")
    prompt = _list(eng, "prompt_token_ids", f"{where}: engine")
    if _list(trn, "prompt_token_ids", f"{where}: train") != prompt + ids:
        raise BadInput(
            f"{where}: train.prompt_token_ids is not engine.prompt_token_ids + token_ids "
            "(score the engine's token ids, never re-tokenised text)"
        )
    scored = _list(trn, "prompt_logprobs", f"{where}: train")[len(prompt) :]
    if len(scored) != len(ids) or not all(isinstance(r, dict) for r in scored + rows):
        raise BadInput(f"{where}: train.prompt_logprobs must hold one dict per response token")
    engine = [_entry(r, y) for r, y in zip(rows, ids)]
    train = [_entry(r, y) for r, y in zip(scored, ids)]
    names = ("engine logprobs", "train prompt_logprobs")
    seq = _keep([True] * len(ids), engine, train, ids=ids, names=names, where=where)
    k = _vllm_k(ids, rows)
    if k:
        tops = [[i for i, e in r.items() if isinstance(e.get("rank"), int) and e["rank"] <= k] for r in rows]
        if all(str(i) in s for top, s in zip(tops, scored) for i in top):
            seq.top = (
                [str(y) in top for y, top in zip(ids, tops)],
                [
                    [_logprob(r[i]["logprob"], where, "engine logprobs") for i in top]
                    for r, top in zip(rows, tops)
                ],
                [
                    [_logprob(s[i]["logprob"], where, "train prompt_logprobs") for i in top]
                    for s, top in zip(scored, tops)
                ],
            )
    return seq


def read_vllm(files: list[Path]) -> list[Step]:
    steps = []
    for n, path in enumerate(files):
        seqs = [_vllm_line(obj, f"{path}:{line}") for line, obj in jsonl(path)]
        if not seqs:
            raise BadInput(f"{path}: no records")
        steps.append(_build(seqs, n, files=[str(path)]))
    return steps


READERS = {
    "project": read_project,
    "prime-rl": read_prime_rl,
    "slime": read_slime,
    "verl": read_verl,
    "trl": read_trl,
    "vllm": read_vllm,
}


# ---------------------------------------------------------------------------------------------------
# Format detection and the entry point


def _signature(path: Path) -> str | None:
    """The format one file's fields identify (any of a format's marking fields), or None."""
    if path.suffix == ".pt":
        obj = load_pt(path)
        keys = set(obj) if isinstance(obj, dict) else set()
        marks = [
            ("slime", {"samples", "rollout_data"}),
            ("verl", {"rollout_log_probs", "old_log_probs", "response_mask"}),
            ("trl", {"sampling_per_token_logps", "old_per_token_logps", "completion_mask"}),
            ("project", {"engine_logprobs", "train_logprobs"}),
        ]
    else:
        records = jsonl(path)
        if not records:
            raise BadInput(f"--dump {path}: no sequences (expected one JSON object per line)")
        keys = set(records[0][1]) if isinstance(records[0][1], dict) else set()
        marks = [
            ("prime-rl", {"inference_logprobs", "trainer_logprobs", "loss_mask"}),
            ("vllm", {"engine", "train"}),
            ("project", {"engine_logprobs", "train_logprobs"}),
        ]
    found = {fmt for fmt, any_of in marks if any_of & keys}
    return found.pop() if len(found) == 1 else None


def detect(files: list[Path], path: str) -> str:
    """The one format the first and the last file's fields identify; else one line asking for --format."""
    found = {_signature(f) for f in files[:1] + files[-1:]}
    if len(found) != 1 or None in found:
        raise BadInput(
            f"--dump {path}: cannot tell the format from its fields; pass --format ({', '.join(FORMATS)})"
        )
    return found.pop()


def read_native(path: str, fmt: str | None = None) -> tuple[str, list[Step]]:
    """(format, steps oldest first) of the export at PATH; fmt None = detect it."""
    files = expand(path)
    fmt = fmt or detect(files, path)
    return fmt, READERS[fmt](files)


def select_steps(steps: list[Step], spec: str | None) -> list[Step]:
    """The steps a --steps spec names ("3", "2-5", "0,4-6"; None or "all" = every step)."""
    if spec is None or spec == "all":
        return steps
    wanted = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise BadInput(f"--steps {spec!r}: expected step numbers and ranges such as 0,4-6, or all")
        wanted |= set(range(int(lo), int(hi or lo) + 1))
    chosen = [s for s in steps if s.step in wanted]
    if not chosen:
        raise BadInput(f"--steps {spec!r}: none of these steps is in the dump (it has {_names(steps)})")
    return chosen


def _names(steps: list[Step]) -> str:
    nums = [s.step for s in steps]
    return ", ".join(map(str, nums)) if len(nums) <= 8 else f"{nums[0]}..{nums[-1]} ({len(nums)} steps)"
