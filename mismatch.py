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
training makes: callers pass them in (`versions`; experiments.py and admit.py get them from train.py).

    python mismatch.py --pair tiny --weights bf16 --kv-cache fp8   # each source alone and combined
    python mismatch.py --control                                   # the engine against itself: the floor
    python mismatch.py --pair tiny --weights fp8 --dump-out dump.jsonl   # also write a log dump (dumps.py)
"""

import copy
import json
import sys
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from cli import EXPECTED, BadInput, Parser, check_output_file, fail, positive_int, seed_int
from dumps import Dump, write_dump
from models import DEVICES, PAIRS, check_prompts, format_prompt, load_pair, read_prompts, resolve_device
from rollout import (
    RolloutConfig,
    RolloutEngine,
    add_rollout_args,
    head,
    response_hidden,
    rollout_config_from_args,
)

PROBES = {"tiny": 64}  # held-out probe prompts by default (other pairs: DEFAULT_PROBES)
DEFAULT_PROBES = 16


def token_kl(engine_logits_N_V: torch.Tensor, train_logits_N_V: torch.Tensor) -> torch.Tensor:
    """Exact KL(π_e ‖ π_t) at N positions from the two sides' logits, in float64: kl_N.

    float64 because the KL of close policies is a small difference of large terms: in fp32 the rounding of
    each row's log-sum-exp alone (~1e-7 relative) moves a 1e-4 KL by 0.1%.
    """
    logp_e_N_V = torch.log_softmax(engine_logits_N_V.double(), -1)
    logp_t_N_V = torch.log_softmax(train_logits_N_V.double(), -1)
    return (logp_e_N_V.exp() * (logp_e_N_V - logp_t_N_V)).sum(-1)


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


def prefix_shift_kl(kl_N: torch.Tensor, rollout) -> torch.Tensor:
    """The prefix-shift part of the mismatch at every response token: KL between the engine's and the
    trainer's distributions of the response prefix y_<t (kl_N: exact per-token KLs, row-major order).

    By the chain rule of KL,  KL(P_engine(y_<t) ‖ P_train(y_<t)) = E_engine[Σ_{τ<t} KL_τ],  so the running
    sum of the earlier tokens' exact KLs on an engine sample estimates it without bias. The per-token part
    at t is KL_t itself: TIS can reweight the token drawn at t, but not the prefix it was drawn after.
    """
    target_B_T = rollout.response_mask[:, 1:].bool()
    kl_B_T = torch.zeros(target_B_T.shape, dtype=kl_N.dtype, device=kl_N.device).masked_scatter(
        target_B_T, kl_N
    )
    return (kl_B_T.cumsum(1) - kl_B_T)[target_B_T]  # exclusive running sum along each response


def sampled_token_metrics(
    logp_engine_N: torch.Tensor, logp_train_N: torch.Tensor, seq_id_N: torch.Tensor
) -> dict:
    """k1, k3, |Δp|, χ², IS-ratio statistics, ESS and the prefix-shift numbers (see the module docstring)."""
    r = (logp_engine_N - logp_train_N).double()
    rho = torch.exp(-r)
    n_seq = int(seq_id_N.max()) + 1 if len(seq_id_N) else 0
    seq_sum = torch.zeros(n_seq, dtype=r.dtype).index_add_(0, seq_id_N, r)
    seq_len = torch.zeros(n_seq, dtype=r.dtype).index_add_(0, seq_id_N, torch.ones_like(r))
    seq_w = torch.exp(-(seq_sum - seq_sum.min()))  # shifted for stability; ESS is scale-free
    dp = (logp_engine_N.exp() - logp_train_N.exp()).abs()
    return {
        "k1": r.mean().item(),
        "k3": (rho - 1 - torch.log(rho)).mean().item(),
        "dp_mean": dp.mean().item(),
        "dp_max": dp.max().item(),
        "dlogp_mean": r.abs().mean().item(),
        "chi2": ((rho - 1) ** 2).mean().item(),
        "ratio_mean": rho.mean().item(),
        "ratio_std": rho.std().item() if len(rho) > 1 else 0.0,
        "ratio_min": rho.min().item(),
        "ratio_max": rho.max().item(),
        "ess": (rho.sum() ** 2 / (len(rho) * (rho**2).sum())).item(),
        "logppl_diff": (seq_sum / seq_len).mean().item(),
        "seq_kl": seq_sum.mean().item(),
        "seq_ess": (seq_w.sum() ** 2 / (n_seq * (seq_w**2).sum())).item(),
    }


def bootstrap_ci(
    kl_N: torch.Tensor,
    seq_id_N: torch.Tensor,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    group_of_seq: torch.Tensor | None = None,
):
    """Confidence interval of the token-mean KL, resampling whole sequences (prompts) with replacement.

    Resampling sequences, not tokens, because tokens of one response are correlated. group_of_seq [S]: the
    group (a weight-noise draw) of each sequence; with two or more groups the resampling is two-stage (draws,
    then sequences within each drawn one), so the spread between draws is inside the interval too.
    """
    n_seq = int(seq_id_N.max()) + 1
    seq_sum = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, kl_N.double())
    seq_len = torch.zeros(n_seq, dtype=torch.float64).index_add_(
        0, seq_id_N, torch.ones_like(kl_N, dtype=torch.float64)
    )
    g = torch.Generator().manual_seed(seed)
    if group_of_seq is None or int(group_of_seq.max()) == 0:
        idx_R_S = torch.randint(n_seq, (n_boot, n_seq), generator=g)
        means_R = seq_sum[idx_R_S].sum(1) / seq_len[idx_R_S].sum(1)
    else:
        members = [torch.nonzero(group_of_seq == k).squeeze(-1) for k in range(int(group_of_seq.max()) + 1)]
        means = []
        for row in torch.randint(len(members), (n_boot, len(members)), generator=g).tolist():
            # groups differ in size, so each replicate is assembled on its own
            idx_S = torch.cat(
                [members[k][torch.randint(len(members[k]), (len(members[k]),), generator=g)] for k in row]
            )
            means.append(seq_sum[idx_S].sum() / seq_len[idx_S].sum())
        means_R = torch.stack(means)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means_R, q).tolist()
    return lo, hi


def topk_token_kl(d: Dump) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimate and lower bound of KL(π_e ‖ π_t) from a dump with top-k log-probs of both sides.

    With S the engine's top-k set at a position, m_e = 1 − Σ_S p_e and m_t = 1 − Σ_S p_t the tail masses:
        KL_t = Σ_S p_e log(p_e/p_t) + Σ_{v∉S} p_e log(p_e/p_t),   and the tail sum equals
               Σ_{v∉S} p_e k3(v) − (m_t − m_e),   k3(v) = ρ_v − 1 − log ρ_v, ρ_v = p_t(v)/p_e(v).
    The sampled token y ~ π_e gives 1[y∉S]·k3(y), an unbiased estimate of Σ_{v∉S} p_e k3, so
        est_t   = Σ_S p_e (log p_e − log p_t) − (m_t − m_e) + 1[y∉S]·k3(y)
    is unbiased, exact when S holds all of the engine's mass, and random only through tail samples.
        lower_t = Σ_S p_e (log p_e − log p_t) + m_e log(m_e / m_t)  <= KL_t   (log-sum inequality)
    needs no sampling at all. Returns (est_R, lower_R), float64.
    """
    p_e_R_K, p_t_R_K = d.top_engine_R_K.exp(), d.top_train_R_K.exp()
    filled_R_K = torch.isfinite(d.top_engine_R_K)
    diff_R_K = torch.where(filled_R_K, d.top_engine_R_K - d.top_train_R_K, torch.zeros_like(p_e_R_K))
    head_R = (p_e_R_K * diff_R_K).sum(-1)
    m_e_R = (1 - p_e_R_K.sum(-1)).clamp(min=0.0)
    m_t_R = (1 - p_t_R_K.sum(-1)).clamp(min=1e-300)
    rho_R = torch.exp(d.train_R - d.engine_R)
    k3_R = rho_R - 1 - torch.log(rho_R)
    est_R = head_R - (m_t_R - m_e_R) + torch.where(d.in_top_R, torch.zeros_like(k3_R), k3_R)
    lower_R = head_R + torch.where(
        m_e_R > 0, m_e_R * torch.log(m_e_R.clamp(min=1e-300) / m_t_R), torch.zeros_like(m_e_R)
    )
    return est_R, lower_R


def dump_estimate(d: Dump, seed: int = 0) -> dict:
    """The one scale from another system's dump: k3 per token (E[k3] under engine samples = the exact KL), or
    the top-k estimate when both sides logged top-k log-probs; a sequence-bootstrap CI; the metrics beside."""
    rho_R = torch.exp(d.train_R - d.engine_R)
    est_R, extra = rho_R - 1 - torch.log(rho_R), {"estimator": "k3"}
    if d.top_engine_R_K is not None:
        est_R, lower_R = topk_token_kl(d)
        extra = {
            "estimator": f"top-{d.top_engine_R_K.shape[1]} + k3 tail",
            "kl_lower_bound": lower_R.mean().item(),
        }
    lo, hi = bootstrap_ci(est_R, d.seq_id_R, seed=seed)
    return {
        "mismatch_kl": est_R.mean().item(),
        "ci_low": lo,
        "ci_high": hi,
        "tokens": len(est_R),
        "sequences": d.sequences,
        **extra,
        **sampled_token_metrics(d.engine_R, d.train_R, d.seq_id_R),
    }


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
    """The one measurement of a rollout configuration, for mismatch.py, experiments.py and admit.py check:
    the engine's samples of `probes` against the trainer, with the time it took. keep: also return the
    Scored samples (under "scored")."""
    t0 = time.time()
    calib = [
        format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:8]
    ]  # fp8 KV: never eval prompts
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


def build_parser() -> Parser:
    p = Parser(
        description="Measure each mismatch source of a rollout configuration on the one scale (no training)."
    )
    p.add_argument("--pair", default="tiny", choices=PAIRS, help="the pair (default: %(default)s)")
    p.add_argument(
        "--probes",
        type=positive_int,
        help=f"held-out probe prompts (default: {PROBES['tiny']} tiny, {DEFAULT_PROBES} others)",
    )
    p.add_argument(
        "--prompts",
        help='metrics-only mode on your own prompts: a JSONL file of {"prompt": ...}; every line is a probe',
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="the zero-mismatch control: the engine is the trainer's "
        "exact copy, scored twice; its number is the floor of this setup",
    )
    p.add_argument(
        "--dump-out", help="also write the samples as a log dump (dumps.py's JSONL schema) to this file"
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
    """--prompts FILE (every line a probe), else the first --probes held-out prompts of the pair."""
    texts = [p.text for p in read_prompts(args.prompts)] if args.prompts else None
    if texts is None:
        texts = [p.text for p in pair.eval_prompts[: args.probes or PROBES.get(pair.name, DEFAULT_PROBES)]]
    return [format_prompt(pair.tokenizer, t) for t in texts]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.staleness:
            raise BadInput(
                f"--staleness {args.staleness}: measuring staleness needs real training steps to make "
                "the old weights; use `python experiments.py sources --staleness K` "
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
