"""``specdec transcribe FILE [FILE...] --config whisper.toml``: speculative transcription of audio files.

Reads wav/flac/ogg (anything libsndfile reads) at any sample rate and channel count, downmixes to
mono and resamples to 16 kHz. Files of up to 30 seconds are batched together in Whisper's
short-form mode; longer files are batched together in long-form mode (30-second windows, seeking
by the predicted timestamps), exactly as ``WhisperForConditionalGeneration.generate`` does.
A file that cannot be read, or holds no audio, is reported by name and skipped; the others are
still transcribed and the command exits with code 2 at the end, the code of every user error
(configuration errors too). Audio reading itself is library code: ``specdec.audio``.

```toml
# whisper.toml
[target]
model = "models/whisper-large-v3"      # WhisperForConditionalGeneration + processor files

[drafter]
use = "shared-encoder"
model = "models/distil-large-v3"       # its decoder is loaded as WhisperForCausalLM
```
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ..audio import SAMPLE_RATE, WINDOW_SECONDS, Audio, AudioError, read_audio
from .common import fail, set_up_logging, stderr_console, with_policy_memory

__all__ = ["SAMPLE_RATE", "Audio", "AudioError", "read_audio", "transcribe_command"]


def _timestamp(seconds: float) -> str:
    minutes, rest = divmod(max(seconds, 0.0), 60.0)
    hours, minutes = divmod(int(minutes), 60)
    stamp = f"{minutes:02d}:{rest:06.3f}"
    return f"{hours:d}:{stamp}" if hours else stamp


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _transcribe_batch(whisper, processor, audios: list[Audio], long_form: bool, options: dict, progress) -> list[dict]:
    """Transcribe one batch of files; one result dict per file, in order."""
    extractor = processor.feature_extractor
    arrays = [audio.samples for audio in audios]
    if long_form:
        inputs = extractor(arrays, sampling_rate=SAMPLE_RATE, return_tensors="pt", truncation=False,
                           padding="longest", return_attention_mask=True)
    else:
        inputs = extractor(arrays, sampling_rate=SAMPLE_RATE, return_tensors="pt", return_attention_mask=True)
    if progress is None:
        monitor = None
    else:
        task = progress.add_task(f"{len(audios)} file(s), {sum(a.seconds for a in audios):.0f} s", total=None)

        def monitor(seek_and_max):  # [B, 2]: frames done, frames in each audio
            done = seek_and_max.min(dim=1).values.sum()
            progress.update(task, completed=int(done), total=int(seek_and_max[:, 1].sum()))

    if long_form:  # Whisper seeks through long audio by the timestamps it predicts
        options = {**options, "return_timestamps": True}
    out = whisper.generate(
        inputs.input_features,
        attention_mask=inputs.attention_mask,
        return_segments=True,
        monitor_progress=monitor,
        **options,
    )
    if progress is not None:
        progress.remove_task(task)
    tokenizer = processor.tokenizer
    results = []
    for audio, tokens, segments in zip(audios, out["sequences"], out["segments"]):
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        parts = []
        for segment in segments:
            # Whisper's times are window-relative guesses; a segment never ends after the audio does.
            start, end = (min(float(segment[key]), audio.seconds) for key in ("start", "end"))
            parts.append({
                "start": round(start, 3),
                "end": round(end, 3),
                "text": tokenizer.decode(segment["tokens"], skip_special_tokens=True).strip(),
            })
        results.append({"file": str(audio.path), "duration": round(audio.seconds, 3), "text": text, "segments": parts})
    return results


def transcribe_command(
    files: list[Path] = typer.Argument(..., help="Audio files (wav, flac, ogg, ...), any sample rate and channels."),
    config: Path = typer.Option(..., "--config", "-c", help="TOML file: \\[target] model = a Whisper folder, \\[drafter] use = a drafter."),
    timestamps: bool = typer.Option(False, "--timestamps", help="Print segments with their start and end times."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document: texts, segments and stats."),
    language: Optional[str] = typer.Option(None, "--language", help="Force the spoken language (e.g. en, german); default: detect."),
    task: str = typer.Option("transcribe", "--task", help="transcribe, or translate (into English)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Files decoded together."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Override [drafter] use = ... by name."),
    progress_bar: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars over the files and through long audio (stderr)."),
) -> None:
    """Transcribe (or translate) audio files with a Whisper target and a speculative drafter."""
    from ..config import SpecdecConfig
    from ..decoding import SpeculativeDecoder
    from ..errors import SpecdecError
    from ..whisper import WhisperSpeculativeDecoder

    if task not in ("transcribe", "translate"):
        raise fail(f"--task must be 'transcribe' or 'translate', got {task!r}")
    set_up_logging()  # weight-loading bars and deprecation warnings would interleave with the transcript
    try:
        spec = SpecdecConfig.from_toml(config)
        if drafter is not None:
            spec = spec.with_choices(drafter=drafter)
        spec = with_policy_memory(spec, dict(spec.sampling))
        if not spec.target_is_encoder_decoder:
            raise fail(f"{config}: [target] model {spec.target['model']!r} is not a Whisper (encoder-decoder) model")
        target, _ = spec.load_target()
        processor = spec.load_processor()
        if not hasattr(processor, "feature_extractor"):
            raise fail(f"{config}: the processor in {spec.target['model']!r} has no feature extractor")
        whisper = WhisperSpeculativeDecoder(SpeculativeDecoder.from_config(spec, target=target))
    except SpecdecError as exc:
        raise fail(str(exc)) from None

    options: dict[str, Any] = dict(spec.sampling)
    options.update(task=task, return_timestamps=True if timestamps else None)
    if language is not None:
        options["language"] = language

    failed: list[str] = []
    audios: list[Audio] = []
    for path in files:
        try:
            audios.append(read_audio(path))
        except AudioError as exc:
            failed.append(str(exc))
            fail(str(exc))  # reported now; the other files are still transcribed
        except SpecdecError as exc:  # the audio libraries are not installed
            raise fail(str(exc)) from None

    results: dict[str, dict] = {}
    counted = ("drafted", "accepted", "new_tokens", "row_steps", "target_calls", "alternatives_read", "alternatives_taken")
    stats = dict.fromkeys(counted, 0) | {"windows": 0}
    audio_seconds = sum(audio.seconds for audio in audios)
    started = time.perf_counter()
    progress = files_task = None
    if progress_bar and (len(audios) > 1 or any(audio.seconds > WINDOW_SECONDS for audio in audios)):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=stderr_console(), transient=True)
        files_task = progress.add_task("files", total=len(audios))  # and one bar per batch of long audio
        progress.start()
    try:
        for long_form in (False, True):
            group = [audio for audio in audios if (audio.seconds > WINDOW_SECONDS) == long_form]
            for batch in _batches(group, batch_size):
                for result in _transcribe_batch(whisper, processor, batch, long_form, options, progress):
                    results[result["file"]] = result
                decode = whisper.stats.decode
                for name in counted:
                    stats[name] += getattr(decode, name)
                stats["windows"] += whisper.stats.windows
                if progress is not None:
                    progress.advance(files_task, len(batch))
    except SpecdecError as exc:
        raise fail(str(exc)) from None
    except ValueError as exc:  # transformers' Whisper checks (unknown language, ...)
        raise fail(f"{exc}") from None
    finally:
        if progress is not None:
            progress.stop()
    compute_seconds = time.perf_counter() - started
    stats.update(
        acceptance_rate=stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0,
        tokens_per_target_call=stats["new_tokens"] / stats["row_steps"] if stats["row_steps"] else 0.0,
        audio_seconds=round(audio_seconds, 3),
        compute_seconds=round(compute_seconds, 3),
        rtfx=audio_seconds / compute_seconds if compute_seconds else 0.0,
    )

    ordered = [results[str(audio.path)] for audio in audios]
    if as_json:
        document = {"files": ordered, "errors": failed, "stats": stats}
        typer.echo(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        for result in ordered:
            if timestamps:
                typer.echo(result["file"])
                for segment in result["segments"]:
                    typer.echo(f"[{_timestamp(segment['start'])} --> {_timestamp(segment['end'])}]  {segment['text']}")
            elif len(files) > 1:
                typer.echo(f"{result['file']}: {result['text']}")
            else:
                typer.echo(result["text"])
        if audios:
            alternatives = (f", alternatives read in {stats['alternatives_read']} verifies, {stats['alternatives_taken']} "
                            "taken" if stats["alternatives_read"] else "")
            typer.echo(
                f"acceptance {stats['acceptance_rate']:.1%}, {stats['tokens_per_target_call']:.2f} tokens per "
                f"target call{alternatives}, RTFx {stats['rtfx']:.1f} ({audio_seconds:.1f} s of audio in "
                f"{compute_seconds:.1f} s)",
                err=True,
            )
    if failed:  # files the user named that cannot be read: a user error, exit 2 like every other one
        raise fail(f"{len(failed)} of {len(files)} file(s) could not be transcribed")
