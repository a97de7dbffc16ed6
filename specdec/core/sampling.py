"""Drawing tokens from distributions without a host sync.

``torch.multinomial`` checks its input with an ``.item()`` (a device sync on every call), so the
drafter and the rejection verifier sample with the exponential race instead: with E_i ~ Exp(1)
independent, ``argmax_i p_i / E_i`` is token i with probability ``p_i / sum(p)``. Zero-probability
tokens are never drawn; the rows need not be normalised. ``generator`` must live on the device of
``probs`` (as for any torch sampling op).
"""

from __future__ import annotations

import torch


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ([..., V], non-negative, each row with a positive sum) -> [...] long."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)  # [..., V]
    race.clamp_(min=torch.finfo(torch.float32).tiny)  # a zero draw would turn 0 / 0 into a NaN winner
    return (probs.float() / race).argmax(-1)
