"""Measurement: how far the rollout engine's policy is from the policy being trained, on one scale.

The canonical scale (nats per token):

    mismatch_kl = mean over response tokens t of  KL(π_engine(·|x_<t) ‖ π_train(·|x_<t))
                = mean_t Σ_v π_e(v|x_<t) (log π_e(v|x_<t) − log π_t(v|x_<t)),

taken on the engine's own samples (x ~ π_engine), over the full vocabulary, in float64, where π_e is the
distribution the engine recorded while it sampled (Rollout.engine_logits) and π_train is the trainer's
current student (a stale engine serves older weights). Both are read at temperature 1 with no top-p
truncation: the policies themselves, not the sampler's settings.

Beside it, from the sampled tokens alone (what dumps from other systems give you), with the per-token
log-ratio r_t = log π_e(y_t|x_<t) − log π_t(y_t|x_<t) and importance ratio ρ_t = π_t(y_t)/π_e(y_t) = e^{−r_t}:
    k1 = mean r_t                  unbiased for the KL, high variance, can be negative
    k3 = mean (ρ_t − 1) − log ρ_t  = mean e^{−r_t} − 1 + r_t; unbiased, always >= 0, low variance
    mean/max |Δp| = |π_e(y_t) − π_t(y_t)|
    chi2 = mean (ρ_t − 1)²         token-level χ²(π_t ‖ π_e) estimate
    ratio_mean/std/min/max of ρ_t, and ess = (Σρ)² / (n Σρ²) ∈ (0, 1], the effective sample fraction
    logppl_diff = mean over sequences of (log-perplexity under π_train − under π_engine)
                = mean_b (1/|b|) Σ_{t∈b} r_t  (k1 with every sequence weighted equally)

Two parts of mismatch:
    per-token     the canonical mismatch_kl: different next-token distributions at the same prefix.
                  Token-level importance weights (TIS) can correct it.
    prefix shift  how far the prefixes the engine visits are from the ones π_train would visit:
                  seq_kl = mean_b Σ_{t∈b} r_t, the sequence-level log-ratio log π_e(y_b)/π_t(y_b),
                  which estimates KL(π_e ‖ π_t) over whole responses (nats per sequence); and seq_ess,
                  the effective sample fraction of the sequence-level weights e^{−Σ_t r_t}. A token-level
                  correction leaves these untouched: they grow with length even at a fixed per-token error.
                  prefix_kl (exact, per token) = mean_t KL(P_e(y_<t) ‖ P_t(y_<t)) = mean_t E_e[Σ_{τ<t} KL_τ]
                  by the chain rule; train.py logs it beside mismatch_kl at every step.

This module measures; it never trains. A stale configuration needs the weights of older versions, which only
training makes: callers pass them in (`versions`, made by admit.stale_versions). The formulas live in kl.py.

    python mismatch.py --pair tiny --weights bf16 --kv-cache fp8   # each source alone and combined
    python mismatch.py --control                                   # the engine against itself: the floor
    python mismatch.py --pair tiny --weights fp8 --dump-out dump.jsonl   # also a log dump (port/dumps.py)
"""

import cli

cli.exit_on_signals(__name__)  # first: a SIGINT/SIGTERM during the imports below is one line too

import copy
import json
import sys
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from cli import EXPECTED, BadInput, Parser, check_output_file, fail, path_text, positive_int, seed_int
from config import (
    DEFAULT_PAIR,
    DEFAULT_PAIR_HELP,
    DEFAULT_PROBES,
    DEVICES,
    KV_SCALE_PROMPTS,
    MEASURE_PROBES,
    PAIRS,
)
from engine import RolloutEngine
from kl import bootstrap_ci, sampled_token_metrics, token_kl
from lab.rollout_args import add_rollout_args, rollout_config_from_args
from models import (
    check_prompts,
    format_prompt,
    head,
    held_out,
    load_pair,
    read_prompts,
    resolve_device,
)
from port.dumps import write_dump
from rollout import RolloutConfig, response_hidden


@torch.no_grad()
def rescored_token_kl(engine: RolloutEngine, train, rollout, chunk: int = 256) -> torch.Tensor:
    """The fallback when the engine recorded nothing (Rollout.engine_logits is None, see rollout.py): the
    engine re-scores the rollout in one teacher-forced pass through an empty cache of its kind. Approximate:
    a different order of computation rounds differently under bf16 or FP8 (up to 7% off on the KL)."""
    h_e_N_H, _ = response_hidden(engine.model, rollout, cache=engine.new_cache())
    h_t_N_H, _ = response_hidden(train, rollout)
    parts = [
        token_kl(head(engine.model, h_e_N_H[i : i + chunk]), head(train, h_t_N_H[i : i + chunk]))
        for i in range(0, len(h_e_N_H), chunk)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------
# Measuring an engine against a trainer policy on probe prompts


@dataclass
class Scored:
    """One engine's samples of the probes, scored by the trainer. R = response tokens (row-major),
    K = top-k."""

    rollout: object
    kl_R: torch.Tensor  # exact per-token KL(π_e ‖ π_t), float64
    logp_engine_R: torch.Tensor  # log π_e(y_t), the engine's own log-prob of the sampled token
    logp_train_R: torch.Tensor  # log π_t(y_t)
    seq_id_R: torch.Tensor  # which probe each token belongs to
    top_ids_R_K: torch.Tensor  # the engine's K most likely tokens at each position
    top_engine_R_K: torch.Tensor  # their log-probs under the engine
    top_train_R_K: torch.Tensor  # and under the trainer


@torch.no_grad()
def score(
    engine: RolloutEngine, train, prompts: list[str], seed: int = 0, chunk: int = 256, top_k: int = 8
) -> Scored:
    """Sample the prompts with the engine (recording its distributions) and score them under `train`."""
    rollout = engine.generate(prompts, generator=torch.Generator(engine.device).manual_seed(seed))
    if rollout.engine_logits is None:
        raise BadInput(
            "the probe batch is too large to record the engine's distributions (RolloutConfig.record_gb); "
            "use fewer probes or shorter responses"
        )
    h_R_H, y_R = response_hidden(train, rollout)
    kl, logp_t, top = [], [], []
    for i in range(0, len(y_R), chunk):
        train_logits = head(train, h_R_H[i : i + chunk]).float()
        engine_logits = rollout.engine_logits[i : i + chunk]
        kl.append(token_kl(engine_logits, train_logits))
        logp_train = torch.log_softmax(train_logits, -1)
        logp_t.append(logp_train.gather(-1, y_R[i : i + chunk, None]).squeeze(-1))
        top_e, ids = torch.log_softmax(engine_logits, -1).topk(min(top_k, engine_logits.shape[-1]), -1)
        top.append((ids, top_e, logp_train.gather(-1, ids)))
    target_B_T = rollout.targets()
    seq_id = torch.arange(len(prompts), device=target_B_T.device)[:, None].expand_as(target_B_T)[target_B_T]

    def cat(parts: list) -> torch.Tensor:
        return torch.cat(parts).cpu() if parts else torch.zeros(0)

    return Scored(
        rollout,
        cat(kl),
        rollout.logprobs[:, 1:][target_B_T].cpu(),
        cat(logp_t),
        seq_id.cpu(),
        *(cat([t[j] for t in top]) for j in range(3)),
    )


def summarize(s: Scored, seed: int = 0) -> dict:
    """The canonical mismatch with its bootstrap CI, and every sampled-token metric beside it."""
    if len(s.kl_R) == 0:
        raise BadInput("the engine produced no response tokens to measure")
    lo, hi = bootstrap_ci(s.kl_R, s.seq_id_R, seed=seed)
    return {
        "mismatch_kl": s.kl_R.mean().item(),
        "ci_low": lo,
        "ci_high": hi,
        "tokens": len(s.kl_R),
        **sampled_token_metrics(s.logp_engine_R, s.logp_train_R, s.seq_id_R),
    }


def measure(
    engine: RolloutEngine, train, tokenizer, prompts: list[str], seed: int = 0, chunk: int = 256
) -> dict:
    """Every metric of this module for one engine against one trainer policy, on the engine's samples."""
    return summarize(score(engine, train, prompts, seed=seed, chunk=chunk), seed)


def configured_engine(student, tokenizer, cfg: RolloutConfig, calib: list[str], versions=None):
    """(engine, trainer policy) for cfg, leaving `student` untouched. `versions`: the weights of versions
    0..n (oldest first) for a stale cfg; the trainer is then at the newest, the engine k versions behind."""
    engine = RolloutEngine(student, tokenizer, cfg, probe_prompts=calib)
    if not versions:
        engine.sync(student, 0)
        return engine, student
    for version, weights in enumerate(versions):
        engine.receive(version, weights)
    train = copy.deepcopy(student)
    train.load_state_dict(versions[-1])
    return engine, train


def measure_config(pair, cfg: RolloutConfig, probes: list[str], versions=None, keep: bool = False) -> dict:
    """The one measurement of a rollout configuration, for mismatch.py, the study and admit.py check:
    the engine's samples of `probes` against the trainer, with the time it took. keep: also return the
    Scored samples (under "scored")."""
    t0 = time.time()
    calib = [  # fp8 KV scales: never eval prompts
        format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:KV_SCALE_PROMPTS]
    ]
    engine, train = configured_engine(pair.student, pair.tokenizer, cfg, calib=calib, versions=versions)
    scored = score(engine, train, probes, seed=cfg.seed)
    result = {**summarize(scored, cfg.seed), "seconds": time.time() - t0}
    return {**result, "scored": scored} if keep else result


def sources(cfg: RolloutConfig) -> list[tuple[str, RolloutConfig]]:
    """Each non-default mismatch source of cfg alone, then all of them together (when more than one)."""
    base = RolloutConfig(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    rows = []
    if cfg.weights != "fp32":
        rows.append((f"weights {cfg.weights}", replace(base, weights=cfg.weights, fp8_skip=cfg.fp8_skip)))
    if cfg.kv_cache != "model":
        rows.append(
            (
                f"kv {cfg.kv_cache} ({cfg.kv_scales})",
                replace(base, kv_cache=cfg.kv_cache, kv_scales=cfg.kv_scales),
            )
        )
    if cfg.staleness:
        rows.append((f"staleness {cfg.staleness}", replace(base, staleness=cfg.staleness)))
    if cfg.noise:
        rows.append((f"noise {cfg.noise:g}", replace(base, noise=cfg.noise)))
    if len(rows) != 1:
        rows.append(("combined" if rows else "identical copy", replace(cfg, temperature=1.0, top_p=1.0)))
    return rows


def measure_sources(
    pair, cfg: RolloutConfig, probes: list[str], versions=None, progress: bool = True
) -> list[dict]:
    """The table: every source of cfg alone and combined, each against the trainer's current policy."""
    rows = sources(cfg)
    out = []
    for name, row in tqdm(rows, desc="sources", disable=not progress):
        out.append(
            {
                "source": name,
                **measure_config(pair, row, probes, versions=versions if row.staleness else None),
            }
        )
    return out


def print_results(results: list[dict], pair: str, device: str, as_json: bool) -> None:
    """The sources table, or JSON (one object per row; mismatch_kl is the canonical number)."""
    if as_json:
        scale = "KL(engine||train) nats/token"
        print(json.dumps({"pair": pair, "scale": scale, "device": device, "rows": results}, indent=2))
    else:
        print_table(results, pair)


def print_table(results: list[dict], pair: str) -> None:
    print(
        f"mismatch on {pair}: KL(π_engine ‖ π_train), nats/token, on the engine's own samples "
        "(95% bootstrap CI over prompts)"
    )
    cols = ["mismatch_kl", "95% CI", "k3", "k1", "|Δp| mean", "chi2", "ess", "seq_kl", "s"]
    widths = [12, 24, 11, 11, 11, 10, 7, 9, 7]
    print(f"{'source':<26}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in results:
        ci = f"[{r['ci_low']:.2e}, {r['ci_high']:.2e}]"
        cells = [
            f"{r['mismatch_kl']:.3e}",
            ci,
            f"{r['k3']:.2e}",
            f"{r['k1']:.2e}",
            f"{r['dp_mean']:.2e}",
            f"{r['chi2']:.2e}",
            f"{r['ess']:.3f}",
            f"{r['seq_kl']:.3f}",
            f"{r['seconds']:.1f}",
        ]
        print(f"{r['source']:<26}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


# ---------------------------------------------------------------------------------------------------
# Command line


def probe_defaults() -> str:
    """'64 tiny, 16 others' for a help string: the probes of one measurement without --probes."""
    named = ", ".join(f"{n} {pair}" for pair, n in MEASURE_PROBES.items())
    return f"{named}, {DEFAULT_PROBES} others"


def build_parser() -> Parser:
    p = Parser(
        description="Measure each mismatch source of a rollout configuration on the one scale (no training)."
    )
    p.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS, help=DEFAULT_PAIR_HELP)
    p.add_argument(
        "--probes",
        type=positive_int,
        help=f"held-out probe prompts (default: {probe_defaults()})",
    )
    p.add_argument(
        "--prompts",
        type=path_text,
        help='metrics-only mode on your own prompts: a JSONL file of {"prompt": ...}; every line is a probe',
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="the zero-mismatch control: the engine is the trainer's "
        "exact copy, scored twice; its number is the floor of this setup",
    )
    p.add_argument(
        "--dump-out",
        type=path_text,
        help="also write the samples as a log dump (port/dumps.py's JSONL schema) to this file",
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON (one object per row; mismatch_kl is the number)"
    )
    p.add_argument("--device", default="auto", choices=DEVICES, help="(default: %(default)s)")
    p.add_argument(
        "--seed", type=seed_int, default=RolloutConfig.seed, help="sampling and noise seed (default: 0)"
    )
    # train.py's rollout flags, so a configuration reads the same everywhere; no temperature or top-p:
    # mismatch is measured between the policies themselves.
    add_rollout_args(p.add_argument_group("rollout engine"), sampling=False)
    return p


def probe_prompts(pair, args) -> list[str]:
    """--prompts FILE (every line a probe), else the first --probes held-out prompts of the pair (more than
    it has is refused: models.held_out)."""
    if args.prompts and args.probes:
        raise BadInput(f"--probes {args.probes} with --prompts: every line of --prompts is a probe; drop one")
    texts = [p.text for p in read_prompts(args.prompts)] if args.prompts else None
    if texts is None:
        n = args.probes or MEASURE_PROBES.get(pair.name, DEFAULT_PROBES)
        texts = [p.text for p in held_out(pair, n, "--probes")]
    return [format_prompt(pair.tokenizer, t) for t in texts]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.staleness:
            raise BadInput(
                f"--staleness {args.staleness}: measuring staleness needs real training steps to make "
                "the old weights; use `python -m study sources --staleness K` "
                "(mismatch.py never trains)"
            )
        if args.dump_out is not None:
            check_output_file(args.dump_out, "--dump-out")  # a writable regular file: no FIFO, no device
        device = resolve_device(args.device)
        cfg = rollout_config_from_args(args, pair=args.pair)
        pair = load_pair(args.pair, device=device)
        check_prompts(pair, cfg.max_new_tokens, prompts=read_prompts(args.prompts) if args.prompts else None)
        probes = probe_prompts(pair, args)
        rows = [
            (
                "control: engine = trainer",
                replace(RolloutConfig(), max_new_tokens=cfg.max_new_tokens, seed=args.seed),
            )
        ]
        rows = rows if args.control else sources(cfg)
        results = []
        for name, row in tqdm(rows, desc="sources", disable=args.json or len(rows) < 2):
            results.append({"source": name, **measure_config(pair, row, probes, keep=bool(args.dump_out))})
        if args.dump_out:
            n = write_dump(args.dump_out, results[-1].pop("scored"))
            print(f"wrote {n} sequences of {results[-1]['source']} to {args.dump_out}", file=sys.stderr)
        for r in results:
            r.pop("scored", None)
    except EXPECTED as e:
        fail(e)
    print_results(results, args.pair, device, as_json=args.json)


if __name__ == "__main__":
    main()
