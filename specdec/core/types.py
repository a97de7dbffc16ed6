"""The data the loop hands between its phases and to plugins."""

from __future__ import annotations

import attrs
import torch


def token_id_list(value) -> list[int]:
    """A generation config's token id setting (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token) for token in value]


@attrs.frozen
class Draft:
    """What a drafter proposes for the active rows of one iteration.

    ``tokens[b, :lengths[b]]`` are row b's drafts; columns past its length are padding that nobody
    reads. ``probs`` are the draft's distributions q over the vocabulary (fp32) when it has them
    (a model does; an n-gram lookup does not, and its q is one-hot); rejection sampling needs them.
    ``token_probs[b, j]`` is q of the drafted token itself, for confidence-driven policies.
    ``lengths_host``, when the drafter computed the lengths on the CPU (prompt lookup does), is the
    same numbers there, so a drafter composing others routes rows without a device sync.
    ``alternatives`` ``[B, A]``, when the drafter has them, are other candidates for the FIRST draft
    position (-1: none): under greedy decoding the loop verifies them in the same target forward,
    each seeing only the committed tokens (a token tree of one level), and where the first draft is
    rejected but an alternative is the target's token, commits it and the target's token after it.
    """

    tokens: torch.Tensor  # [B, K] long
    lengths: torch.Tensor  # [B] long, 0 <= lengths <= K
    probs: torch.Tensor | None = None  # [B, K, V] float32
    token_probs: torch.Tensor | None = None  # [B, K] float32
    lengths_host: torch.Tensor | None = None  # [B] long, CPU
    alternatives: torch.Tensor | None = None  # [B, A] long, -1 where none
    # ``in_draft``'s answer, computed once: the loop, ``with_padding`` and the verifiers all ask, and on
    # a CPU each tensor op costs 5-10 us. Not an init argument, so ``attrs.evolve`` starts without it.
    _in_draft: torch.Tensor | None = attrs.field(init=False, default=None, eq=False, repr=False)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def full(self) -> bool:
        """Whether every row drafted all ``width`` columns, known on the host (``lengths_host``): no
        padding, so ``in_draft`` is all true and nobody needs to compute it."""
        return self.lengths_host is not None and bool(self.width) and min(self.lengths_host.tolist()) == self.width

    def in_draft(self) -> torch.Tensor:
        """[B, K] bool: which columns are drafts (the rest is padding)."""
        if self._in_draft is None:
            mask = torch.arange(self.width, device=self.tokens.device)[None, :] < self.lengths[:, None]
            object.__setattr__(self, "_in_draft", mask)
        return self._in_draft

    def with_padding(self, token: int) -> Draft:
        """The same draft with ``token`` in its padding columns, whatever the drafter left there (models
        and processors read every column, so an id such as -1 must not reach them)."""
        if self.full:
            return self
        in_draft = self.in_draft()
        padded = attrs.evolve(self, tokens=self.tokens.masked_fill(~in_draft, token))
        object.__setattr__(padded, "_in_draft", in_draft)  # the same lengths and width
        return padded

    def padded_to(self, width: int) -> Draft:
        """The same draft ``width`` columns wide (static shapes: a verify block of a fixed width);
        the new columns are padding (``token``-free: zeros, q = 0), outside every row's length."""
        extra = width - self.width
        if extra <= 0:
            return self

        def wider(tensor):
            return None if tensor is None else torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra, *tensor.shape[2:])], 1)

        return attrs.evolve(self, tokens=wider(self.tokens), probs=wider(self.probs), token_probs=wider(self.token_probs))

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> Draft:
        """No drafts at all: the iteration is a plain target step for every row."""
        return cls(
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )


@attrs.frozen
class Verdict:
    """The verifier's answer per row: how many drafts it keeps and the one token it appends after them.

    ``next_token`` is the correction at the first rejected position, or the bonus token when every
    draft was accepted. ``target_probs`` is the target's probability of ``next_token`` (fp32), which
    target-confidence policies read at the next lookahead.
    """

    accepted: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long
    target_probs: torch.Tensor | None = None  # [B] float32


@attrs.frozen
class Step:
    """One finished iteration, as observers and policies see it.

    The ``*_host`` fields are CPU tensors from the iteration's single device sync, so observers can
    count without forcing another one. ``rows_host`` are the original batch indices of the rows that
    took part, in the order of every other per-row field.
    """

    iteration: int
    rows_host: torch.Tensor  # [B] long, original row ids
    draft: Draft
    verdict: Verdict
    drafted_host: torch.Tensor  # [B] long
    accepted_host: torch.Tensor  # [B] long: drafts kept (a first-position alternative taken: 0, and 2 appended)
    appended_host: torch.Tensor  # [B] long, tokens committed this step (after eos / length cuts)
    finished_host: torch.Tensor  # [B] bool
    appended_tokens: torch.Tensor  # [B, K + 1] long; row b's first appended_host[b] are real
    target_probs_host: torch.Tensor | None = None  # [B] float32: verdict.target_probs, None if unset
    # For a drafter with ``wants_hidden_states``: the target's last hidden state at every position it
    # read this iteration ([B, M, H], device) and that position in the row's buffer ([B, M] long),
    # -1 where the column was a hole or a rejected draft. Every committed token the target has read
    # appears exactly once over the iterations.
    hidden_states: torch.Tensor | None = None
    hidden_positions: torch.Tensor | None = None
    # Columns of first-position alternatives the verify read (``Draft.alternatives``; 0: it read none,
    # also where the draft had some and ``DecodeState.verify_alternatives`` said no).
    siblings: int = 0


@attrs.define
class DecodeStats:
    """Counts over one ``generate`` call.

    ``mean_accepted_length`` is the tokens a row gains per verification step (accepted drafts plus
    the one token the target always adds), the figure speculative-decoding papers call tau.
    """

    rows: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    iterations: int = 0
    row_steps: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    # First-position alternatives (``Draft.alternatives``): verifies that read them, and rows that
    # committed one (and the target's token after it) where the first draft was rejected.
    alternatives_read: int = 0
    alternatives_taken: int = 0
    wall_time_s: float = 0.0

    def __add__(self, other: DecodeStats) -> DecodeStats:
        """The counts of two calls together (a transcription's windows, a benchmark's batches)."""
        if not isinstance(other, DecodeStats):
            return NotImplemented
        return DecodeStats(**{field.name: getattr(self, field.name) + getattr(other, field.name)
                              for field in attrs.fields(DecodeStats)})

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def as_dict(self) -> dict:
        out = attrs.asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_second=self.tokens_per_second,
        )
        return out


@attrs.frozen
class DecodeOutput:
    """What ``SpeculativeDecoder.generate`` returns: ``sequences`` as ``model.generate`` would, plus stats."""

    sequences: torch.Tensor  # [B, prompt + new] long
    stats: DecodeStats
