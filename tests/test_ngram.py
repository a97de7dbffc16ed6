"""The ``ngram`` drafter's lookup decisions on hand-made token rows, and the host copy it reads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.observers import Observer
from specdec.policies import ConstantLookahead

from .conftest import greedy_reference, left_padded_prompts

PAD = 0


def state_for(decoder: SpeculativeDecoder, rows: list[list[int]]):
    """A fresh request's state for left-padded ``rows`` (their tokens count as committed)."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return decoder.prepare(input_ids, mask, 8)


def propose(decoder, rows, max_tokens, **options):
    state = state_for(decoder, rows)
    draft = NGramDrafter(**options).propose(state, torch.tensor(max_tokens), None)
    return [t[:n] for t, n in zip(draft.tokens.tolist(), draft.lengths.tolist())], draft.width


class TestLookup:
    def test_longest_suffix_wins_then_shorter(self, llama):
        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter())
        row = [5, 6, 7, 8, 9, 6, 7, 3, 4, 1, 7, 6, 7]
        # max 1: the latest earlier "7" (position 10) is followed by 6 7, the end of what is committed.
        assert propose(decoder, [row], [4], max_ngram=1)[0] == [[6, 7]]
        # max 2: "6 7" last occurred at 5-6, followed by 3 4 1 7.
        assert propose(decoder, [row], [4], max_ngram=2)[0] == [[3, 4, 1, 7]]
        # max 3: "7 6 7" never occurred before, so the 2-gram answers.
        assert propose(decoder, [row], [4], max_ngram=3)[0] == [[3, 4, 1, 7]]

    def test_most_recent_match_and_the_lookahead_cap(self, llama):
        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter())
        row = [2, 3, 10, 11, 2, 3, 20, 21, 22, 2, 3]
        assert propose(decoder, [row], [2], max_ngram=2)[0] == [[20, 21]]

    def test_no_match_proposes_nothing_and_the_draft_has_no_width(self, llama):
        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter())
        tokens, width = propose(decoder, [[1, 2, 3, 4, 5]], [5], min_ngram=1)
        assert tokens == [[]] and width == 0

    def test_min_ngram_refuses_short_matches(self, llama):
        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter())
        row = [4, 9, 8, 7, 9]
        assert propose(decoder, [row], [3], max_ngram=2, min_ngram=1)[0] == [[8, 7, 9]]
        assert propose(decoder, [row], [3], max_ngram=2, min_ngram=2)[0] == [[]]

    def test_padding_never_matches_and_rows_are_independent(self, llama):
        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter())
        # Row 1 ends in the pad id, which its own left padding holds: padding is not text.
        rows = [[1, 2, 3, 1, 2, 3, 1], [5, PAD], [7, 8, 7]]
        tokens, width = propose(decoder, rows, [2, 2, 2], max_ngram=2)
        assert tokens == [[2, 3], [], [8, 7]]
        assert width == 2  # as wide as the longest proposal


def lookup_by_hand(row: list[int], wanted: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup spelled out: the longest suffix (n from max_ngram down) that occurs earlier with
    a token after it; the tokens after its latest such occurrence."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(row) < n + 1:
            continue
        suffix = row[-n:]
        starts = [s for s in range(len(row) - n) if row[s : s + n] == suffix]
        if starts:
            follow = starts[-1] + n
            return row[follow : follow + wanted]
    return []


# Token ids whose 8-byte little-endian forms overlap: 256 is bytes 00 01 00.., 1 is 01 00 ..;
# a byte search can match across token boundaries, which the lookup must never report.
token_ids = st.sampled_from([1, 2, 256, 257, 512, 65536, 65537, 16777216])


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(token_ids, min_size=1, max_size=14), min_size=1, max_size=3),
       wanted=st.integers(0, 5), max_ngram=st.integers(1, 4), data=st.data())
def test_lookup_matches_the_spelled_out_search(rows, wanted, max_ngram, data):
    min_ngram = data.draw(st.integers(1, max_ngram))
    state = state_for_ids(rows)
    draft = NGramDrafter(max_ngram=max_ngram, min_ngram=min_ngram).propose(state, torch.full((len(rows),), wanted), None)
    got = [t[:n] for t, n in zip(draft.tokens.tolist(), draft.lengths.tolist())]
    assert got == [lookup_by_hand(row, wanted, max_ngram, min_ngram) for row in rows]
    assert draft.width == max((len(g) for g in got), default=0)


def state_for_ids(rows: list[list[int]]):
    """``state_for`` without a model's vocabulary: the lookup reads only the host buffers."""
    from specdec.core.state import DecodeState

    width = max(len(r) for r in rows)
    buffer = torch.tensor([[PAD] * (width - len(r)) + r + [PAD] for r in rows])
    lengths = torch.full((len(rows),), width)
    return DecodeState(
        generation_config=None, processors=[], sequences=buffer.clone(), token_mask=buffer != PAD,
        lengths=lengths.clone(), lengths_host=lengths, sequences_host=buffer,
        padding_host=torch.tensor([width - len(r) for r in rows]), prompt_width=width, max_new_tokens=0,
        eos_token_ids=torch.tensor([]), eos_token_set=frozenset(), pad_token_id=PAD,
        rows=torch.arange(len(rows)), rows_host=torch.arange(len(rows)),
    )


class MirrorCheck(Observer):
    """Compares the host copy of the committed tokens with the device buffer after every step."""

    name = "mirror-check"

    def __init__(self):
        self.steps = 0

    def on_step(self, state, step):
        rows = state.rows_host
        for row in rows.tolist():
            length = int(state.lengths_host[row])
            assert length == int(state.lengths[row])
            assert torch.equal(state.sequences_host[row, :length], state.sequences[row, :length].cpu())
        self.steps += 1


def test_host_copy_follows_the_device_buffer(llama, llama_draft):
    """Ragged acceptance, rows finishing early: the host copy the n-gram drafter reads stays exact."""
    input_ids, mask = left_padded_prompts([6, 2, 9, 4], seed=21)
    check = MirrorCheck()
    decoder = SpeculativeDecoder(
        target=llama, drafter=ModelDrafter(llama_draft), policy=ConstantLookahead(k=4), observers=[check]
    )
    expected = greedy_reference(llama, input_ids, mask, 18)
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=18)
    assert torch.equal(out.sequences, expected)
    assert check.steps == out.stats.iterations > 1
