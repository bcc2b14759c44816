"""The audit of an exported run: one figure page and a report.md to read beside the verdict.

`admit.py audit --dump PATH [--format F] --budget budget.json --out DIR` reads an export
(port/native.py), judges the selected steps as `check --dump` does, and writes DIR/audit.png and
DIR/report.md. The page has four panels, each from the per-token estimate that the verdict averages
(`token_estimates`):
    per-token KL histogram   counts over log10 of the estimate, log y; tokens at or below 1e-12 counted apart
    KL vs position           mean estimate at each position in the response (log y), with its token count
    KL per step              each step's mean with its 95% sequence-bootstrap CI, and the budget line
    top 20 tokens            the tokens with the largest share of the summed estimate, decoded when the
                             export has token ids and a tokenizer is given (`--tokenizer`)
The per-token estimate is k3 = ρ − 1 − log ρ with ρ = π_train(y)/π_engine(y) on sampled tokens, or the
top-k + k3-tail estimate (port.estimate.topk_token_kl) when both sides logged top-k log-probs; its mean over
tokens is `port.estimate.dump_estimate`'s mismatch_kl.

    python admit.py audit --dump runs/x/token_exports --budget budgets/tiny/budget.json --out audit/x
"""

import torch
from matplotlib.figure import Figure

from lab.runfiles import atomic_savefig
from port.dumps import Dump
from port.estimate import topk_token_kl
from port.native import Step

TOP_TOKENS = 20  # tokens listed in the top-contribution panel and table
FLOOR = 1e-12  # per-token estimates at or below this are counted apart from the histogram


def token_estimates(d: Dump) -> torch.Tensor:
    """The per-token estimate whose mean is dump_estimate's mismatch_kl [R], float64: the top-k + k3-tail
    estimate when both sides logged top-k, else k3 = ρ − 1 − log ρ, ρ = exp(log π_t(y) − log π_e(y))."""
    if d.top_engine_R_K is not None:
        return topk_token_kl(d)[0]
    rho_R = torch.exp(d.train_R - d.engine_R)
    return rho_R - 1 - torch.log(rho_R)


def origins(chosen: list[Step]) -> list[tuple[int, int]]:
    """(step, sequence within the step) of each sequence of native.merge(chosen), in its order."""
    return [(s.step, i) for s in chosen for i in range(s.dump.sequences)]


def top_tokens(step: Step, est_R: torch.Tensor, origin: list, decode=None, n: int = TOP_TOKENS) -> list[dict]:
    """The n tokens with the largest estimate: share = est_t / Σ est (their part of the mean). `origin`:
    (step, sequence) of each of `step`'s sequences; decode: token id -> text, or None."""
    total = est_R.sum().item()
    rows = []
    for r in est_R.argsort(descending=True)[:n].tolist():
        tid = int(step.token_ids_R[r]) if step.token_ids_R is not None else None
        rows.append(
            {
                "step": origin[int(step.dump.seq_id_R[r])][0],
                "sequence": origin[int(step.dump.seq_id_R[r])][1],
                "position": int(step.position_R[r]),
                "token_id": tid,
                "text": decode(tid) if decode is not None and tid is not None else None,
                "estimate": est_R[r].item(),
                "share": est_R[r].item() / total if total > 0 else float("nan"),
                "engine_logprob": step.dump.engine_R[r].item(),
                "train_logprob": step.dump.train_R[r].item(),
            }
        )
    return rows


def by_position(step: Step, est_R: torch.Tensor) -> tuple[list[int], list[float], list[int]]:
    """(positions, mean estimate at each, token count at each)."""
    n = int(step.position_R.max()) + 1
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, step.position_R, est_R)
    counts = torch.bincount(step.position_R, minlength=n)
    seen = (counts > 0).nonzero().squeeze(-1).tolist()
    return seen, [(sums[p] / counts[p]).item() for p in seen], [int(counts[p]) for p in seen]


def _token(row: dict) -> str:
    if row["text"] is not None:
        return f"{row['text']!r} (id {row['token_id']})"
    return f"id {row['token_id']}" if row["token_id"] is not None else "(no token ids)"


def _label(row: dict) -> str:
    return f"step {row['step']} seq {row['sequence']} pos {row['position']} {_token(row)}"


def draw(path, merged: Step, per_step: list[dict], result: dict, tops: list[dict]) -> None:
    """The four-panel page (see the module docstring), written to `path` as PNG through the project's
    atomic path (lab.runfiles.atomic_savefig)."""
    est_R = token_estimates(merged.dump)
    fig = Figure(figsize=(11, 8))  # no pyplot: no global backend change
    ax = fig.subplots(2, 2)
    positive = est_R[est_R > FLOOR]
    if len(positive):
        ax[0, 0].hist(torch.log10(positive).numpy(), bins=40, color="tab:blue")
    ax[0, 0].set_yscale("log")
    ax[0, 0].set_xlabel("log10 per-token KL estimate (nats)")
    ax[0, 0].set_ylabel("tokens")
    ax[0, 0].set_title(f"per-token KL ({int((est_R <= FLOOR).sum())} of {len(est_R)} tokens <= {FLOOR:g})")
    pos, mean, count = by_position(merged, est_R)
    ax[0, 1].plot(pos, [max(m, FLOOR) for m in mean], marker=".", color="tab:orange")
    ax[0, 1].set_yscale("log")
    ax[0, 1].set_xlabel("position in the response (tokens)")
    ax[0, 1].set_ylabel("mean KL estimate (nats/token)")
    ax[0, 1].set_title(f"KL vs position ({min(count)}-{max(count)} tokens a position)")
    steps = [r["step"] for r in per_step]
    mid = [r["mismatch_kl"] for r in per_step]
    err = [
        [m - r["ci_low"] for m, r in zip(mid, per_step)],
        [r["ci_high"] - m for m, r in zip(mid, per_step)],
    ]
    chosen = set(result["steps"])
    colors = ["tab:green" if s in chosen else "tab:gray" for s in steps]
    for s, m, lo, hi, c in zip(steps, mid, err[0], err[1], colors):
        ax[1, 0].errorbar([s], [m], yerr=[[lo], [hi]], fmt="o", color=c, capsize=3)
    ax[1, 0].axhline(
        result["budget"], color="tab:red", linestyle="--", label=f"budget {result['budget']:.2e}"
    )
    ax[1, 0].set_yscale("log")  # the steps' CIs and a budget orders of magnitude apart stay readable
    ax[1, 0].set_xticks(steps)
    ax[1, 0].set_xlabel("training step (green: judged)")
    ax[1, 0].set_ylabel("mismatch KL (nats/token), 95% CI")
    ax[1, 0].set_title(f"KL per step: {result['verdict'].upper()} on the judged steps")
    ax[1, 0].legend(fontsize=8)
    labels = [_label(r) for r in tops][::-1]
    ax[1, 1].barh(range(len(tops)), [r["estimate"] for r in tops][::-1], color="tab:purple")
    ax[1, 1].set_yticks(range(len(tops)), labels, fontsize=6)
    ax[1, 1].set_xscale("log")
    ax[1, 1].set_xlabel("per-token KL estimate (nats)")
    ax[1, 1].set_title(f"top {len(tops)} tokens: {sum(r['share'] for r in tops):.0%} of the summed estimate")
    fig.suptitle(f"{result['format']} export: {result['tokens']} tokens, {result['sequences']} sequences")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)  # a full disk leaves the previous page, never a torn one


def coverage_rule(result: dict) -> str:
    """What the estimator needs to be unbiased, the dump's own check of it, and the interval's rule
    (port.estimate.dump_estimate's coverage_rule)."""
    if result["estimator"] == "k3":
        need = (
            "k3 is unbiased for KL(engine ‖ train) only when the engine's support covers the trainer's "
            "(E_engine[ρ] = 1): both sides the same temperature, no top-p / top-k truncation. "
            f"Check: the mean IS ratio ρ here is {result['ratio_mean']:.4f} (1 when covered)."
        )
    else:
        need = (
            f"{result['estimator']}: exact over the engine's top-k set; outside it, k3 on sampled tokens "
            "outside the set (unbiased under the same coverage condition as k3). The top-k set must be "
            f"exactly the engine's k largest. Lower bound without sampling: {result['kl_lower_bound']:.3e}."
        )
    return f"{need} Interval: {result['coverage_rule']}."


def band(result: dict) -> str:
    """The budget's 95% interval as the report prints it; an open upper end reads "beyond the grid"."""
    b_lo, b_hi = result["budget_interval"]
    return f"[{b_lo:.3e}, {'beyond the grid' if b_hi is None else f'{b_hi:.3e}'}]"


def report(result: dict, tops: list[dict], command: str, figure: str) -> str:
    """report.md: the verdict, the estimator, the coverage rule, the per-step table and the command."""
    lines = [
        f"# Mismatch audit: {result['verdict'].upper()} for the {result['loss']} loss",
        "",
        f"{result['reason']}.",
        "",
        f"- mismatch {result['mismatch_kl']:.3e} nats/token, 95% CI [{result['ci_low']:.3e}, "
        f"{result['ci_high']:.3e}], budget {result['budget']:.3e} (its 95% interval {band(result)})",
        f"- read as `{result['format']}`: {result['tokens']} tokens in {result['sequences']} sequences, "
        f"steps {', '.join(map(str, result['steps']))}",
        f"- estimator: {result['estimator']}",
        f"- coverage rule: {coverage_rule(result)}",
        "- verdict rule: admit if the CI's upper end < the budget interval's lower end, reject if the CI's "
        "lower end > the budget interval's upper end, else uncertain",
        "",
        f"![audit]({figure})",
        "",
        "| step | sequences | tokens | mismatch (nats/token) | 95% CI |",
        "|---:|---:|---:|---:|---|",
        *(
            f"| {r['step']} | {r['sequences']} | {r['tokens']} | {r['mismatch_kl']:.3e} | "
            f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}] |"
            for r in result["per_step"]
        ),
        "",
        f"Top {len(tops)} tokens by estimate:",
        "",
        "| step | sequence | position | token | estimate | share | log π_engine | log π_train |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
        *(
            f"| {r['step']} | {r['sequence']} | {r['position']} | {_token(r)} | {r['estimate']:.3e} | "
            f"{r['share']:.1%} | {r['engine_logprob']:.4f} | {r['train_logprob']:.4f} |"
            for r in tops
        ),
        "",
        "Made by:",
        "",
        f"    {command}",
        "",
    ]
    return "\n".join(lines)
