"""``ngram``: prompt lookup. Match the row's last n tokens earlier in its own prompt and output,
and propose what followed the most recent match (n from ``max_ngram`` down to ``min_ngram``).

No model, no cache, no distribution (q is one-hot): it pays off on inputs that repeat themselves,
such as code edits, summaries that quote, and retrieval-augmented prompts.
"""

from __future__ import annotations

import attrs
import torch

from ..core.types import Draft
from ..core.deferred import no_grad
from ..core.hookspecs import hookimpl
from ..core.components import Drafter


def _positive(instance, attribute, value):
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _not_above_max(instance, attribute, value):
    if value > instance.max_ngram:
        raise ValueError(f"min_ngram ({value}) must not exceed max_ngram ({instance.max_ngram})")


@attrs.define(eq=False)
class NGramDrafter(Drafter):
    """Prompt-lookup drafter.

    ``max_ngram``: longest suffix to match. ``min_ngram``: shortest suffix worth matching.
    """

    name = "ngram"

    max_ngram: int = attrs.field(default=3, validator=[attrs.validators.instance_of(int), _positive])
    min_ngram: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int), _positive, _not_above_max])

    @no_grad
    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        # The lookup runs on the host copy of the committed tokens, as vLLM's n-gram proposer does:
        # it costs no device sync, and the draft is exactly as wide as the longest proposal, so the
        # target never verifies padding when nothing (or little) matched.
        rows_host = state.rows_host
        sequences = state.sequences_host[rows_host]  # [B, T]
        lengths = state.lengths_host[rows_host]  # [B]
        batch, total = sequences.shape
        positions = torch.arange(total)
        real = (positions[None, :] >= state.padding_host[rows_host][:, None]) & (positions[None, :] < lengths[:, None])
        found = torch.zeros(batch, dtype=torch.bool)
        follow = torch.zeros(batch, dtype=torch.long)  # where the proposal starts
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if total < n + 1:
                continue
            suffix_index = (lengths[:, None] - n + torch.arange(n)[None, :]).clamp(min=0)
            suffix = sequences.gather(1, suffix_index)  # [B, n]
            suffix_real = real.gather(1, suffix_index).all(1) & (lengths >= n)
            windows = sequences.unfold(1, n, 1)  # [B, S, n]: window s covers s .. s+n-1
            starts = positions[: windows.shape[1]]
            match = (windows == suffix[:, None, :]).all(-1) & real.unfold(1, n, 1).all(-1)  # [B, S]
            # Not the suffix itself: the match must be followed by at least one committed token.
            match &= starts[None, :] + n < lengths[:, None]
            match &= suffix_real[:, None]
            latest = torch.where(match, starts[None, :], -1).amax(1)  # [B], -1 if none
            hit = (latest >= 0) & ~found
            follow = torch.where(hit, latest + n, follow)
            found |= hit
        available = (lengths - follow).clamp(min=0)
        draft_lengths = torch.where(found, torch.minimum(max_tokens, available), 0)  # [B]
        width = int(draft_lengths.max())
        index = (follow[:, None] + torch.arange(width)[None, :]).clamp(max=total - 1)
        tokens = sequences.gather(1, index)  # [B, K]
        device = state.device
        return Draft(
            tokens=tokens.to(device, non_blocking=True),
            lengths=draft_lengths.to(device, non_blocking=True),
            token_probs=torch.ones(batch, width, dtype=torch.float32, device=device),
            lengths_host=draft_lengths,
        )


@hookimpl
def specdec_register(registry):
    registry.register_drafter("ngram", NGramDrafter)
