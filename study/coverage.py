"""coverage: how often a dump's 95% CI misses the exact KL from above, for k3-only and top-k dumps.

For each pair and cell of CELLS (weight noise σ ∈ {0.03, 0.1, 0.3, 1.0}, and fp8 weights), our own engine
samples `draws` independent sets of `size` sequences (draw i: its own sampling and noise seed; prompts
i·size, i·size + 1, … taken cyclically from the held-out then the training prompts, so sequences are
i.i.d. and a reused prompt gets a fresh seed). Each draw is judged as a dump would be
(port.estimate.dump_estimate, without and with its top-k fields), and its CI is compared with that draw's
exact KL (mean over its tokens of the engine's recorded distributions against the trainer's, float64):
    miss        fraction of draws with ci_high < exact    (a 95% two-sided CI should miss above <= 2.5%)
    width       mean (ci_high − ci_low) / exact
    plain       the same for the estimator's own percentile interval (ci_estimator), without the rule
    flagged     fraction of draws port.estimate.dump_flags calls unreadable (our own dumps: none should be)
The draws are cached (one file each, under $OPD_CACHE/coverage), so a rerun only judges.

    python -m study coverage --pair tiny --draws 200      # ~5 min on a 2-core CPU
    python -m study coverage --pair smollm2               # 1-3 min a draw on a busy 2-core CPU; resumes
"""

import json
from pathlib import Path

import torch
from tqdm import tqdm

from lab.atomic import atomic_write_text
from lab.hf_pairs import cache_dir
from mismatch import measure_config
from models import format_prompt, load_pair
from port.dumps import Dump
from port.estimate import dump_estimate
from rollout import RolloutConfig
from study.common import RESULTS, slug

CELLS = (
    *((f"noise {s}", {"noise": s}) for s in (0.03, 0.1, 0.3, 1.0)),
    ("fp8 weights", {"weights": "fp8"}),
)
TOKENS = {"tiny": 16, "smollm2": 16}  # max_new_tokens of the pool's sequences (tiny stops at EOS)
DRAWS = 50  # independent draws per cell
SIZE = 64  # sequences per draw
KINDS = (("k3", False), ("top-k", True))  # a dump without and with its top-k fields


def draw_path(pair: str, cell: str, tokens: int, size: int, i: int) -> Path:
    return cache_dir() / "coverage" / f"{pair}-{slug(cell)}-t{tokens}-n{size}-{i}.pt"


def sample_draw(pair, over: dict, tokens: int, size: int, i: int) -> dict:
    """Draw i of a cell: the Scored samples of `size` prompts, kept compact (no distributions)."""
    pool = [*pair.eval_prompts, *pair.train_prompts]
    prompts = [format_prompt(pair.tokenizer, pool[(i * size + j) % len(pool)].text) for j in range(size)]
    cfg = RolloutConfig(max_new_tokens=tokens, seed=i, **over)
    return compact(measure_config(pair, cfg, prompts, keep=True)["scored"])


def compact(s) -> dict:
    """A Scored sample as a draw: the exact KL per token and what a dump of it holds (as_dump)."""
    return {
        "kl_R": s.kl_R,
        "engine_R": s.logp_engine_R.double(),
        "train_R": s.logp_train_R.double(),
        "seq_id_R": s.seq_id_R,
        "y_R": s.rollout.tokens[:, 1:][s.rollout.targets()].cpu(),
        "top_ids_R_K": s.top_ids_R_K,
        "top_engine_R_K": s.top_engine_R_K.double(),
        "top_train_R_K": s.top_train_R_K.double(),
    }


def draws_of(pair, cell: str, over: dict, tokens: int, size: int, n: int) -> list[dict]:
    """The cell's n draws, sampled once and cached."""
    out = []
    for i in tqdm(range(n), desc=f"{pair.name} {cell}", unit="draw", leave=False):
        path = draw_path(pair.name, cell, tokens=tokens, size=size, i=i)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(sample_draw(pair, over, tokens=tokens, size=size, i=i), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        out.append(torch.load(path, weights_only=True))
    return out


def as_dump(d: dict, top: bool) -> Dump:
    """A draw as the dump our engine writes (dumps.write_dump), with or without its top-k fields."""
    dump = Dump(d["engine_R"], d["train_R"], d["seq_id_R"])
    if top:
        dump.in_top_R = (d["top_ids_R_K"] == d["y_R"][:, None]).any(-1)
        dump.top_engine_R_K, dump.top_train_R_K = d["top_engine_R_K"], d["top_train_R_K"]
    return dump


def judge_draws(draws: list[dict], top: bool) -> dict:
    """One cell × estimator: the miss fraction and mean relative width of dump_estimate's interval (the
    coverage rule) and of the estimator's plain percentile interval, and the draws it flagged."""
    rows = []
    for d in draws:
        exact = d["kl_R"].mean().item()
        e = dump_estimate(as_dump(d, top))
        rows.append((exact, e["ci_low"], e["ci_high"], *e["ci_estimator"], bool(e["warnings"])))
    n = len(rows)
    return {
        "draws": n,
        "exact_kl_mean": sum(r[0] for r in rows) / n,
        "miss": sum(r[2] < r[0] for r in rows) / n,
        "width": sum((r[2] - r[1]) / r[0] for r in rows) / n,
        "miss_plain": sum(r[4] < r[0] for r in rows) / n,
        "width_plain": sum((r[4] - r[3]) / r[0] for r in rows) / n,
        "flagged": sum(r[5] for r in rows) / n,
    }


def coverage(pair_name: str, draws: int, size: int, tokens: int, device: str) -> dict:
    """Every cell of one pair, k3-only and top-k (see the module docstring)."""
    pair = load_pair(pair_name, device=device)
    cells = []
    for cell, over in CELLS:
        pool = draws_of(pair, cell, over, tokens=tokens, size=size, n=draws)
        cells += [{"cell": cell, "dump": kind, **judge_draws(pool, top)} for kind, top in KINDS]
    rules = {kind: dump_estimate(as_dump(pool[0], top=top))["coverage_rule"] for kind, top in KINDS}
    return {"pair": pair_name, "size": size, "tokens": tokens, "coverage_rules": rules, "cells": cells}


def coverage_table(results: list[dict]) -> str:
    lines = [
        "95% CI upper end below the exact KL (miss; target <= 2.5%) and mean width / exact KL, per draw of "
        f"{results[0]['size']} sequences; plain = the estimator's percentile bootstrap alone",
        f"{'pair':8} {'cell':12} {'dump':6} {'draws':>5} {'exact KL':>9} {'miss':>6} {'width':>6} "
        f"{'plain miss':>10} {'plain width':>11} {'flagged':>7}",
    ]
    for res in results:
        for c in res["cells"]:
            lines.append(
                f"{res['pair']:8} {c['cell']:12} {c['dump']:6} {c['draws']:>5} {c['exact_kl_mean']:>9.3g} "
                f"{c['miss']:>6.1%} {c['width']:>6.2f} {c['miss_plain']:>10.1%} {c['width_plain']:>11.2f} "
                f"{c['flagged']:>7.1%}"
            )
    lines += [f"rule ({kind}): {rule}" for kind, rule in results[0]["coverage_rules"].items()]
    return "\n".join(lines)


def merged(path: Path, results: list[dict]) -> list[dict]:
    """`results` with the other pairs' committed results kept (a one-pair run replaces only its pair)."""
    fresh = {r["pair"] for r in results}
    kept = json.loads(path.read_text())["results"] if path.is_file() else []
    return [r for r in kept if r["pair"] not in fresh] + results


def run_coverage(args, device: str) -> None:
    """python -m study coverage: each pair's cells, results/coverage.json and the table."""
    draws = {"tiny": args.draws, "smollm2": args.smollm2_draws or args.draws}
    pairs = ("tiny", "smollm2") if args.pair == "both" else (args.pair,)
    results = [coverage(p, draws[p], size=args.size, tokens=TOKENS[p], device=device) for p in pairs]
    out = RESULTS / "coverage.json"
    results = merged(out, results)
    atomic_write_text(out, json.dumps({"results": results}, indent=2) + "\n")
    print(coverage_table(results))
    print(f"wrote {out}")
