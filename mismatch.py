"""Measurement: how far the rollout engine's policy is from the policy being trained, on one scale.

The canonical scale (nats per token):

    mismatch_kl = mean over response tokens t of  KL(π_engine(·|x_<t) ‖ π_train(·|x_<t))
                = mean_t Σ_v π_e(v|x_<t) (log π_e(v|x_<t) − log π_t(v|x_<t)),

taken on the engine's own samples (x ~ π_engine), over the full vocabulary, where π_train is the trainer's
current student (the policy being updated; a stale engine serves older weights). Both sides are read at temperature 1 with no top-p truncation: the
policies themselves, not the sampler's settings.

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

    python mismatch.py --pair tiny --weights bf16
"""

import argparse
import json
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from models import PAIRS, BadInput, format_prompt, load_pair
from rollout import RolloutConfig, RolloutEngine, snapshot
from train import PAIR_DEFAULTS, Batches, add_rollout_args, pair_config, head, make_engine, resolve_device, response_hidden, rollout_config_from_args, train_step


def exact_token_kl(engine: RolloutEngine, train, rollout, chunk: int = 256) -> torch.Tensor:
    """Exact KL(π_engine ‖ π_train) at every response token of `rollout`: kl_N (row-major order).

    The engine side is scored through the engine's own model and an empty cache of its kind, in one pass:
    our FP8 KV cache quantizes prompt and response alike, so this gives the distributions it sampled from.
    Vocabulary-sized logits are formed `chunk` tokens at a time, so gemma3's 262k vocabulary fits.
    """
    with torch.no_grad():
        h_e_N_H, _ = response_hidden(engine.model, rollout, cache=engine.new_cache())
        h_t_N_H, _ = response_hidden(train, rollout)
        out = []
        for i in range(0, len(h_e_N_H), chunk):
            logp_e = torch.log_softmax(head(engine.model, h_e_N_H[i : i + chunk]).float(), -1)
            logp_t = torch.log_softmax(head(train, h_t_N_H[i : i + chunk]).float(), -1)
            out.append((logp_e.exp() * (logp_e - logp_t)).sum(-1))
        return torch.cat(out) if out else torch.zeros(0)


def prefix_shift_kl(kl_N: torch.Tensor, rollout) -> torch.Tensor:
    """The prefix-shift part of the mismatch at every response token: KL between the engine's and the
    trainer's distributions of the response prefix y_<t (kl_N: exact per-token KLs, row-major order).

    By the chain rule of KL,  KL(P_engine(y_<t) ‖ P_train(y_<t)) = E_engine[Σ_{τ<t} KL_τ],  so the running
    sum of the earlier tokens' exact KLs on an engine sample estimates it without bias. The per-token part
    at t is KL_t itself: TIS can reweight the token drawn at t, but not the prefix it was drawn after.
    """
    target_B_T = rollout.response_mask[:, 1:].bool()
    kl_B_T = torch.zeros(target_B_T.shape, dtype=kl_N.dtype, device=kl_N.device).masked_scatter(target_B_T, kl_N)
    return (kl_B_T.cumsum(1) - kl_B_T)[target_B_T]  # exclusive running sum along each response


def sampled_token_metrics(logp_engine_N: torch.Tensor, logp_train_N: torch.Tensor, seq_id_N: torch.Tensor) -> dict:
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


def bootstrap_ci(kl_N: torch.Tensor, seq_id_N: torch.Tensor, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Confidence interval of the token-mean KL, resampling whole sequences (prompts) with replacement.

    Resampling sequences, not tokens, because tokens of one response are correlated.
    """
    n_seq = int(seq_id_N.max()) + 1
    seq_sum = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, kl_N.double())
    seq_len = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_id_N, torch.ones_like(kl_N, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    idx_R_S = torch.randint(n_seq, (n_boot, n_seq), generator=g)
    means_R = seq_sum[idx_R_S].sum(1) / seq_len[idx_R_S].sum(1)
    lo, hi = torch.quantile(means_R, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


# ---------------------------------------------------------------------------------------------------
# Measuring a configuration


def measure(engine: RolloutEngine, train, tokenizer, prompts: list[str], seed: int = 0, chunk: int = 256) -> dict:
    """Every metric of this module for one engine against one trainer policy, on the engine's samples."""
    rollout = engine.generate(prompts, generator=torch.Generator(engine.device).manual_seed(seed))
    kl_N = exact_token_kl(engine, train, rollout, chunk).cpu()
    mask = rollout.response_mask[:, 1:].bool()
    seq_id_N = torch.arange(len(prompts), device=mask.device)[:, None].expand_as(mask)[mask].cpu()
    with torch.no_grad():
        h_N_H, y_N = response_hidden(train, rollout)
        logp_train_N = torch.cat([torch.log_softmax(head(train, h_N_H[i : i + chunk]).float(), -1).gather(-1, y_N[i : i + chunk, None]).squeeze(-1)
                                  for i in range(0, len(y_N), chunk)]).cpu()  # fmt: skip
    logp_engine_N = rollout.logprobs[:, 1:][mask].cpu()
    lo, hi = bootstrap_ci(kl_N, seq_id_N, seed=seed)
    return {"mismatch_kl": kl_N.mean().item(), "ci_low": lo, "ci_high": hi, "tokens": len(kl_N),
            **sampled_token_metrics(logp_engine_N, logp_train_N, seq_id_N)}  # fmt: skip


def opd_trajectory(pair, steps: int, device) -> list[dict]:
    """Weights after 0..steps real OPD steps (the pair's default settings): what a stale engine serves."""
    import copy

    cfg = pair_config(pair.name)
    student = copy.deepcopy(pair.student)
    work = copy.copy(pair)
    work.student = student
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr)
    batches = Batches(work, make_engine(work, cfg), cfg, device)
    snapshots = [snapshot(student)]
    for step in range(1, steps + 1):
        train_step(work, batches, cfg, optimizer, step, device)
        snapshots.append(snapshot(student))
    return snapshots


def synced_engine(pair, train, cfg: RolloutConfig, trajectory: list[dict] | None = None) -> RolloutEngine:
    """An engine for cfg, synced to `train`. A stale engine is walked through `trajectory` (the weights of
    versions 0..k), so it serves the old weights while `train` ends at the newest."""
    calib = [format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:8]]  # fp8 KV calibration, never eval prompts
    engine = RolloutEngine(train, pair.tokenizer, cfg, probe_prompts=calib)
    if cfg.staleness:
        for version, weights in enumerate(trajectory):
            train.load_state_dict(weights)
            engine.sync(train, version)
    else:
        engine.sync(train, 0)
    return engine


def sources(cfg: RolloutConfig) -> list[tuple[str, RolloutConfig]]:
    """Each non-default mismatch source of cfg alone, then all of them together (when more than one)."""
    base = RolloutConfig(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    rows = []
    if cfg.weights != "fp32":
        rows.append((f"weights {cfg.weights}", replace(base, weights=cfg.weights, fp8_skip=cfg.fp8_skip)))
    if cfg.kv_cache != "model":
        rows.append((f"kv {cfg.kv_cache} ({cfg.kv_scales})", replace(base, kv_cache=cfg.kv_cache, kv_scales=cfg.kv_scales)))
    if cfg.staleness:
        rows.append((f"staleness {cfg.staleness}", replace(base, staleness=cfg.staleness)))
    if cfg.noise:
        rows.append((f"noise {cfg.noise:g}", replace(base, noise=cfg.noise)))
    if len(rows) != 1:
        rows.append(("combined" if rows else "identical copy", replace(cfg, temperature=1.0, top_p=1.0)))
    return rows


def measure_sources(pair, cfg: RolloutConfig, n_probes: int, device, progress: bool = True) -> list[dict]:
    """The table: every source of cfg alone and combined, each against the trainer's current policy."""
    import copy

    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.eval_prompts[:n_probes]]
    trajectory = opd_trajectory(pair, cfg.staleness, device) if cfg.staleness else None
    train = pair.student
    if trajectory:
        train = copy.deepcopy(pair.student)
        train.load_state_dict(trajectory[-1])
    results = []
    for name, row in tqdm(sources(cfg), desc="sources", disable=not progress):
        t0 = time.time()
        engine = synced_engine(pair, train, row, trajectory)
        results.append({"source": name, **measure(engine, train, pair.tokenizer, probes, seed=cfg.seed), "seconds": time.time() - t0})
    return results


def print_table(results: list[dict], pair: str) -> None:
    print(f"mismatch on {pair}: KL(π_engine ‖ π_train), nats/token, on the engine's own samples (95% bootstrap CI over prompts)")
    print(f"{'source':<26}{'mismatch_kl':>12}{'95% CI':>24}{'k3':>11}{'k1':>11}{'|Δp| mean':>11}{'chi2':>10}{'ess':>7}{'seq_kl':>9}{'s':>7}")
    for r in results:
        ci = f"[{r['ci_low']:.2e}, {r['ci_high']:.2e}]"
        print(f"{r['source']:<26}{r['mismatch_kl']:>12.3e}{ci:>24}{r['k3']:>11.2e}{r['k1']:>11.2e}{r['dp_mean']:>11.2e}{r['chi2']:>10.2e}"
              f"{r['ess']:>7.3f}{r['seq_kl']:>9.3f}{r['seconds']:>7.1f}")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Measure each mismatch source of a rollout configuration on the one scale.", add_help=True)
    parser.add_argument("--pair", default="tiny", help=f"one of {', '.join(PAIRS)} (default tiny)")
    parser.add_argument("--probes", type=int, help="held-out probe prompts (default: 64 tiny, 16 smollm2)")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per row; mismatch_kl is the canonical number)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    # train.py's rollout flags, so a configuration reads the same everywhere; no temperature or top-p:
    # mismatch is measured between the policies themselves.
    add_rollout_args(parser.add_argument_group("rollout engine"), sampling=False)
    parser.add_argument("--seed", type=int, default=0, help="sampling and noise seed")
    args = parser.parse_args(argv)
    try:
        if args.pair not in PAIR_DEFAULTS or args.pair == "custom":
            raise BadInput(f"--pair {args.pair!r}: choose one of {', '.join(PAIRS)}")
        device = resolve_device(args.device)
        cfg = rollout_config_from_args(args, max_new_tokens=args.max_new_tokens or PAIR_DEFAULTS[args.pair]["max_new_tokens"])
        pair = load_pair(args.pair, device=device)
        results = measure_sources(pair, cfg, args.probes or {"tiny": 64}.get(args.pair, 16), device, progress=not args.json)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps({"pair": args.pair, "scale": "KL(engine||train) nats/token", "device": device, "rows": results}, indent=2))
    else:
        print_table(results, args.pair)


if __name__ == "__main__":
    main()
