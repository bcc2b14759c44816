"""A dump's interval covers the exact KL (study/coverage.py on fixed seeds of the tiny pair), and the check
never judges a dump it cannot read: unmasked padding, swapped or tempered columns, and top-k rows that hold
the sampled token below rank k, each against a direct computation."""

import json
import math

import pytest
import torch

import budget
from cli import BadInput
from mismatch import measure_config
from models import format_prompt
from port.dumps import Dump, read_dump, write_dump
from port.estimate import dump_estimate, dump_flags, seq_mean_se
from port.judge import check_dump
from rollout import RolloutConfig
from study.coverage import CELLS, as_dump, compact, judge_draws, sample_draw

DRAWS = 20  # fixed seeds 0..19 per cell, 64 sequences each
MISS_BOUND = 1 / DRAWS  # at most one of the 20 draws may miss from above (the 200-draw table: <= 1%)
BUDGET = {
    "schema_version": budget.SCHEMA_VERSION,
    "pair": "tiny",
    "loss": "analytic",
    "budget": 100.0,  # far above any tiny dump: a readable one is admitted
    "how": "crossing",
    "tolerance": {"nats": 0.01},
    "seconds_per_run": 10.0,
}


@pytest.fixture(scope="module")
def pools(tiny_pair):
    return {cell: [sample_draw(tiny_pair, over, 16, 64, i) for i in range(DRAWS)] for cell, over in CELLS}


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c, _ in CELLS])
@pytest.mark.parametrize("top", [False, True], ids=["k3", "top-k"])
def test_the_interval_covers_the_exact_kl_in_every_cell(pools, cell, top):
    result = judge_draws(pools[cell], top)
    assert result["miss"] <= MISS_BOUND, result
    assert result["flagged"] == 0, "our own engine's dumps are readable"


@pytest.mark.slow
def test_the_plain_k3_interval_is_what_under_covers(pools):
    """The bound above can fail: the k3 estimator's percentile interval alone misses at σ = 1."""
    assert judge_draws(pools["noise 1.0"], top=False)["miss_plain"] > 4 * MISS_BOUND


# ---------------------------------------------------------------------------------------------------
# Flags, each against a direct computation


@pytest.fixture(scope="module")
def noisy(tiny_pair):
    """Our engine at σ = 1 (many sampled tokens outside the top-8 of 16), 64 sequences."""
    probes = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_pair.eval_prompts[:64]]
    return measure_config(tiny_pair, RolloutConfig(max_new_tokens=8, noise=1.0), probes, keep=True)["scored"]


def sequences(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_unmasked_padding_is_flagged_and_never_admitted(noisy, tmp_path):
    write_dump(tmp_path / "d.jsonl", noisy)
    lines = sequences(tmp_path / "d.jsonl")
    T = max(len(d["engine_logprobs"]) for d in lines)

    def pad(key):
        return torch.tensor([d[key] + [0.0] * (T - len(d[key])) for d in lines])

    lens = torch.tensor([len(d["engine_logprobs"]) for d in lines])
    for name, mask in (("ones", torch.ones(len(lines), T)), ("mask", torch.arange(T) < lens[:, None])):
        torch.save(
            {
                "engine_logprobs": pad("engine_logprobs"),
                "train_logprobs": pad("train_logprobs"),
                "mask": mask,
            },
            tmp_path / f"{name}.pt",
        )
    flagged = dump_estimate(read_dump(tmp_path / "ones.pt"))
    # Directly: each row's trailing run of (0, 0) pairs (the padded slots, and any real ones before them).
    runs = []
    for d in lines:
        pairs = list(zip(d["engine_logprobs"], d["train_logprobs"])) + [(0.0, 0.0)] * (
            T - len(d["engine_logprobs"])
        )
        run = 0
        while run < T and pairs[T - 1 - run] == (0.0, 0.0):
            run += 1
        runs.append(run)
    direct = sum(runs) if sum(r >= 2 for r in runs) >= 2 else 0
    assert flagged["padding_tokens"] == direct > 0
    assert len(flagged["warnings"]) == 1 and flagged["warnings"][0].startswith("padding:")
    assert dump_estimate(read_dump(tmp_path / "mask.pt"))["warnings"] == []
    out = check_dump(BUDGET, tmp_path / "ones.pt")
    assert out["verdict"] == "uncertain" and "padding" in out["reason"]
    assert check_dump(BUDGET, tmp_path / "mask.pt")["verdict"] == "admit"


def test_swapped_columns_are_flagged(noisy):
    d = Dump(noisy.logp_engine_R.double(), noisy.logp_train_R.double(), noisy.seq_id_R)
    swapped = Dump(d.train_R, d.engine_R, d.seq_id_R)
    assert dump_flags(d)["warnings"] == []
    flags = dump_flags(swapped)
    assert len(flags["warnings"]) == 1 and flags["warnings"][0].startswith("columns:")
    # directly: the sequence-clustered z of k1 = mean(train − engine) of the original columns, negated
    r = (d.engine_R - d.train_R).tolist()
    seqs = {}
    for x, s in zip(r, d.seq_id_R.tolist()):
        seqs.setdefault(s, []).append(x)
    m = sum(r) / len(r)
    se = math.sqrt(
        len(seqs) / (len(seqs) - 1) * sum((sum(v) - m * len(v)) ** 2 for v in seqs.values())
    ) / len(r)
    assert seq_mean_se(d.engine_R - d.train_R, d.seq_id_R) == pytest.approx((m, se), rel=1e-9)
    assert flags["k1_z"] == pytest.approx(-m / se, rel=1e-9) and flags["k1_z"] < -4


def tempered(engine_temperature: float, seed: int = 0, n_seq: int = 64, length: int = 8):
    """Tokens drawn at temperature 0.7 from random logits over 16 ids; the trainer scores at 0.7 too; the
    engine column is logged at `engine_temperature` (1.0: vLLM's raw log-probs, 0.7: the sampled policy)."""
    g = torch.Generator().manual_seed(seed)
    z_R_V = 3 * torch.randn(n_seq * length, 16, generator=g, dtype=torch.float64)
    y_R = torch.multinomial(torch.softmax(z_R_V / 0.7, -1), 1, generator=g).squeeze(-1)
    logged = torch.log_softmax(z_R_V / engine_temperature, -1).gather(-1, y_R[:, None]).squeeze(-1)
    train = torch.log_softmax(z_R_V / 0.7, -1).gather(-1, y_R[:, None]).squeeze(-1)
    return Dump(logged, train, torch.arange(n_seq).repeat_interleave(length)), z_R_V


def test_a_temperature_on_one_side_only_is_flagged():
    ok, _ = tempered(0.7)  # both columns the same tensor: the identical-columns flag, and no other
    assert dump_flags(ok)["flags"] == ["identical"] and dump_estimate(ok)["mismatch_kl"] == pytest.approx(
        0, abs=1e-12
    )
    bad, z_R_V = tempered(1.0)
    est = dump_estimate(bad)
    assert len(est["warnings"]) == 1 and est["warnings"][0].startswith("columns:")
    # directly from the distributions: E_{p_0.7}[p_0.7/p_1] = Σ p_0.7²/p_1 > 1 and E[k1] = −KL(p_0.7 ‖ p_1)
    p7, p1 = torch.softmax(z_R_V / 0.7, -1), torch.softmax(z_R_V, -1)
    ratio = (p7**2 / p1).sum(-1).mean().item()
    k1 = -(p7 * (p7.log() - p1.log())).sum(-1).mean().item()
    assert ratio > 1 and k1 < 0
    assert est["k1"] == pytest.approx(k1, abs=5 * seq_mean_se(bad.engine_R - bad.train_R, bad.seq_id_R)[1])


# ---------------------------------------------------------------------------------------------------
# Top-k rows that hold the sampled token below rank k


def add_sampled_token(lines: list[dict]) -> int:
    """Rewrite a dump as vLLM's logprobs=k writes it: the sampled token joins a row it is not in."""
    added = 0
    for d in lines:
        for t, y in enumerate(d["token_ids"]):
            if str(y) not in d["engine_top_logprobs"][t]:
                d["engine_top_logprobs"][t][str(y)] = d["engine_logprobs"][t]
                d["train_top_logprobs"][t][str(y)] = d["train_logprobs"][t]
                added += 1
    return added


def test_top_k_rows_holding_the_sampled_token_read_as_the_exact_top_k(noisy, tmp_path):
    write_dump(tmp_path / "d8.jsonl", noisy)
    lines = sequences(tmp_path / "d8.jsonl")
    for d in lines:  # the engine's top-2 (write_dump writes each row most likely first)
        for t, row in enumerate(d["engine_top_logprobs"]):
            keep = list(row)[:2]
            for key in ("engine_top_logprobs", "train_top_logprobs"):
                d[key][t] = {i: d[key][t][i] for i in keep}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    assert add_sampled_token(lines) > 10
    (tmp_path / "vllm.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    direct = read_dump(tmp_path / "d.jsonl")  # the engine's own top-2
    trimmed = read_dump(tmp_path / "vllm.jsonl")
    for a, b in ((direct.top_engine_R_K, trimmed.top_engine_R_K), (direct.in_top_R, trimmed.in_top_R)):
        assert torch.equal(a, b)
    assert dump_estimate(trimmed)["mismatch_kl"] == dump_estimate(direct)["mismatch_kl"]


def test_top_k_rows_that_cannot_be_trimmed_are_refused(noisy, tmp_path):
    write_dump(tmp_path / "d.jsonl", noisy)
    lines = sequences(tmp_path / "d.jsonl")
    d = lines[0]
    d["engine_top_logprobs"][0]["99"] = d["train_top_logprobs"][0]["99"] = -30.0  # not the sampled token
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(BadInput, match="top-k rows hold 8 to 9 ids; write exactly the engine's k"):
        read_dump(tmp_path / "bad.jsonl")
    lines = sequences(tmp_path / "d.jsonl")
    for (
        x
    ) in lines:  # every row: the engine's 7 most likely others, then the sampled token as the least likely
        for t, y in enumerate(x["token_ids"]):
            for key in ("engine_top_logprobs", "train_top_logprobs"):
                row = x[key][t]
                others = [i for i in x["engine_top_logprobs"][t] if i != str(y)][:7]
                x[key][t] = {**{i: row[i] for i in others}, str(y): -50.0}
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(BadInput, match="every top-k row ends in the sampled token"):
        read_dump(tmp_path / "all.jsonl")


def test_as_dump_is_what_write_dump_writes(tiny_pair, tmp_path):
    """The coverage study judges draws built in memory (study.coverage.as_dump): the same numbers as the
    dump our engine writes and read_dump reads."""
    probes = [format_prompt(tiny_pair.tokenizer, p.text) for p in tiny_pair.eval_prompts[:16]]
    s = measure_config(tiny_pair, RolloutConfig(max_new_tokens=8, noise=0.3), probes, keep=True)["scored"]
    write_dump(tmp_path / "d.jsonl", s)
    d = compact(s)
    read = read_dump(tmp_path / "d.jsonl")
    for top in (False, True):
        b = dump_estimate(read if top else Dump(read.engine_R, read.train_R, read.seq_id_R))
        a = dump_estimate(as_dump(d, top))
        assert a["mismatch_kl"] == pytest.approx(b["mismatch_kl"], rel=1e-6)
        assert a["ci_high"] == pytest.approx(b["ci_high"], rel=1e-6)
