"""``rejection``: speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

Row b's draft token x at position j, drawn from the draft's q, is kept with probability
min(1, p(x) / q(x)), where p is the target's distribution there (after the same temperature /
top-k / top-p warpers). At the first rejected position the target appends a token drawn from the
residual norm(max(0, p - q)); when every draft was kept it appends a bonus token drawn from p. Each
committed token is then distributed exactly as if the target had sampled it alone.

A drafter without distributions (``ngram``) proposes deterministically: q is one-hot on its
token, so the token is kept with probability p(x) and the residual is p with x removed.

Without sampling (``do_sample=False``) this verifier decides exactly like ``greedy``, so one
plugins.toml serves both.
"""

from __future__ import annotations

import attrs
import torch

from ..core.sampling import sample
from ..core.types import Draft, Verdict
from ..core.hookspecs import hookimpl
from ..core.components import Verifier
from .greedy import greedy_verdict


@attrs.define(eq=False)
class RejectionVerifier(Verifier):
    """Speculative sampling: output distributed exactly as the target's own sampling (greedy when not sampling)."""

    name = "rejection"

    def check_generation_config(self, generation_config) -> None:
        """Both greedy decoding and sampling are fine."""

    def verify(self, state, draft: Draft, scores: torch.Tensor) -> Verdict:
        if not state.do_sample:
            return greedy_verdict(draft, scores)
        generator = state.generator
        batch, width = draft.tokens.shape
        if not width:  # a plain step: a draw from the target's own distribution, nothing to accept
            p_next = torch.softmax(scores[:, 0].float(), dim=-1)  # [B, V] fp32
            next_token = sample(p_next, generator)
            return Verdict(accepted=torch.zeros_like(next_token), next_token=next_token,
                           target_probs=p_next.gather(1, next_token[:, None])[:, 0])
        vocab = scores.shape[-1]
        p = torch.softmax(scores.float(), dim=-1)  # [B, K + 1, V] fp32
        in_draft = None if draft.full else draft.in_draft()  # [B, K]; None: no padding
        tokens = draft.tokens if in_draft is None else draft.tokens.masked_fill(~in_draft, 0)  # padding is never read
        p_token = p[:, :width].gather(2, tokens[..., None])[..., 0]  # [B, K]
        if draft.probs is None:
            q_token = torch.ones_like(p_token)  # one-hot q
        else:
            q_token = draft.probs.float().gather(2, tokens[..., None])[..., 0]  # [B, K]

        # Keep with probability min(1, p / q): u < p / q, without dividing (q > 0 for a drawn token).
        u = torch.rand(batch, width, generator=generator, device=scores.device)  # [B, K]
        keep = u * q_token < p_token
        if in_draft is not None:
            keep &= in_draft
        accepted = keep.long().cumprod(1).sum(1)  # [B]: drafts kept before the first rejection

        p_next = p.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]  # [B, V]
        at = accepted.clamp(max=width - 1)  # [B]; only read where a draft was rejected
        if draft.probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, tokens.gather(1, at[:, None]), 1.0)  # [B, V]
        else:
            q_next = draft.probs.float().gather(1, at[:, None, None].expand(-1, 1, vocab))[:, 0]  # [B, V]
        rejected = accepted < draft.lengths  # [B]
        dist = torch.where(rejected[:, None], self.residual(p_next, q_next), p_next)  # [B, V]
        next_token = sample(dist, generator)  # [B]
        target_probs = p_next.gather(1, next_token[:, None])[:, 0]  # [B]
        return Verdict(accepted=accepted, next_token=next_token, target_probs=target_probs)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)) per row ([B, V] fp32), the distribution of the token after a rejection."""
        excess = (p - q).clamp(min=0)  # [B, V]
        total = excess.sum(-1, keepdim=True)  # [B, 1]
        # A rejection means q(x) > p(x) for the drafted x, so p > q somewhere else; only rounding
        # (p and q equal to float precision) leaves nothing, and then p itself is the answer.
        return torch.where(total > 0, excess / total.clamp(min=torch.finfo(p.dtype).tiny), p)


@hookimpl
def specdec_register(registry):
    registry.register_verifier("rejection", RejectionVerifier)
