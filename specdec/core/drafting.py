"""A draft built one token per forward, shared by every drafter that drafts with a model, and the
``alternatives`` and ``matmul_precision`` options of those drafters."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .sampling import sample
from .types import Draft

# More first-position candidates than this are not worth a verify column each: on SmolLM2 and
# whisper-base the draft's 4th to 6th candidates add 3 points of coverage together
# (benchmarks/draft_alternatives.py).
MAX_ALTERNATIVES = 8
# A drafter's matmul_precision (core/packed_linear.py): "highest" its float32 as loaded, "medium"
# bfloat16 weights in every step's linear layers, "auto" bfloat16 for the weight shapes this machine
# runs faster so, "int8" int8 weights (a scale per output row) with the rows quantised per call.
MATMUL_PRECISIONS = ("highest", "medium", "auto", "int8")


def alternatives_option(instance, attribute, value) -> None:
    """attrs validator of a drafter's ``alternatives``: an integer from 0 to ``MAX_ALTERNATIVES``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ALTERNATIVES:
        raise ConfigError(f"drafter '{instance.name}': option 'alternatives' must be an integer from 0 to "
                          f"{MAX_ALTERNATIVES}, got {value!r}")


def matmul_precision_option(instance, attribute, value) -> None:
    """attrs validator of a drafter's ``matmul_precision``: one of ``MATMUL_PRECISIONS``."""
    if value not in MATMUL_PRECISIONS:
        raise ConfigError(f"drafter '{instance.name}': option 'matmul_precision' must be one of "
                          f"{', '.join(repr(choice) for choice in MATMUL_PRECISIONS)}, got {value!r}")


class TokenByToken:
    """Collects a draft token by token: processes each position's scores, picks the token (argmax,
    or a sample when sampling), keeps the draft's probabilities q, counts each row's length and says
    when to stop (every row at its budget, or the policy's ``keep_drafting`` says no row goes on).
    A drafter calls its model, then ``add`` with the position's raw scores, then ``more``.

    A row the policy stops is masked on the device (its length stops growing; the tokens drafted
    for it afterwards are padding nobody reads). Whether the loop also ends as soon as no row goes
    on is ``state.draft_early_exit``: that needs the device's answer on the host, one sync per
    draft position, which is free on a CPU and stalls a GPU's queue (``SpeculativeDecoder``'s
    ``draft_early_exit`` chooses; docs/design.md, "Host syncs", has the measurement).
    """

    def __init__(self, state, max_tokens: torch.Tensor, keep_drafting=None, alternatives: int = 0,
                 reduced: bool = False, token_map=None):  # max_tokens [B] CPU
        self.state = state
        # Other candidates for the first position (Draft.alternatives): greedy only, where the loop
        # verifies them; sampling draws one token per position.
        self.alternatives_wanted = 0 if state.do_sample else alternatives
        self.alternatives: torch.Tensor | None = None  # [B, A]
        self.keep_drafting = keep_drafting
        self.max_tokens_host = max_tokens
        self.width = max(max_tokens.tolist())
        device, batch = state.device, state.active
        self.limit = max_tokens.to(device, non_blocking=True)  # [B]
        self.drafted = 0
        # With no policy judging each position, and no row that can run out of tokens to draft (a
        # reduced-vocabulary draft whose processors allow only tokens outside its map: Whisper's
        # timestamp grammar forcing a timestamp), every row drafts its budget: a position is its
        # processors, its q when sampling and its token, and the tokens, q and the lengths are put
        # together once in ``draft``. On a CPU the per-position masks and copies cost 5-10 us a
        # tensor op, 10% of a small draft model's step (docs/benchmarks.md, stops 15 and 31).
        listening = keep_drafting is not None and getattr(keep_drafting, "listening", True)
        # A greedy draft over a reduced vocabulary (``token_map``, core/reduced_vocab.py) whose
        # processors only suppress tokens, and then apply Whisper's timestamp grammar where the map
        # holds every timestamp, picks its token among its own V' scores: ``add`` takes them as the
        # head gave them, never the whole vocabulary's (``reads_reduced``). On whisper-base a draft
        # position cost 0.30 ms over the 51,865 tokens (docs/benchmarks.md, stop 60), 0.62 ms with
        # the timestamp grammar (stop 64).
        self._in_map = None
        if token_map is not None and not listening and not state.do_sample:
            self._in_map = state.suppression_in(token_map)
            if self._in_map is not None:
                self._lengths_host = state.lengths_host[state.rows_host]  # committed, for the at-begin ones
                # Whisper's timestamp grammar reads each row's tokens so far: its committed ones, by length
                self._groups = state._length_groups() if self._in_map[3] is not None else ()
        self._lean = not (listening or reduced and state.processors) or self._in_map is not None
        if self._lean:
            self._tokens: list[torch.Tensor] = []  # [B] per position
            self._scores: list[torch.Tensor] = []  # [B, V] per position: q when sampling, else the scores ([B, V'] in the map)
            self._picks: list[torch.Tensor] = []  # [B] per position: the token's index in the map
            return
        self.tokens = torch.zeros(batch, self.width, dtype=torch.long, device=device)  # [B, K]
        self.token_probs = torch.zeros(batch, self.width, dtype=torch.float32, device=device)  # [B, K]
        self.probs: torch.Tensor | None = None  # [B, K, V] when sampling
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.drafting = self.limit > 0  # [B]

    @property
    def so_far(self) -> torch.Tensor:
        """[B, j] the tokens drafted before the next one (what processors see after the committed ones)."""
        if self._lean:
            return torch.stack(self._tokens, dim=1) if self._tokens else self.limit.new_zeros(self.limit.shape[0], 0)
        return self.tokens[:, : self.drafted]

    @property
    def reads_reduced(self) -> bool:
        """Whether ``add`` takes the reduced head's scores ([B, V']) as they are."""
        return self._in_map is not None

    def _add_in_map(self, scores: torch.Tensor) -> torch.Tensor:  # [B, V'] fp32 -> token [B] (full ids)
        j = self.drafted
        ids, always, at_begin, grammar = self._in_map
        scores = scores.masked_fill(always, float("-inf"))
        for processor, mask in at_begin:  # a row's position is at the begin index once, at most
            rows = self._lengths_host + j == processor.begin_index
            if bool(rows.any()):
                scores = torch.where(rows.to(scores.device)[:, None] & mask, float("-inf"), scores)
        if grammar is not None:  # over the map's tokens, fed the tokens so far as map places
            processor, place = grammar
            so_far = self.so_far
            for prefix, group, _ in self._groups:
                scores[group] = processor(place[torch.cat([prefix, so_far[group]], dim=1)], scores[group])
        if j == 0 and self.alternatives_wanted:
            top = scores.topk(min(self.alternatives_wanted + 1, scores.shape[-1]), dim=-1)
            possible = (top.values[:, 1:] > float("-inf")) & (self.limit > 0)[:, None]
            self.alternatives = torch.where(possible, ids[top.indices[:, 1:]], -1)  # [B, A]
        pick = scores.argmax(-1)
        token = ids[pick]
        self._tokens.append(token)
        self._scores.append(scores)
        self._picks.append(pick)
        self.drafted = j + 1
        return token

    def add(self, scores: torch.Tensor) -> torch.Tensor:  # scores [B, V] fp32, raw -> token [B]
        if self._in_map is not None:
            return self._add_in_map(scores)
        j, state = self.drafted, self.state
        if state.processors:
            scores = state.process(scores[:, None], lambda: self.so_far)[:, 0]
        if j == 0 and self.alternatives_wanted:
            top = scores.topk(self.alternatives_wanted + 1, dim=-1)  # the first is the draft itself
            possible = (top.values[:, 1:] > float("-inf")) & (self.limit > 0)[:, None]
            self.alternatives = torch.where(possible, top.indices[:, 1:], -1)  # [B, A]
        if self._lean:
            if state.do_sample:
                # q (the target's warpers applied to the draft's scores) is exactly what the token is
                # drawn from and what the rejection verifier divides by.
                scores = torch.softmax(scores, dim=-1)
                token = sample(scores, state.generator)
            else:
                token = scores.argmax(-1)
            self._tokens.append(token)
            self._scores.append(scores)
            self.drafted = j + 1
            return token
        # A row whose scores are all -inf has nothing to draft. It stops here; scoring it as uniform
        # keeps q finite for the tokens nobody reads.
        possible = scores.amax(-1) > float("-inf")  # [B]
        scores = torch.where(possible[:, None], scores, 0.0)
        self.drafting = self.drafting & possible
        q = torch.softmax(scores, dim=-1)  # [B, V] fp32
        if state.do_sample:
            token = sample(q, state.generator)
            if self.probs is None:
                self.probs = torch.zeros(*self.tokens.shape, q.shape[-1], dtype=torch.float32, device=q.device)
            self.probs[:, j] = q
        else:
            token = scores.argmax(-1)
        self.tokens[:, j] = token
        self.token_probs[:, j] = q.gather(1, token[:, None])[:, 0]
        self.lengths += self.drafting
        self.drafted = j + 1
        self._q = q
        return token

    def more(self) -> bool:
        """Whether to draft another token: some row is under its budget and the policy lets it go on."""
        if self.drafted == self.width:
            return False
        if self._lean:
            return True
        self.drafting = self.drafting & (self.limit > self.drafted)
        if self.keep_drafting is None:
            return True
        j = self.drafted - 1
        keep = self.keep_drafting(j, self.tokens[:, j], self.token_probs[:, j], self._q)
        if keep is not None:
            self.drafting = self.drafting & keep
            if self.state.draft_early_exit and not bool(self.drafting.any()):  # a sync; the CPU's default
                return False
        return True

    def draft(self) -> Draft:
        drafted = self.drafted
        if self._lean:
            if not drafted:
                return Draft.empty(self.limit.shape[0], self.limit.device)
            tokens = torch.stack(self._tokens, dim=1)  # [B, K]
            stacked = torch.stack(self._scores, dim=1)  # [B, K, V] fp32 ([B, K, V'] in the map)
            q = stacked if self.state.do_sample else torch.softmax(stacked, dim=-1)
            picks = torch.stack(self._picks, dim=1) if self._picks else tokens  # where in q each token is
            # Every row drafted its budget: the draft's width is the largest, the lengths are known here.
            whole = drafted == self.width
            return Draft(tokens=tokens, lengths=self.limit if whole else self.limit.clamp(max=drafted),
                         token_probs=q.gather(2, picks[..., None])[..., 0],
                         probs=q if self.state.do_sample else None,
                         lengths_host=self.max_tokens_host if whole else self.max_tokens_host.clamp(max=drafted),
                         alternatives=self.alternatives)
        return Draft(tokens=self.tokens[:, :drafted], lengths=self.lengths, token_probs=self.token_probs[:, :drafted],
                     probs=None if self.probs is None else self.probs[:, :drafted],
                     alternatives=self.alternatives if drafted else None)
