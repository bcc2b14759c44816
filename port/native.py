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
          forward); main captures them from the training forward. v0.3.1 under model parallelism: a
          sample's copies (by `sample_indices`) are gathered across the step's rank files (Megatron's rank
          order tp-cp-ep-dp-pp); with pipeline parallelism only the last stage's files hold `log_probs`
          (`forward_only`), the other stages' `loss_masks` must agree; with context parallelism each CP
          rank holds two zigzag slices (`cp_utils.slice_log_prob_with_cp`), put back in order; another CP
          layout (--allgather-cp) is refused, naming main 624b824, which gathers the slices itself. In a
          --dump-details folder, `DIR/rollout_data/` (rollout dumps, no trainer log-probs) is left out.
verl      verl 0.9.1 writes no log-prob file of its own: this reads one `.pt` per step from the hook in
          PORTING.md (in `PPOTrainer._compute_old_log_prob`, `verl/trainer/ppo/v1/trainer_base.py`), a dict
          of the batch's own tensors [B, R]: `responses`, `rollout_log_probs` (the rollout engine),
          `old_log_probs` (the actor's recompute), `response_mask`; plus `global_steps` (the trainer's
          attribute; the key is ours), and `temperature`, `top_p` (the rollout config's; keys ours).
          Kept: response_mask.
trl       TRL 1.16.0 writes no log-prob file either: one `.pt` per step and process from the
          GRPOTrainer hook in PORTING.md, holding `_generate_and_score_completions`' own outputs
          (`trl/trainer/grpo_trainer.py`): `completion_ids`, `completion_mask`, `sampling_per_token_logps`
          (vLLM; NaN where vLLM gave none), `old_per_token_logps`, and `tool_mask` in tool-using runs
          (0 on tool-result tokens, whose engine log-prob TRL sets to 0.0); plus `global_step` and
          `process_index` (keys ours, values TRL's `state.global_step` and accelerate's), and
          `temperature`, `top_p` (GRPOConfig's; keys ours). Kept: completion_mask * tool_mask, minus NaN
          engine log-probs (TRL's own "no log-prob" marker).
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
          otherwise the step falls back to k3 on the sampled token. One file is one step. Our key
          `sampling` holds {temperature, top_p, logprobs_mode} of the generating run.

Each step carries the sampling settings its export records (`Step.sampling`); sampling_check says whether
both columns are the distribution the tokens were drawn from (logged_at: each system's columns).

    python admit.py check --budget budgets/tiny/budget.json --dump runs/x/token_exports --top-p 1
"""

import glob
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cli import BadInput
from port.dumps import (
    MAX_PT_BYTES,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    Dump,
    check_size,
    check_tensor,
    is_number,
    is_token_id,
    logprob_problem,
    read_dump,
)

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
    sampling: dict = field(default_factory=dict)  # what the export records: temperature, top_p, logprobs_mode


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


# ---------------------------------------------------------------------------------------------------
# Typed fields: every field a reader uses is checked here, by port/dumps.py's rules (log-prob numbers,
# token-id ranges, tensor dtypes, sizes), before any value of it is converted


MAX_RANK = 2**16  # ranks (processes) of one step; a larger rank number is not one


def _integer(v) -> int | None:
    """v as an integer: a Python int (no bool) or a one-element integer tensor; None for anything else."""
    if torch.is_tensor(v) and v.numel() == 1 and not (v.is_floating_point() or v.is_complex()):
        return int(v) if v.dtype != torch.bool else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


ENTRIES = {  # a per-token kind: (entry test, what the entries must be, the tensor kind of dumps.check_tensor)
    "ids": (is_token_id, f"token ids in [0, {MAX_TOKEN_ID}]", "ids"),
    "mask": (lambda v: isinstance(v, bool) or (is_number(v) and math.isfinite(v)), "0/1 or booleans", "mask"),
    "logprobs": (lambda v: v is None or is_number(v), "log-probs (numbers, or null)", "logprobs"),
    "weights": (
        lambda v: v is None or (is_number(v) and math.isfinite(v)),
        "finite weights or null",
        "logprobs",
    ),
}
SCALARS = {  # a scalar kind: (test of the integer, what it must be)
    "step": (lambda n: 0 <= n < 2**63, "a step number (an integer >= 0)"),
    "rank": (lambda n: 0 <= n < MAX_RANK, f"a rank (an integer in [0, {MAX_RANK}))"),
    "length": (lambda n: 0 <= n <= MAX_TOKENS, f"a length (an integer in [0, {MAX_TOKENS}])"),
    "index": (lambda n: 0 <= n < 2**63, "an index (an integer >= 0)"),
}


def _shown(v) -> str:
    if torch.is_tensor(v):
        return f"a tensor of {v.dtype} {tuple(v.shape)}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)[:40]


def typed(obj, key: str, kind: str, where: str):
    """obj[key] checked as `kind` before any of it is converted, as plain Python values; one line naming
    the field (and the entry) and what is accepted otherwise, a missing field or a null likewise.
        ids, mask, logprobs, weights   per token: a list whose every entry is one (ENTRIES), or a tensor
                                       of the dtype dumps.check_tensor accepts for it (flattened)
        step, rank, length             an integer (or a one-element integer tensor) in range (SCALARS)
        object, list                   a dict, a list"""
    if not isinstance(obj, dict):
        raise BadInput(f"{where} is {_shown(obj)}; expected an object with field {key!r}")
    if obj.get(key) is None:
        raise BadInput(f"{where}: missing field {key!r}")
    value = obj[key]
    if kind in ("object", "list"):
        if not isinstance(value, dict if kind == "object" else list):
            raise BadInput(f"{where}: {key} is {_shown(value)}; expected a{'n' * (kind == 'object')} {kind}")
        return value
    if kind in SCALARS:
        test, words = SCALARS[kind]
        n = _integer(value)
        if n is None or not test(n):
            raise BadInput(f"{where}: {key} is {_shown(value)}; expected {words}")
        return n
    test, words, tensor_kind = ENTRIES[kind]
    if torch.is_tensor(value):
        check_tensor(value, key, tensor_kind, where=where)
        if value.numel() > MAX_TOKENS:
            raise BadInput(f"{where}: {key} holds {value.numel()} values; a dump holds at most {MAX_TOKENS}")
        return value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{where}: {key} is {_shown(value)}; expected a list of {words} or a tensor")
    for i, v in enumerate(value):
        if not test(v):
            raise BadInput(f"{where}: {key}[{i}] is {_shown(v)}; expected {words}")
    return list(value)


def _aligned(obj: dict, fields: tuple, where: str, n: int | None = None) -> list[list]:
    """Several per-token fields, (key, kind) each (typed), that must have one entry per token; a ragged
    one is named."""
    cols = [typed(obj, key, kind, where=where) for key, kind in fields]
    n = len(cols[0]) if n is None else n
    for (key, _), col in zip(fields, cols):
        if len(col) != n:
            raise BadInput(f"{where}: {key} has {len(col)} entries, expected {n} (one per token)")
    return cols


def _logprob(value, where: str, name: str) -> float:
    """One kept token's log-prob by port/dumps.py's rule (logprob_problem): a finite number in
    [MIN_LOGPROB, 0]; a null is prime-rl's record of a NaN, a NaN TRL's of no log-prob."""
    if not is_number(value) or not math.isfinite(value):  # also vLLM's "no entry for token y" (_entry)
        raise BadInput(f"{where}: {name} is {_shown(value)} at a kept token; expected a finite log-prob")
    if problem := logprob_problem(value):
        raise BadInput(f"{where}: {name} holds {problem} at a kept token")
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
    check_size(Path(files[0]), sequences=len(seqs), tokens=sum(len(s.engine) for s in seqs))  # dumps' limits

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
    """Merge (step, rank, file, seqs) parts into steps (rank files checked by _rank_files)."""
    by_step = _rank_files(parts, contiguous)
    return [
        _build([s for r in sorted(f) for s in f[r][1]], step, files=[f[r][0] for r in sorted(f)])
        for step, f in sorted(by_step.items())
    ]


def _rank_files(parts: list[tuple], contiguous: bool) -> dict[int, dict[int, tuple]]:
    """{step: {rank: (file, payload)}} of (step, rank, file, payload) parts. Every step must have the same
    rank files (and, where every rank writes, ranks 0..n-1): a missing rank file is named."""
    by_step: dict[int, dict[int, tuple]] = {}
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
    return by_step


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
    fields = (("token_ids", "ids"), ("loss_mask", "mask"), ("inference_logprobs", "logprobs"))
    ids, loss_mask, engine, train = _aligned(obj, (*fields, ("trainer_logprobs", "logprobs")), where)
    keep = [bool(m) for m in loss_mask]
    keys = ("rl_weights", "ref_kl_weights")  # all null when the run has no such stream
    streams = [typed(obj, k, "weights", where=where) if obj.get(k) is not None else None for k in keys]
    streams = [s if s is not None and any(w is not None for w in s) else None for s in streams]
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
        keys = [tuple(typed(obj, k, k, where=f"{path}:{n}") for k in ("step", "rank")) for n, obj in records]
        for (n, _), key in zip(records, keys):
            if key != keys[0]:
                raise BadInput(f"{path}:{n}: step/rank differ from the file's first record")
        parts.append((*keys[0], str(path), seqs))
    return _steps(parts, contiguous=False)


def _slime_samples(obj, path: Path) -> tuple[int, int, list[dict]]:
    """(rollout_id, rank, samples) from either slime layout; a rollout dump is named as one."""
    if not isinstance(obj, dict) or ("samples" not in obj and "rollout_data" not in obj):
        raise BadInput(f"{path}: missing field 'samples' (slime main) or 'rollout_data' (slime v0.3.1)")
    if "samples" in obj and "format_version" not in obj and "rank" not in obj:
        raise BadInput(
            f"{path}: a slime rollout dump ({{rollout_id, samples}}: --save-debug-rollout-data, or "
            "DIR/rollout_data/ of --dump-details), which holds no trainer log-probs; read the training dumps "
            "(--save-debug-train-data, DIR/train_data/)"
        )
    step = typed(obj, "rollout_id", "step", where=str(path))
    rank = typed(obj, "rank", "rank", where=str(path)) if obj.get("rank") is not None else 0
    if "samples" in obj:
        samples = typed(obj, "samples", "list", where=str(path))
    else:
        data = typed(obj, "rollout_data", "object", where=str(path))
        n = len(typed(data, "response_lengths", "list", where=f"{path}: rollout_data"))
        per_sample = [k for k, v in data.items() if isinstance(v, (list, tuple)) and len(v) == n]
        samples = [{k: data[k][i] for k in per_sample} for i in range(n)]
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise BadInput(f"{path}: sample {i} is {_shown(sample)}; expected a dict of the sample's fields")
    return step, rank, samples


NO_LOG_PROBS = (
    "slime v0.3.1 recomputes them only without --use-rollout-logprobs or with --get-mismatch-metrics, and "
    "not when a single-micro-batch policy loss reuses the training forward (can_reuse_log_probs_in_loss); "
    "slime main 624b824 captures them from the training forward"
)


def read_slime(files: list[Path]) -> list[Step]:
    """Both layouts. Each step's copies of a sample (by its index: v0.3.1's sample_indices, main's
    sample_index) are gathered across the step's rank files and read once, from the files that hold its
    log_probs (v0.3.1 writes them on the last pipeline stage only; _slime_step)."""
    loaded, every_rank_writes = [], True
    for path in files:
        obj = load_pt(path)
        every_rank_writes &= isinstance(obj, dict) and "rollout_data" in obj  # v0.3.1; main: one writer
        loaded.append((str(path), *_slime_samples(obj, path)))
    _rank_files([(step, rank, file, None) for file, step, rank, _ in loaded], contiguous=every_rank_writes)
    parts = []
    for step in sorted({step for _, step, _, _ in loaded}):
        of_step = sorted(((r, f, x) for f, st, r, x in loaded if st == step), key=lambda c: c[0])
        seqs = _slime_step(step, of_step, v031=every_rank_writes)
        parts += [(step, rank, file, seqs.get(file, [])) for rank, file, _ in of_step]
    return _steps(parts, contiguous=every_rank_writes)


def _slime_step(step: int, files: list[tuple[int, str, list[dict]]], v031: bool) -> dict[str, list[_Seq]]:
    """{file: seqs} of one step, each sample once, under the first file holding its log_probs. With
    pipeline parallelism (v0.3.1) the other stages' files hold the sample without log_probs: their
    loss_masks must agree with the last stage's. With context parallelism the last stage's copies hold
    slices, put back in order (_cp_size, _put_back)."""
    copies: dict = {}  # sample index -> [(rank, file, i, sample)], ranks ascending
    for rank, file, samples in files:
        for i, x in enumerate(samples):
            index = next((k for k in ("sample_indices", "sample_index") if x.get(k) is not None), None)
            key = typed(x, index, "index", where=f"{file}: sample {i}") if index else (file, i)
            copies.setdefault(key, []).append((rank, file, i, x))
    if not any("log_probs" in c[3] for cs in copies.values() for c in cs):
        _, file, i, _ = next(iter(copies.values()))[0]
        stages = "; with pipeline parallelism only the last stage's ranks write them" if v031 else ""
        raise BadInput(f"{file}: sample {i}: missing field 'log_probs' ({NO_LOG_PROBS}{stages})")
    last = {key: [c for c in cs if "log_probs" in c[3]] for key, cs in copies.items()}
    for key, cs in copies.items():
        if not last[key]:
            why = (
                "with pipeline parallelism slime v0.3.1 writes log_probs on the last stage's ranks only, "
                f"and no file of step {step} there holds sample index {key}: read every rank's file"
                if v031
                else NO_LOG_PROBS
            )
            raise BadInput(f"{cs[0][1]}: sample {cs[0][2]}: missing field 'log_probs' ({why})")
        _same_masks(key, cs, last[key][0])
    cp = _cp_size(step, last)
    out: dict[str, list[_Seq]] = {}
    for cs in last.values():
        _, file, i, _ = cs[0]
        out.setdefault(file, []).append(_slime_seq(_put_back(cs, cp), f"{file}: sample {i}"))
    return out


def _slime_seq(x: dict, where: str) -> _Seq:
    """One sample's kept tokens, its fields over the whole response."""
    n = typed(x, "response_lengths", "length", where=where) if x.get("response_lengths") is not None else None
    fields = (("rollout_log_probs", "logprobs"), ("log_probs", "logprobs"), ("loss_masks", "mask"))
    engine, train, mask = _aligned(x, fields, where, n=n)
    tokens = typed(x, "tokens", "ids", where=where)
    ids = tokens[len(tokens) - len(mask) :] if len(tokens) >= len(mask) else None
    keep = [bool(m) for m in mask]
    return _keep(keep, engine, train, ids=ids, names=("rollout_log_probs", "log_probs"), where=where)


def _same_masks(key, copies: list[tuple], ref: tuple) -> None:
    """Every copy of a sample (other pipeline stages, tensor-parallel ranks) trains the same tokens."""
    mask = typed(ref[3], "loss_masks", "mask", where=f"{ref[1]}: sample {ref[2]}")
    for _, file, i, x in copies:
        if x is not ref[3] and typed(x, "loss_masks", "mask", where=f"{file}: sample {i}") != mask:
            raise BadInput(
                f"{file}: sample {i}: loss_masks differ from the copy of sample index {key} in {ref[1]}: "
                "the ranks' files of one step disagree on which tokens train"
            )


def _slime_lengths(x: dict, where: str) -> tuple[int, int]:
    """(total length, response length) of a sample: total_lengths, else its tokens."""
    n = typed(x, "response_lengths", "length", where=where)
    if x.get("total_lengths") is not None:
        return typed(x, "total_lengths", "length", where=where), n
    return len(typed(x, "tokens", "ids", where=where)), n


def _zigzag(total: int, n: int, cp: int, r: int) -> list[int]:
    """The response positions CP rank r of cp holds in slime v0.3.1 (`cp_utils.slice_log_prob_with_cp`):
    the sequence of `total` tokens is cut into 2·cp chunks of ceil(total / 2cp), rank r holds chunks r and
    2cp − 1 − r, and the logit at position q scores token q + 1, so response token i (prompt P = total − n)
    is logit P − 1 + i. Positions of the first chunk, then of the second."""
    if cp == 1:
        return list(range(n))
    size, start = -(-total // (2 * cp)), total - n - 1
    out = []
    for c in (r, 2 * cp - 1 - r):
        lo, hi = max(c * size, start), min((c + 1) * size, total - 1)
        out += range(lo - start, hi - start) if lo < hi else []
    return out


def _length(v) -> int:
    return v.numel() if torch.is_tensor(v) else len(v) if isinstance(v, (list, tuple)) else -1


def _cp_fits(copies: list[tuple], cp: int) -> bool:
    """Whether `copies` (rank order) are tp = len / cp tensor-parallel copies of each of cp zigzag slices:
    copy j is CP rank j // tp (Megatron's rank order tp-cp-ep-dp-pp: tensor-parallel ranks fastest)."""
    if len(copies) % cp:
        return False
    tp = len(copies) // cp
    for j, (_, file, i, x) in enumerate(copies):
        total, n = _slime_lengths(x, f"{file}: sample {i}")
        if cp > 1 and sum(len(_zigzag(total, n, cp, r=r)) for r in range(cp)) != n:
            return False
        held = len(_zigzag(total, n, cp, r=j // tp))
        if any(_length(x.get(k)) != held for k in ("rollout_log_probs", "log_probs")):
            return False
    return True


def _cp_size(step: int, last: dict) -> int:
    """The context-parallel size of a step: the one size under which every sample's last-stage copies hold
    exactly their CP rank's zigzag positions (1: whole responses). None fits: CP slices of another layout
    (--allgather-cp splits the packed batch), refused by name, unless every sample has one copy (a field
    of the wrong length, which _slime_seq names); several fit: refused."""
    fits = None
    for key, cs in last.items():
        ok = {cp for cp in range(1, len(cs) + 1) if _cp_fits(cs, cp)}
        fits = ok if fits is None else fits & ok
        if not fits and max(len(c) for c in last.values()) > 1:
            _, file, i, x = cs[0]
            lens = [_length(c[3].get("log_probs")) for c in cs]
            raise BadInput(
                f"{file}: sample {i}: step {step} holds sample index {key} on ranks "
                f"{', '.join(str(c[0]) for c in cs)} with {lens} log_probs entries, which no zigzag context-"
                f"parallel split of its {_slime_lengths(x, file)[1]} response tokens gives: slime v0.3.1 "
                "CP slices of another layout (--allgather-cp) cannot be put back from the files; dump with "
                "CP 1, or with slime main 624b824 or later, which gathers the CP slices before it writes"
            )
    if fits and len(fits) > 1:
        raise BadInput(
            f"step {step}: the slime v0.3.1 files fit context-parallel sizes {sorted(fits)} alike; cannot "
            "tell how to put the slices back: dump with CP 1, or with slime main 624b824 or later"
        )
    return fits.pop() if fits else 1


def _put_back(copies: list[tuple], cp: int) -> dict:
    """A sample with whole-response rollout_log_probs and log_probs: each CP rank's slices (its first
    tensor-parallel copy) written at the positions _zigzag gives."""
    first = copies[0][3]
    if cp == 1:
        return first
    tp = len(copies) // cp
    total, n = _slime_lengths(first, f"{copies[0][1]}: sample {copies[0][2]}")
    engine, train = [None] * n, [None] * n
    for r in range(cp):
        _, file, i, x = copies[r * tp]
        where = f"{file}: sample {i}"
        e = typed(x, "rollout_log_probs", "logprobs", where=where)
        t = typed(x, "log_probs", "logprobs", where=where)
        for q, a, b in zip(_zigzag(total, n, cp, r=r), e, t):
            engine[q], train[q] = a, b
    return {**first, "rollout_log_probs": engine, "log_probs": train}


def _padded(obj, path: Path, fields: tuple, step_key: str) -> tuple[int, list[list]]:
    """(step, [B, T] tensors as nested lists) from a dict of same-shape tensors, (key, kind) each: typed
    (dumps.check_tensor: ids integer and in range, log-probs floating point, masks finite) and sized
    before any is converted."""
    if not isinstance(obj, dict):
        raise BadInput(f"{path}: expected a dict of tensors")
    keys = [k for k, _ in fields]
    for k, kind in fields:
        if not torch.is_tensor(obj.get(k)) or obj[k].dim() != 2:
            raise BadInput(f"{path}: missing field {k!r} (a [B, T] tensor)")
        check_tensor(obj[k], k, kind, where=str(path))
    shape = obj[keys[0]].shape
    for k in keys:
        if obj[k].shape != shape:
            raise BadInput(f"{path}: {k} is {tuple(obj[k].shape)}, {keys[0]} is {tuple(shape)}; must match")
    if shape.numel() > MAX_TOKENS:
        raise BadInput(f"{path}: {keys[0]} holds {shape.numel()} tokens; a dump holds at most {MAX_TOKENS}")
    step = typed(obj, step_key, "step", where=str(path))
    return step, [obj[k].float().tolist() if obj[k].is_floating_point() else obj[k].tolist() for k in keys]


def read_verl(files: list[Path]) -> list[Step]:
    keys = ("responses", "rollout_log_probs", "old_log_probs", "response_mask")
    fields = tuple(zip(keys, ("ids", "logprobs", "logprobs", "mask")))
    parts, recorded = [], {}
    for path in files:
        obj = load_pt(path)
        step, (ids, engine, train, mask) = _padded(obj, path, fields, step_key="global_steps")
        recorded.setdefault(step, []).append((str(path), _sampling(obj, str(path))))
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
    return _with_sampling(_steps(parts, contiguous=True), recorded)


def read_trl(files: list[Path]) -> list[Step]:
    keys = ("completion_ids", "sampling_per_token_logps", "old_per_token_logps", "completion_mask")
    fields = tuple(zip(keys, ("ids", "logprobs", "logprobs", "mask")))
    parts, recorded = [], {}
    for path in files:
        obj = load_pt(path)
        step, (ids, engine, train, mask) = _padded(obj, path, fields, step_key="global_step")
        recorded.setdefault(step, []).append((str(path), _sampling(obj, str(path))))
        tool = obj.get("tool_mask")
        if tool is not None and (not torch.is_tensor(tool) or tool.shape != obj["completion_mask"].shape):
            raise BadInput(f"{path}: tool_mask must be a tensor shaped like completion_mask")
        tool = check_tensor(tool, "tool_mask", "mask", where=str(path)).tolist() if tool is not None else None
        tool = tool or [[1] * len(r) for r in mask]
        rank = (
            typed(obj, "process_index", "rank", where=str(path))
            if obj.get("process_index") is not None
            else 0
        )
        seqs = []
        for b in range(len(mask)):
            keep = [bool(m) and bool(u) and not math.isnan(e) for m, u, e in zip(mask[b], tool[b], engine[b])]
            seqs.append(
                _keep(keep, engine[b], train[b], ids=ids[b], names=keys[1:3], where=f"{path}: row {b}")
            )
        parts.append((step, rank, str(path), seqs))
    return _with_sampling(_steps(parts, contiguous=True), recorded)


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


def _vllm_rows(rows: list, where: str, name: str, first: int = 0) -> list[dict]:
    """vLLM's per-position {token_id: Logprob} dicts (rows[t] is name[first + t]), typed: token ids as
    decimal text, each Logprob an object with a numeric `logprob` (dumps.is_number) and an integer `rank`
    or none."""
    for t, row in enumerate(rows, start=first):
        if not isinstance(row, dict):
            raise BadInput(f"{where}: {name}[{t}] is {_shown(row)}; expected a {{token_id: Logprob}} object")
        for token, e in row.items():
            rank = e.get("rank") if isinstance(e, dict) else None
            if not re.fullmatch(r"[0-9]{1,10}", token):
                raise BadInput(f"{where}: {name}[{t}] has the key {token[:20]!r}; expected token ids as keys")
            if not isinstance(e, dict) or not is_number(e.get("logprob")):
                raise BadInput(
                    f"{where}: {name}[{t}][{token[:20]!r}] is {_shown(e)}; expected a token id's Logprob "
                    "object {logprob: number, rank: integer}"
                )
            if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
                raise BadInput(
                    f"{where}: {name}[{t}][{token!r}].rank is {_shown(rank)}; expected an integer >= 0"
                )
    return rows


def _vllm_line(obj: dict, where: str) -> _Seq:
    eng, trn = (obj.get("engine"), obj.get("train")) if isinstance(obj, dict) else (None, None)
    if not isinstance(eng, dict) or not isinstance(trn, dict):
        raise BadInput(f"{where}: missing field 'engine' or 'train' (a vLLM RequestOutput as a dict)")
    outputs = typed(eng, "outputs", "list", where=f"{where}: engine")
    if not outputs:
        raise BadInput(f"{where}: engine.outputs is []; expected the request's completion output")
    ids, rows = _aligned(
        outputs[0], (("token_ids", "ids"), ("logprobs", "list")), f"{where}: engine.outputs[0]"
    )
    rows = _vllm_rows(rows, where, name="engine.outputs[0].logprobs")
    prompt = typed(eng, "prompt_token_ids", "ids", where=f"{where}: engine")
    if typed(trn, "prompt_token_ids", "ids", where=f"{where}: train") != prompt + ids:
        raise BadInput(
            f"{where}: train.prompt_token_ids is not engine.prompt_token_ids + token_ids "
            "(score the engine's token ids, never re-tokenised text)"
        )
    scored = typed(trn, "prompt_logprobs", "list", where=f"{where}: train")[len(prompt) :]
    if len(scored) != len(ids):
        raise BadInput(f"{where}: train.prompt_logprobs must hold one dict per response token")
    scored = _vllm_rows(scored, where, name="train.prompt_logprobs", first=len(prompt))
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
        records = jsonl(path)
        seqs = [_vllm_line(obj, f"{path}:{line}") for line, obj in records]
        if not seqs:
            raise BadInput(f"{path}: no records")
        steps.append(_build(seqs, n, files=[str(path)]))
        lines = [
            (f"{path}:{line}", _sampling(obj.get("sampling"), f"{path}:{line}: sampling"))
            for line, obj in records
        ]
        _with_sampling(steps[-1:], {n: lines})
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


def training_dumps(files: list[Path], path: str) -> list[Path]:
    """The files less slime's rollout dumps where they sit beside its training dumps: --dump-details DIR
    writes DIR/rollout_data/{rollout_id}.pt (the rollout, no trainer log-probs) and DIR/train_data/."""
    kept = [
        f for f in files if f.parent.name != "rollout_data" or not (f.parent.parent / "train_data").is_dir()
    ]
    if not kept:
        raise BadInput(
            f"--dump {path}: only slime rollout dumps (rollout_data/), which hold no trainer log-probs; "
            "point --dump at the train_data/ folder beside them, or at the --dump-details folder"
        )
    return kept


def read_native(path: str, fmt: str | None = None) -> tuple[str, list[Step]]:
    """(format, steps oldest first) of the export at PATH; fmt None = detect it."""
    files = training_dumps(expand(path), path)
    fmt = fmt or detect(files, path)
    return fmt, READERS[fmt](files)


MAX_STEP = 10**9  # a step number beyond it is no training step's: a --steps range reaching it is a typo


def select_steps(steps: list[Step], spec: str | None) -> list[Step]:
    """The steps a --steps spec names ("3", "2-5", "0,4-6"; None or "all" = every step): ASCII digits only
    (str.isdigit would take "²", which int() refuses), each range low-high with low <= high <= MAX_STEP.
    A step is tested against each range, so no range is ever listed number by number."""
    if spec is None or spec == "all":
        return steps
    ranges = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", part)
        if not m:
            raise BadInput(f"--steps {spec!r}: expected step numbers and ranges such as 0,4-6, or all")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if len(hi) > len(str(MAX_STEP)) or int(hi) > MAX_STEP:  # the length first: int() of 5000 digits fails
            raise BadInput(
                f"--steps {spec!r}: {hi[:20]} is beyond any step number (at most {MAX_STEP}); "
                f"the dump has steps {_names(steps)}"
            )
        if int(lo) > int(hi):
            raise BadInput(f"--steps {spec!r}: the range {lo}-{hi} runs backwards; write it low-high")
        ranges.append((int(lo), int(hi)))
    chosen = [s for s in steps if any(lo <= s.step <= hi for lo, hi in ranges)]
    if not chosen:
        raise BadInput(f"--steps {spec!r}: none of these steps is in the dump (it has {_names(steps)})")
    return chosen


def _names(steps: list[Step]) -> str:
    nums = [s.step for s in steps]
    return ", ".join(map(str, nums)) if len(nums) <= 8 else f"{nums[0]}..{nums[-1]} ({len(nums)} steps)"


# ---------------------------------------------------------------------------------------------------
# Sampling settings: which distribution each column holds

SETTINGS = ("temperature", "top_p")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's logprobs_mode values that are log-probs
WHY = {  # why a format's columns part from the sampled distribution, as the mismatch line says it
    "project": "the project format holds the policies at temperature 1, untruncated (port/dumps.py)",
    "prime-rl": "prime-rl's trainer applies the temperature but no top-p",
    "slime": "SGLang's log-probs are not renormalised to the top-p nucleus",
    "verl": "verl's old_log_probs apply the temperature but no top-p",
    "trl": "TRL's old_per_token_logps apply the temperature but no top-p",
    "vllm": "vLLM's prompt_logprobs scoring pass runs at temperature 1, untruncated, whatever its settings",
}


def logged_at(fmt: str, t: float, p: float, mode: str | None) -> tuple[tuple, tuple]:
    """((temperature, top-p) the engine column holds, (temperature, top-p) the trainer column holds) for a run
    that sampled at temperature t and top-p p, as each system computes them:
    project   (1, 1) and (1, 1): the format's contract (port/dumps.py);
    prime-rl  (t, p): vLLM with logprobs_mode processed_logprobs, prime-rl's default (configs/inference.py);
              (t, 1): the trainer divides by the per-token temperatures, no nucleus (trainer/batch.py);
    slime     (t, 1): SGLang returns log_softmax(logits / t), not renormalised to the nucleus; (t, 1):
              Megatron divides the logits by --rollout-temperature (megatron_utils/loss.py);
    verl      (t, p): rollout.logprobs_mode processed_logprobs (0.9.1); (t, 1): logits / temperature;
    trl       (t, p): vLLM processed_logprobs, which TRL requests; (t, 1): logits / temperature;
    vllm      (t, p) with logprobs_mode processed_logprobs, (1, 1) with raw_logprobs (vLLM's default);
              (1, 1): prompt_logprobs are scored from the raw logits (vLLM 0.33)."""
    if fmt == "project":
        return (1.0, 1.0), (1.0, 1.0)
    if fmt == "vllm":
        return ((t, p) if mode == "processed_logprobs" else (1.0, 1.0)), (1.0, 1.0)
    if fmt == "slime":
        return (t, 1.0), (t, 1.0)
    return (t, p), (t, 1.0)


def _same(a: tuple, b: tuple) -> bool:
    return all(abs(x - y) <= 1e-9 for x, y in zip(a, b))


def _settings_of(step: Step, fmt: str, temperature: float | None, top_p: float | None) -> tuple[dict, str]:
    """(temperature, top_p, logprobs_mode) for one step: the export's record, else the flags, else (project
    only) the format's contract; a flag that contradicts the record is refused."""
    rec = step.sampling
    for key, flag in zip(SETTINGS, (temperature, top_p)):
        if flag is not None and key in rec and abs(rec[key] - flag) > 1e-9:
            raise BadInput(
                f"--{key.replace('_', '-')} {flag:g}: the export records {key} {rec[key]:g} at step "
                f"{step.step} ({step.files[0]}); leave the flag out or pass the recorded value"
            )
    got = {"temperature": temperature, "top_p": top_p, **rec}
    source = "the export" if rec else "--temperature/--top-p"
    if fmt == "project" and None in (got["temperature"], got["top_p"]):  # unsaid: as the format says
        source = "the project format's contract" if got["temperature"] == got["top_p"] else source
        got = {k: 1.0 if got[k] is None else got[k] for k in SETTINGS}
    return got, source


def sampling_check(fmt: str, steps: list[Step], temperature=None, top_p=None) -> dict:
    """Whether both columns of the steps are the distribution their tokens were drawn from (k3 needs it):
    each column's (temperature, top-p) by logged_at, against the sampled (t, p) the export records or the
    flags give. A setting nobody gives is tried at two values; where the answer depends on it, the dump is
    not judged and the line names the flag to pass. Greedy decoding (t = 0) samples from no logged
    distribution. Returns {temperature, top_p, source, engine, train, same, reason}."""
    for step in steps:
        got, source = _settings_of(step, fmt, temperature=temperature, top_p=top_p)
        t, p, mode = got.get("temperature"), got.get("top_p"), got.get("logprobs_mode")
        out = {"temperature": t, "top_p": p, "source": source, "engine": None, "train": None, "same": False}
        if t == 0:
            return {
                **out,
                "reason": f"step {step.step} decoded greedily (temperature 0): no logged column is "
                "the distribution its tokens were drawn from",
            }
        tries = [
            (tt, pp, mm)
            for tt in ([t] if t is not None else [1.0, 0.5])
            for pp in ([p] if p is not None else [1.0, 0.5])
            for mm in ([mode] if mode is not None or fmt != "vllm" else list(LOGPROBS_MODES))
        ]
        judged = {
            (tt, pp, mm): _same(e, (tt, pp)) and _same(r, (tt, pp))
            for tt, pp, mm in tries
            for e, r in [logged_at(fmt, tt, pp, mode=mm)]
        }
        outcomes = set(judged.values())
        if len(outcomes) > 1:  # name the settings whose value alone changes the answer
            missing = [
                f"--{key.replace('_', '-')}"
                for i, key in enumerate(SETTINGS)
                if any(
                    judged[c] != judged[d]
                    for c in judged
                    for d in judged
                    if c[i] != d[i] and c[1 - i] == d[1 - i]
                )
            ] or ["--temperature", "--top-p"]
            return {
                **out,
                "reason": f"the {fmt} export does not record the run's sampling settings, and the "
                f"verdict depends on them: pass {' and '.join(missing)} (as the run sampled)",
            }
        if outcomes == {False}:
            e, r = _held(fmt, t, p, mode=mode)
            s, es, rs = (shown_settings(x) for x in ((t, p), e, r))
            return {
                **out,
                "engine": e,
                "train": r,
                "reason": (
                    f"step {step.step} sampled at {s} ({source}), but the engine column holds {es} and the "
                    f"trainer's {rs}: {WHY[fmt]}; k3 needs both to be the distribution the tokens "
                    "were drawn from"
                ),
            }
    e, r = _held(fmt, t, p, mode=mode)
    return {**out, "engine": e, "train": r, "same": True, "reason": None}


def shown_settings(settings) -> str:
    """(temperature, top-p) as words; None, a setting nobody gave, as the run's."""
    t, p = (f"{v:g}" if v is not None else "the run's" for v in settings)
    return f"temperature {t}, top-p {p}"


def _held(fmt: str, t, p, mode) -> tuple[list, list]:
    """logged_at as lists, a setting nobody gave (None) shown as None where the column follows it."""
    e, r = logged_at(fmt, math.nan if t is None else t, math.nan if p is None else p, mode=mode)
    return ([None if math.isnan(v) else v for v in x] for x in (e, r))


def _sampling(obj, where: str) -> dict:
    """The sampling settings an export records beside its tensors (keys ours: `temperature`, `top_p`, and for
    vLLM `logprobs_mode`), checked: a temperature >= 0, a top-p in (0, 1], a logprobs_mode of log-probs."""
    if not isinstance(obj, dict):
        return {}
    out = {}
    for key in SETTINGS:
        v = obj.get(key)
        if v is None:
            continue
        v = v.item() if torch.is_tensor(v) and v.numel() == 1 and v.is_floating_point() else v
        if not (is_number(v) and math.isfinite(v) and (0 < v <= 1 if key == "top_p" else v >= 0)):
            words = "a number in (0, 1]" if key == "top_p" else "a number >= 0"
            raise BadInput(f"{where}: {key} is {_shown(v)}; expected {words}")
        out[key] = float(v)
    mode = obj.get("logprobs_mode")
    if mode is not None:
        if mode not in LOGPROBS_MODES:
            raise BadInput(
                f"{where}: logprobs_mode is {_shown(mode)}; expected {' or '.join(LOGPROBS_MODES)} "
                "(logits are not log-probs)"
            )
        out["logprobs_mode"] = mode
    return out


def _with_sampling(steps: list[Step], recorded: dict[int, list[tuple[str, dict]]]) -> list[Step]:
    """Each step with the sampling settings its files (or lines) record, which must agree."""
    for step in steps:
        found = recorded.get(step.step, [])
        for where, rec in found[1:]:
            if rec != found[0][1]:
                raise BadInput(
                    f"{where}: records sampling {rec}, but {found[0][0]} of step {step.step} {found[0][1]}"
                )
        step.sampling = found[0][1] if found else {}
    return steps
