"""port/native.py reads every system's export, written in that system's own layout (native_fixtures.py), to the
same per-token log-probs, honouring its masks; bad exports are one line naming the file and the field; the
check and audit CLIs give a per-step table and an audit page."""

import json
import math

import pytest
import torch
from native_fixtures import (
    WRITERS,
    expected,
    make_truth,
    make_vllm_truth,
    write_prime_rl,
    write_slime_main,
    write_trl,
    write_verl,
    write_vllm,
)

import admit
import budget
from port.audit import by_position, token_estimates
from port.estimate import dump_estimate
from port.native import merge, read_native, select_steps

MASKED = {"prime-rl", "slime", "slime-main", "verl", "trl"}  # formats whose responses hold tool tokens
BUDGET = {
    "schema_version": budget.SCHEMA_VERSION,
    "pair": "tiny",
    "loss": "analytic",
    "budget": 0.05,
    "how": "crossing",
    "tolerance": {"nats": 0.01},
    "seconds_per_run": 10.0,
}


@pytest.mark.parametrize("fmt", [*WRITERS, "slime-main"])
def test_each_native_layout_reads_to_the_same_logprobs(tmp_path, fmt):
    truth = make_truth()
    writer = write_slime_main if fmt == "slime-main" else WRITERS[fmt]
    path = writer(tmp_path / "export", truth)
    found, steps = read_native(str(path))  # the format told by the fields alone
    assert found == fmt.removesuffix("-main")
    assert len(steps) == len(truth)
    for step, (number, (engine, train, ids, positions)) in zip(steps, expected(truth).items()):
        assert step.dump.engine_R.tolist() == engine, "engine log-probs of the kept tokens"
        assert step.dump.train_R.tolist() == train, "trainer log-probs of the kept tokens"
        assert step.token_ids_R.tolist() == ids
        assert step.dump.sequences == sum(len(seqs) for _, seqs in truth[number])
        if fmt in MASKED:  # steps numbered as the system numbers them; positions count the tool tokens
            assert step.step == number and step.position_R.tolist() == positions
    assert (
        read_native(str(path), fmt.removesuffix("-main"))[1][0].dump.engine_R.tolist()
        == steps[0].dump.engine_R.tolist()
    )


def test_a_glob_of_one_step_reads_that_step(tmp_path):
    truth = make_truth()
    root = write_prime_rl(tmp_path, truth)
    _, steps = read_native(str(root / "step_4" / "*.jsonl"))
    assert [s.step for s in steps] == [4] and steps[0].dump.engine_R.tolist() == expected(truth)[4][0]


def test_trl_drops_tokens_vllm_could_not_score_and_prime_rl_keeps_only_sampled_tokens(tmp_path):
    truth = make_truth(steps=(0,), ranks=1)
    path = write_trl(tmp_path / "trl", truth) / "step_0_rank_0.pt"
    data = torch.load(path)
    data["sampling_per_token_logps"][0, 0] = math.nan  # TRL's marker: vLLM gave no log-prob here
    torch.save(data, path)
    assert len(read_native(str(path), "trl")[1][0].dump.engine_R) == len(expected(truth)[0][0]) - 1
    root = write_prime_rl(tmp_path / "prime", truth)
    file = root / "step_0" / "rank_0.jsonl"
    record = json.loads(file.read_text().splitlines()[0])
    record["rl_weights"] = [
        0.0 if t == len(record["token_ids"]) - 1 else 1.0 for t in range(len(record["token_ids"]))
    ]
    file.write_text(json.dumps(record) + "\n" + "\n".join(file.read_text().splitlines()[1:]) + "\n")
    assert len(read_native(str(root))[1][0].dump.engine_R) == len(expected(truth)[0][0]) - 1


def test_vllm_top_k_keeps_exactly_the_k_largest(tmp_path):
    """vLLM adds the sampled token to a position's dict when it ranks below k; the reader drops it, so the
    top-k estimator sees the engine's k largest, the same as computed from the full distributions."""
    k, truth = 3, make_vllm_truth()
    _, steps = read_native(str(write_vllm(tmp_path, truth, k=k)))
    d = steps[0].dump
    seqs = truth[0][0][1]
    logp_e = torch.tensor([row for s in seqs for row in s.logp_e])
    logp_t = torch.tensor([row for s in seqs for row in s.logp_t])
    ids = torch.tensor([y for s in seqs for y in s.ids])
    top_e, top_ids = logp_e.topk(k, -1)
    assert d.top_engine_R_K.shape == (len(ids), k)
    assert torch.equal(d.top_engine_R_K.sort(-1).values, top_e.double().sort(-1).values)
    assert torch.equal(d.in_top_R, (top_ids == ids[:, None]).any(-1))
    assert (~d.in_top_R).any(), "the fixture must have sampled tokens below the top k"
    p_e = top_e.double().exp()
    head = (p_e * (top_e.double() - logp_t.gather(-1, top_ids).double())).sum(-1)
    k3_out = (lambda r: r - 1 - r.log())(torch.exp(d.train_R - d.engine_R))
    direct = head - ((1 - logp_t.gather(-1, top_ids).double().exp().sum(-1)) - (1 - p_e.sum(-1)))
    direct = direct + torch.where(d.in_top_R, 0.0, k3_out)
    assert torch.allclose(token_estimates(d), direct, atol=1e-12)


def test_per_token_estimates_average_to_dump_estimate_and_positions_match_a_loop(tmp_path):
    roots = [write_verl(tmp_path / "verl", make_truth()), write_vllm(tmp_path / "v", make_vllm_truth(), k=3)]
    for root in roots:  # k3, then top-k + k3 tail
        step = merge(read_native(str(root))[1])
        est = token_estimates(step.dump)
        assert abs(est.mean().item() - dump_estimate(step.dump)["mismatch_kl"]) < 1e-12
        pos, mean, count = by_position(step, est)
        for p, m, c in zip(pos, mean, count):
            at = [e for e, q in zip(est.tolist(), step.position_R.tolist()) if q == p]
            assert c == len(at) and abs(m - sum(at) / len(at)) < 1e-12


def test_steps_selection(tmp_path):
    _, steps = read_native(str(write_verl(tmp_path, make_truth(steps=(1, 2, 5, 6)))))
    assert [s.step for s in select_steps(steps, "2,5-9")] == [2, 5, 6]
    assert [s.step for s in select_steps(steps, None)] == [1, 2, 5, 6]


# ---------------------------------------------------------------------------------------------------
# Command line


def test_check_prints_a_per_step_table_and_judges_the_selected_steps(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(BUDGET))
    root = write_prime_rl(tmp_path, make_truth())
    with pytest.raises(SystemExit) as code:
        admit.main(
            ["check", "--budget", str(tmp_path / "b.json"), "--dump", str(root), "--steps", "4", "--json"]
        )
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == [4] and [r["step"] for r in out["per_step"]] == [3, 4]
    _, steps = read_native(str(root))
    assert (
        out["mismatch_kl"] == dump_estimate(steps[1].dump)["mismatch_kl"] == out["per_step"][1]["mismatch_kl"]
    )
    assert code.value.code == admit.VERDICT_EXIT[out["verdict"]]
    with pytest.raises(SystemExit):
        admit.main(["check", "--budget", str(tmp_path / "b.json"), "--dump", str(root)])
    text = capsys.readouterr().out
    assert "* judged: steps 3, 4" in text and "(prime-rl)" in text


def test_audit_writes_the_page_and_the_report(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(BUDGET))
    root = write_trl(tmp_path / "trl", make_truth(steps=(1, 2, 3)))
    argv = ["audit", "--budget", str(tmp_path / "b.json"), "--dump", str(root), "--out", str(tmp_path / "a")]
    admit.main([*argv, "--tokenizer", "tiny", "--steps", "2-3"])
    report = (tmp_path / "a" / "report.md").read_text()
    assert (tmp_path / "a" / "audit.png").read_bytes()[:4] == b"\x89PNG"
    assert "estimator: k3" in report and "coverage rule" in report and "--steps 2-3" in report
    assert report.count("\n| ") >= 3 + 20, "per-step rows and the top-20 tokens"
    assert "wrote" in capsys.readouterr().out


def _bad(tmp_path, kind: str) -> tuple[list[str], str]:
    """(admit argv, text the one error line must contain) for each kind of bad export."""
    truth = make_truth()
    if kind == "missing field":
        root = write_prime_rl(tmp_path / "p", truth)
        f = root / "step_3" / "rank_1.jsonl"
        rec = json.loads(f.read_text().splitlines()[0])
        del rec["trainer_logprobs"]
        f.write_text(json.dumps(rec) + "\n")
        return ["--dump", str(root)], "rank_1.jsonl:1: missing field 'trainer_logprobs'"
    if kind == "ragged mask":
        root = write_verl(tmp_path / "v", truth)
        d = torch.load(root / "step_4.pt")
        d["response_mask"] = d["response_mask"][:, :-1]
        torch.save(d, root / "step_4.pt")
        return ["--dump", str(root)], "step_4.pt: response_mask"
    if kind == "ragged loss_mask":
        root = write_prime_rl(tmp_path / "p", truth)
        f = root / "step_4" / "rank_0.jsonl"
        rec = json.loads(f.read_text().splitlines()[0])
        rec["loss_mask"] = rec["loss_mask"][:-1]
        f.write_text(json.dumps(rec) + "\n")
        return ["--dump", str(root), "--format", "prime-rl"], "rank_0.jsonl:1: loss_mask has"
    if kind == "missing rank":
        root = write_trl(tmp_path / "t", truth)
        (root / "step_4_rank_1.pt").unlink()
        return ["--dump", str(root)], "step 4 has no file for rank 1"
    if kind == "nan":
        root = write_verl(tmp_path / "v", truth)
        d = torch.load(root / "step_3.pt")
        d["old_log_probs"][0, 0] = math.nan
        torch.save(d, root / "step_3.pt")
        return ["--dump", str(root)], "step_3.pt: row 0: old_log_probs is nan"
    if kind == "no STABLE":
        root = write_prime_rl(tmp_path / "p", truth)
        (root / "step_4" / "STABLE").unlink()
        return ["--dump", str(root)], "step_4: no STABLE file"
    if kind == "slime without log_probs":
        root = write_slime_main(tmp_path / "s", truth)
        d = torch.load(root / "3.pt")
        del d["samples"][2]["log_probs"]
        torch.save(d, root / "3.pt")
        return ["--dump", str(root)], "3.pt: sample 2: missing field 'log_probs'"
    if kind == "unknown format":
        (tmp_path / "x.jsonl").write_text(json.dumps({"logprobs": [-1.0]}) + "\n")
        return ["--dump", str(tmp_path / "x.jsonl")], "pass --format"
    if kind == "re-tokenised":
        root = write_vllm(tmp_path / "v", truth)
        f = root / "step_3.jsonl"
        rec = json.loads(f.read_text().splitlines()[0])
        rec["train"]["prompt_token_ids"][-1] += 1
        f.write_text(json.dumps(rec) + "\n")
        return ["--dump", str(f)], "step_3.jsonl:1: train.prompt_token_ids"
    root = write_verl(tmp_path / "v", truth)
    return ["--dump", str(root), "--steps", "9"], "--steps '9'"


KINDS = [
    "missing field",
    "ragged mask",
    "ragged loss_mask",
    "missing rank",
    "nan",
    "no STABLE",
    "slime without log_probs",
    "unknown format",
    "re-tokenised",
    "bad steps",
]


@pytest.mark.parametrize("cmd", ["check", "audit"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_export_is_one_line_naming_file_and_field(tmp_path, capsys, kind, cmd):
    (tmp_path / "b.json").write_text(json.dumps(BUDGET))
    argv, needle = _bad(tmp_path, kind)
    out = ["--out", str(tmp_path / "audit")] if cmd == "audit" else []
    with pytest.raises(SystemExit) as code:
        admit.main([cmd, "--budget", str(tmp_path / "b.json"), *argv, *out])
    err = capsys.readouterr().err
    assert code.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "audit").exists(), "a refused audit created its folder"
