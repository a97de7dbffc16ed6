"""``TokenByToken``'s two paths: the lean one (no policy judging each position) drafts exactly what
the per-position one drafts, with the same lengths and probabilities, greedy or sampled, with logits
processors or without; and what a ``Draft`` knows on the host (``full``) and keeps (``in_draft``)."""

from __future__ import annotations

import torch

import attrs
import pytest

from specdec import SpeculativeDecoder
from specdec.core.types import Draft
from specdec.drafters import ModelDrafter
from specdec.policies import ConstantLookahead
from specdec.verifiers import RejectionVerifier

from .conftest import Recorder, left_padded, perturbed_copy, tiny_llama

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]


class EveryRowGoesOn(ConstantLookahead):
    """Constant k, but answering ``continue_drafting`` (always yes): the drafter must ask at every position."""

    name = "every-row-goes-on"

    def continue_drafting(self, state, position, tokens, token_probs, probs):
        return torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)


def _run(target, draft_model, policy, prompts, new_tokens, **options):
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=policy, observers=[recorder],
                                 verifier=RejectionVerifier())
    listening = []
    propose = decoder.drafter.propose

    def watch(state, max_tokens, keep_drafting):
        listening.append(keep_drafting.listening)
        return propose(state, max_tokens, keep_drafting)

    decoder.drafter.propose = watch
    input_ids, mask = left_padded(prompts)
    sampled = options.get("do_sample", False)
    if sampled:
        options["generator"] = torch.Generator().manual_seed(7)
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, **{"do_sample": False, **options})
    if not sampled:
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, **{"do_sample": False, **options})
        assert torch.equal(out.sequences, expected)
    return recorder.steps, set(listening), out.sequences


def test_the_lean_draft_equals_the_one_asked_at_every_position():
    """Left-padded rows that finish at different times (so budgets differ per row near the end)."""
    target = tiny_llama(20, vocab=32, layers=2, dtype=torch.float64, init=0.3)
    draft_model = perturbed_copy(target, 0.1)
    lean, lean_listening, _ = _run(target, draft_model, ConstantLookahead(k=4), PROMPTS, 13)
    asked, asked_listening, _ = _run(target, draft_model, EveryRowGoesOn(k=4), PROMPTS, 13)
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


@pytest.mark.parametrize("options", [
    dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=20),
    dict(do_sample=False, repetition_penalty=1.5),  # a processor that reads the tokens drafted so far
], ids=["sampled", "greedy-processors"])
def test_the_lean_path_with_processors_and_sampling_drafts_what_the_asked_one_does(options):
    """The same draws in the same order: the same drafts, q, lengths (also on the host) and output."""
    target = tiny_llama(20, vocab=32, layers=2, dtype=torch.float64, init=0.3)
    draft_model = perturbed_copy(target, 0.1)
    lean, lean_listening, lean_out = _run(target, draft_model, ConstantLookahead(k=4), PROMPTS, 13, **options)
    asked, asked_listening, asked_out = _run(target, draft_model, EveryRowGoesOn(k=4), PROMPTS, 13, **options)
    assert lean_listening == {False} and asked_listening == {True}
    assert torch.equal(lean_out, asked_out)
    assert len(lean) == len(asked)
    drafted = 0
    for a, b in zip(lean, asked):
        assert torch.equal(a.draft.lengths, b.draft.lengths)
        if a.draft.width == 0:
            continue
        assert a.draft.lengths_host is not None and torch.equal(a.draft.lengths_host, a.draft.lengths)
        in_draft = a.draft.in_draft()
        assert torch.equal(a.draft.tokens[in_draft], b.draft.tokens[in_draft])
        torch.testing.assert_close(a.draft.token_probs[in_draft], b.draft.token_probs[in_draft], rtol=1e-6, atol=0)
        if options["do_sample"]:
            torch.testing.assert_close(a.draft.probs[in_draft], b.draft.probs[in_draft], rtol=1e-6, atol=0)
        drafted += int(in_draft.sum())
    assert drafted > 0


class TestDraftHostKnowledge:
    def test_full_only_when_every_row_drafted_every_column_known_on_the_host(self):
        tokens = torch.zeros(2, 3, dtype=torch.long)
        assert Draft(tokens=tokens, lengths=torch.tensor([3, 3]), lengths_host=torch.tensor([3, 3])).full
        assert not Draft(tokens=tokens, lengths=torch.tensor([3, 2]), lengths_host=torch.tensor([3, 2])).full
        assert not Draft(tokens=tokens, lengths=torch.tensor([3, 3])).full  # not known on the host
        assert not Draft.empty(2, torch.device("cpu")).full

    def test_a_full_draft_needs_no_padding(self):
        draft = Draft(tokens=torch.tensor([[5, 6]]), lengths=torch.tensor([2]), lengths_host=torch.tensor([2]))
        assert draft.with_padding(0) is draft

    def test_in_draft_is_kept_through_padding_and_recomputed_for_new_lengths(self):
        draft = Draft(tokens=torch.tensor([[5, -1, -1], [5, 6, 7]]), lengths=torch.tensor([1, 3]))
        padded = draft.with_padding(0)
        assert padded.tokens.tolist() == [[5, 0, 0], [5, 6, 7]]
        assert padded.in_draft() is draft.in_draft()
        shorter = attrs.evolve(padded, lengths=torch.tensor([0, 2]))
        assert shorter.in_draft().tolist() == [[False, False, False], [True, True, False]]
        assert shorter.with_padding(9).tokens.tolist() == [[9, 9, 9], [5, 6, 9]]
