"""The speech evaluation set: built deterministically with espeak-ng and sox, disjoint from the training split, scored with jiwer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other by module name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_tts = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                               reason="espeak-ng and sox are not installed (apt-get install espeak-ng sox)")


class TestSentences:
    def test_splits_are_disjoint(self):
        """No training text equals or contains an eval sentence; ids are unique."""
        data = load("speech_eval_data")
        data.check_disjoint()
        for split in ("eval", "train"):
            ids = [row["id"] for row in data.utterances(split)]
            assert len(ids) == len(set(ids))

    def test_eval_covers_three_languages_and_long_form(self):
        """English, German and French, with long-form joins."""
        rows = load("speech_eval_data").utterances("eval")
        assert {r["language"] for r in rows} == {"en", "de", "fr"}
        assert sum("long" in r["id"] for r in rows) >= 3

    def test_generated_training_text_is_fixed(self):
        """The seeded template sentences are the same on every call."""
        data = load("speech_eval_data")
        assert data.generated_train_sentences(30) == data.generated_train_sentences(30)
        assert len(set(data.generated_train_sentences(100))) == 100


@needs_tts
class TestBuilder:
    def test_builds_16k_mono_wavs_deterministically(self, tmp_path):
        """Two builds of the first utterances give the same bytes: 16 kHz mono, 3-30 s, with references."""
        soundfile = pytest.importorskip("soundfile")
        builder = load("build_speech_eval")
        rows = builder.build(tmp_path / "a", limit=2, progress=None)
        builder.build(tmp_path / "b", limit=2, progress=None)
        listed = json.loads((tmp_path / "a" / "utterances.json").read_text())
        assert [r["id"] for r in listed] == [r["id"] for r in rows] == ["eval-en-00", "eval-en-01"]
        for row in rows:
            audio, rate = soundfile.read(tmp_path / "a" / row["file"])
            assert rate == 16000 and audio.ndim == 1
            assert 3 <= row["seconds"] <= 30 and row["seconds"] == pytest.approx(len(audio) / 16000, abs=1e-3)
            assert (tmp_path / "a" / row["file"]).read_bytes() == (tmp_path / "b" / row["file"]).read_bytes()
        manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
        assert manifest["espeak_ng"].startswith("eSpeak NG") and manifest["split"] == "eval"


class TestWordErrorRate:
    def test_english_normaliser(self):
        """Case, punctuation and contractions do not count as errors; a wrong word does."""
        wer = load("speech_wer").word_error_rate
        pytest.importorskip("jiwer")
        assert wer(["I won't go to the station, Mr Smith."], ["i will not go to the station mister smith"], "en") == 0
        assert wer(["the quick brown fox"], ["the quick brown box"], "en") == pytest.approx(0.25)

    def test_german_and_french(self):
        """BasicTextNormalizer for other languages: case and punctuation only."""
        wer = load("speech_wer").word_error_rate
        pytest.importorskip("jiwer")
        assert wer(["Der Zug fährt ab."], ["der zug fährt ab"], "de") == 0
        assert wer(["Il a plu toute la journée."], ["il a plu toute la semaine"], "fr") == pytest.approx(1 / 6)


class TestTrainingProse:
    """build_speech_train_prose.py's sentence filter and mixing (no espeak-ng, no weights)."""

    def test_only_plain_sentences_are_kept(self):
        prose = load("build_speech_train_prose")
        text = ("Returns the number of items that are still waiting in the queue.\n"
                "This makes the functions in torch.nn available to every module here. "
                "Set max_length to 20 before calling the function again please. "
                "See https colon slash slash example dot com for all of the details. "
                "The BertModel class wraps the encoder and the pooler layers. "
                "Too short a line. "
                "The value is cached, e.g. on the first call of the method here.\n\n"
                "Each sentence may wrap across\nlines of one paragraph and still be kept whole.")
        assert prose.plain_sentences(text) == [
            "Returns the number of items that are still waiting in the queue.",
            "Each sentence may wrap across lines of one paragraph and still be kept whole.",
        ]

    def test_sources_are_interleaved_and_kept_disjoint_from_the_eval_set(self):
        prose = load("build_speech_train_prose")
        data = load("speech_eval_data")
        assert prose.interleave([["a1", "a2", "a3"], ["b1"], ["c1", "c2"]]) == ["a1", "b1", "c1", "a2", "c2", "a3"]
        eval_sentence = data.EVAL_SENTENCES["en"][0]
        seen: set[str] = set()
        kept = prose.disjoint(["One plain sentence about a queue of tasks.", "One plain sentence about a queue of tasks.",
                               f"He said: {eval_sentence}", eval_sentence[:-1]], seen)
        assert kept == ["One plain sentence about a queue of tasks."]

    def test_the_texts_source_reads_a_files_answers_and_drops_eval_sentences(self, tmp_path):
        prose = load("build_speech_train_prose")
        data = load("speech_eval_data")
        eval_sentence = data.EVAL_SENTENCES["en"][0]
        answers = tmp_path / "answers.jsonl"
        answers.write_text("\n".join(json.dumps(row) for row in [
            {"kind": "explain", "answer": "Every bicycle has two wheels and a frame of steel. Short one."},
            {"kind": "creative", "answer": f"The old fox looked up at the birds every morning. {eval_sentence}"},
            {"text": "Rain falls when the clouds grow too heavy to hold their water."},
        ]) + "\n", encoding="utf-8")
        assert sorted(prose.source_sentences(["texts"], texts=answers)) == [
            "Every bicycle has two wheels and a frame of steel.",
            "Rain falls when the clouds grow too heavy to hold their water.",
            "The old fox looked up at the birds every morning.",
        ]
        with pytest.raises(SystemExit, match="--texts"):
            prose.source_sentences(["texts"])
        broken = tmp_path / "broken.jsonl"
        broken.write_text('{"answer": "Fine."}\n{"answer": \n', encoding="utf-8")
        with pytest.raises(SystemExit, match=r"broken.jsonl, line 2: not JSON"):
            prose.source_sentences(["texts"], texts=broken)
        broken.write_text('{"kind": "explain"}\n', encoding="utf-8")
        with pytest.raises(SystemExit, match=r"line 1: needs an 'answer' or 'text' string"):
            prose.source_sentences(["texts"], texts=broken)
        with pytest.raises(SystemExit, match=r"missing.jsonl: cannot read it"):
            prose.source_sentences(["texts"], texts=tmp_path / "missing.jsonl")

    def test_the_fortunes_source_reads_each_entry_and_leaves_the_pictures_out(self, tmp_path, monkeypatch):
        prose = load("build_speech_train_prose")
        (tmp_path / "wisdom.u8").write_text("The early bird catches the worm, but the second\nmouse gets the cheese.\n%\n"
                                            "Short one.\n%\nNever put off until tomorrow what you can do today.\n",
                                            encoding="utf-8")
        (tmp_path / "art.u8").write_text("Every picture here is drawn with many small characters.\n", encoding="utf-8")
        (tmp_path / "wisdom").write_text("not read: only the .u8 files are\n", encoding="utf-8")
        assert prose.fortune_texts(tmp_path) == ["The early bird catches the worm, but the second mouse gets the cheese.",
                                                 "Short one.",
                                                 "Never put off until tomorrow what you can do today."]
        monkeypatch.setattr(prose, "FORTUNES", tmp_path)
        assert sorted(prose.source_sentences(["fortunes"])) == [
            "Never put off until tomorrow what you can do today.",
            "The early bird catches the worm, but the second mouse gets the cheese.",
        ]
        with pytest.raises(SystemExit, match="apt-get install fortunes fortunes-min"):
            prose.fortune_texts(tmp_path / "none")
