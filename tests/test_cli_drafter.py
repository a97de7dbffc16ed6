"""``specdec drafter train`` (specdec/cli/drafter.py): reads a corpus, trains a head, saves it; bad input
is a clear error, not a traceback. And how the long commands (training, ``bench``) report progress on
a terminal and in a log (specdec/cli/common.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli.drafter import drafter_app, first_tokens
from specdec.prompts import read_corpus
from specdec.errors import InputError

from .conftest import run_on_a_terminal

PAIR = Path(__file__).resolve().parent.parent / "models" / "python-pair" / "target"
runner = CliRunner()


class TestReadCorpus:
    def test_jsonl_texts_and_plain_text_blocks(self, tmp_path):
        jsonl = tmp_path / "c.jsonl"
        jsonl.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c", "kind": "x"}) + "\n")
        assert read_corpus(jsonl) == ["a b", "c"]
        plain = tmp_path / "c.txt"
        plain.write_text("one\ntwo\n\nthree\n")
        assert read_corpus(plain) == ["one\ntwo", "three"]

    def test_bad_files_are_input_errors(self, tmp_path):
        with pytest.raises(InputError, match="does not exist"):
            read_corpus(tmp_path / "none.jsonl")
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "no text"}\n')
        with pytest.raises(InputError, match='"text"'):
            read_corpus(bad)

    def test_a_token_budget_keeps_the_first_texts(self):
        class Words:
            def __call__(self, text, add_special_tokens=False):
                return {"input_ids": text.split()}

        assert first_tokens(["a b c", "d e", "f"], Words(), 7) == ["a b c", "d e"]
        assert first_tokens(["a b c d e f g h"], Words(), 2) == ["a b c d e f g h"]  # at least one


def small_training(tmp_path) -> list[str]:
    """``specdec drafter train`` arguments for one quick epoch on the bundled target over a small
    corpus of code written to ``tmp_path`` (no --out)."""
    corpus = tmp_path / "corpus.jsonl"
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return ["train", "--target", str(PAIR), "--corpus", str(corpus), "--vocab", "64", "--length", "32",
            "--epochs", "1", "--batch-size", "4", "--threads", "1"]


@pytest.mark.skipif(not (PAIR / "tokenizer.json").is_file(), reason="the bundled pair is absent")
class TestTrainCommand:
    def test_trains_and_saves_a_head(self, tmp_path):
        out = tmp_path / "head.safetensors"
        result = runner.invoke(drafter_app, [*small_training(tmp_path), "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert out.is_file() and "held-out top-1" in result.output and 'use = "hidden-state"' in result.output
        # Not a terminal here: the phases report as plain lines (rich would draw nothing until the end).
        assert "target hidden states (rows): " in result.stderr and "head steps: " in result.stderr
        assert "(100%)" in result.stderr

    def test_continues_a_head_unrolled_and_refuses_an_unroll_that_does_not_fit(self, tmp_path):
        common = small_training(tmp_path)
        first = tmp_path / "first.safetensors"
        assert runner.invoke(drafter_app, [*common, "--out", str(first)]).exit_code == 0
        result = runner.invoke(drafter_app, [*common, "--out", str(tmp_path / "second.safetensors"),
                                             "--init", str(first), "--unroll", "3"])
        assert result.exit_code == 0, result.output
        assert "step 2:" in result.output and "step 3:" in result.output
        result = runner.invoke(drafter_app, [*common, "--out", str(tmp_path / "bad.safetensors"), "--unroll", "17"])
        assert result.exit_code == 2 and "unroll must be between 1 and half the row length (16)" in result.output
        assert not (tmp_path / "bad.safetensors").exists()

    def test_rows_that_begin_with_a_text(self, tmp_path):
        common = small_training(tmp_path)
        out = tmp_path / "head.safetensors"
        result = runner.invoke(drafter_app, [*common, "--out", str(out), "--rows", "texts"])
        assert result.exit_code == 0, result.output
        assert out.is_file() and "held-out top-1" in result.output
        result = runner.invoke(drafter_app, [*common, "--out", str(tmp_path / "bad.safetensors"), "--rows", "lines"])
        assert result.exit_code == 2 and "rows must be 'stream' or 'texts', got 'lines'" in result.output
        assert not (tmp_path / "bad.safetensors").exists()

    def test_a_missing_corpus_is_a_clear_error(self, tmp_path):
        result = runner.invoke(drafter_app, ["train", "--target", str(PAIR), "--corpus", str(tmp_path / "no.jsonl"),
                                             "--out", str(tmp_path / "h.safetensors")])
        assert result.exit_code == 2 and "does not exist" in result.output


def test_phases_report_as_plain_lines_where_stderr_is_not_a_terminal(capsys):
    """A log or a pipe: the first report of a phase, then at most one every 30 s, and its end."""
    from specdec.cli.common import phase_progress

    now = [100.0]
    with phase_progress({"teacher": "target: encoder + transcripts"}, clock=lambda: now[0]) as on_progress:
        for done, at in [(8, 100.0), (16, 110.0), (24, 131.0), (32, 140.0), (40, 162.0)]:
            now[0] = at
            on_progress("teacher", done, 40)
        on_progress("teacher", 40, 40)  # reported twice at its end: one line
        now[0] = 170.0
        on_progress("train", 1, 300)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "target: encoder + transcripts: 8/40 (20%), 0s elapsed",
        "target: encoder + transcripts: 24/40 (60%), 31s elapsed, about 21s left",
        "target: encoder + transcripts: 40/40 (100%), 1m02s elapsed",
        "train: 1/300 (0%), 0s elapsed",
    ]


def test_phases_draw_bars_on_a_terminal():
    """On a real pseudo-terminal the phases are rich bars (a bar of ━, the count done of total),
    not the plain lines a log gets."""
    import textwrap

    script = textwrap.dedent("""
        import time
        from specdec.cli.common import phase_progress
        with phase_progress({"train": "head steps"}) as on_progress:
            for done in range(1, 4):
                on_progress("train", done, 3)
                time.sleep(0.2)
    """)
    code, text = run_on_a_terminal(script)
    assert code == 0, text
    assert "head steps" in text and "3/3" in text and "━" in text, text
    assert "elapsed" not in text, text


def test_a_long_commands_status_reports_as_plain_lines_where_stderr_is_not_a_terminal(capsys):
    """``specdec bench``'s status in a log: its first message, then at most one every 30 s."""
    from specdec.cli.common import status_progress

    now = [10.0]
    with status_progress("loading models", clock=lambda: now[0]) as on_status:
        for at, message in [(12.0, "batch 1: warm-up: target"), (41.0, "batch 1: repeat 1/3, batch 1/4: specdec"),
                            (75.0, "batch 1: repeat 2/3, batch 3/4: target"), (80.0, "batch 4: repeat 1/3")]:
            now[0] = at
            on_status(message)
    assert capsys.readouterr().err.splitlines() == [
        "loading models (0s elapsed)",
        "batch 1: repeat 1/3, batch 1/4: specdec (31s elapsed)",
        "batch 1: repeat 2/3, batch 3/4: target (1m05s elapsed)",
    ]
