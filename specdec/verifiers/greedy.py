"""``greedy``: keep drafts while they equal the target's argmax; append the target's own next token.

The output is the target's greedy output, token for token, whatever the drafter proposed.
"""

from __future__ import annotations

import attrs
import torch

from ..core.types import Draft, Verdict
from ..errors import ConfigError
from ..core.hookspecs import hookimpl
from ..core.components import Verifier


@attrs.define(eq=False)
class GreedyVerifier(Verifier):
    """Accept drafts while they equal the target's argmax: output identical to greedy decoding."""

    name = "greedy"
    argmax_only = True

    def check_generation_config(self, generation_config) -> None:
        if generation_config.do_sample:
            raise ConfigError(
                "verifier 'greedy' cannot sample (do_sample=True); use verifier 'rejection', "
                "or set do_sample=False / temperature = 0"
            )

    def verify(self, state, draft: Draft, scores: torch.Tensor) -> Verdict:
        return greedy_verdict(draft, scores)


def greedy_verdict(draft: Draft, scores: torch.Tensor) -> Verdict:
    """Keep the prefix of each row's draft that equals the target's argmax; append the argmax after it.

    Shared with ``rejection``, which decides exactly like this when it is not sampling.
    """
    width = draft.width
    if width == 0:  # a plain target step: the argmax, with no drafts to compare
        at_next = scores[:, 0]
        next_token = at_next.argmax(-1)
        target_probs = torch.softmax(at_next, dim=-1).gather(1, next_token[:, None])[:, 0]
        return Verdict(accepted=torch.zeros_like(next_token), next_token=next_token, target_probs=target_probs)
    target_tokens = scores.argmax(-1)  # [B, K + 1]
    agree = draft.tokens == target_tokens[:, :width]
    if not draft.full:
        agree &= draft.in_draft()
    accepted = agree.long().cumprod(1).sum(1)  # [B]: length of the agreeing prefix
    next_token = target_tokens.gather(1, accepted[:, None])[:, 0]  # [B]
    at_next = scores.gather(1, accepted[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0]  # [B, V]
    target_probs = torch.softmax(at_next, dim=-1).gather(1, next_token[:, None])[:, 0]
    return Verdict(accepted=accepted, next_token=next_token, target_probs=target_probs)


@hookimpl
def specdec_register(registry):
    registry.register_verifier("greedy", GreedyVerifier)
