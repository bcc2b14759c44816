"""port/native.py reads every system's export, written in that system's own layout (native_fixtures.py), to the
same per-token log-probs, honouring its masks; bad exports are one line naming the file and the field; the
check and audit CLIs give a per-step table and an audit page. A misread export is flagged and never judged,
slime's parallel layouts are read (or refused by name), a dump is judged only at the distribution it was
sampled from, its verdict is its worst step's, and no ADMIT rests on what its tokens cannot see."""

import json
import math
import time

import pytest
import torch
from native_fixtures import (
    WRITERS,
    bypass,
    expected,
    filled,
    make_rare_truth,
    make_truth,
    make_vllm_truth,
    rare_kl,
    tools_kept,
    write_prime_rl,
    write_project,
    write_slime_main,
    write_slime_v031,
    write_trl,
    write_verl,
    write_vllm,
)

import admit
import budget
from cli import BadInput
from port.audit import by_position, token_estimates
from port.estimate import dump_estimate
from port.judge import check_dump
from port.native import FORMATS, MAX_STEP, merge, read_native, select_steps
from verdict import VERDICT_EXIT, judge

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
    assert code.value.code == VERDICT_EXIT[out["verdict"]]
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


# ---------------------------------------------------------------------------------------------------
# Typed schemas: each layout's fields are checked before any conversion, by port/dumps.py's rules


def _edit_jsonl(path, edit) -> None:
    """Rewrite the first record of a JSONL file through edit(record) (in place)."""
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    edit(record)
    path.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")


def _edit_pt(path, edit) -> None:
    data = torch.load(path, weights_only=True)
    edit(data)
    torch.save(data, path)


def _put(d: dict, key: str, value) -> None:
    d[key] = value


def _vllm_entry_bare(rec: dict) -> None:
    """A vLLM logprobs row whose Logprob is a bare float instead of {logprob, rank, decoded_token}."""
    row = rec["engine"]["outputs"][0]["logprobs"][0]
    row[next(iter(row))] = -0.5


# name: (writer, the file to edit under the export, edit, text the one line must hold); each layout written
# by its own writer (native_fixtures.py), one field then set to what a careless or broken export holds
MISTYPED = {
    # prime-rl: per-token lists of the wrong entry type; a log-prob no float holds; a rank as text
    "prime-rl token_ids as strings": (
        write_prime_rl,
        "step_3/rank_0.jsonl",
        lambda r: _put(r, "token_ids", [str(t) for t in r["token_ids"]]),
        "rank_0.jsonl:1: token_ids[0] is '",
    ),
    "prime-rl 400-digit log-prob": (
        write_prime_rl,
        "step_3/rank_0.jsonl",
        lambda r: r["inference_logprobs"].__setitem__(-1, -(10**400)),
        "inference_logprobs[",
    ),
    "prime-rl rank as text": (
        write_prime_rl,
        "step_3/rank_0.jsonl",
        lambda r: _put(r, "rank", "0"),
        "rank is '0'; expected a rank",
    ),
    "prime-rl rl_weights of text": (
        write_prime_rl,
        "step_3/rank_0.jsonl",
        lambda r: _put(r, "rl_weights", ["1"] * len(r["token_ids"])),
        "rl_weights[0] is '1'",
    ),
    # slime (main layout): samples not a list of sample dicts; a float tensor of token ids; int log-probs
    "slime samples as a string": (
        write_slime_main,
        "3.pt",
        lambda d: _put(d, "samples", "abc"),
        "samples is",
    ),
    "slime samples as ints": (
        write_slime_main,
        "3.pt",
        lambda d: _put(d, "samples", [1, 2]),
        "3.pt: sample 0 is 1; expected a dict",
    ),
    "slime float tokens": (
        write_slime_main,
        "3.pt",
        lambda d: d["samples"][1].__setitem__("tokens", d["samples"][1]["tokens"].float()),
        "sample 1: tokens is a tensor of torch.float32; expected an integer tensor",
    ),
    "slime int64 log_probs": (
        write_slime_main,
        "3.pt",
        lambda d: d["samples"][0].__setitem__("log_probs", d["samples"][0]["log_probs"].long()),
        "sample 0: log_probs is a tensor of torch.int64; expected a floating-point tensor",
    ),
    "slime rollout_id as text": (
        write_slime_main,
        "3.pt",
        lambda d: _put(d, "rollout_id", "3"),
        "rollout_id is '3'; expected a step number",
    ),
    # verl: token ids holding NaN (a float tensor), int64 log-probs (the project's .pt reader refuses them)
    "verl responses with NaN": (
        write_verl,
        "step_3.pt",
        lambda d: _put(d, "responses", d["responses"].float().index_fill(1, torch.tensor([0]), math.nan)),
        "step_3.pt: responses is a tensor of torch.float32; expected an integer tensor",
    ),
    "verl int64 log-probs": (
        write_verl,
        "step_3.pt",
        lambda d: _put(d, "rollout_log_probs", d["rollout_log_probs"].long()),
        "rollout_log_probs is a tensor of torch.int64; expected a floating-point tensor",
    ),
    "verl token id beyond int32": (
        write_verl,
        "step_3.pt",
        lambda d: d["responses"].__setitem__((0, 0), 2**40),
        "responses holds",
    ),
    # TRL: the process index accelerate gives, as a name; a mask of NaN
    "trl process_index as a name": (
        write_trl,
        "step_3_rank_0.pt",
        lambda d: _put(d, "process_index", "main"),
        "process_index is 'main'; expected a rank",
    ),
    "trl process_index beyond any rank": (  # every rank below it would be asked for: a set of 10^12
        write_trl,
        "step_3_rank_0.pt",
        lambda d: _put(d, "process_index", 10**12),
        "process_index is 1000000000000; expected a rank (an integer in [0, 65536))",
    ),
    "trl NaN completion_mask": (
        write_trl,
        "step_3_rank_0.pt",
        lambda d: _put(d, "completion_mask", d["completion_mask"].float().fill_(math.nan)),
        "completion_mask holds NaN",
    ),
    # vLLM: RequestOutput fields of the wrong type; a Logprob that is a bare number; a token id as a name
    "vllm outputs as a number": (
        write_vllm,
        "step_3.jsonl",
        lambda r: r["engine"].__setitem__("outputs", 5),
        "step_3.jsonl:1: engine: outputs is 5; expected a list",
    ),
    "vllm bare-float Logprob": (
        write_vllm,
        "step_3.jsonl",
        _vllm_entry_bare,
        "engine.outputs[0].logprobs[0]['",
    ),
    "vllm token id as a word": (
        write_vllm,
        "step_3.jsonl",
        lambda r: _put(r["train"]["prompt_logprobs"][-1], "the", {"logprob": -1.0, "rank": 1}),
        "] has the key 'the'; expected token ids as keys",
    ),
    # the project's own JSONL: token ids of the wrong type are refused, not silently dropped
    "project bool token_ids": (
        write_project,
        "step_3.jsonl",
        lambda r: _put(r, "token_ids", [True] * len(r["engine_logprobs"])),
        "step_3.jsonl:1: token_ids must be a list of token ids",
    ),
}


@pytest.mark.parametrize("cmd", ["check", "audit"])
@pytest.mark.parametrize("case", MISTYPED)
def test_a_mistyped_field_is_one_line_naming_file_and_field(tmp_path, capsys, case, cmd):
    writer, name, edit, needle = MISTYPED[case]
    root = writer(tmp_path / "export", make_truth())
    (_edit_pt if name.endswith(".pt") else _edit_jsonl)(root / name, edit)
    (tmp_path / "b.json").write_text(json.dumps(BUDGET))
    argv = ["--dump", str(root), "--format", case.split()[0]]
    out = ["--out", str(tmp_path / "audit")] if cmd == "audit" else []
    with pytest.raises(SystemExit) as code:
        admit.main([cmd, "--budget", str(tmp_path / "b.json"), *argv, *out])
    err = capsys.readouterr().err
    assert code.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert "Traceback" not in err and not (tmp_path / "audit").exists()


def test_every_reader_has_a_mistyped_field_case():
    """One typed-schema case at least for every format a reader exists for."""
    assert {case.split()[0] for case in MISTYPED} == set(FORMATS)


# --steps: ASCII step numbers, ranges bounded and never listed number by number
STEPS_SPECS = {
    "²": "expected step numbers",  # str.isdigit takes it, int() does not
    "٣": "expected step numbers",  # an Arabic-Indic digit: a decimal to Python, no step number
    "0-99999999999": "beyond any step number",
    "9" * 5000: "beyond any step number",  # int() of 5000 digits raises; never reached
    "5-2": "runs backwards",
    "1,,2": "expected step numbers",
}


@pytest.mark.parametrize("spec", STEPS_SPECS, ids=lambda s: s[:20])
def test_a_bad_steps_spec_is_one_line(tmp_path, spec):
    _, steps = read_native(str(write_verl(tmp_path, make_truth(steps=(1, 2)))))
    with pytest.raises(BadInput, match=STEPS_SPECS[spec]):
        select_steps(steps, spec)


def test_a_steps_range_up_to_the_cap_is_tested_not_listed(tmp_path):
    """0-MAX_STEP spans 10^9 numbers: selecting with it is immediate (a set of them would take minutes)."""
    _, steps = read_native(str(write_verl(tmp_path, make_truth(steps=(1, 2, 5)))))
    start = time.perf_counter()
    assert [s.step for s in select_steps(steps, f"0-{MAX_STEP}")] == [1, 2, 5]
    assert [s.step for s in select_steps(steps, " 2 - 4 ,5")] == [2, 5]
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------------
# No silent misread: the flags, slime's parallel layouts, the sampling settings, the worst step, and what
# no sample can see

LAYOUTS = [*WRITERS, "slime-main"]
WIDE = {**BUDGET, "budget": 100.0}  # far above any fixture: what keeps a dump from ADMIT is its reading
SAMPLED_AT_1 = {"temperature": 1.0, "top_p": 1.0}


def _write(fmt: str, root, truth, **kw):
    return (write_slime_main if fmt == "slime-main" else WRITERS[fmt])(root, truth, **kw)


MISREADS = {  # flag: (the truth as the misread export holds it, words its line names)
    "identical": (bypass, "bypass_mode"),  # verl bypass mode: old_log_probs copied from rollout_log_probs
    "zeros": (tools_kept, "tool mask"),  # TRL's 0.0 engine log-probs at tool results, the mask dropped
    "range": (filled, "log(2^-149)"),  # a fill value at a masked slot read as kept
}


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("flag", MISREADS)
def test_a_misread_is_flagged_and_never_judged(tmp_path, fmt, flag):
    """Each misread in each layout: the clean export is ADMITTED against a wide budget, the misread one is
    UNCERTAIN, its line naming the flag and the likely cause, and the JSON naming the flag."""
    make, words = MISREADS[flag]
    truth = make_truth()
    clean = check_dump(WIDE, _write(fmt, tmp_path / "clean", truth), **SAMPLED_AT_1)
    assert clean["verdict"] == "admit" and clean["flags"] == [], clean["reason"]
    out = check_dump(WIDE, _write(fmt, tmp_path / "bad", make(truth)), **SAMPLED_AT_1)
    assert out["verdict"] == "uncertain" and flag in out["flags"], out["reason"]
    assert f"{flag}:" in out["reason"] and words in out["reason"]


def test_a_trl_hook_that_dropped_tool_mask_is_flagged(tmp_path):
    """TRL writes engine log-prob 0.0 at tool results; without tool_mask they read as a large mismatch."""
    truth = make_truth()
    masked = check_dump(WIDE, write_trl(tmp_path / "a", truth), **SAMPLED_AT_1)
    dropped = check_dump(WIDE, write_trl(tmp_path / "b", truth, tool_mask=False), **SAMPLED_AT_1)
    assert masked["verdict"] == "admit" and masked["flags"] == []
    assert (
        dropped["verdict"] == "uncertain"
        and dropped["flags"] == ["zeros"]
        and "tool_mask" in dropped["reason"]
    )
    assert dropped["mismatch_kl"] > 2 * masked["mismatch_kl"], "the misread the flag stands for"


def test_the_zero_and_range_flags_hold_their_stated_bounds():
    """zeros: more than 1% of kept tokens at engine 0.0 where the trainer gives under 1/2, in runs (a token
    both sides are near sure of is none, and neither is a lone one: a broken engine's sure EOS); range:
    below log of the smallest positive float32, 2^-149, where fp32 (and bf16, from 2^-133) underflow to 0."""
    from port.dumps import Dump
    from port.estimate import LOG_MIN_BF16, LOG_MIN_FP32, dump_flags

    assert torch.tensor(2.0**-149).item() > 0 and torch.tensor(2.0**-150).item() == 0
    assert torch.tensor(2.0**-133, dtype=torch.bfloat16).item() > 0
    assert torch.tensor(2.0**-134, dtype=torch.bfloat16).item() == 0
    assert LOG_MIN_FP32 == pytest.approx(math.log(2.0**-149)) and LOG_MIN_BF16 == pytest.approx(
        -92.19, abs=0.01
    )
    seq = torch.arange(400) // 8
    engine, train = (
        torch.full((400,), -1.0, dtype=torch.float64),
        torch.full((400,), -1.1, dtype=torch.float64),
    )
    engine[:4] = 0.0  # 1% of the tokens
    assert "zeros" not in dump_flags(Dump(engine, train, seq))["flags"]
    engine[4] = 0.0
    flags = dump_flags(Dump(engine, train, seq))
    assert flags["engine_zero_tokens"] == 5 and "zeros" in flags["flags"]
    near = train.clone()
    near[:5] = -1e-7  # the trainer near sure of the token too
    assert dump_flags(Dump(engine, near, seq))["engine_zero_tokens"] == 0
    lone = torch.full((400,), -1.0, dtype=torch.float64)
    lone[::8] = 0.0  # one per sequence, 12.5% of the tokens
    assert dump_flags(Dump(lone, train, seq))["engine_zero_tokens"] == 0
    low = train.clone()
    low[0] = -103.0
    assert "range" not in dump_flags(Dump(engine, low, seq))["flags"]
    low[0] = -103.5
    assert dump_flags(Dump(engine, low, seq))["below_dtype_tokens"] == 1


@pytest.mark.parametrize("tp,cp,pp", [(1, 1, 2), (1, 2, 1), (2, 2, 2), (1, 3, 2)])
def test_slime_v031_with_pipeline_and_context_parallelism_reads_every_token(tmp_path, tp, cp, pp):
    """slime v0.3.1 as production runs write it (one file per global rank, log_probs on the last pipeline
    stage only, CP ranks holding zigzag slices): read from the --dump-details folder, whose rollout_data/
    is left out, to the same log-probs, ids and positions as the truth."""
    truth = make_truth(per_rank=3)
    write_slime_v031(tmp_path, truth, tp=tp, cp=cp, pp=pp, details=True)
    assert len(list((tmp_path / "train_data").glob("3_*.pt"))) == tp * cp * 2 * pp
    assert (tmp_path / "rollout_data" / "3.pt").is_file()
    found, steps = read_native(str(tmp_path))
    assert found == "slime" and [s.step for s in steps] == [3, 4]
    for step, (engine, train, ids, positions) in zip(steps, expected(truth).values()):
        assert step.dump.engine_R.tolist() == engine and step.dump.train_R.tolist() == train
        assert step.token_ids_R.tolist() == ids and step.position_R.tolist() == positions
    first = torch.load(tmp_path / "train_data" / "3_0.pt")["rollout_data"]
    assert ("log_probs" in first) == (pp == 1), "the first stage holds no log_probs"
    if cp > 1:
        assert len(first["rollout_log_probs"][0]) < first["response_lengths"][0], "a rank holds slices"


def _contiguous(log_prob, total, n, cp_rank, cp):
    """A CP split that is not slime v0.3.1's zigzag: each rank a contiguous share of the response."""
    size = -(-n // cp)
    return log_prob[cp_rank * size : (cp_rank + 1) * size]


def test_slime_exports_it_cannot_read_are_refused_by_name(tmp_path):
    """CP slices of another layout, a missing last-stage file, only the first stage's files, stages that
    disagree on a mask, and rollout dumps: each one line naming the cause (and the version that works)."""
    truth = make_truth(steps=(3,), per_rank=3)
    write_slime_v031(tmp_path / "ag", truth, cp=2, split=_contiguous)
    with pytest.raises(BadInput, match=r"--allgather-cp.*slime main 624b824"):
        read_native(str(tmp_path / "ag"))
    pp = write_slime_v031(tmp_path / "pp", truth, pp=2)  # ranks 0, 1: stage 0; ranks 2, 3: the last stage
    (pp / "3_3.pt").unlink()
    with pytest.raises(BadInput, match=r"missing field 'log_probs' \(with pipeline parallelism .* index 3"):
        read_native(str(pp))
    (pp / "3_2.pt").unlink()
    with pytest.raises(BadInput, match=r"--use-rollout-logprobs.*only the last stage's ranks write them"):
        read_native(str(pp))
    masks = write_slime_v031(tmp_path / "masks", truth, pp=2)
    data = torch.load(masks / "3_0.pt")
    data["rollout_data"]["loss_masks"][0] = 1 - data["rollout_data"]["loss_masks"][0]
    torch.save(data, masks / "3_0.pt")
    with pytest.raises(BadInput, match=r"3_0.pt: sample 0: loss_masks differ"):
        read_native(str(masks))
    write_slime_v031(tmp_path / "details", truth, details=True)
    with pytest.raises(BadInput, match=r"only slime rollout dumps .* train_data/"):
        read_native(str(tmp_path / "details" / "rollout_data"))
    (tmp_path / "alone").mkdir()
    (tmp_path / "details" / "rollout_data" / "3.pt").rename(tmp_path / "alone" / "3.pt")
    with pytest.raises(BadInput, match=r"3.pt: a slime rollout dump .* no trainer log-probs"):
        read_native(str(tmp_path / "alone"), "slime")


SAMPLING = [  # (layout, the settings the export records, flags given, judged?, words of the line)
    ("vllm", {"temperature": 1.0, "top_p": 1.0, "logprobs_mode": "processed_logprobs"}, {}, True, ""),
    ("vllm", {"temperature": 0.7, "top_p": 1.0, "logprobs_mode": "processed_logprobs"}, {}, False, "runs at"),
    ("vllm", {"temperature": 0.7, "top_p": 1.0, "logprobs_mode": "raw_logprobs"}, {}, False, "engine column"),
    ("vllm", None, {}, False, "pass --temperature and --top-p"),
    ("verl", {"temperature": 0.7, "top_p": 1.0}, {}, True, ""),
    ("verl", {"temperature": 1.0, "top_p": 0.9}, {}, False, "no top-p"),
    ("trl", {"temperature": 0.7, "top_p": 1.0}, {}, True, ""),
    ("trl", {"temperature": 1.0, "top_p": 0.9}, {}, False, "no top-p"),
    ("trl", None, {"top_p": 0.95}, False, "no top-p"),
    ("prime-rl", None, {}, False, "pass --top-p"),
    ("prime-rl", None, {"temperature": 0.7, "top_p": 1.0}, True, ""),
    ("prime-rl", None, {"top_p": 0.9}, False, "no top-p"),
    ("slime", None, {"top_p": 1.0}, True, ""),
    ("slime", None, {"top_p": 0.9}, False, "not renormalised"),
    ("slime-main", None, {}, False, "pass --top-p"),
    ("project", None, {}, True, ""),
    ("project", None, {"temperature": 0.7}, False, "temperature 1, untruncated"),
]


@pytest.mark.parametrize("fmt,recorded,flags,judged,words", SAMPLING)
def test_a_dump_is_judged_only_at_the_distribution_it_was_sampled_from(
    tmp_path, fmt, recorded, flags, judged, words
):
    """Each column's distribution (temperature, top-p) as its system computes it, against the settings the
    export records or the flags give: judged when both are the sampled one, else UNCERTAIN naming why."""
    kw = {"sampling": recorded} if recorded else {}
    out = check_dump(WIDE, _write(fmt, tmp_path, make_truth(), **kw), **flags)
    assert out["sampling"]["same"] is judged and ("sampling" in out["flags"]) is not judged
    assert out["verdict"] == ("admit" if judged else "uncertain"), out["reason"]
    assert words in out["reason"]


def test_a_setting_the_export_records_is_not_overridden(tmp_path, capsys):
    root = write_verl(tmp_path / "v", make_truth(), sampling={"temperature": 0.7, "top_p": 1.0})
    with pytest.raises(BadInput, match=r"--temperature 1: the export records temperature 0.7"):
        check_dump(WIDE, root, temperature=1.0)
    (tmp_path / "b.json").write_text(json.dumps(WIDE))
    with pytest.raises(SystemExit) as code:
        admit.main(["check", "--budget", str(tmp_path / "b.json"), "--top-p", "0.9"])
    assert code.value.code == 2 and "--top-p without --dump" in capsys.readouterr().err


def _band(lo: float, hi: float) -> dict:
    """A budget_ci as calibrate writes it: [lo, hi] over its draws."""
    return {"lo": lo, "hi": hi, "draws": 200, "beyond_largest_mismatch": 0.0}


WORST = {**BUDGET, "budget": 0.4, "budget_ci": _band(0.3, 0.5)}


def _number_of(fmt: str, path, step: int) -> int:
    """The step number a reader gives the fixture's step `step` (vLLM and the project format: file order)."""
    return next(s.step for s in read_native(str(path))[1] if any(f"step_{step}" in f for f in s.files))


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_a_bad_step_rejects_a_dump_whose_pool_admits(tmp_path, fmt):
    """Eleven steps near 0.003 nats/token and one near 2: the pool of all twelve admits on its own, the
    dump REJECTS, naming the step, which the per-step table marks."""
    noise = {s: 0.1 for s in range(12)} | {4: 2.0}
    path = _write(fmt, tmp_path, make_vllm_truth(steps=range(12), n_seqs=32, noise=noise))
    out = check_dump(WORST, path, **SAMPLED_AT_1)
    bad = 4 if fmt not in ("vllm", "project") else _number_of(fmt, path, 4)
    assert judge(WORST, out, out["sequences"], available=None)["verdict"] == "admit", "the pool alone"
    assert out["verdict"] == "reject" and out["worst_step"] == bad, out["reason"]
    assert f"step {bad}'s lower bound" in out["reason"]
    verdicts = {r["step"]: r["verdict"] for r in out["per_step"]}
    assert verdicts.pop(bad) == "reject" and set(verdicts.values()) == {"admit"}


def test_a_dump_admits_only_if_every_step_does(tmp_path, capsys):
    noise = {s: 0.1 for s in range(6)} | {4: 1.2}
    root = write_prime_rl(tmp_path, make_vllm_truth(steps=range(6), n_seqs=64, noise=noise))
    (tmp_path / "b.json").write_text(json.dumps(WORST))
    with pytest.raises(SystemExit) as code:
        admit.main(["check", "--budget", str(tmp_path / "b.json"), "--dump", str(root), "--top-p", "1"])
    text = capsys.readouterr().out
    assert code.value.code == 4 and text.startswith("UNCERTAIN") and "the pooled steps admit" in text
    assert "but step 4's interval" in text and "every judged step" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["4*"])
    assert "UNCERTAIN" in row and "<- worst" in row
    assert "blind spot:" in text and "sampling: temperature the run's, top-p 1" in text


SMALL = {**BUDGET, "budget": 0.05, "budget_ci": _band(0.04, 0.06)}  # a sampled-token loss's size
LARGE = {**BUDGET, "budget": 5.0, "budget_ci": _band(4.0, 6.0)}


@pytest.mark.parametrize("fmt,k", [("project", 0), ("vllm", 0), ("vllm", 2), ("vllm", 3)])
def test_rare_tokens_no_sample_drew_are_never_admitted(tmp_path, fmt, k):
    """The rare-token engine (native_fixtures.make_rare_truth: 0.56 nats/token on a token of mass 0.006
    that no sample drew): the interval alone would ADMIT it against a small budget; the blind-spot bound
    ε·L (ε = 1 − 0.05^(1/N), L = 149 log 2) keeps it UNCERTAIN, and so does the tail mass of top-2 rows;
    top-3 rows see the whole vocabulary and REJECT. Against a budget above the bound it is admitted."""
    truth = make_rare_truth()
    path = write_vllm(tmp_path, truth, k=k) if fmt == "vllm" else write_project(tmp_path, truth)
    out = check_dump(SMALL, path, **SAMPLED_AT_1)
    exact, n = rare_kl(), out["tokens"]
    assert n == 256 and 0.5 < exact < 0.6
    if k < 3:
        mass = 1 - 0.05 ** (1 / n) if k == 0 else 0.006  # top-2: the mass outside the rows
        assert (
            out["blind_kl"] == pytest.approx(mass * 149 * math.log(2), rel=1e-5) and out["blind_kl"] > exact
        )
        assert out["ci_high"] < SMALL["budget_ci"]["lo"], "the interval alone admits"
        assert out["verdict"] == "uncertain" and "cannot rule out" in out["reason"], out["reason"]
        assert check_dump(LARGE, path, **SAMPLED_AT_1)["verdict"] == "admit"
    else:
        assert out["blind_kl"] == pytest.approx(0, abs=1e-9) and out["verdict"] == "reject"
        assert out["mismatch_kl"] == pytest.approx(exact, rel=1e-6)


def test_the_blind_spot_bound_and_the_tokens_that_close_it():
    from port.estimate import blind_kl, tokens_to_see

    for n in (1, 256, 10**6):
        assert blind_kl(n)["blind_kl"] == pytest.approx((1 - 0.05 ** (1 / n)) * 149 * math.log(2))
    assert blind_kl(10**6)["blind_kl"] == pytest.approx(-math.log(0.05) / 1e6 * 149 * math.log(2), rel=1e-5)
    assert blind_kl(256, tail_mass=0.001)["blind_kl"] == pytest.approx(0.001 * 149 * math.log(2))
    for kl in (0.002, 0.05, 1.0):
        n = tokens_to_see(kl)
        assert blind_kl(n)["blind_kl"] < kl <= blind_kl(n - 1)["blind_kl"]
    assert tokens_to_see(0.0) is None
