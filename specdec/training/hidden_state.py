"""Fitting a hidden-state head (drafters/hidden_state.py) to a target from text.

Teacher forcing only: the target reads the corpus in plain forwards (prefill speed, no generation)
and gives its last hidden state h_p at every position. The head reads ``[embedding of token p,
h_(p-1)]`` and is trained to predict h_p: a smooth L1 loss on the hidden state, plus the
KL divergence of the head's reduced-vocabulary distribution against the target's own (both read out
through the target's LM head rows of the token map). The token map is the ``vocab`` tokens the
target itself predicts most often on the corpus (plus its eos tokens).

When drafting, only the first token is read with a real hidden state: the second reads the head's
own prediction, and attends to its cache of real reads plus the first draft's entry. Trained on real
states alone, the head sees such inputs for the first time when it drafts (position-2 acceptance
fell to a sixth of position 1's on SmolLM2). ``unroll`` > 1 trains the way it drafts (EAGLE-3's
"training-time test"): step s reads token p + s with the head's step s - 1 prediction, attending to
step 0's entries up to p and to its own earlier steps at p, the very cache a draft of s + 1 tokens
builds (``unrolled_mask``). Step s's loss is weighted 0.8**s.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import attrs
import torch

from ..core.types import token_id_list
from ..drafters.hidden_state import head_config, target_parts
from ..drafters.hidden_state_head import HiddenStateHead
from ..errors import InputError


@attrs.frozen
class HeadTrainingReport:
    """What ``train_hidden_state_head`` fitted and how well the head predicts held-out tokens."""

    head: HiddenStateHead
    tokens: int  # training positions per epoch
    steps: int
    losses: list[float]  # per step
    heldout_top1: float  # share of held-out positions where the head's token is the target's greedy token
    map_coverage: float  # share of the target's greedy tokens on the corpus that the token map holds
    seconds: float
    path: Path | None = None
    heldout_top1_per_step: tuple[float, ...] = ()  # heldout_top1 for each unrolled step (step 0 first)

    def summary(self) -> str:
        where = f", saved to {self.path}" if self.path else ""
        later = "".join(f", step {s + 1}: {top1:.1%}" for s, top1 in enumerate(self.heldout_top1_per_step[1:], 1))
        return (f"{self.steps} steps over {self.tokens} positions in {self.seconds:.0f}s: loss "
                f"{self.losses[0]:.3f} -> {self.losses[-1]:.3f}, held-out top-1 {self.heldout_top1:.1%}{later}, "
                f"token map covers {self.map_coverage:.1%} of the target's tokens{where}")


def _text_ids(texts: Sequence[str] | Sequence[Sequence[int]], tokenizer) -> list[list[int]]:
    """Each text's token ids, a string's followed by the tokenizer's eos."""
    ids = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise InputError(f"text {i} is a string; pass a tokenizer (or token ids)")
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                tokens.append(tokenizer.eos_token_id)
            ids.append(tokens)
        else:
            ids.append([int(token) for token in text])
    return ids


def token_rows(texts: Sequence[str] | Sequence[Sequence[int]], tokenizer, length: int) -> torch.Tensor:
    """The corpus as rows of ``length`` token ids ([N, length]); texts are joined with eos between them."""
    ids = [token for text in _text_ids(texts, tokenizer) for token in text]
    rows = len(ids) // length
    if rows < 2:
        raise InputError(f"the corpus holds {len(ids)} tokens: fewer than two rows of {length}; give more text")
    return torch.tensor(ids[: rows * length]).view(rows, length)


def text_rows(texts: Sequence[str] | Sequence[Sequence[int]], tokenizer, length: int,
              pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as rows of ``length`` token ids that each begin with a text: ``(rows [N, length],
    real [N, length] bool)``. Whole texts are packed in order while they fit; the rest of a row is
    ``pad`` (``real`` False there). A text longer than a row fills rows of its own.

    Why: with texts joined and cut every ``length`` tokens, most texts are split, and the target
    reads the second part without the first: an answer without the question it answers, hidden
    states the head never meets when it drafts."""
    rows, real, current = [], [], []

    def flush():
        if current:
            rows.append(current + [pad] * (length - len(current)))
            real.append([True] * len(current) + [False] * (length - len(current)))
            current.clear()

    for tokens in _text_ids(texts, tokenizer):
        for start in range(0, len(tokens), length):
            piece = tokens[start : start + length]
            if len(current) + len(piece) > length:
                flush()
            current.extend(piece)
    flush()
    if len(rows) < 2:
        raise InputError(f"the corpus makes {len(rows)} row(s) of {length} tokens: fewer than two; give more text")
    return torch.tensor(rows), torch.tensor(real)


ROW_LAYOUTS = ("stream", "texts")


@torch.no_grad()
def target_features(target, rows: torch.Tensor, batch_size: int, on_progress=None) -> torch.Tensor:
    """The target's last hidden state at every position of ``rows`` ([N, T, H], in the target's dtype)."""
    features = []
    for start in range(0, rows.shape[0], batch_size):
        batch = rows[start : start + batch_size].to(target.device)
        out = target(input_ids=batch, output_hidden_states=True, use_cache=False)
        features.append(out.hidden_states[-1].cpu())
        if on_progress is not None:
            on_progress("features", min(start + batch_size, rows.shape[0]), rows.shape[0])
    return torch.cat(features)


def _scheduler(optimizer, schedule: str, total: int):
    if schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    warmup = max(1, total // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def cached_features(target, rows: torch.Tensor, batch_size: int, cache: str | Path | None = None,
                    on_progress=None) -> torch.Tensor:
    """``target_features``, read from / written to ``cache`` when given (keyed by the rows and the target)."""
    if cache is None:
        return target_features(target, rows, batch_size, on_progress)
    import hashlib

    cache = Path(cache).expanduser()
    digest = hashlib.sha256(rows.numpy().tobytes())
    digest.update(repr((rows.shape, type(target).__name__, target.config.to_json_string(use_diff=False),
                        str(target.dtype))).encode())
    key = digest.hexdigest()
    if cache.is_file():
        try:
            saved = torch.load(cache, map_location="cpu", weights_only=True)
            if saved.get("key") == key:
                if on_progress is not None:
                    on_progress("features", rows.shape[0], rows.shape[0])
                return saved["features"]
        except Exception:  # noqa: BLE001 - a stale or broken cache is recomputed
            pass
    features = target_features(target, rows, batch_size, on_progress)
    cache.parent.mkdir(parents=True, exist_ok=True)
    temporary = cache.with_name(cache.name + ".tmp")
    torch.save({"key": key, "features": features}, temporary)
    temporary.replace(cache)
    return features


@torch.no_grad()
def _greedy_counts(features: torch.Tensor, lm_head_weight: torch.Tensor, chunk: int = 2048,
                   real: torch.Tensor | None = None) -> torch.Tensor:
    """How often the target's greedy token over ``features`` is each token of its vocabulary ([V]),
    counting only the positions ``real`` marks (None: all). Chunked, and without copying features."""
    counts = torch.zeros(lm_head_weight.shape[0], dtype=torch.long)
    flat = features.reshape(-1, features.shape[-1])
    kept = None if real is None else real.reshape(-1).long()
    weight = lm_head_weight.detach().cpu().to(flat.dtype)
    for start in range(0, flat.shape[0], chunk):
        greedy = (flat[start : start + chunk] @ weight.T).argmax(-1)
        if kept is not None:
            greedy = greedy[kept[start : start + chunk].bool()]
        counts += torch.bincount(greedy, minlength=counts.shape[0])
    return counts


@torch.no_grad()
def frequent_tokens(features: torch.Tensor, lm_head_weight: torch.Tensor, vocab: int, always: list[int],
                    chunk: int = 2048, real: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The ``vocab`` tokens the target predicts most often (its greedy tokens over ``features`` at
    the positions ``real`` marks, None: all), with ``always`` added; and the share of greedy tokens
    they cover."""
    counts = _greedy_counts(features, lm_head_weight, chunk, real)
    vocab = min(vocab, counts.shape[0])
    chosen = counts.argsort(descending=True)[:vocab]
    extra = [token for token in always if token not in set(chosen.tolist())]
    if extra:
        chosen = torch.cat([chosen[: vocab - len(extra)], torch.tensor(extra)])
    coverage = float(counts[chosen].sum()) / max(int(counts.sum()), 1)
    return chosen.sort().values, coverage


def map_coverage(features: torch.Tensor, lm_head_weight: torch.Tensor, token_map: torch.Tensor,
                 real: torch.Tensor | None = None) -> float:
    """The share of the target's greedy tokens over ``features`` (at ``real``; None: all) that ``token_map`` holds."""
    counts = _greedy_counts(features, lm_head_weight, real=real)
    return float(counts[token_map.cpu()].sum()) / max(int(counts.sum()), 1)


def train_hidden_state_head(
    target,
    texts: Sequence[str] | Sequence[Sequence[int]],
    out: str | Path | None = None,
    *,
    tokenizer=None,
    vocab: int = 8192,
    length: int = 128,
    epochs: int = 1,
    batch_size: int = 8,
    lr: float = 1e-3,
    hidden_weight: float = 1.0,
    noise: float = 0.05,
    holdout: float = 0.1,
    seed: int = 0,
    schedule: str = "constant",
    unroll: int = 1,
    init: HiddenStateHead | str | Path | None = None,
    feature_cache: str | Path | None = None,
    rows: str = "stream",
    on_progress: Callable[[str, int, int], None] | None = None,
) -> HeadTrainingReport:
    """Fit a ``HiddenStateHead`` to ``target`` on ``texts`` (see the module doc); save it to ``out``.

    ``noise`` (relative to the hidden states' spread) is added to the input hidden states while
    training, as EAGLE does, because when drafting the head reads its own predictions.
    ``schedule``: ``"constant"`` or ``"cosine"`` (the learning rate falls to a tenth along a cosine
    after a short warm-up). ``unroll``: drafted positions trained per row position (see the module
    doc; 1 trains on real hidden states only). ``init``: a head (or its file) to continue from, its
    weights and token map (``vocab`` is then unused), e.g. to unroll a head trained without.
    ``feature_cache``: a file where the target's hidden states for these
    rows are kept; a later call on the same rows and target reads them instead of running the
    target again (the file names the rows' hash; anything else there is recomputed).
    ``rows``: ``"stream"`` joins the texts and cuts rows of ``length`` (a text may span two rows);
    ``"texts"`` starts every row with a text and packs whole texts (``text_rows``), the padding
    left out of the loss, the token map and the held-out score.
    ``on_progress(phase, done, total)`` is called as features are computed and steps are taken.
    """
    if not 0.0 <= holdout < 1.0 or vocab < 2 or length < 4 or batch_size < 1 or epochs < 1:
        raise InputError("holdout must be in [0, 1), vocab >= 2, length >= 4, batch_size and epochs >= 1")
    if not 1 <= unroll <= length // 2:
        raise InputError(f"unroll must be between 1 and half the row length ({length // 2}), got {unroll}")
    if schedule not in ("constant", "cosine"):
        raise InputError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    if rows not in ROW_LAYOUTS:
        raise InputError(f"rows must be {' or '.join(map(repr, ROW_LAYOUTS))}, got {rows!r}")
    started = time.perf_counter()
    torch.manual_seed(seed)
    embedding, weight, _ = target_parts(target, "train_hidden_state_head")
    eos = token_id_list(target.generation_config.eos_token_id)
    if rows == "texts":
        table, real = text_rows(texts, tokenizer, length, pad=eos[0] if eos else 0)
    else:
        table, real = token_rows(texts, tokenizer, length), None  # every position is text
    order = torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(seed))
    heldout = max(1, int(round(table.shape[0] * holdout))) if holdout else 0
    test_rows, train_rows = table[order[:heldout]], table[order[heldout:]]
    test_real, train_real = (None, None) if real is None else (real[order[:heldout]], real[order[heldout:]])
    target.eval()
    features = cached_features(target, train_rows, batch_size, feature_cache, on_progress)  # [N, T, H]
    if init is None:
        token_map, coverage = frequent_tokens(features, weight, vocab, eos, real=train_real)
        head = HiddenStateHead(head_config(target.config), token_map)
    else:
        head = init if isinstance(init, HiddenStateHead) else HiddenStateHead.load(init, target, "train_hidden_state_head")
        head = copy.deepcopy(head)  # the caller's head stays as it was
        coverage = map_coverage(features, weight, head.token_map, train_real)
    head = head.to(device=target.device, dtype=torch.float32)
    head.attach(weight.float())
    head.train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    spread = float(features.float().std())
    steps_per_epoch = math.ceil(train_rows.shape[0] / batch_size)
    total = steps_per_epoch * epochs
    losses: list[float] = []
    scheduler = _scheduler(optimizer, schedule, total)
    for step in range(total):
        pick = torch.randint(0, train_rows.shape[0], (min(batch_size, train_rows.shape[0]),))
        loss = _loss(head, embedding, train_rows[pick], features[pick], hidden_weight, noise * spread, unroll,
                     None if train_real is None else train_real[pick])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if on_progress is not None:
            on_progress("train", step + 1, total)
    head.eval()
    per_step = _heldout_top1(head, target, embedding, test_rows, batch_size, unroll, test_real) if heldout else ()
    top1 = per_step[0] if per_step else float("nan")
    head = head.to(dtype=target.dtype)
    head.attach(weight)
    path = None
    if out is not None:
        path = head.save(out, metadata={"heldout_top1": f"{top1:.4f}", "map_coverage": f"{coverage:.4f}",
                                        "unroll": str(unroll),
                                        "heldout_top1_per_step": " ".join(f"{t:.4f}" for t in per_step),
                                        "target": str(getattr(target.config, "_name_or_path", "") or "")})
    positions = train_rows.numel() if train_real is None else int(train_real.sum())  # padding is not trained on
    return HeadTrainingReport(head=head, tokens=positions, steps=total, losses=losses, heldout_top1=top1,
                              map_coverage=coverage, seconds=time.perf_counter() - started, path=path,
                              heldout_top1_per_step=tuple(per_step))


def unrolled_mask(length: int, step: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive attention mask ``[1, 1, length, (step + 1) * length]`` of unrolled step ``step``.

    Keys are laid out step by step (``length`` entries each). Query p of step s sees step 0's keys
    at positions <= p (the cache of real reads, as the draft finds it) and steps 1..s at p itself
    (the entries the draft's earlier tokens wrote).
    """
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    blocks = [key <= query] + [key == query] * step
    seen = torch.cat(blocks, dim=1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


def unrolled_predictions(head, embedding, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                         noise: float = 0.0, encoder_states: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's predicted hidden states for each unrolled step: ``steps`` tensors ``[B, L, H]``, with
    ``L = T - steps``. Step s at index j reads token j + 1 + s and predicts ``features[:, j + 1 + s]``.
    ``encoder_states`` ([B, S, D]): what a Whisper head's layer cross-attends to (the target's encoder output).
    """
    from transformers import DynamicCache, EncoderDecoderCache

    device = head.device
    tokens, features = tokens.to(device), features.to(device=device, dtype=head.dtype)
    length = tokens.shape[1] - steps
    before = features[:, :length]  # h_j
    if noise:
        before = before + noise * torch.randn_like(before)
    positions = torch.arange(length, device=device)[None, :].expand(tokens.shape[0], -1)
    cache = DynamicCache(config=head.config) if steps > 1 else None
    encoder = {}
    if encoder_states is not None:
        encoder["encoder_outputs"] = (encoder_states.to(device=device, dtype=head.dtype),)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache()) if steps > 1 else None
    predicted = []
    for step in range(steps):
        with torch.no_grad():  # the target's embedding is frozen: no gradient for its table
            embedded = embedding(tokens[:, 1 + step : 1 + step + length]).to(head.dtype)
        inputs = torch.cat([embedded, before], dim=-1)
        mask = unrolled_mask(length, step, head.dtype, device) if steps > 1 else None
        out = head(inputs_embeds=inputs, position_ids=positions + step, attention_mask=mask,
                   past_key_values=cache, use_cache=steps > 1, **encoder)
        before = out.hidden_states[-1]
        predicted.append(before)
    return predicted


def _loss(head, embedding, tokens, features, hidden_weight: float, noise: float, unroll: int = 1,
          real: torch.Tensor | None = None, encoder_states: torch.Tensor | None = None) -> torch.Tensor:
    """``real`` [B, T] bool: the positions that are text (None: all); padding is left out."""
    features = features.to(device=head.device, dtype=torch.float32)
    length = tokens.shape[1] - unroll
    total = weights = 0.0
    for step, predicted in enumerate(unrolled_predictions(head, embedding, tokens, features, unroll, noise,
                                                          encoder_states)):
        truth = features[:, 1 + step : 1 + step + length]
        scored = None if real is None else real[:, 1 + step : 1 + step + length].to(head.device).float()  # [B, L]
        with torch.no_grad():
            wanted = torch.softmax(head.readout(truth), dim=-1)  # the target's distribution on the map
        hidden_loss = torch.nn.functional.smooth_l1_loss(predicted, truth, reduction="none").mean(-1)  # [B, L]
        # KL rather than cross-entropy: the same gradients, and a loss that goes to 0 when the head
        # matches the target (cross-entropy stops at the entropy of the target's distribution).
        token_loss = (wanted * (torch.log(wanted.clamp(min=1e-12)) - torch.log_softmax(head.readout(predicted), dim=-1))).sum(-1)
        if scored is None:
            hidden_loss, token_loss = hidden_loss.mean(), token_loss.mean()
        else:
            count = scored.sum().clamp(min=1.0)
            hidden_loss, token_loss = (hidden_loss * scored).sum() / count, (token_loss * scored).sum() / count
        weight = 0.8 ** step
        total = total + weight * (hidden_weight * hidden_loss + token_loss)
        weights += weight
    return total / weights


@torch.no_grad()
def _heldout_top1(head, target, embedding, rows, batch_size, unroll: int = 1,
                  real: torch.Tensor | None = None) -> list[float]:
    """Per unrolled step, the share of held-out text positions (``real``; None: all) where the
    head's greedy token equals the target's greedy token."""
    right, seen = [0] * unroll, [0] * unroll
    lm_head = target.get_output_embeddings().weight.float()
    real = torch.ones_like(rows, dtype=torch.bool) if real is None else real
    for start in range(0, rows.shape[0], batch_size):
        batch = rows[start : start + batch_size]
        features = target_features(target, batch, batch_size).to(head.device, torch.float32)
        length = batch.shape[1] - unroll
        for step, predicted in enumerate(unrolled_predictions(head, embedding, batch, features, unroll)):
            guess = head.token_map[head.readout(predicted).argmax(-1)]
            truth = (features[:, 1 + step : 1 + step + length] @ lm_head.T).argmax(-1)
            scored = real[start : start + batch_size, 1 + step : 1 + step + length].to(guess.device)
            right[step] += int(((guess == truth) & scored).sum())
            seen[step] += int(scored.sum())
    return [r / max(n, 1) for r, n in zip(right, seen)]
