"""Fitting a hidden-state head (drafters/hidden_state.py, EAGLE-style) to a Whisper target on speech.

The head reads ``[embedding of token p, the target's last decoder state at p - 1]`` and predicts the
decoder state at p, which it reads out through the target's output rows of a reduced vocabulary.
For Whisper its layers are decoder layers, so they also cross-attend to the target's encoder
output. Each starts as a copy of one of the target's decoder layers (``layers``: the last by
default), whose cross-attention key and value projections stay frozen: in the loop the head then
reads the very keys and values the target computed for that layer (drafters/shared_encoder.py,
``shared_cross_attention_layers``) and adds no cross-attention cache of its own.

The data are the shared-encoder draft's (training/whisper_draft.py): the target's encoder output
and greedy transcript of every training utterance, computed once and kept in ``cache``. One
teacher-forced forward of the target's decoder over each transcript gives the hidden states the
head learns to predict. The loss is ``training/hidden_state.py``'s: smooth L1 on the hidden state
plus the KL divergence on the reduced vocabulary, ``unroll`` > 1 training on the head's own
predictions as it drafts.

Held-out utterances measure top-1 per drafted position: the share of transcript tokens the head's
greedy choice gets right at its first drafted token (after real states) and at later ones (after
its own predictions).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from ..drafters.hidden_state import head_config, target_parts
from ..drafters.hidden_state_head import HiddenStateHead
from ..errors import InputError
from .hidden_state import HeadTrainingReport, _loss, _scheduler, unrolled_predictions
from .whisper_draft import (
    Progress,
    TeacherData,
    _padded,
    _training,
    cached_teacher_pass,
    choose_token_map,
    fit_batches,
    read_utterances,
    special_tokens,
)


@torch.no_grad()
def teacher_states(target, data: TeacherData, batch_size: int = 8, on_progress: Progress | None = None) -> list[torch.Tensor]:
    """Per utterance, the target's last decoder hidden state at every label position but the last
    ([T - 1, H], float16): the state at p is what the target's head turns into label token p + 1."""
    out = []
    for start in range(0, len(data.labels), batch_size):
        labels = data.labels[start : start + batch_size]
        inputs, _ = _padded([label[:-1] for label in labels])
        encoded = data.encoder_states[start : start + batch_size].to(device=target.device, dtype=target.dtype)
        decoded = target.model.decoder(input_ids=inputs.to(target.device), encoder_hidden_states=encoded).last_hidden_state
        for row, label in enumerate(labels):
            out.append(decoded[row, : len(label) - 1].to(torch.float16).cpu())
        if on_progress is not None:
            on_progress("teacher states", min(start + batch_size, len(data.labels)), len(data.labels))
    return out


def build_whisper_head(target, token_map: torch.Tensor, layers: Sequence[int] = (-1,)) -> HiddenStateHead:
    """A head for the Whisper ``target`` whose layers, final norm and positions start as the target's
    (its decoder layers ``layers``, the last by default), read out through the target's rows of ``token_map``."""
    decoder = target.model.decoder
    head = HiddenStateHead(head_config(target.config, len(layers)), token_map).to(device=target.device, dtype=target.dtype)
    with torch.no_grad():
        for own, source in enumerate(layers):
            head.decoder.layers[own].load_state_dict(decoder.layers[source].state_dict())
        head.decoder.layer_norm.load_state_dict(decoder.layer_norm.state_dict())
        head.decoder.embed_positions.load_state_dict(decoder.embed_positions.state_dict())
    return head


def _restore_frozen(head: HiddenStateHead, target, layers: Sequence[int]) -> None:
    """The frozen parameters exactly as the target's (trained in float32, they were rounded for a
    float64 target): equal projections are what lets the head share the target's keys and values."""
    decoder, own = target.model.decoder, head.decoder
    with torch.no_grad():
        for mine, source in enumerate(layers):
            for name in ("k_proj", "v_proj"):
                getattr(own.layers[mine].encoder_attn, name).load_state_dict(
                    getattr(decoder.layers[source].encoder_attn, name).state_dict())
        own.embed_positions.load_state_dict(decoder.embed_positions.state_dict())


def _rows(data: TeacherData, states: list[torch.Tensor], rows: Sequence[int]):
    """Tokens [b, T], hidden states [b, T, H] and the positions to score [b, T] of ``rows``: the
    labels without their last token, right-padded. A state is scored where it follows the prompt,
    for the head first drafts the token after the target's first transcript token."""
    tokens, real = _padded([data.labels[i][:-1] for i in rows])
    features = torch.nn.utils.rnn.pad_sequence([states[i].float() for i in rows], batch_first=True)
    real[:, : data.prompt_length] = False
    return tokens, features, real


def train_whisper_hidden_state_head(
    target,
    processor,
    audio_dir: str | Path,
    out: str | Path | None = None,
    *,
    layers: Sequence[int] = (-1,),
    vocab: int = 8192,
    epochs: int = 4,
    batch_size: int = 8,
    lr: float = 1e-3,
    hidden_weight: float = 1.0,
    noise: float = 0.05,
    unroll: int = 1,
    holdout: float = 0.05,
    languages: Sequence[str] | None = None,
    seed: int = 0,
    cache: str | Path | None = None,
    teacher_batch_size: int | None = None,
    save_dtype: torch.dtype | None = None,
    on_progress: Progress | None = None,
) -> HeadTrainingReport:
    """Fit a ``HiddenStateHead`` to the Whisper ``target`` on the audio listed in
    ``audio_dir/utterances.json`` (see the module doc) and save it to ``out`` (a safetensors file).

    ``layers``: the target's decoder layers the head's layers start from (one each; the last by
    default). ``unroll``, ``noise`` and ``hidden_weight``: as ``train_hidden_state_head``'s. ``cache`` and ``teacher_batch_size``: as
    ``distill_whisper_draft``'s (the two share the cached teacher pass). ``save_dtype``: the file's
    float dtype (default: the target's). float16 halves it, and keeps the head sharing the target's
    keys and values where the target's weights are float16 values (a CTranslate2 checkpoint's are).
    """
    count = target.config.decoder_layers
    if not 1 <= len(layers) <= 8 or any(not -count <= i < count for i in layers):
        raise InputError(f"layers must be 1 to 8 indices of the target's {count} decoder layers, got {list(layers)}")
    if epochs < 1 or batch_size < 1 or (teacher_batch_size or 1) < 1 or not 0.0 <= holdout < 1.0 or lr <= 0:
        raise InputError("epochs, batch_size and teacher_batch_size must be >= 1, holdout in [0, 1), lr > 0")
    if not 1 <= unroll <= 8:
        raise InputError(f"unroll must be between 1 and 8, got {unroll}")
    started = time.perf_counter()
    torch.manual_seed(seed)
    target.eval()
    embedding, weight, _ = target_parts(target, "train_whisper_hidden_state_head")
    utterances = read_utterances(audio_dir, languages)
    data = cached_teacher_pass(target, processor, utterances, cache, teacher_batch_size or batch_size, on_progress)
    states = teacher_states(target, data, batch_size, on_progress)
    order = torch.randperm(len(utterances), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(len(order) * holdout)) if holdout else 0
    test, train = order[:held], order[held:]
    token_map, coverage = choose_token_map([data.labels[i] for i in train], target.config.vocab_size, vocab,
                                           special_tokens(target), skip=data.prompt_length)
    head = build_whisper_head(target, token_map, layers).float()
    head.attach(weight.float())
    spread = float(torch.cat([states[i] for i in train]).float().std())
    # Frozen: the positions (the target's), and the cross-attention key and value projections, so
    # that the head reads the keys and values the target computes for the layers it started from.
    frozen = (".embed_", "encoder_attn.k_proj", "encoder_attn.v_proj", "readout_layer")

    def batch_loss(rows):
        tokens, features, real = _rows(data, states, rows)
        if tokens.shape[1] <= unroll:
            return None
        return _loss(head, embedding, tokens, features, hidden_weight, noise * spread, unroll, real,
                     encoder_states=data.encoder_states[rows])

    with _training(head, frozen) as parameters:
        head.train()
        losses = fit_batches(parameters, train, epochs, batch_size, torch.optim.AdamW(parameters, lr=lr),
                             lambda optimizer, total: _scheduler(optimizer, "cosine", total), batch_loss, seed, on_progress)
        head.eval()
    if not losses:
        raise InputError(f"{audio_dir}: no transcript is longer than {unroll} tokens; nothing to train on")
    per_step = heldout_top1(head, embedding, data, states, test, unroll, batch_size) if test else ()
    top1 = per_step[0] if per_step else float("nan")
    head = head.to(dtype=target.dtype)
    head.attach(weight)
    _restore_frozen(head, target, layers)
    path = None
    if out is not None:
        path = head.save(out, dtype=save_dtype, metadata={
            "heldout_top1": f"{top1:.4f}", "map_coverage": f"{coverage:.4f}", "unroll": str(unroll),
            "heldout_top1_per_step": " ".join(f"{t:.4f}" for t in per_step), "init_layers": ",".join(map(str, layers)),
            "training_utterances": str(len(train)), "epochs": str(epochs),
            "target": str(getattr(target.config, "_name_or_path", "") or ""),
        })
    positions = sum(int(_rows(data, states, [i])[2].sum()) for i in train)
    return HeadTrainingReport(head=head, tokens=positions, steps=len(losses), losses=losses, heldout_top1=top1,
                              map_coverage=coverage, seconds=time.perf_counter() - started, path=path,
                              heldout_top1_per_step=tuple(per_step))


@torch.no_grad()
def heldout_top1(head, embedding, data: TeacherData, states: list[torch.Tensor], rows: Sequence[int],
                 unroll: int = 1, batch_size: int = 8) -> list[float]:
    """Per drafted position (the first after real states, then after the head's own predictions),
    the share of the transcript tokens of ``rows`` that the head's greedy choice gets right."""
    right, seen = [0] * unroll, [0] * unroll
    for start in range(0, len(rows), batch_size):
        batch = list(rows[start : start + batch_size])
        tokens, features, real = _rows(data, states, batch)
        if tokens.shape[1] <= unroll:
            continue
        wanted, _ = _padded([data.labels[i][1:] for i in batch])  # the token each state is read out as
        length = tokens.shape[1] - unroll
        predictions = unrolled_predictions(head, embedding, tokens, features, unroll,
                                           encoder_states=data.encoder_states[batch])
        for step, predicted in enumerate(predictions):
            guess = head.token_map[head.readout(predicted).argmax(-1)].cpu()
            columns = slice(1 + step, 1 + step + length)
            scored = real[:, columns]
            right[step] += int(((guess == wanted[:, columns]) & scored).sum())
            seen[step] += int(scored.sum())
    return [r / max(n, 1) for r, n in zip(right, seen)]

