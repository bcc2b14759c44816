"""Build the tiny pair: a small Llama-style teacher trained to near-perfect 2–3 digit addition, and a smaller
student trained only until it starts to solve problems, so OPD has room to improve it.

Plain supervised next-token cross-entropy on the answers; both models are saved with the tokenizer under
`pairs/tiny/` (the committed files). This is the only place besides train.py that changes weights. --out
is checked before training starts; the new pair is saved beside the old one and swapped in with signals
held off, so a stop or a full disk leaves the previous pair whole (never one model new, one old).

    python -m tools.build_tiny            # about 15 min on a 2-core CPU; rewrites pairs/tiny/
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import json
import os
import shutil
import time
from pathlib import Path

import torch

from cli import (
    EXPECTED,
    Parser,
    StopSignals,
    WriteFailed,
    check_output_dir,
    fail,
    path_text,
)
from evaluate import exact_match_accuracy
from lab.atomic import atomic_write_text
from models import TINY_DIR, Prompt, format_prompt, tiny_config, tiny_problems, tiny_tokenizer
from rollout import positions

from transformers import LlamaForCausalLM  # isort: skip


def _tiny_batch(tokenizer, problems: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize prompt+answer+<eos>; the loss mask covers the answer and <eos> (what the model must
    produce)."""
    texts = [format_prompt(tokenizer, p.text) + p.answer + tokenizer.eos_token for p in problems]
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_lens = [
        len(tokenizer(format_prompt(tokenizer, p.text), add_special_tokens=False).input_ids) for p in problems
    ]
    seq_lens = enc.attention_mask.sum(1)
    T = enc.input_ids.shape[1]
    pos_T = torch.arange(T)
    # Left padding: the answer starts at (T - seq_len + prompt_len).
    start_B = T - seq_lens + torch.tensor(prompt_lens)
    loss_mask_B_T = pos_T[None, :] >= start_B[:, None]
    return enc.input_ids, enc.attention_mask, loss_mask_B_T


def train_supervised(model, tokenizer, *, steps: int, lr: float, batch: int, seed: int) -> None:
    """Plain next-token cross-entropy on answers: how the tiny teacher and the student's warm start are
    made."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    for step in range(steps):
        ids_B_T, attn_B_T, loss_mask_B_T = _tiny_batch(
            tokenizer, tiny_problems(batch, seed=seed * 100_003 + step, held_out=False)
        )
        # Position ids that skip the left padding, exactly as the sampler will use them.
        logits_B_T_V = model(
            input_ids=ids_B_T, attention_mask=attn_B_T, position_ids=positions(attn_B_T)
        ).logits
        # Position t predicts token t+1.
        logp_B_T = (
            torch.log_softmax(logits_B_T_V[:, :-1].float(), -1).gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
        )
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
    # size: (first round steps, later round steps, peak lr of later rounds, max rounds,
    #        stop when accuracy >= x)
    plan = {"teacher": (3000, 1000, 1e-3, 8, 0.96), "student": (100, 100, 3e-3, 40, 0.25)}
    report, models = {}, {}
    for size, (first, later, lr_later, max_rounds, target) in plan.items():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(size))
        t0 = time.time()
        print(
            f"training tiny {size} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params)",
            flush=True,
        )
        for rounds in range(1, max_rounds + 1):
            steps, lr = (first, 3e-3) if rounds == 1 else (later, lr_later)
            train_supervised(model, tokenizer, steps=steps, lr=lr, batch=128, seed=seed * 1000 + rounds)
            acc = exact_match_accuracy(model, tokenizer, held_out)
            print(f"  {size} round {rounds}: held-out accuracy {acc:.3f}", flush=True)
            if acc >= target:
                break
        report[size] = {"held_out_accuracy": acc, "rounds": rounds, "seconds": round(time.time() - t0, 1)}
        model.generation_config.pad_token_id = 0
        models[size] = model
    save_pair(models, tokenizer, out_dir=out_dir, report=report)
    return report


def save_pair(models: dict, tokenizer, out_dir: Path, report: dict) -> None:
    """Save each model with the tokenizer into out_dir/.<size>.new, then, with SIGINT/SIGTERM held off
    (StopSignals), swap each into out_dir/<size> and write build.json. A full disk while saving is one
    WriteFailed line with the previous pair untouched; the staged folders never outlive the call."""
    staged = {size: out_dir / f".{size}.new" for size in models}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for size, model in models.items():
            shutil.rmtree(staged[size], ignore_errors=True)
            model.save_pretrained(staged[size])
            tokenizer.save_pretrained(staged[size])
        with StopSignals() as stop:
            for size, path in staged.items():
                old = out_dir / f".{size}.old"
                shutil.rmtree(old, ignore_errors=True)
                if (out_dir / size).exists():
                    os.replace(out_dir / size, old)
                os.replace(path, out_dir / size)
                shutil.rmtree(old, ignore_errors=True)
            atomic_write_text(out_dir / "build.json", json.dumps(report, indent=2) + "\n")
        stop.check(f"interrupted while saving; the new pair in {out_dir} is whole")
    except WriteFailed:
        raise
    except (OSError, RuntimeError) as e:  # save_pretrained on a full disk
        raise WriteFailed(
            f"could not write the pair to {out_dir} ({e}); its previous files are intact"
        ) from e
    finally:
        for path in staged.values():
            shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=path_text, default=str(TINY_DIR), help=f"output folder (default {TINY_DIR})"
    )
    args = parser.parse_args(argv)
    try:
        out = check_output_dir(args.out, "--out")  # before 15 minutes of training, not after
        for size in ("teacher", "student"):
            check_output_dir(out / size, "--out")
        report = build_tiny(out)
    except EXPECTED as e:
        fail(e)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
