"""``TokenByToken``'s two paths: the lean one (greedy, no processors, no policy judging each position)
drafts exactly what the per-position one drafts, with the same lengths and probabilities."""

from __future__ import annotations

import torch

from specdec import SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.policies import ConstantLookahead

from .conftest import Recorder, left_padded, perturbed_copy, tiny_llama

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]


class EveryRowGoesOn(ConstantLookahead):
    """Constant k, but answering ``continue_drafting`` (always yes): the drafter must ask at every position."""

    name = "every-row-goes-on"

    def continue_drafting(self, state, position, tokens, token_probs, probs):
        return torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)


def _run(target, draft_model, policy, prompts, new_tokens):
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=policy, observers=[recorder])
    listening = []
    propose = decoder.drafter.propose

    def watch(state, max_tokens, keep_drafting):
        listening.append(keep_drafting.listening)
        return propose(state, max_tokens, keep_drafting)

    decoder.drafter.propose = watch
    input_ids, mask = left_padded(prompts)
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out.sequences, expected)
    return recorder.steps, set(listening)


def test_the_lean_draft_equals_the_one_asked_at_every_position():
    """Left-padded rows that finish at different times (so budgets differ per row near the end)."""
    target = tiny_llama(20, vocab=32, layers=2, dtype=torch.float64, init=0.3)
    draft_model = perturbed_copy(target, 0.1)
    lean, lean_listening = _run(target, draft_model, ConstantLookahead(k=4), PROMPTS, 13)
    asked, asked_listening = _run(target, draft_model, EveryRowGoesOn(k=4), PROMPTS, 13)
    assert lean_listening == {False} and asked_listening == {True}
    assert len(lean) == len(asked)
    short_rows = 0
    for a, b in zip(lean, asked):
        assert torch.equal(a.draft.tokens[a.draft.in_draft()], b.draft.tokens[b.draft.in_draft()])
        assert torch.equal(a.draft.lengths, b.draft.lengths)
        if a.draft.width == 0:  # a plain target step (the last token of every row)
            continue
        in_draft = a.draft.in_draft()
        torch.testing.assert_close(a.draft.token_probs[in_draft], b.draft.token_probs[in_draft], rtol=1e-6, atol=0)
        short_rows += int((a.draft.lengths < a.draft.width).sum())
    assert short_rows > 0  # rows near their budget drafted less than the batch's width
    assert any(bool((a.draft.token_probs[a.draft.in_draft()] < 0.999).any()) for a in lean)  # not all certain
