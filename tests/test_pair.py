"""Tests for the bundled target/draft model pair and the script that builds it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_pair.py"
PAIR = REPO / "models" / "python-pair"

SAMPLE_CODE = '''\
import os


class Greeter:
    """Say hello.\tTabs, unicode \u00e9\u00e8 and   odd  spacing survive."""

    def __init__(self, name: str = "world") -> None:
        self.name = name

    def greet(self, times=2):
        for i in range(times):
            print(f"hello, {self.name}! #{i}")
        return {"ok": True, 'n': times}


def main(argv=None):
    return Greeter(os.environ.get("USER", "x")).greet()
'''


def _tiny_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "test").mkdir()  # must be skipped
    (corpus / "test" / "test_x.py").write_text("def test_x():\n    assert False\n")
    for i in range(8):
        body = "".join(
            f"def func_{i}_{j}(a, b={j}):\n"
            f'    """Return a combination of a and b number {j}."""\n'
            f"    total = a * {j} + b\n"
            f"    for k in range({j + 1}):\n"
            f"        total += k\n"
            f"    return total\n\n\n"
            for j in range(6)
        )
        body += f"class Thing{i}:\n    def __init__(self, x):\n        self.x = x\n\n    def value(self):\n        return self.x + {i}\n"
        (corpus / ("pkg" if i % 2 else ".") / f"mod{i}.py").write_text(body)
    return corpus


def test_training_script_smoke(tmp_path):
    corpus = _tiny_corpus(tmp_path)
    out = tmp_path / "pair"
    cmd = [
        sys.executable, str(SCRIPT), "--out", str(out), "--corpus-dir", str(corpus), "--tiny",
        "--target-steps", "3", "--draft-steps", "3", "--vocab-size", "320", "--seq-len", "32",
        "--batch-size", "2", "--eval-tokens", "256", "--threads", "1", "--n-prompts", "4", "--log-every", "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32)
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert target.config.eos_token_id == draft.config.eos_token_id == tok.eos_token_id
    assert (out / "target" / "model.safetensors").exists()

    report = json.loads((out / "training.json").read_text())
    assert report["corpus"]["train_files"] + report["corpus"]["heldout_files"] == 8  # test/ skipped
    assert report["corpus"]["heldout_files"] >= 1
    for key in ("target", "draft"):
        assert report[key]["params"] > 0
        assert report[key]["heldout_loss"] > 0
    assert 0.0 <= report["draft_target_top1_agreement_heldout"] <= 1.0
    assert report["python_version"]

    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert 1 <= len(prompts) <= 4
    for p in prompts:
        assert 64 <= len(p["prompt"]) <= 400
        assert p["prompt"].lstrip().startswith(("def ", "class ", "async def ", "@"))

    # deterministic: a second run gives identical prompts and identical weights
    out2 = tmp_path / "pair2"
    cmd2 = [a if a != str(out) else str(out2) for a in cmd]
    proc2 = subprocess.run(cmd2, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert (out2 / "prompts.jsonl").read_text() == (out / "prompts.jsonl").read_text()
    assert (out2 / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    target2 = AutoModelForCausalLM.from_pretrained(out2 / "target", dtype=torch.float32)
    for (n1, p1), (_, p2) in zip(target.state_dict().items(), target2.state_dict().items()):
        assert torch.equal(p1, p2), n1


# ---------------------------------------------------------------- shipped pair

needs_pair = pytest.mark.skipif(not (PAIR / "target").exists(), reason="models/python-pair not built")


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32, local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float32, local_files_only=True)
    return tok, target.eval(), draft.eval()


@needs_pair
def test_shipped_pair_loads_and_shares_vocab(pair):
    tok, target, draft = pair
    assert target.dtype == draft.dtype == torch.float32
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(target.config, attr) == getattr(draft.config, attr)
        assert getattr(target.generation_config, attr) == getattr(draft.generation_config, attr)
    assert target.config.eos_token_id == tok.eos_token_id == tok.pad_token_id
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert n_t > 10_000_000 and n_d * 4 < n_t
    size = sum(f.stat().st_size for f in PAIR.rglob("*") if f.is_file())
    assert size < 60 * 1024 * 1024


@needs_pair
def test_shipped_tokenizer_round_trips_python(pair):
    tok, _, _ = pair
    ids = tok.encode(SAMPLE_CODE, add_special_tokens=False)
    assert tok.decode(ids) == SAMPLE_CODE
    assert tok.decode(tok(SAMPLE_CODE)["input_ids"], skip_special_tokens=True) == SAMPLE_CODE
    # each model dir carries the same tokenizer
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(PAIR / "draft").encode(SAMPLE_CODE) == tok.encode(SAMPLE_CODE)


@needs_pair
def test_shipped_prompts_and_report():
    prompts = [json.loads(line) for line in (PAIR / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 64
    assert all(64 <= len(p["prompt"]) <= 400 for p in prompts)
    report = json.loads((PAIR / "training.json").read_text())
    assert report["target"]["heldout_loss"] < report["draft"]["heldout_loss"]
    assert 0.0 < report["draft_target_top1_agreement_heldout"] < 1.0


@needs_pair
def test_shipped_target_greedy_generate(pair):
    tok, target, draft = pair
    prompt = json.loads((PAIR / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = target.generate(**enc, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        out_d = draft.generate(**enc, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    new = out[0, enc["input_ids"].shape[1]:]
    assert new.numel() == 16
    assert out_d.shape[1] == enc["input_ids"].shape[1] + 8
    assert tok.decode(new).strip()  # produced some non-whitespace text
