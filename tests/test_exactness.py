"""Greedy speculative output equals ``target.generate(do_sample=False)``, token for token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor

from specdec import Draft, SpeculativeDecoder
from specdec.drafters import Drafter, ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead, HeuristicLookahead

from .conftest import greedy_reference, left_padded_prompts, tiny_model

PROMPT_LENGTHS = [9, 3, 14, 1, 6, 11, 2, 8]


class NonsenseDrafter(Drafter):
    """Proposes random tokens: the target must reject them and still produce its own output."""

    name = "nonsense"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, state, max_tokens, keep_drafting):
        width = int(max_tokens.max())
        tokens = torch.randint(0, self.vocab, (state.active, width), generator=self.generator)
        return Draft(tokens=tokens, lengths=max_tokens.clone())


class BanRepeat(LogitsProcessor):
    """Forbids each row's previous token: a processor whose answer depends on the row's history."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


def make_drafter(kind: str, arch: str):
    if kind == "model":
        return ModelDrafter(tiny_model(arch, layers=1, seed=1))
    if kind == "same":
        return ModelDrafter(tiny_model(arch))
    if kind == "ngram":
        return NGramDrafter(max_ngram=3)
    if kind == "nonsense":
        return NonsenseDrafter(tiny_model(arch).config.vocab_size)
    raise ValueError(kind)


def make_policy(kind: str):
    return HeuristicLookahead() if kind == "heuristic" else ConstantLookahead(k=int(kind))


def generated_count(new_tokens: torch.Tensor, eos: int) -> int:
    """Tokens the rows really generated: up to and including each row's first eos."""
    total = 0
    for row in new_tokens.tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


def eos_mid_row(target, input_ids, mask, max_new_tokens):
    """An eos id that the target emits part-way through row 0, so rows end at different times."""
    free = greedy_reference(target, input_ids, mask, max_new_tokens, eos_token_id=None)
    return int(free[0, input_ids.shape[1] + max_new_tokens // 3])


class TestGreedyExactness:
    """Every drafter and policy, two architectures, batch 1 to 8 with left padding."""

    @pytest.mark.parametrize("arch", ["llama", "gpt2"])
    @pytest.mark.parametrize("drafter", ["model", "same", "ngram", "nonsense"])
    @pytest.mark.parametrize("policy", ["1", "3", "8", "heuristic"])
    @pytest.mark.parametrize("batch", [1, 3, 8])
    def test_matches_target_generate(self, arch, drafter, policy, batch):
        target = tiny_model(arch)
        input_ids, mask = left_padded_prompts(PROMPT_LENGTHS[:batch], seed=batch)
        max_new = 24
        eos = eos_mid_row(target, input_ids, mask, max_new)
        expected = greedy_reference(target, input_ids, mask, max_new, eos_token_id=eos)
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter(drafter, arch), policy=make_policy(policy))
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
        assert out.sequences.shape == expected.shape
        assert torch.equal(out.sequences, expected)
        assert out.stats.new_tokens == generated_count(expected[:, input_ids.shape[1] :], eos)
        assert out.stats.target_calls <= out.stats.new_tokens

    def test_eos_really_ends_a_row_early(self, llama):
        """The fixture above must exercise ragged finishing, or it proves less than it claims."""
        input_ids, mask = left_padded_prompts(PROMPT_LENGTHS[:3], seed=3)
        eos = eos_mid_row(llama, input_ids, mask, 24)
        out = SpeculativeDecoder(target=llama, drafter=NGramDrafter()).generate(
            input_ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos
        )
        row0 = out.sequences[0, input_ids.shape[1] :].tolist()
        assert eos in row0 and row0.index(eos) < 23

    @pytest.mark.parametrize("arch", ["llama", "gpt2"])
    def test_draft_equal_to_target_accepts_everything(self, arch):
        target = tiny_model(arch)
        input_ids, mask = left_padded_prompts([7, 4, 10], seed=5)
        out = SpeculativeDecoder(target=target, drafter=ModelDrafter(target), policy=ConstantLookahead(k=4)).generate(
            input_ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None
        )
        assert torch.equal(out.sequences, greedy_reference(target, input_ids, mask, 20, eos_token_id=None))
        assert out.stats.acceptance_rate == 1.0
        # k=4 accepted plus one bonus token per verify: 20 tokens in 4 target calls.
        assert out.stats.target_calls == 4
        assert out.stats.mean_accepted_length == 5.0

    def test_nonsense_drafter_accepts_little_but_stays_exact(self, llama):
        input_ids, mask = left_padded_prompts([5, 8], seed=7)
        out = SpeculativeDecoder(target=llama, drafter=NonsenseDrafter(llama.config.vocab_size)).generate(
            input_ids, attention_mask=mask, max_new_tokens=16
        )
        assert torch.equal(out.sequences, greedy_reference(llama, input_ids, mask, 16))
        assert out.stats.acceptance_rate < 0.2

    def test_plain_target_steps_when_lookahead_is_zero(self, llama, llama_draft):
        input_ids, mask = left_padded_prompts([5, 8], seed=9)
        out = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft), policy=ConstantLookahead(k=0)).generate(
            input_ids, attention_mask=mask, max_new_tokens=10
        )
        assert torch.equal(out.sequences, greedy_reference(llama, input_ids, mask, 10))
        assert out.stats.drafted == 0 and out.stats.draft_calls == 0

    def test_decoder_is_reusable_across_requests(self, llama, llama_draft):
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft), policy=HeuristicLookahead())
        for seed, lengths in enumerate([[4, 9], [12], [3, 3, 7, 1]]):
            input_ids, mask = left_padded_prompts(lengths, seed=seed)
            out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=12)
            assert torch.equal(out.sequences, greedy_reference(llama, input_ids, mask, 12))

    @pytest.mark.parametrize(
        "options",
        [
            dict(repetition_penalty=1.3),
            dict(no_repeat_ngram_size=2),
            dict(encoder_repetition_penalty=1.5),
            dict(encoder_no_repeat_ngram_size=2),
            dict(min_new_tokens=12, repetition_penalty=0.8, no_repeat_ngram_size=3),
            dict(forced_eos_token_id=7, exponential_decay_length_penalty=(4, 1.5)),
            dict(bad_words_ids=[[3], [11, 33]], sequence_bias={(20,): 3.0}, renormalize_logits=True),
        ],
        ids=lambda options: ",".join(options),
    )
    @pytest.mark.parametrize("drafter", ["same", "ngram"])
    def test_generation_options_that_read_the_history(self, llama, options, drafter):
        """Processors that read each row's tokens, or hold per-row state built from the prompt
        (the padding a repetition penalty ignores, the prompt an encoder penalty reads), see the
        right rows at every draft position, while rows sit in length groups and finished rows
        leave the batch. An identical draft is always accepted, so every draft position is exercised."""
        input_ids, mask = left_padded_prompts([5, 9, 2, 7, 4], seed=13)
        eos = eos_mid_row(llama, input_ids, mask, 20)
        expected = greedy_reference(llama, input_ids, mask, 20, eos_token_id=eos, **options)
        decoder = SpeculativeDecoder(target=llama, drafter=make_drafter(drafter, "llama"), policy=ConstantLookahead(k=3))
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, **options)
        assert torch.equal(out.sequences, expected)
        if drafter == "same":  # the draft applies the same processors, so it never disagrees
            assert out.stats.acceptance_rate == 1.0

    @pytest.mark.parametrize("drafter", ["same", "model"])
    def test_custom_logits_processor(self, llama, drafter):
        """A user's processor, as ``model.generate(logits_processor=...)`` takes it, sees each
        row's own history at every draft position (this one bans repeating the previous token)."""
        input_ids, mask = left_padded_prompts([5, 9, 2, 7], seed=17)
        expected = greedy_reference(llama, input_ids, mask, 16, logits_processor=[BanRepeat()])
        assert not torch.equal(expected, greedy_reference(llama, input_ids, mask, 16))  # the ban has work to do
        decoder = SpeculativeDecoder(target=llama, drafter=make_drafter(drafter, "llama"), policy=ConstantLookahead(k=3))
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=16, logits_processor=[BanRepeat()])
        assert torch.equal(out.sequences, expected)

    def test_stats_count_what_happened(self, llama, llama_draft):
        input_ids, mask = left_padded_prompts([6, 2, 9], seed=11)
        out = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft), policy=ConstantLookahead(k=3)).generate(
            input_ids, attention_mask=mask, max_new_tokens=15, eos_token_id=None
        )
        stats = out.stats
        assert stats.rows == 3 and stats.new_tokens == 45
        assert stats.new_tokens == stats.accepted + stats.row_steps  # one target token per row step
        assert stats.iterations == stats.target_calls
        assert 0 <= stats.acceptance_rate <= 1 and stats.wall_time_s > 0


_ARCHS = {arch: tiny_model(arch) for arch in ("llama", "gpt2")}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["llama", "gpt2"]),
    lengths=st.lists(st.integers(1, 16), min_size=1, max_size=8),
    drafter=st.sampled_from(["model", "same", "ngram", "nonsense"]),
    policy=st.sampled_from(["1", "2", "3", "5", "8", "heuristic"]),
    max_new=st.integers(1, 20),
    eos_at=st.one_of(st.none(), st.integers(0, 19)),
    seed=st.integers(0, 10_000),
)
def test_property_random_batches_match_target(arch, lengths, drafter, policy, max_new, eos_at, seed):
    """Random batch sizes, prompt lengths, drafters, lookaheads, budgets and eos positions."""
    target = _ARCHS[arch]
    input_ids, mask = left_padded_prompts(lengths, seed=seed)
    eos = None
    if eos_at is not None and eos_at < max_new:
        free = greedy_reference(target, input_ids, mask, max_new, eos_token_id=None)
        eos = int(free[seed % len(lengths), input_ids.shape[1] + eos_at])
    expected = greedy_reference(target, input_ids, mask, max_new, eos_token_id=eos)
    decoder = SpeculativeDecoder(target=target, drafter=make_drafter(drafter, arch), policy=make_policy(policy))
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
