"""``specdec drafter train``: fit a ``hidden_state`` drafter head to a target on a text corpus;
``specdec drafter distill-whisper``: distil a reduced-head ``shared-encoder`` draft from a Whisper target;
``specdec drafter train-whisper``: fit a ``hidden_state`` head to a Whisper target on speech.

``drafter_app`` is a typer sub-app; the main CLI mounts it with
``app.add_typer(drafter_app, name="drafter")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import InputError, SpecdecError
from .common import phase_progress, set_up_logging, stderr_console

drafter_app = typer.Typer(help="Train drafters for a target model.", no_args_is_help=True)


@drafter_app.callback()
def _drafter():
    """Train drafters for a target model."""


def first_tokens(texts: list[str], tokenizer, budget: int) -> list[str]:
    """The first texts whose tokens (with one eos each) fit ``budget``; at least one."""
    kept, used = [], 0
    for text in texts:
        used += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        if kept and used > budget:
            break
        kept.append(text)
    return kept


@drafter_app.command("train")
def train(
    target: str = typer.Option(..., "--target", help="The target model: a folder or a hub id."),
    corpus: Path = typer.Option(..., "--corpus", help='Text: JSON Lines with a "text" key, or plain text.'),
    out: Path = typer.Option(..., "--out", help="Where to write the head (safetensors)."),
    vocab: int = typer.Option(8192, help="Tokens in the head's reduced vocabulary (the target's most frequent)."),
    length: int = typer.Option(256, help="Tokens per training row."),
    rows: str = typer.Option("stream", help="stream: the texts joined and cut every --length tokens (a text may "
                             "span two rows); texts: every row begins with a text, whole texts packed, the rest "
                             "padding left out of the loss."),
    epochs: int = typer.Option(2, help="Passes over the corpus."),
    batch_size: int = typer.Option(8, help="Rows per step."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW)."),
    schedule: str = typer.Option("cosine", help="constant | cosine."),
    unroll: int = typer.Option(1, help="Drafted positions to train per position: 2 or more also trains the head "
                               "on its own predictions, as it drafts (EAGLE-3's training-time test)."),
    init: Optional[Path] = typer.Option(None, help="A head to continue training from (its token map is kept)."),
    max_texts: int = typer.Option(0, help="Use only the first N texts (0: all)."),
    max_tokens: int = typer.Option(0, help="Use only the first texts up to this many tokens (0: all)."),
    holdout: float = typer.Option(0.05, help="Share of rows held out to measure top-1 agreement."),
    feature_cache: Optional[Path] = typer.Option(None, help="Keep the target's hidden states in this file."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    dtype: str = typer.Option("float32", help="The target's dtype while training."),
    seed: int = typer.Option(0, help="Seed for the split, the batches and the initial weights."),
):
    """Run the target over the corpus, fit a one-layer head to its hidden states, save it to --out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..prompts import read_corpus
    from ..training.hidden_state import train_hidden_state_head

    set_up_logging()
    if threads:
        torch.set_num_threads(threads)
    console = stderr_console()
    try:
        texts = read_corpus(corpus)
        if max_texts:
            texts = texts[:max_texts]
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise InputError(f"--dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        with console.status(f"loading {target}"):
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).eval()
            tokenizer = AutoTokenizer.from_pretrained(target)
        if max_tokens:
            texts = first_tokens(texts, tokenizer, max_tokens)
        with phase_progress({"features": "target hidden states (rows)", "train": "head steps"}) as on_progress:
            report = train_hidden_state_head(
                model, texts, out, tokenizer=tokenizer, vocab=vocab, length=length, epochs=epochs,
                batch_size=batch_size, lr=lr, schedule=schedule, unroll=unroll, init=init, holdout=holdout, seed=seed,
                feature_cache=feature_cache, rows=rows, on_progress=on_progress,
            )
    except (SpecdecError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(report.summary())
    typer.echo(f'Use it with:\n[drafter]\nuse = "hidden-state"\nhead = "{report.path}"')


@drafter_app.command("distill-whisper")
def distill_whisper(
    target: str = typer.Option("whisper-base", "--target",
                               help="The Whisper target: a folder, or a name fetched by `specdec models fetch`."),
    audio_dir: Path = typer.Option(..., "--audio-dir", help="Training audio with its utterances.json "
                                   "(benchmarks/build_speech_eval.py --split train)."),
    out: Path = typer.Option(..., "--out", help="The folder to write draft.safetensors into."),
    layers: str = typer.Option("0", help="The target's decoder layers the draft's layers start from, e.g. 0 or 0,5."),
    vocab: int = typer.Option(8192, help="Tokens in the draft's reduced head."),
    epochs: int = typer.Option(8, help="Passes over the training audio."),
    batch_size: int = typer.Option(8, help="Utterances per step (and per teacher batch)."),
    lr: float = typer.Option(3e-4, help="Peak learning rate (AdamW, cosine after a short warm-up)."),
    languages: str = typer.Option("", help="Only utterances of these languages, e.g. en (default: all)."),
    holdout: float = typer.Option(0.05, help="Share of utterances held out to measure top-1 agreement."),
    train_cross_kv: bool = typer.Option(False, help="Also train the cross-attention key/value projections (3x slower)."),
    cache: Optional[Path] = typer.Option(None, help="Keep the teacher pass (encoder outputs, pseudo-labels) in this file."),
    teacher_batch_size: int = typer.Option(0, help="Utterances per batch of the teacher pass (0: --batch-size)."),
    labels: str = typer.Option("generate", help="Train along the target's own transcripts (generate) or along "
                               "utterances.json's texts (reference: no generate, a third of the teacher pass's time)."),
    timestamps: float = typer.Option(0.0, help="With --labels reference: the share of utterances trained with "
                                     "timestamps, as long-form transcription writes them (every timestamp token "
                                     "joins the head), so that the draft drafts them in long-form audio."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    seed: int = typer.Option(0, help="Seed for the split, the batches and the order."),
):
    """Distil a reduced-head shared-encoder draft from a Whisper target on its own transcripts of --audio-dir."""
    from ..training.whisper_draft import LABEL_SOURCES, distill_whisper_draft

    layer_ids = _checked(_layer_ids, layers)

    def fit(model, processor, on_progress):
        return distill_whisper_draft(
            model, processor, audio_dir, out, layers=layer_ids, vocab=vocab, epochs=epochs, batch_size=batch_size,
            lr=lr, holdout=holdout, seed=seed, cache=cache, on_progress=on_progress, train_cross_kv=train_cross_kv,
            teacher_batch_size=teacher_batch_size or None, languages=_languages(languages), labels=labels,
            timestamps=timestamps,
        )

    if labels not in LABEL_SOURCES:
        typer.echo(f"Error: --labels must be one of {', '.join(LABEL_SOURCES)}, got {labels!r}", err=True)
        raise typer.Exit(2)
    if timestamps and (labels != "reference" or not 0.0 <= timestamps <= 1.0):
        typer.echo(f"Error: --timestamps must be a share in [0, 1] and needs --labels reference, got {timestamps} "
                   f"with --labels {labels}", err=True)
        raise typer.Exit(2)
    report = _on_whisper(target, threads, fit, "draft steps")
    typer.echo(report.summary())
    typer.echo(f'Use it with:\n[drafter]\nuse = "shared-encoder"\nmodel = "{report.path.parent}"')


@drafter_app.command("train-whisper")
def train_whisper(
    target: str = typer.Option("whisper-base", "--target",
                               help="The Whisper target: a folder, or a name fetched by `specdec models fetch`."),
    audio_dir: Path = typer.Option(..., "--audio-dir", help="Training audio with its utterances.json "
                                   "(benchmarks/build_speech_eval.py --split train)."),
    out: Path = typer.Option(..., "--out", help="Where to write the head (safetensors)."),
    layers: str = typer.Option("-1", help="The target's decoder layers the head's layers start from, one each, "
                               "e.g. -1 (the last) or 0,5."),
    vocab: int = typer.Option(8192, help="Tokens in the head's reduced vocabulary."),
    epochs: int = typer.Option(4, help="Passes over the training audio."),
    batch_size: int = typer.Option(8, help="Utterances per step (and per teacher batch)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW, cosine after a short warm-up)."),
    unroll: int = typer.Option(2, help="Drafted positions trained per position: 2 or more also trains the head on "
                               "its own predictions, as it drafts (EAGLE-3's training-time test)."),
    languages: str = typer.Option("", help="Only utterances of these languages, e.g. en (default: all)."),
    holdout: float = typer.Option(0.05, help="Share of utterances held out to measure top-1 agreement."),
    cache: Optional[Path] = typer.Option(None, help="Keep the teacher pass (encoder outputs, pseudo-labels) in this "
                                         "file; distill-whisper's cache serves too."),
    teacher_batch_size: int = typer.Option(0, help="Utterances per batch of the teacher pass (0: --batch-size)."),
    save_dtype: str = typer.Option("float32", help="The file's float dtype: float32, or float16 (half the size; "
                                   "the head still shares the target's cross-attention where the target's "
                                   "weights are float16 values, as a converted CTranslate2 checkpoint's are)."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    seed: int = typer.Option(0, help="Seed for the split, the batches and the initial weights."),
):
    """Fit a hidden-state (EAGLE-style) head to a Whisper target on its own transcripts of --audio-dir."""
    from ..training.whisper_hidden_state import train_whisper_hidden_state_head

    layer_ids, dtype = _checked(_layer_ids, layers), _checked(_save_dtype, save_dtype)

    def fit(model, processor, on_progress):
        return train_whisper_hidden_state_head(
            model, processor, audio_dir, out, layers=layer_ids, vocab=vocab, epochs=epochs, batch_size=batch_size, lr=lr,
            unroll=unroll, holdout=holdout, seed=seed, cache=cache, teacher_batch_size=teacher_batch_size or None,
            languages=_languages(languages), save_dtype=dtype, on_progress=on_progress,
        )

    report = _on_whisper(target, threads, fit, "head steps")
    typer.echo(report.summary())
    typer.echo(f'Use it with:\n[drafter]\nuse = "hidden-state"\nhead = "{report.path}"')


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--layers must be comma-separated integers, got {text!r}") from None


def _save_dtype(text: str):
    import torch

    if text not in ("float32", "float16", "bfloat16"):
        raise InputError(f"--save-dtype must be float32, float16 or bfloat16, got {text!r}")
    return getattr(torch, text)


def _checked(parse, text: str):
    """``parse(text)``, an option's value; a bad one ends the command with code 2 before any model loads."""
    try:
        return parse(text)
    except InputError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None


def _languages(text: str) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] or None


def _on_whisper(target: str, threads: int, fit, steps: str):
    """Load the Whisper ``target`` (a folder or a fetched name) and its processor, then run
    ``fit(model, processor, on_progress)`` under progress bars; errors end the command with code 2."""
    import torch

    from ..config import resolve_model
    from ..core.models import load_pretrained

    set_up_logging()
    if threads:
        torch.set_num_threads(threads)
    console = stderr_console()
    try:
        from transformers import AutoProcessor, WhisperForConditionalGeneration

        path = resolve_model(target, who="--target")
        with console.status(f"loading {path}"):
            model = load_pretrained(WhisperForConditionalGeneration, path, dtype=torch.float32, who="--target")
            processor = AutoProcessor.from_pretrained(str(path))
        labels = {"teacher": "target: encoder + labels", "teacher logits": "target: distributions",
                  "teacher states": "target: decoder states", "train": steps}
        with phase_progress(labels) as on_progress:
            return fit(model, processor, on_progress)
    except (SpecdecError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
