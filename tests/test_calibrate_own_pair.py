"""A budget for the user's own pair: `python -m lab.calibrate --teacher T --student S --prompts P` on a pair
built here, and the budget it writes read by `check --dump`, by a live `check` of the same models only, and
by `train.py --budget` of the same models only."""

import json
import os
import random
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test runs a calibration or a CLI in a subprocess


def calibrate_cli(*args, cwd, module="lab.calibrate"):
    return run_cli(*args, cwd=cwd, entry=module)


def build_pair(folder: Path) -> dict:
    """Two random Llama models of the tiny pair's shapes, saved with the tiny tokenizer as any Hugging Face
    model folder is, and 40 addition prompts (4 held out: the probes). The teacher's larger initial weights
    make it peaked, far from the near-uniform student, so 4 OPD steps lower the held-out reverse KL."""
    import torch
    from transformers import LlamaForCausalLM

    from models import tiny_config, tiny_tokenizer

    for seed, size in enumerate(("teacher", "student")):
        torch.manual_seed(seed)
        config = tiny_config(size)
        config.initializer_range = 0.3 if size == "teacher" else config.initializer_range
        LlamaForCausalLM(config).save_pretrained(folder / size)
        tiny_tokenizer().save_pretrained(folder / size)
    rng = random.Random(0)
    lines = [json.dumps({"prompt": f"{rng.randint(10, 99)}+{rng.randint(10, 99)}="}) for _ in range(40)]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return {"teacher": folder / "teacher", "student": folder / "student", "prompts": folder / "prompts.jsonl"}


def pair_args(files: dict) -> list[str]:
    return [arg for key in ("teacher", "student", "prompts") for arg in (f"--{key}", str(files[key]))]


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A calibration of 4 steps, one seed, the baseline and one noise level (about a minute on 2 cores)."""
    folder = tmp_path_factory.mktemp("own")
    files = build_pair(folder)
    grid = [
        "--steps",
        "4",
        "--seeds",
        "1",
        "--noise-grid",
        "0.3",
        "--real",
        "",
        "--probes",
        "4",
        "--tolerance",
        "0.05",
    ]
    result = calibrate_cli(*pair_args(files), *grid, "--out", "cal", "--device", "cpu", cwd=folder)
    assert result.returncode == 0, result.stderr[-2000:]
    return {**files, "folder": folder, "budget": folder / "cal" / "budget.json", "stdout": result.stdout}


def test_calibrate_writes_a_budget_that_names_the_pairs_models(own):
    from lab.hf_pairs import prompts_sha256

    budget = json.loads(own["budget"].read_text())
    assert budget["pair"] == "custom" and (budget["loss"], budget["tis_cap"]) == ("analytic", 0.0)
    assert budget["teacher"] == str(own["teacher"].resolve()) and budget["student"] == str(
        own["student"].resolve()
    )
    assert budget["prompts"] == str(own["prompts"].resolve())
    assert budget["prompts_sha256"] == prompts_sha256(own["prompts"])
    assert [p["source"] for p in budget["points"]] == ["baseline", "noise 0.3"]
    assert budget["points"][0]["mismatch"] < 1e-9 < budget["points"][1]["mismatch"]
    assert budget["baseline"]["improvement"] > 0 and budget["how"] in (
        "crossing",
        "all-within",
        "none-within",
    )
    assert "--teacher" in budget["command"] and (own["folder"] / "cal" / "budget.png").stat().st_size > 0
    assert own["stdout"].startswith(f"--teacher {budget['teacher']} --student {budget['student']}, loss")


def test_check_dump_accepts_the_own_pair_budget(own):
    """A dump of the own pair's engine at weight noise σ = 1 (far above the budget) is judged against it."""
    from mismatch import measure_config
    from models import format_prompt, load_pair
    from port.dumps import write_dump
    from rollout import RolloutConfig

    pair = load_pair(**{k: str(own[k]) for k in ("teacher", "student", "prompts")})
    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:16]]
    scored = measure_config(pair, RolloutConfig(max_new_tokens=8, noise=1.0), probes, keep=True)["scored"]
    write_dump(own["folder"] / "d.jsonl", scored)
    result = calibrate_cli(
        "check", "--budget", str(own["budget"]), "--dump", "d.jsonl", cwd=own["folder"], module="admit.py"
    )
    assert result.returncode == 1 and "REJECT for the analytic loss" in result.stdout, result.stderr[-2000:]


def test_a_live_check_needs_the_budgets_own_models(own):
    """With the same --teacher/--student/--prompts the check measures the own pair's probes; with --pair
    it is refused with one line that says what to give."""
    budget = str(own["budget"])
    same = calibrate_cli(
        "check", "--budget", budget, *pair_args(own), "--probes", "4", cwd=own["folder"], module="admit.py"
    )
    assert same.returncode in (0, 1, 4) and "for the analytic loss" in same.stdout, same.stderr[-2000:]
    other = calibrate_cli("check", "--budget", budget, "--pair", "tiny", cwd=own["folder"], module="admit.py")
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1 and "give the same --teacher/--student" in lines[0], (
        other.stderr
    )


def test_other_models_or_prompts_are_refused(own, tmp_path):
    """match_pair, as check and train.py call it: another student, or the probes of other prompts, is one
    line; the same models through other spellings of their paths are the same pair."""
    from budget import match_pair, read_budget
    from cli import BadInput
    from lab.hf_pairs import pair_files, prompts_sha256

    budget = read_budget(own["budget"], None)
    files = pair_files(str(own["teacher"]), str(own["student"]), str(own["prompts"]))
    sha = prompts_sha256(files["prompts"])
    match_pair(budget, "custom", files, where="b", probes=True, prompts_sha256=sha)  # the same: no error
    relative = pair_files(os.path.relpath(own["teacher"]), os.path.relpath(own["student"]))
    match_pair(budget, "custom", relative, where="b")
    swapped = pair_files(str(own["teacher"]), str(own["teacher"]))
    with pytest.raises(BadInput, match="a budget holds only for its own models"):
        match_pair(budget, "custom", swapped, where="b")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+2="}\n{"prompt": "3+4="}\n')
    with pytest.raises(BadInput, match="held-out tenth of --prompts"):
        match_pair(
            budget,
            "custom",
            files,
            where="b",
            probes=True,
            prompts_sha256=prompts_sha256(tmp_path / "p.jsonl"),
        )
    with pytest.raises(BadInput, match="give the same --teacher/--student"):
        match_pair(budget, "tiny", {}, where="b")


def test_train_budget_of_the_own_pair_holds_for_its_models_only(own):
    """train.py --budget reads the own pair's budget for a run of the same models, and refuses it for a run
    of other models, before anything loads."""
    from cli import BadInput
    from lab.train_args import pair_config
    from lab.watch import run_budget

    same = {k: str(own[k]) for k in ("teacher", "student", "prompts")}
    assert run_budget(pair_config("custom", budget=str(own["budget"]), **same))["pair"] == "custom"
    other = {**same, "student": str(own["teacher"])}
    with pytest.raises(BadInput, match="a budget holds only for its own models"):
        run_budget(pair_config("custom", budget=str(own["budget"]), **other))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--teacher", "t"], "--teacher and --student must be given together"),
        (
            ["--teacher", "/no/t", "--student", "/no/s", "--prompts", "p.jsonl"],
            "--teacher /no/t: no such folder",
        ),
        (["--teacher", "org/t", "--student", "org/s"], "need --prompts"),
    ],
    ids=["alone", "missing", "no-prompts"],
)
def test_calibrate_refuses_an_incomplete_pair_with_one_line(tmp_path, args, needle):
    result = calibrate_cli(*args, "--out", "cal", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "cal").exists()
