"""On-policy distillation under training–inference mismatch, in one file.

The whole idea, with nothing else in the way (the full project splits this into models.py, rollout.py,
mismatch.py and train.py):

    1. a *rollout engine* holds its own copy of the student and samples responses (here: with Gaussian
       weight noise, the one mismatch knob, so the engine's policy π_engine differs from π_train);
    2. the fixed teacher and the trained student score every sampled token;
    3. the student takes a gradient step on the per-token reverse KL to the teacher,
           KL_t = Σ_v p_s(v | x_<t) (log p_s(v | x_<t) − log p_t(v | x_<t)),
       averaged over response tokens, on the engine's samples;
    4. the engine copies the new weights (and adds its noise again).

We also print the mismatch itself, KL(π_engine ‖ π_train) per token on the engine's samples.
The pair is the tiny addition pair committed in pairs/tiny/ (a 3-layer teacher, a 2-layer student). Of
the project it imports only cli.py, for what every command shares (SIGINT or SIGTERM is one line and exit
130 / 143, and --noise has the project's bound), and config.py, for the pair's response length.

    python opd_minimal.py                 # under a minute on a 2-core CPU: accuracy 0.31 -> 0.86
    python opd_minimal.py --noise 0.05    # a noisier engine: watch the mismatch column grow
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from config import MAX_NEW_TOKENS

PAIR_DIR = Path(__file__).resolve().parent / "pairs" / "tiny"
MAX_NEW = MAX_NEW_TOKENS["tiny"]  # tokens sampled per response: an answer of at most 4 digits, then <eos>


def problems(n, rng):
    """Addition problems "a+b=" with their answers; the tokenizer's chat template adds <bos>."""
    pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(n)]
    return [f"<bos>{a}+{b}=" for a, b in pairs], [str(a + b) for a, b in pairs]


def add_noise(model, sigma, gen):
    """W <- W + sigma * rms(W) * N(0, 1), per tensor: noise relative to each tensor's own scale (the engine's
    definition, engine.add_weight_noise; a test compares the two)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * sigma * p.pow(2).mean().sqrt())


@torch.no_grad()
def sample(model, tok, prompts, max_new, gen, greedy=False):
    """Sample responses token by token: the prompt once, then only the newest token, attending to the keys and
    values the model cached for the earlier ones (rollout.py does the same, with FP8 and stale engines).

    Returns tokens [B, T], attention mask [B, T], response mask [B, T] (sampled tokens up to and incl. EOS).
    """
    enc = tok(prompts, padding=True, add_special_tokens=False, return_tensors="pt")
    ids, attn = enc.input_ids, enc.attention_mask
    resp = torch.zeros_like(ids, dtype=torch.bool)
    alive = torch.ones(len(prompts), dtype=torch.bool)
    new, cache = ids, None  # what the model has not seen yet, and its cache of what it has
    for _ in range(max_new):
        pos = positions(attn)[:, -new.shape[1] :]
        out = model(input_ids=new, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        logits, cache = out.logits[:, -1], out.cache
        nxt = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        nxt = torch.where(alive, nxt, tok.pad_token_id)
        ids = torch.cat([ids, nxt[:, None]], 1)
        attn = torch.cat([attn, alive[:, None].long()], 1)
        resp = torch.cat([resp, alive[:, None]], 1)
        alive = alive & (nxt != tok.eos_token_id)
        new = nxt[:, None]
        if not alive.any():
            break
    return ids, attn, resp


def positions(attn):
    """Position ids that skip left padding (the first real token is position 0)."""
    return (attn.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, ids, attn):
    """log p(· | x_<t) for every position t >= 1: [B, T-1, V]."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    return torch.log_softmax(logits[:, :-1].float(), -1)


def reverse_kl(logp_a, logp_b, mask):
    """Mean over masked tokens of KL(a ‖ b) = Σ_v a(v) (log a(v) − log b(v))."""
    kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1)  # [B, T-1]
    return (kl * mask).sum() / mask.sum()


def accuracy(model, tok, rng, n=256):
    prompts, answers = problems(n, rng)
    ids, _, resp = sample(model, tok, prompts, max_new=MAX_NEW, gen=None, greedy=True)
    texts = [tok.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(ids, resp)]
    return sum(t == a for t, a in zip(texts, answers)) / n


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag is one line and exit code 2, not a usage block
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def checked(kind, ok, accepted: str):
    """An argparse type= that refuses values for which ok(x) is false (NaN fails every comparison)."""

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}")
        return value

    return convert


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(description="OPD with a noisy rollout engine, in one file.")
    ap.add_argument(
        "--steps", type=checked(int, lambda x: x >= 1, "an integer >= 1"), default=400, help="optimizer steps"
    )
    ap.add_argument(
        "--noise",
        type=cli.noise_sigma,  # the project's bound: past σ = 10 the engine is mostly noise (cli.MAX_NOISE)
        default=0.01,
        help="relative std of the engine's weight noise; 0 = exact copy",
    )
    ap.add_argument(
        "--lr",
        type=checked(float, lambda x: 0 < x < 1, "a number in (0, 1)"),
        default=2e-3,
        help="AdamW learning rate",
    )
    ap.add_argument(
        "--batch",
        type=checked(int, lambda x: x >= 1, "an integer >= 1"),
        default=128,
        help="responses per step",
    )
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    tok = AutoTokenizer.from_pretrained(PAIR_DIR / "student", padding_side="left")
    teacher = AutoModelForCausalLM.from_pretrained(PAIR_DIR / "teacher").eval()
    student = AutoModelForCausalLM.from_pretrained(PAIR_DIR / "student").eval()
    engine = copy.deepcopy(student)  # the rollout engine's own weights
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)
    # lr decays linearly to 0 over the run: a high lr learns fast early, the decay settles it at the end
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / args.steps)

    print(
        f"engine noise sigma = {args.noise}; step 0 accuracy {accuracy(student, tok, random.Random(1)):.2f}"
    )
    print(f"{'step':>4}  {'reverse KL':>10}  {'mismatch':>9}  {'accuracy':>8}")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        engine.load_state_dict(student.state_dict())  # sync
        add_noise(engine, args.noise, gen)  # the mismatch knob
        prompts, _ = problems(args.batch, rng)
        ids, attn, resp = sample(engine, tok, prompts, max_new=MAX_NEW, gen=gen)
        mask = resp[:, 1:].float()  # position t-1 predicts token t

        logp_s = token_logprobs(student, ids, attn)
        with torch.no_grad():
            logp_t = token_logprobs(teacher, ids, attn)
            mismatch = reverse_kl(token_logprobs(engine, ids, attn), logp_s, mask)
        loss = reverse_kl(logp_s, logp_t, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        acc = (
            f"{accuracy(student, tok, random.Random(1)):8.2f}" if step % 50 == 0 or step == args.steps else ""
        )
        print(f"{step:4d}  {loss.item():10.4f}  {mismatch.item():9.5f}  {acc}", flush=True)
    print(
        f"done in {time.time() - t0:.0f}s "
        "(reverse KL in nats/token; accuracy: greedy exact match, 256 problems)"
    )


if __name__ == "__main__":
    main()
