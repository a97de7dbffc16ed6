"""``specdec transcribe``: audio files in, the target's own transcript out, bad files named and skipped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
import transformers
import typer
from typer.testing import CliRunner

from specdec.audio import SAMPLE_RATE, AudioError, read_audio
from specdec.cli.transcribe import transcribe_command

from .tiny_whisper import processor, tiny_distil_decoder, tiny_whisper

transformers.logging.set_verbosity_error()

MAX_NEW = 12


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()
    app.command("transcribe")(transcribe_command)
    app.command("other")(lambda: None)  # two commands, so "transcribe" is a subcommand as in specdec's CLI
    return app


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A Whisper target with its processor, a distil-style draft, whisper.toml and audio files."""
    root = tmp_path_factory.mktemp("whisper")
    target = tiny_whisper(seed=0)
    target.save_pretrained(root / "target")
    processor().save_pretrained(root / "target")
    tiny_distil_decoder(seed=1).save_pretrained(root / "draft")
    (root / "whisper.toml").write_text(
        '[target]\nmodel = "target"\ndtype = "float64"\n\n'
        '[drafter]\nuse = "shared_encoder"\nmodel = "draft"\n\n'
        f"[sampling]\nmax_new_tokens = {MAX_NEW}\n"
    )
    rng = np.random.default_rng(0)
    t = np.arange(int(44_100 * 3)) / 44_100
    stereo_tone = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], axis=1) * 0.3
    soundfile.write(root / "tone.wav", stereo_tone, 44_100)  # 3 s, stereo, 44.1 kHz
    soundfile.write(root / "noise.flac", rng.normal(0, 0.1, 8_000 * 5), 8_000)  # 5 s, mono, 8 kHz
    soundfile.write(root / "silence.ogg", np.zeros(16_000 * 2), 16_000)  # 2 s of silence
    soundfile.write(root / "long.wav", rng.normal(0, 0.1, 16_000 * 45).astype(np.float32), 16_000)  # 45 s
    soundfile.write(root / "empty.wav", np.zeros(0), 16_000)
    (root / "broken.wav").write_bytes(b"RIFF....WAVEfmt definitely not audio")
    return root


def run(app, workspace, *files, options=()):
    paths = [str(workspace / name) for name in files]
    return CliRunner().invoke(app, ["transcribe", *paths, *options, "--config", str(workspace / "whisper.toml")])


def reference_texts(workspace, names, long_form=False, **options):
    """What the target's own generate transcribes, through the same processor."""
    target = transformers.WhisperForConditionalGeneration.from_pretrained(workspace / "target", dtype=torch.float64)
    proc = transformers.AutoProcessor.from_pretrained(workspace / "target")
    arrays = [read_audio(workspace / name).samples for name in names]
    extra = dict(truncation=False, padding="longest") if long_form else {}
    inputs = proc.feature_extractor(arrays, sampling_rate=SAMPLE_RATE, return_tensors="pt", return_attention_mask=True, **extra)
    options.setdefault("task", "transcribe")  # the command's default
    if long_form:
        options["return_timestamps"] = True
    ids = target.generate(inputs.input_features.double(), attention_mask=inputs.attention_mask,
                          max_new_tokens=MAX_NEW, **options)
    return [proc.tokenizer.decode(row, skip_special_tokens=True).strip() for row in ids]


class TestReadAudio:
    """Sound files become 16 kHz mono float32, or an AudioError naming the file."""

    def test_resamples_and_downmixes(self, workspace):
        """3 s of 44.1 kHz stereo become 48000 mono samples."""
        audio = read_audio(workspace / "tone.wav")
        assert audio.samples.shape == (48_000,) and audio.samples.dtype == np.float32
        assert audio.seconds == pytest.approx(3.0)

    @pytest.mark.parametrize("name, message", [("empty.wav", "no audio"), ("broken.wav", "cannot read"),
                                               ("missing.wav", "no such file")])
    def test_bad_files(self, workspace, name, message):
        """Empty, unreadable and missing files each say what is wrong, with the file name."""
        with pytest.raises(AudioError, match=message) as raised:
            read_audio(workspace / name)
        assert name in str(raised.value)


class TestTranscribeCommand:
    """The typer command, run through CliRunner on files the tests wrote."""

    def test_one_file_prints_the_targets_transcript(self, app, workspace):
        """Stereo 44.1 kHz in, the text target.generate gives for it out, stats on stderr."""
        result = run(app, workspace, "tone.wav")
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == reference_texts(workspace, ["tone.wav"])[0]
        assert "RTFx" in result.stderr and "tokens per target call" in result.stderr

    def test_batch_with_timestamps(self, app, workspace):
        """Several files, segments with start and end times under each file's name."""
        result = run(app, workspace, "tone.wav", "noise.flac", "silence.ogg", options=["--timestamps"])
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert [line for line in lines if not line.startswith("[")] == [
            str(workspace / name) for name in ("tone.wav", "noise.flac", "silence.ogg")
        ]
        segments = [line for line in lines if line.startswith("[")]
        assert segments and all(" --> " in line for line in segments)

    def test_translate_with_language_as_json(self, app, workspace):
        """--language and --task translate reach Whisper's prompt; --json holds texts and stats."""
        result = run(app, workspace, "tone.wav", "noise.flac", options=["--language", "de", "--task", "translate", "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        expected = reference_texts(workspace, ["tone.wav", "noise.flac"], language="de", task="translate")
        assert [f["text"] for f in document["files"]] == expected
        assert document["errors"] == []
        stats = document["stats"]
        assert stats["rtfx"] > 0 and stats["audio_seconds"] == pytest.approx(8.0)
        assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["tokens_per_target_call"] >= 1.0

    def test_alternatives_read_are_counted(self, app, workspace, tmp_path):
        """With the draft's first-position alternatives read, the stats count them; the text is the target's."""
        config = tmp_path / "whisper.toml"
        config.write_text((workspace / "whisper.toml").read_text()
                          .replace('model = "target"', f'model = "{workspace / "target"}"')
                          .replace('model = "draft"', f'model = "{workspace / "draft"}"\nalternatives = 2'))
        paths = [str(workspace / name) for name in ("tone.wav", "noise.flac")]
        result = CliRunner().invoke(app, ["transcribe", *paths, "--json", "--config", str(config)])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert [f["text"] for f in document["files"]] == reference_texts(workspace, ["tone.wav", "noise.flac"])
        assert document["stats"]["alternatives_read"] > 0
        assert 0 <= document["stats"]["alternatives_taken"] <= document["stats"]["alternatives_read"]
        result = CliRunner().invoke(app, ["transcribe", paths[0], "--config", str(config)])
        assert "alternatives read in" in result.stderr

    def test_cost_aware_keeps_its_memory_in_the_cache_and_the_text_is_the_targets(self, app, workspace, tmp_path,
                                                                                   monkeypatch):
        """With [policy] use = "cost-aware" and no memory set, transcribe keeps one in $SPECDEC_CACHE/policies."""
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        config = tmp_path / "whisper.toml"
        config.write_text((workspace / "whisper.toml").read_text()
                          .replace('model = "target"', f'model = "{workspace / "target"}"')
                          .replace('model = "draft"', f'model = "{workspace / "draft"}"') + '\n[policy]\nuse = "cost-aware"\n')
        paths = [str(workspace / name) for name in ("tone.wav", "noise.flac")]
        for _ in range(2):
            result = CliRunner().invoke(app, ["transcribe", *paths, "--json", "--config", str(config)])
            assert result.exit_code == 0, result.output
            assert [f["text"] for f in json.loads(result.stdout)["files"]] == reference_texts(workspace, ["tone.wav", "noise.flac"])
        files = list((tmp_path / "cache" / "policies").glob("cost-aware-*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["format"] == 1

    def test_long_audio_in_30_second_windows(self, app, workspace):
        """45 s of audio is transcribed long-form, as target.generate does, beside a short file."""
        result = run(app, workspace, "long.wav", "tone.wav", options=["--json"])
        assert result.exit_code == 0, result.output
        files = {f["file"]: f for f in json.loads(result.stdout)["files"]}
        long = files[str(workspace / "long.wav")]
        assert long["duration"] == pytest.approx(45.0)
        assert long["text"] == reference_texts(workspace, ["long.wav"], long_form=True)[0]
        assert all(0 <= s["start"] <= s["end"] <= 45.0 for s in long["segments"])
        assert json.loads(result.stdout)["stats"]["windows"] >= 2

    def test_bad_files_are_named_and_the_rest_transcribed(self, app, workspace):
        """Unreadable, empty and missing files: one error each, the good file transcribed, exit code 2
        (the code of every user error, as generate and bench use it)."""
        result = run(app, workspace, "broken.wav", "tone.wav", "empty.wav", "missing.wav")
        assert result.exit_code == 2
        for name in ("broken.wav", "empty.wav", "missing.wav"):
            assert f"Error: {workspace / name}" in result.stderr
        assert f"{workspace / 'tone.wav'}: " in result.stdout
        assert "3 of 4 file(s) could not be transcribed" in result.stderr

    def test_config_errors_exit_2_without_traceback(self, app, workspace, tmp_path):
        """A missing config, a non-Whisper target, a bad task or language: exit 2 and one clear line."""
        (tmp_path / "gpt2").mkdir()
        transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)).save_pretrained(tmp_path / "gpt2")
        (tmp_path / "text.toml").write_text(f'[target]\nmodel = "{tmp_path / "gpt2"}"\n[drafter]\nuse = "ngram"\n')
        cases = [
            (["--config", str(tmp_path / "nope.toml")], "does not exist"),
            (["--config", str(tmp_path / "text.toml")], "not a Whisper"),
            (["--config", str(workspace / "whisper.toml"), "--task", "summarize"], "--task"),
            (["--config", str(workspace / "whisper.toml"), "--language", "klingon"], "klingon"),
        ]
        for options, message in cases:
            result = CliRunner().invoke(app, ["transcribe", str(workspace / "tone.wav"), *options])
            assert result.exit_code == 2, (options, result.output)
            assert result.stderr.startswith("Error:") and message in result.stderr, result.stderr
            assert "Traceback" not in result.output


class TestAsALibraryAndAProcess:
    """Audio reading works without the CLI; the real command prints no library warnings."""

    def test_audio_and_whisper_modules_need_no_typer(self):
        import subprocess
        import sys
        from pathlib import Path

        code = "import sys, specdec.audio, specdec.whisper; print('typer' in sys.modules, 'specdec.cli' in sys.modules)"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "PATH": ""})
        assert result.stdout.split() == ["False", "False"], result.stderr

    def test_real_process_prints_the_text_and_no_warnings(self, workspace):
        import os
        import subprocess
        import sys
        from pathlib import Path

        result = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "transcribe", str(workspace / "tone.wav"), "-c", str(workspace / "whisper.toml")],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == reference_texts(workspace, ["tone.wav"])[0]
        assert "warn" not in result.stderr.lower() and "deprecat" not in result.stderr.lower(), result.stderr
