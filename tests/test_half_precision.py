"""Half precision (issue 17, item 1): the bundled pair in bfloat16 and float16, judged against the
target's own ``generate`` in the same dtype.

Exactness proper is the float64 tests' job. Here: plain target steps are ``generate``'s own
arithmetic bit for bit; a speculative row parts from ``generate`` only at a near-tie, one that the
dtype's rounding can reverse (``specdec.exactness``); and that check does catch a wrong acceptance.
"""

from __future__ import annotations

import functools
import json
import types

import attrs
import pytest
import torch

from specdec import SpeculativeDecoder, bundled_pair_path
from specdec.core.types import Verdict
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.exactness import Explainer, explain_divergence, first_divergence, spacing
from specdec.policies import ConstantLookahead
from specdec.verifiers import GreedyVerifier
from specdec.verifiers.greedy import greedy_verdict

from .tiny_whisper import features, tiny_whisper

PAIR = bundled_pair_path()
needs_pair = pytest.mark.skipif(not (PAIR / "target").exists(), reason="models/python-pair not built")


@functools.cache
def half_pair(dtype_name: str):
    """The bundled pair loaded in ``dtype_name``, its tokenizer and held-out prompts (once per dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target", padding_side="left", local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=dtype, local_files_only=True).eval()
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=dtype, local_files_only=True).eval()
    prompts = [json.loads(line)["prompt"] for line in (PAIR / "prompts.jsonl").read_text().splitlines()]
    return tokenizer, target, draft, prompts


def _batches(tokenizer, prompts, batch_size):
    for first in range(0, len(prompts), batch_size):
        yield tokenizer(prompts[first:first + batch_size], return_tensors="pt", padding=True)


def keep_every_draft(draft, scores) -> Verdict:
    """A broken greedy verdict: every draft kept, whatever the target says."""
    if draft.width == 0:
        return greedy_verdict(draft, scores)
    accepted = draft.lengths.clone()
    return Verdict(accepted=accepted, next_token=scores.argmax(-1).gather(1, accepted[:, None])[:, 0],
                   target_probs=torch.ones(accepted.shape))


@attrs.define(eq=False)
class AcceptEverything(GreedyVerifier):
    """A broken verifier: keeps every draft whatever the target says."""

    def verify(self, state, draft, scores):
        return keep_every_draft(draft, scores)


def _divergences(tokenizer, target, decoder, prompts, batch_size, max_new_tokens):
    """How many rows ``decoder`` decoded, and each row's first divergence from ``generate`` at
    ``batch_size``, explained (``explain_divergence``, with ``generate``'s own margin)."""
    found, rows, explain = [], 0, Explainer(target)
    eos = target.generation_config.eos_token_id
    for batch in _batches(tokenizer, prompts, batch_size):
        width = batch["input_ids"].shape[1]
        reference = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        ours = decoder.generate(**batch, max_new_tokens=max_new_tokens).sequences[:, width:].tolist()
        for r, (theirs, mine) in enumerate(zip(reference.sequences[:, width:].tolist(), ours)):
            rows += 1
            divergence = first_divergence(theirs, mine, eos)
            if divergence is None:
                continue
            at, their_token, our_token = divergence
            prompt = batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist()
            margin = float(reference.logits[at][r, their_token].float() - reference.logits[at][r, our_token].float())
            found.append(explain(prompt + theirs[:at], their_token, our_token, reference_margin=margin))
    return found, rows


@needs_pair
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_plain_steps_in_half_precision_are_generates_own_arithmetic(dtype, batch_size):
    """Without drafts (k = 0), every step is a one-token forward like ``generate``'s: the rows are
    identical bit for bit, near-ties included, at batch 1 and on a ragged batch."""
    tokenizer, target, _, prompts = half_pair(dtype)
    decoder = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=0))
    for batch in _batches(tokenizer, prompts[:8], batch_size):
        reference = target.generate(**batch, max_new_tokens=24, do_sample=False)
        out = decoder.generate(**batch, max_new_tokens=24)
        assert out.sequences.dtype == torch.long
        assert torch.equal(out.sequences, reference)
        assert out.stats.drafted == 0


@needs_pair
@pytest.mark.parametrize("dtype, batch_size", [("bfloat16", 1), ("bfloat16", 4), ("float16", 4)])
def test_speculative_rows_in_half_precision_part_only_at_near_ties(dtype, batch_size):
    """With drafts, the target reads (k + 1)-token blocks where ``generate`` reads one token: other
    matmul shapes, other roundings. A row may part from ``generate``'s, but only where the target's
    top two tokens are within that rounding (how many do is the CPU's and the kernels' business:
    ``benchmarks/half_precision.py`` reports the share)."""
    tokenizer, target, draft, prompts = half_pair(dtype)
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=5))
    count = 8 if batch_size == 1 else 16  # one at a time, 16 took half a minute of the suite
    found, rows = _divergences(tokenizer, target, decoder, prompts[:count], batch_size, max_new_tokens=48)
    assert rows == count
    for why in found:
        assert why.near_tie, why


@needs_pair
def test_a_wrong_acceptance_is_told_from_a_near_tie():
    """The check above can fail: a verifier that keeps every draft parts from ``generate`` at
    tokens the target ranks far below its own."""
    tokenizer, target, draft, prompts = half_pair("bfloat16")
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=5),
                                 verifier=AcceptEverything())
    found, _ = _divergences(tokenizer, target, decoder, prompts[:4], 4, max_new_tokens=32)
    assert found and not all(why.near_tie for why in found)
    assert any(why.reference_margin > 10 * (why.rounding + why.ulp) for why in found)


# --- the helpers themselves ---------------------------------------------------------------------


def test_first_divergence_reads_rows_up_to_their_end():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == (1, 6, 9)
    # What follows an end is padding; a row that ended parts where the other went on.
    assert first_divergence([5, 2, 0, 0], [5, 2, 3, 3], eos_token_id=2) is None
    assert first_divergence([5, 6, 2, 2], [5, 6, 7, 2], eos_token_id=2) == (2, 2, 7)
    # Whisper's generate drops its longest row's end: a row one token shorter ended there.
    assert first_divergence([5, 6], [5, 6, 7], eos_token_id=[2, 3]) == (2, 2, 7)
    assert first_divergence([5, 6, 3], [5, 6], eos_token_id=[2, 3]) is None


@pytest.mark.parametrize("dtype, value, expected", [
    (torch.bfloat16, 4.92, 2.0 ** -5), (torch.bfloat16, 10.04, 2.0 ** -4), (torch.float16, 1.0, 2.0 ** -10),
    (torch.float16, -0.3, 2.0 ** -12), (torch.float32, 6.5, 2.0 ** -21), (torch.bfloat16, 0.0, 2.0 ** -133),
])
def test_spacing_is_one_ulp_of_the_dtype(dtype, value, expected):
    assert spacing(dtype, value) == expected
    here = torch.tensor(abs(value), dtype=dtype)
    assert float(torch.nextafter(here, torch.tensor(1e4, dtype=dtype)) - here) == expected


def test_explain_divergence_reads_an_encoder_decoder_target_with_its_encoder_inputs():
    """Whisper's decoder is read on its prefix with the audio's features: a token far below the
    argmax is no near-tie, and in float32 the margin is float64's to rounding."""
    target = tiny_whisper().float()
    audio = features(1).float()
    prefix = [target.generation_config.decoder_start_token_id]
    with torch.no_grad():
        logits = target(input_features=audio, decoder_input_ids=torch.tensor([prefix])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    why = explain_divergence(target, prefix, best, worst, input_features=audio)
    assert not why.near_tie
    assert why.float64_agrees_with_reference
    assert why.reference_margin == pytest.approx(why.float64_margin, rel=1e-4)
    assert why.reference_margin == pytest.approx(float(logits[best] - logits[worst]), rel=1e-5)
    assert target.dtype == torch.float32  # the float64 copy is the function's own, not the caller's model


def test_spacing_refuses_a_dtype_without_one():
    with pytest.raises(ValueError, match="torch.int64 is not a floating-point dtype"):
        spacing(torch.int64, 3.0)


def test_an_explainer_reads_each_row_as_explain_divergence_does_with_one_float64_copy(monkeypatch):
    """Rows after the first reuse the float64 copy: one model's worth of memory, not one per row."""
    from specdec import exactness

    from .conftest import tiny_llama

    target = tiny_llama(0, vocab=32, dtype=torch.bfloat16)
    prefixes = [[3, 7, 9], [4, 4, 12, 30, 1]]
    expected = [explain_divergence(target, prefix, 5, 6) for prefix in prefixes]
    copies = []
    made = exactness.copy.deepcopy
    monkeypatch.setattr(exactness, "copy", types.SimpleNamespace(deepcopy=lambda model: copies.append(model) or made(model)))
    explain = Explainer(target)
    assert [explain(prefix, 5, 6) for prefix in prefixes] == expected
    assert copies == [target]
    assert target.dtype == torch.bfloat16


def test_a_lucky_read_of_the_two_logits_does_not_shrink_the_rounding(monkeypatch):
    """A lone read may round the two tokens' logits almost exactly while every neighbour moves by
    0.02: the rounding is judged from the neighbours too, so a 2-ulp margin there is a near-tie,
    and a token 2.5 logits down is still a wrong one."""
    from specdec import exactness

    from .conftest import tiny_llama

    exact = torch.linspace(-4.0, 7.0, 64, dtype=torch.float64)
    exact[10], exact[11], exact[12] = 7.5, 7.5 - 0.0625, 5.0
    own = exact + 0.02 * torch.tensor([(-1) ** i for i in range(64)], dtype=torch.float64)
    own[10:13] = exact[10:13]  # the lucky read: no error on the candidates
    target = tiny_llama(0, vocab=64, dtype=torch.bfloat16)
    monkeypatch.setattr(exactness, "_last_logits", lambda model, prefix, inputs: own if model is target else exact)
    why = exactness.Explainer(target)
    close = why([1, 2], 10, 11, reference_margin=0.0625)
    assert close.rounding == pytest.approx(0.04) and close.ulp == 0.03125
    assert close.near_tie
    assert not why([1, 2], 10, 12, reference_margin=2.5).near_tie
