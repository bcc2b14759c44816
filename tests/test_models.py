"""The pairs load offline from what the repo and setup.sh provide."""

import pytest
import torch

from evaluate import exact_match_accuracy
from lab.hf_pairs import load_hf_pair
from models import TINY_DIR, BadInput, load_pair, read_prompts, tiny_problems


def test_tiny_loads_from_committed_files_and_teacher_beats_student(tiny_pair):
    assert (TINY_DIR / "teacher" / "model.safetensors").stat().st_size < 5e6
    held_out = tiny_problems(200, seed=99, held_out=True)
    teacher_acc = exact_match_accuracy(tiny_pair.teacher, tiny_pair.tokenizer, held_out)
    student_acc = exact_match_accuracy(tiny_pair.student, tiny_pair.tokenizer, held_out)
    assert teacher_acc >= 0.95, teacher_acc
    assert 0.1 <= student_acc <= 0.7, student_acc


def test_held_out_split_is_disjoint():
    train = {p.text for p in tiny_problems(3000, seed=0, held_out=False)}
    held = {p.text for p in tiny_problems(300, seed=0, held_out=True)}
    assert not train & held


def test_smollm2_teacher_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = load_pair("smollm2", student_layers=24)
    assert pair.teacher.config.num_hidden_layers == 30 and pair.student.config.num_hidden_layers == 24
    assert len(pair.train_prompts) >= 200 and len(pair.eval_prompts) >= 50
    assert (
        not hasattr(pair.teacher.config, "quantization_config")
        or pair.teacher.config.quantization_config is None
    )
    # The student's layers are copies of the teacher's, renumbered for the KV cache.
    assert [layer.self_attn.layer_idx for layer in pair.student.model.layers] == list(range(24))
    ids = pair.tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(pair.student(ids).logits).all()
    # The admission check loads the student alone (the teacher cut into it, no copy): the same student.
    alone = load_pair("smollm2", student_layers=24, student_only=True)
    assert alone.teacher is None and alone.student.config.dropped_layers == pair.student.config.dropped_layers
    full, cut = pair.student.state_dict(), alone.student.state_dict()
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    assert [layer.self_attn.layer_idx for layer in alone.student.model.layers] == list(range(24))


def test_tiny_student_alone_is_the_pairs_student(tiny_pair):
    alone = load_pair("tiny", student_only=True)
    full, cut = tiny_pair.student.state_dict(), alone.student.state_dict()
    assert alone.teacher is None and all(torch.equal(full[k], cut[k]) for k in full)


def test_smollm2_greedy_matches_hf_generate(monkeypatch):
    from models import format_prompt
    from rollout import RolloutConfig, generate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = load_pair("smollm2", student_layers=24)
    tok = pair.tokenizer
    prompts = [format_prompt(tok, p.text) for p in pair.eval_prompts[:3]]
    ours = generate(pair.student, tok, prompts, RolloutConfig(temperature=0, max_new_tokens=12))
    enc = tok(prompts, padding=True, add_special_tokens=False, return_tensors="pt")
    theirs = pair.student.generate(
        **enc,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    theirs = theirs[:, enc.input_ids.shape[1] :]
    assert torch.equal(ours.tokens[:, ours.prompt_len :][:, : theirs.shape[1]], theirs)


def test_different_vocabularies_are_refused(tmp_path):
    from transformers import AutoTokenizer

    # A copy of the tiny student whose tokenizer has one extra token.
    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(TINY_DIR / "student")
    tok.add_tokens(["#"])
    tok.save_pretrained(other)
    for f in ("config.json", "model.safetensors"):
        (other / f).write_bytes((TINY_DIR / "student" / f).read_bytes())
    with pytest.raises(BadInput, match="different vocabularies"):
        load_hf_pair(str(TINY_DIR / "teacher"), str(other), "cpu")


def test_read_prompts_reports_bad_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(BadInput, match=r"p.jsonl:2: not valid JSON"):
        read_prompts(f)
    f.write_text('{"prompt": "a", "answer": "b"}\n\n{"prompt": "c"}\n')
    assert [p.answer for p in read_prompts(f)] == ["b", None]
