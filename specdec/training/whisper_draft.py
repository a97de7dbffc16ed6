"""Distilling a reduced-head ``shared-encoder`` draft from a Whisper target, the Distil-Whisper way.

1. **Teacher pass, once** (cached in a file): the target's encoder output for every training
   utterance (one 30-second window each, [1500, d_model], kept in float16), and the label prefixes
   the draft is trained along: by default the target's own greedy transcript (``generate`` with the
   utterance's language forced, no timestamps), the pseudo-labels; with ``labels="reference"`` the
   utterance's reference text, tokenized, which needs no ``generate`` (the teacher pass then costs
   the encoder alone, about a third of the default's on whisper-base) and is cheap enough to train on
   several times more speech.
2. **Token map**: the tokens the target says most often in its pseudo-labels, then, to fill the
   head, the lowest ids (BPE merge order, roughly frequency order in the tokenizer's corpus); always
   the tokens Whisper's prompt and processors need (eot, sot, the task and language tokens,
   notimestamps). With ``timestamps`` (a share of the utterances whose labels are written the way
   long-form transcription writes them, ``with_timestamps``) every timestamp token too, so that the
   draft learns to close a segment, to open the next with the same time and to go on after it;
   without, timestamps are not drafted: where the timestamp grammar forces one, the draft's guess is
   rejected and the target decodes that token itself.
3. **Teacher distributions**: one teacher-forced forward of the target's decoder over each label:
   at every position the target's own choice (its argmax, with the generation config's suppressed
   tokens left out, as ``generate`` does) and its ``top`` highest logits over the map (float16).
   Along the pseudo-labels the choice is the label itself; along a reference text it is what the
   target would say after that prefix, which is what a draft must guess to be accepted.
4. **Training**: the draft (drafters/shared_encoder_draft.py: layers copied from the target's,
   Distil-Whisper copies the first and the last; the head from the target's output rows of the
   map; the target's embeddings, frozen; by default its cross-attention key and value projections
   too) reads the cached encoder output, never the audio, and is
   trained on cross-entropy with the target's choices plus the KL divergence to the target's
   distribution renormalised over its top tokens in the map (Distil-Whisper's loss: 0.8 CE + 1.0 KL).

Held-out utterances measure top-1 agreement: the share of the target's choices the draft's greedy
choice gets right given the label prefix, which is about the acceptance rate of its first draft token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import attrs
import torch

from ..drafters.shared_encoder_draft import WhisperDraftDecoder, build_draft, save_shared_encoder_draft
from ..errors import InputError

Progress = Callable[[str, int, int], None]

LABEL_SOURCES = ("generate", "reference")
TIME_PRECISION = 0.02  # seconds per timestamp token, as transformers' Whisper generate has it


@attrs.frozen
class Utterance:
    path: Path
    language: str
    seconds: float
    text: str | None = None  # the reference text, where the listing has one


def read_utterances(audio_dir: str | Path, languages: Sequence[str] | None = None) -> list[Utterance]:
    """The utterances listed in ``audio_dir/utterances.json`` (``benchmarks/build_speech_eval.py``'s
    format: file, language, seconds, text), of ``languages`` only when given; 30 s at most each."""
    audio_dir = Path(audio_dir).expanduser()
    listing = audio_dir / "utterances.json"
    if not listing.is_file():
        raise InputError(f"{listing} does not exist: build the training split with "
                         "benchmarks/build_speech_eval.py --split train")
    try:
        rows = json.loads(listing.read_text(encoding="utf-8"))
        out = [Utterance(audio_dir / row["file"], row["language"], float(row["seconds"]), row.get("text"))
               for row in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{listing}: not a list of utterances with file, language and seconds: {exc}") from None
    out = [u for u in out if (not languages or u.language in languages) and u.seconds <= 30.0]
    if len(out) < 2:
        raise InputError(f"{listing}: fewer than two utterances of at most 30 s{' in ' + ','.join(languages) if languages else ''}")
    return out


@attrs.frozen
class TeacherData:
    """What the target says about the training audio, computed once."""

    encoder_states: torch.Tensor  # [N, frames, D] float16
    labels: list[list[int]]  # per utterance: prompt tokens, the transcript (or reference text), eot
    prompt_length: int  # tokens of the prompt (sot, language, task, notimestamps)
    # Per label where they differ (``with_timestamps``: a timestamped label's prompt has no notimestamps).
    prompt_lengths: tuple[int, ...] | None = None

    def prompt_of(self, row: int) -> int:
        """Tokens of label ``row``'s prompt: the positions before ``prompt_of(row) - 1`` predict nothing generated."""
        return self.prompt_lengths[row] if self.prompt_lengths is not None else self.prompt_length

    def after_prompts(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """[len(rows), width] bool: the label positions of ``rows`` that predict a generated token."""
        starts = torch.tensor([self.prompt_of(r) - 1 for r in rows])
        return torch.arange(width)[None, :] >= starts[:, None]


@attrs.frozen
class TeacherScores:
    """The target's teacher-forced scores along one utterance's label ([T - 1] positions)."""

    choice: torch.Tensor  # [T - 1] long: the token the target picks after each label prefix (full vocabulary)
    top_ids: torch.Tensor  # [T - 1, K] long: map (reduced) ids of the target's K highest logits in the map
    top_logits: torch.Tensor  # [T - 1, K] float16: those logits


def prompt_ids(target, language: str) -> list[int]:
    config = target.generation_config
    lang = config.lang_to_id.get(f"<|{language}|>") if getattr(config, "lang_to_id", None) else None
    tokens = [config.decoder_start_token_id]
    if lang is not None:
        tokens += [lang, config.task_to_id["transcribe"]]
    return tokens + [config.no_timestamps_token_id]


def timestamp_ids(target, seconds: float) -> int:
    """The timestamp token of ``seconds`` into a window (Whisper's 0.02 s steps, 0 to 30 s)."""
    return target.generation_config.no_timestamps_token_id + 1 + round(min(max(seconds, 0.0), 30.0) / TIME_PRECISION)


def _sentences(text: str) -> list[str]:
    return [part for part in re.split(r"(?<=[.!?])\s+", text.strip()) if part]


def with_timestamps(target, processor, data: TeacherData, utterances: Sequence[Utterance], share: float,
                    seed: int = 0) -> TeacherData:
    """``data`` with a ``share`` of its reference labels (a seeded choice) written as long-form
    transcription writes a window: the prompt without notimestamps, then ``<|0.00|>``, each sentence
    of the text followed by the time it ends and, but for the last, the same time again to open the
    next segment, then eot. Where each sentence ends is guessed from its share of the text's characters
    over the utterance's length: the draft's targets are the target's own choices after each
    prefix (``teacher_logits``), timestamps included, so a guessed time in a prefix only makes the
    target repeat that time where it opens the next segment, as it repeats its own."""
    if not 0.0 <= share <= 1.0:
        raise InputError(f"timestamps must be a share of the utterances, in [0, 1], got {share}")
    if share == 0.0:
        return data
    config = target.generation_config
    eot = config.eos_token_id
    eot = eot[0] if isinstance(eot, list) else eot
    limit = target.config.max_target_positions
    chosen = torch.randperm(len(utterances), generator=torch.Generator().manual_seed(seed + 1))
    chosen = set(chosen[: round(share * len(utterances))].tolist())
    labels, prompts = list(data.labels), [data.prompt_of(i) for i in range(len(utterances))]
    for i in sorted(chosen):
        u = utterances[i]
        if not (u.text or "").strip():
            raise InputError(f"timestamps need the utterance's text, and utterances.json has none for {u.path.name}")
        prompt = prompt_ids(target, u.language)[:-1]  # without notimestamps
        sentences = _sentences(u.text)
        total, said = sum(len(s) for s in sentences), 0
        ids = prompt + [timestamp_ids(target, 0.0)]
        for number, sentence in enumerate(sentences):
            said += len(sentence)
            end = timestamp_ids(target, u.seconds * said / total)
            ids += reference_ids(processor, sentence) + [end] + ([end] if number < len(sentences) - 1 else [])
        labels[i] = ids[: limit - 1] + [eot]
        prompts[i] = len(prompt)
    return TeacherData(data.encoder_states, labels, max(prompts), tuple(prompts))


def _check_labels(utterances: Sequence[Utterance], labels: str) -> None:
    if labels not in LABEL_SOURCES:
        raise InputError(f"labels must be one of {', '.join(LABEL_SOURCES)}, got {labels!r}")
    if labels == "reference":
        blank = [u.path.name for u in utterances if not (u.text or "").strip()]
        if blank:
            raise InputError(f"labels='reference' needs a text for every utterance; utterances.json has none for "
                             f"{', '.join(blank[:3])}{' and more' if len(blank) > 3 else ''}")


def reference_ids(processor, text: str) -> list[int]:
    """A reference text as the target's tokens, as Whisper writes a transcript (a leading space)."""
    return list(processor.tokenizer(" " + text.strip(), add_special_tokens=False).input_ids)


@torch.no_grad()
def teacher_pass(target, processor, utterances: Sequence[Utterance], batch_size: int = 8,
                 on_progress: Progress | None = None, labels: str = "generate") -> TeacherData:
    """The target's encoder output of every utterance, and its greedy transcript (``labels="generate"``)
    or the tokenized reference text (``"reference"``) as the label (see the module doc)."""
    from transformers.modeling_outputs import BaseModelOutput

    from ..audio import read_audio

    _check_labels(utterances, labels)
    limit = target.config.max_target_positions

    # Batched by duration (shortest first): rows of a batch then need about as many tokens, and
    # ``generate`` wastes fewer steps on rows that have finished. Returned in the given order.
    order = sorted(range(len(utterances)), key=lambda i: utterances[i].seconds)
    states: list[torch.Tensor | None] = [None] * len(utterances)
    label: list[list[int] | None] = [None] * len(utterances)
    eot = target.generation_config.eos_token_id
    eot = eot[0] if isinstance(eot, list) else eot
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = [utterances[i] for i in rows]
        audio = [read_audio(u.path).samples for u in batch]
        features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        features = features.to(device=target.device, dtype=target.dtype)
        encoded = target.model.encoder(features).last_hidden_state  # [b, frames, D]
        if labels == "generate":
            out = target.generate(features, encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                                  language=[u.language for u in batch], task="transcribe", return_timestamps=False)
            texts = [[int(t) for t in out[row].tolist() if int(t) != eot] for row in range(len(batch))]
        else:
            texts = [reference_ids(processor, u.text) for u in batch]
        for row, (i, u) in enumerate(zip(rows, batch)):
            prompt = prompt_ids(target, u.language)
            # The decoder reads at most ``limit`` positions, and a label's inputs are all its tokens but
            # the last: a longer label is cut to fit (a reference text can be longer than a transcript).
            label[i] = (prompt + texts[row])[: limit - 1] + [eot]
            states[i] = encoded[row].to(torch.float16).cpu()
        if on_progress is not None:
            on_progress("teacher", min(start + batch_size, len(utterances)), len(utterances))
    lengths = {len(prompt_ids(target, u.language)) for u in utterances}
    return TeacherData(torch.stack(states), label, max(lengths))


def _target_key(target) -> str:
    """A digest of the target's config, dtype and a sample of its weights."""
    digest = hashlib.sha256(target.config.to_json_string(use_diff=False).encode())
    digest.update(str(target.dtype).encode())
    parameters = list(target.parameters())
    for parameter in parameters[:: max(1, len(parameters) // 16)]:
        digest.update(parameter.detach().float().cpu().numpy().tobytes()[:4096])
    return digest.hexdigest()


def _utterance_key(u: Utterance, labels: str = "generate") -> str:
    key = u.language.encode() + Path(u.path).read_bytes()
    if labels == "reference":  # another label for the same audio: another row
        key = b"reference\0" + (u.text or "").encode() + b"\0" + key
    return hashlib.sha256(key).hexdigest()


def cached_teacher_pass(target, processor, utterances, cache: str | Path | None, batch_size: int = 8,
                        on_progress: Progress | None = None, labels: str = "generate") -> TeacherData:
    """``teacher_pass``, kept in ``cache``. Rows are keyed per utterance (its audio bytes and language,
    and with reference labels its text) under a key of the target (config, dtype, weights): a later
    run on the same target reuses every utterance the file holds and computes only the others (a
    subset of a cached set costs nothing, a superset only its new utterances); the file then holds
    the union. A cache for another target, or a broken one, is recomputed. ``labels`` is checked
    here too: a fully cached request runs no ``teacher_pass`` to check it."""
    _check_labels(utterances, labels)
    if cache is None:
        return teacher_pass(target, processor, utterances, batch_size, on_progress, labels)
    target_key = _target_key(target)
    keys = [_utterance_key(u, labels) for u in utterances]
    cache = Path(cache).expanduser()
    saved = None
    if cache.is_file():
        try:
            saved = torch.load(cache, map_location="cpu", weights_only=True)
            if saved.get("target_key") != target_key or len(saved["utterance_keys"]) != len(saved["labels"]):
                saved = None
        except Exception:  # noqa: BLE001 - a broken cache is recomputed
            saved = None
    have = {key: row for row, key in enumerate(saved["utterance_keys"])} if saved else {}
    missing = [i for i, key in enumerate(keys) if key not in have]
    if missing:
        done = len(utterances) - len(missing)

        def progress(phase, count, total):
            if on_progress is not None:
                on_progress(phase, done + count, len(utterances))

        fresh = teacher_pass(target, processor, [utterances[i] for i in missing], batch_size, progress, labels)
        old_keys = list(saved["utterance_keys"]) if saved else []
        new_keys = [keys[i] for i in missing]
        states = torch.cat([saved["encoder_states"], fresh.encoder_states]) if saved else fresh.encoder_states
        labels = (list(saved["labels"]) if saved else []) + fresh.labels
        saved = {"target_key": target_key, "utterance_keys": old_keys + new_keys, "encoder_states": states,
                 "labels": labels}
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary = cache.with_name(cache.name + ".tmp")
        torch.save(saved, temporary)
        temporary.replace(cache)
        have = {key: row for row, key in enumerate(saved["utterance_keys"])}
    elif on_progress is not None:
        on_progress("teacher", len(utterances), len(utterances))
    rows = [have[key] for key in keys]
    lengths = {len(prompt_ids(target, u.language)) for u in utterances}
    return TeacherData(saved["encoder_states"][rows], [saved["labels"][r] for r in rows], max(lengths))


def special_tokens(target) -> list[int]:
    """The tokens Whisper's prompt and processors use: eot, sot, notimestamps, tasks, languages."""
    config = target.generation_config
    ids = [config.decoder_start_token_id, config.no_timestamps_token_id]
    eos = config.eos_token_id
    ids += eos if isinstance(eos, list) else [eos]
    ids += list((getattr(config, "task_to_id", None) or {}).values())
    ids += list((getattr(config, "lang_to_id", None) or {}).values())
    return sorted({int(i) for i in ids if i is not None})


def choose_token_map(labels: Sequence[Sequence[int]], vocab: int, size: int, always: Sequence[int],
                     skip: int = 0) -> tuple[torch.Tensor, float]:
    """``size`` token ids: ``always``, then the most frequent label tokens (after each label's first
    ``skip``, the prompt), then the lowest ids not yet chosen. Returns them sorted, and the share
    of label tokens they cover."""
    if size < len(set(always)) + 1 or size > vocab:
        raise InputError(f"the token map needs between {len(set(always)) + 1} and {vocab} tokens, got {size}")
    counts = torch.zeros(vocab, dtype=torch.long)
    for label in labels:
        counts += torch.bincount(torch.tensor(label[skip:], dtype=torch.long), minlength=vocab)
    chosen = list(dict.fromkeys(int(t) for t in always))
    taken = set(chosen)
    seen = counts.argsort(descending=True, stable=True)
    seen = [int(t) for t in seen[: int((counts > 0).sum())]]
    for token in seen + list(range(vocab)):
        if len(chosen) >= size:
            break
        if token not in taken:
            chosen.append(token)
            taken.add(token)
    ids = torch.tensor(sorted(chosen))
    coverage = float(counts[ids].sum()) / max(int(counts.sum()), 1)
    return ids, coverage


@torch.no_grad()
def teacher_logits(target, data: TeacherData, token_map: torch.Tensor, batch_size: int = 8,
                   on_progress: Progress | None = None, top: int = 64) -> list[TeacherScores]:
    """Per utterance, the target's choice at every label position and its ``top`` highest logits over
    the map (``TeacherScores``). The choice leaves out the generation config's ``suppress_tokens`` (and
    ``begin_suppress_tokens`` right after the prompt), which ``generate`` never says."""
    out = []
    ids = token_map.to(target.device)
    config = target.generation_config
    suppressed = torch.tensor(sorted(set(getattr(config, "suppress_tokens", None) or [])), dtype=torch.long)
    begin = torch.tensor(sorted(set(getattr(config, "begin_suppress_tokens", None) or [])), dtype=torch.long)
    top = min(top, token_map.numel())
    for start in range(0, len(data.labels), batch_size):
        labels = data.labels[start : start + batch_size]
        inputs, _ = _padded([label[:-1] for label in labels])
        encoded = data.encoder_states[start : start + batch_size].to(device=target.device, dtype=target.dtype)
        logits = target(encoder_outputs=(encoded,), decoder_input_ids=inputs.to(target.device)).logits  # [b, T, V]
        scores = logits.to(torch.float32, copy=True)
        scores[..., suppressed.to(scores.device)] = -math.inf
        for row in range(len(labels)):
            scores[row, data.prompt_of(start + row) - 1, begin.to(scores.device)] = -math.inf
        choice = scores.argmax(-1).cpu()  # [b, T]
        best = scores[..., ids].topk(top, dim=-1)  # [b, T, K] over the map
        for row, label in enumerate(labels):
            n = len(label) - 1
            out.append(TeacherScores(choice=choice[row, :n].clone(), top_ids=best.indices[row, :n].cpu(),
                                     top_logits=best.values[row, :n].to(torch.float16).cpu()))
        if on_progress is not None:
            on_progress("teacher logits", min(start + batch_size, len(data.labels)), len(data.labels))
    return out


def _padded(rows: Sequence[Sequence[int]], fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids and a [B, T] bool mask of the real ones (causal models never look
    right, so right padding changes nothing for the real positions)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), fill, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask


@attrs.frozen
class DistillReport:
    """What ``distill_whisper_draft`` trained, and how well the draft agrees with the target on held-out audio."""

    draft: WhisperDraftDecoder
    utterances: int  # training utterances
    tokens: int  # training label tokens (after the prompt)
    steps: int
    losses: list[float]
    heldout_top1_before: float  # the initial draft (copied layers), for comparison
    heldout_top1: float
    map_coverage: float  # share of the pseudo-labels' tokens the token map holds
    seconds: float
    path: Path | None = None

    def summary(self) -> str:
        where = f", saved to {self.path}" if self.path else ""
        return (f"{self.steps} steps over {self.utterances} utterances ({self.tokens} label tokens) in "
                f"{self.seconds:.0f}s: loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}; held-out top-1 "
                f"{self.heldout_top1_before:.1%} -> {self.heldout_top1:.1%}; the token map covers "
                f"{self.map_coverage:.1%} of the target's tokens{where}")


def distill_whisper_draft(
    target,
    processor,
    audio_dir: str | Path,
    out: str | Path | None = None,
    *,
    layers: Sequence[int] = (0,),
    vocab: int = 8192,
    epochs: int = 8,
    batch_size: int = 8,
    lr: float = 3e-4,
    ce_weight: float = 0.8,
    kl_weight: float = 1.0,
    holdout: float = 0.05,
    train_cross_kv: bool = False,
    languages: Sequence[str] | None = None,
    seed: int = 0,
    cache: str | Path | None = None,
    teacher_batch_size: int | None = None,
    labels: str = "generate",
    timestamps: float = 0.0,
    on_progress: Progress | None = None,
) -> DistillReport:
    """Train a reduced-head shared-encoder draft for the Whisper ``target`` on the audio listed in
    ``audio_dir/utterances.json`` (see the module doc) and save it to ``out`` (a folder).

    ``layers``: which of the target's decoder layers the draft's layers start from (Distil-Whisper:
    the first and the last). ``vocab``: tokens in the head. ``train_cross_kv``: train the
    cross-attention key and value projections too (Distil-Whisper does; about 3x the step's cost). ``cache``: a file for the teacher pass
    (encoder outputs and pseudo-labels), reused by a later run on the same target for every utterance
    it holds. ``teacher_batch_size``: utterances per batch of the teacher pass (default
    ``batch_size``); larger batches make ``generate``'s steps cheaper per utterance on a CPU, and
    the labels are the same greedy transcripts (every row is a full 30-second window: no padding).
    ``labels``: what the draft is trained along, ``"generate"`` (the target's greedy transcripts) or
    ``"reference"`` (utterances.json's texts, no ``generate``: a third of the teacher pass's time);
    either way it learns the target's choice and distribution after each prefix. ``timestamps``: the
    share of the utterances whose reference labels are timestamped as long-form transcription writes
    them (``with_timestamps``; ``labels="reference"`` only): the map then holds every timestamp token,
    so that the draft drafts them where ``generate(return_timestamps=True)`` runs (long-form audio).
    ``on_progress(phase, done, total)`` follows the teacher pass and the training steps.
    """
    decoder_layers = target.config.decoder_layers
    if not layers or any(not 0 <= i < decoder_layers for i in layers):
        raise InputError(f"layers must be indices of the target's {decoder_layers} decoder layers, got {list(layers)}")
    if timestamps and labels != "reference":
        raise InputError("timestamps are written into reference labels: use labels='reference' with them")
    if not 0.0 <= timestamps <= 1.0:  # before the teacher pass, which can take an hour
        raise InputError(f"timestamps must be a share of the utterances, in [0, 1], got {timestamps}")
    if epochs < 1 or batch_size < 1 or (teacher_batch_size or 1) < 1 or not 0.0 <= holdout < 1.0 or lr <= 0:
        raise InputError("epochs, batch_size and teacher_batch_size must be >= 1, holdout in [0, 1), lr > 0")
    started = time.perf_counter()
    torch.manual_seed(seed)
    target.eval()
    utterances = read_utterances(audio_dir, languages)
    data = cached_teacher_pass(target, processor, utterances, cache, teacher_batch_size or batch_size, on_progress,
                               labels)
    data = with_timestamps(target, processor, data, utterances, timestamps, seed)
    order = torch.randperm(len(utterances), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(len(order) * holdout)) if holdout else 0
    test, train = order[:held], order[held:]
    always = special_tokens(target)
    if timestamps:  # every time a window can say, the tokens after notimestamps
        always += list(range(target.generation_config.no_timestamps_token_id + 1, target.config.vocab_size))
    token_map, coverage = choose_token_map([data.labels[i] for i in train], target.config.vocab_size, vocab,
                                           always, skip=data.prompt_length)
    teacher = teacher_logits(target, data, token_map, batch_size, on_progress)
    reduced = torch.full((target.config.vocab_size,), -100, dtype=torch.long)  # full id -> reduced id
    reduced[token_map] = torch.arange(token_map.numel())

    # Trained in the target's dtype: the embeddings are the target's own modules (frozen, not copied).
    draft = build_draft(target, token_map, init_layers=list(layers))
    # Frozen: the target's embeddings (shared), and unless asked the cross-attention key and value
    # projections, which start as the target's layer's and read the target's encoder output. The
    # keys and values over 1500 frames are most of a training step's arithmetic; frozen, they
    # need only their forward pass, a third of what training them costs.
    frozen = (".embed_",) if train_cross_kv else (".embed_", "encoder_attn.k_proj", "encoder_attn.v_proj")
    with _training(draft, frozen) as parameters:
        return _fit(target, draft, data, teacher, train, test, reduced, coverage, parameters, out, layers,
                    epochs, batch_size, lr, ce_weight, kl_weight, seed, started, on_progress, labels, timestamps)


@contextlib.contextmanager
def _training(draft, frozen: tuple[str, ...]):
    """The draft's parameters to train (those whose names hold none of ``frozen``); the others do not
    require gradients meanwhile (the embeddings are the target's: their flags are put back after)."""
    fixed = [p for name, p in draft.named_parameters() if any(part in name for part in frozen)]
    flags = [p.requires_grad for p in fixed]
    for p in fixed:
        p.requires_grad_(False)
    try:
        yield [p for name, p in draft.named_parameters() if not any(part in name for part in frozen)]
    finally:
        for p, flag in zip(fixed, flags):
            p.requires_grad_(flag)


def _fit(target, draft, data, teacher, train, test, reduced, coverage, parameters, out, layers,
         epochs, batch_size, lr, ce_weight, kl_weight, seed, started, on_progress, labels, timestamps) -> DistillReport:
    """The training loop of ``distill_whisper_draft``, then the held-out measure and the file."""
    before = heldout_top1(draft, data, test, target.config.vocab_size, teacher=teacher) if test else float("nan")
    draft.train()
    losses = fit_batches(parameters, train, epochs, batch_size, torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0),
                         _cosine_to_zero, lambda rows: _loss(draft, data, teacher, rows, reduced, ce_weight, kl_weight),
                         seed, on_progress)
    draft.eval()
    for p in parameters:
        p.requires_grad_(False)
    after = heldout_top1(draft, data, test, target.config.vocab_size, teacher=teacher) if test else float("nan")
    path = None
    if out is not None:
        path = save_shared_encoder_draft(draft, out, metadata={
            "init_layers": json.dumps(list(layers)), "heldout_top1": f"{after:.4f}", "map_coverage": f"{coverage:.4f}",
            "training_utterances": str(len(train)), "epochs": str(epochs), "labels": labels,
            "timestamps": str(timestamps),
            "target": str(getattr(target.config, "_name_or_path", "") or ""),
        })
    tokens = sum(len(data.labels[i]) - data.prompt_of(i) for i in train)
    return DistillReport(draft=draft, utterances=len(train), tokens=tokens, steps=len(losses), losses=losses,
                         heldout_top1_before=before, heldout_top1=after, map_coverage=coverage,
                         seconds=time.perf_counter() - started, path=path)


def _cosine_to_zero(optimizer, total: int):
    warmup = max(1, total // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))


def fit_batches(parameters, train: Sequence[int], epochs: int, batch_size: int, optimizer, schedule,
                batch_loss: Callable[[list[int]], torch.Tensor | None], seed: int,
                on_progress: Progress | None = None) -> list[float]:
    """``epochs`` passes over the utterances ``train``, shuffled (seeded) and cut into batches:
    ``batch_loss(rows)`` is each batch's loss (None skips it), gradients are clipped to norm 1, and
    the learning rate follows ``schedule(optimizer, total steps)``. Returns the losses."""
    total = math.ceil(len(train) / batch_size) * epochs
    scheduler = schedule(optimizer, total)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for _ in range(epochs):
        shuffled = [train[i] for i in torch.randperm(len(train), generator=generator).tolist()]
        for start in range(0, len(shuffled), batch_size):
            loss = batch_loss(shuffled[start : start + batch_size])
            if loss is None:
                continue
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            if on_progress is not None:
                on_progress("train", len(losses), total)
    return losses


def _draft_logits(draft, data: TeacherData, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's reduced logits at every label position of ``rows`` ([b, T, V']) and the mask of real ones."""
    inputs, mask = _padded([data.labels[i][:-1] for i in rows])
    encoded = data.encoder_states[rows].to(device=draft.device, dtype=draft.dtype)
    hidden = draft.model.decoder(input_ids=inputs.to(draft.device), encoder_hidden_states=encoded).last_hidden_state
    return draft.proj_out(hidden), mask.to(draft.device)


def _loss(draft, data, teacher, rows, reduced, ce_weight, kl_weight) -> torch.Tensor:
    logits, mask = _draft_logits(draft, data, rows)  # [b, T, V'], [b, T]
    mask &= data.after_prompts(rows, mask.shape[1]).to(mask.device)  # the prompt is given, not predicted
    choice = torch.nn.utils.rnn.pad_sequence([teacher[i].choice for i in rows], batch_first=True)  # [b, T]
    wanted = reduced[choice].to(logits.device)  # -100 outside the map: no cross-entropy there
    log_q = torch.log_softmax(logits.float(), dim=-1)
    ce = torch.nn.functional.cross_entropy(log_q[mask], wanted[mask], ignore_index=-100)
    top_ids = torch.nn.utils.rnn.pad_sequence([teacher[i].top_ids for i in rows], batch_first=True).to(logits.device)
    top_logits = torch.nn.utils.rnn.pad_sequence([teacher[i].top_logits for i in rows], batch_first=True)
    p = torch.softmax(top_logits.float().to(logits.device), dim=-1)  # [b, T, K]: the target's, over its top tokens
    kl = (p * (torch.log(p.clamp(min=1e-12)) - log_q.gather(-1, top_ids))).sum(-1)[mask].mean()
    return ce_weight * ce + kl_weight * kl


@torch.no_grad()
def heldout_top1(draft, data: TeacherData, rows: Sequence[int], vocab: int, batch_size: int = 8,
                 teacher: Sequence[TeacherScores] | None = None) -> float:
    """Share of the target's choices at the label positions of ``rows`` (after the prompt) that the
    draft's greedy choice gets right: ``teacher``'s choices where given, else the labels themselves
    (the target's greedy transcripts)."""
    right = seen = 0
    for start in range(0, len(rows), batch_size):
        batch = list(rows[start : start + batch_size])
        logits, mask = _draft_logits(draft, data, batch)
        mask &= data.after_prompts(batch, mask.shape[1]).to(mask.device)
        guess = draft.token_map[logits.argmax(-1)]
        if teacher is None:
            wanted, _ = _padded([data.labels[i][1:] for i in batch])
        else:
            wanted = torch.nn.utils.rnn.pad_sequence([teacher[i].choice for i in batch], batch_first=True)
        right += int(((guess == wanted.to(guess.device)) & mask).sum())
        seen += int(mask.sum())
    return right / max(seen, 1)
