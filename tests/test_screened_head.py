"""Greedy verifies with the target's LM head screened in bfloat16 (core/screened_head.py): the
bound's arithmetic, the argmax's candidates on adversarial heads, and the loop's output on real
transformers models, where the screen is on and where it must stay off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from specdec import ConfigError, SpeculativeDecoder
from specdec.config import SpecdecConfig
from specdec.core import packed_linear, screened_head
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead
from specdec.verifiers import RejectionVerifier

from .conftest import pin_packing
from .test_pair import PAIR, needs_pair

needs_bfloat16 = pytest.mark.skipif(not (packed_linear.available() and packed_linear.bfloat16_available()),
                                    reason="no oneDNN bfloat16 matmul here")


def test_the_bound_covers_bfloat16s_rounding_and_float32s_sums():
    """2^-7 + 2^-16 for the two roundings to bfloat16, gamma_K for float32's sums three times over
    (the bfloat16 pass's, generate's and the second pass's), 1% for the norms."""
    unit = 2.0 ** -24
    for features in (64, 576, 4096):
        gamma = features * unit / (1 - features * unit)
        expected = 1.01 * (2.0 ** -7 + 2.0 ** -16 + gamma * (1 + 2.0 ** -7 + 2.0 ** -16) + 2 * gamma)
        assert screened_head.error_factor(features) == pytest.approx(expected, rel=1e-12)
    assert 0.0080 < screened_head.error_factor(576) < 0.0081  # 1.01 x (0.0078125 + 0.0000153 + 0.0000346 + 0.0000687)
    assert screened_head.error_factor(4096) > screened_head.error_factor(576)


def _check(flat: torch.Tensor, weight: torch.Tensor) -> int:
    """The screen of ``flat @ weight.T``: float32 values at its candidates, each row's float64
    argmax among them, and its argmax that of float32's logits wherever float64's top two are further
    apart than float32's rounding. Returns the number of candidates."""
    largest = float(torch.linalg.vector_norm(weight, dim=1).max())
    logits, (rows, tokens) = screened_head.screened_logits(flat, weight, largest)
    full = F.linear(flat, weight)
    exact = flat.double() @ weight.double().T
    torch.testing.assert_close(logits[rows, tokens], full[rows, tokens], rtol=1e-5, atol=1e-5)
    chosen = set(zip(rows.tolist(), tokens.tolist()))
    top = exact.topk(2, dim=1)
    scale = torch.linalg.vector_norm(flat.double(), dim=1) * largest
    for r in range(flat.shape[0]):
        assert (r, int(top.indices[r, 0])) in chosen, f"row {r}: float64's argmax is not a candidate"
        if top.values[r, 0] - top.values[r, 1] > 1e-5 * scale[r]:
            assert int(logits[r].argmax()) == int(full[r].argmax()) == int(top.indices[r, 0])
    return len(chosen)


@needs_bfloat16
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(2, 12), features=st.sampled_from([64, 256, 576]),
       vocab=st.sampled_from([512, 4096]), scale=st.sampled_from([1e-2, 1.0, 30.0]))
def test_the_argmax_is_always_a_candidate_on_random_heads(seed, rows, features, vocab, scale):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, features, generator=generator) * scale / features ** 0.5
    flat = torch.randn(rows, features, generator=generator) * scale
    _check(flat, weight)


@needs_bfloat16
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ties=st.integers(2, 16), spread=st.sampled_from([0.0, 1e-6, 1e-4, 1e-3, 1e-2]))
def test_near_ties_that_bfloat16_cannot_tell_apart_are_decided_in_float32(seed, ties, spread):
    """Head rows nearly parallel to the hidden state, their logits closer than bfloat16 resolves
    them: all of them are candidates, and float32 picks the one float64 picks."""
    generator = torch.Generator().manual_seed(seed)
    features, vocab = 256, 2048
    weight = torch.randn(vocab, features, generator=generator) / features ** 0.5
    flat = torch.randn(3, features, generator=generator)
    direction = flat[0] / torch.linalg.vector_norm(flat[0])
    for i in range(ties):  # rows whose logit for row 0 is its largest, apart by about ``spread``
        weight[i] = direction * (1 + spread * i / ties) + 1e-3 * torch.randn(features, generator=generator)
    weight[vocab - 1] = -weight[0]  # a row with the largest norm and the lowest logit: the bound's largest
    count = _check(flat, weight)
    assert count >= 3


@needs_bfloat16
def test_a_confident_head_recomputes_a_few_tokens_a_row():
    """What makes the screen cheap: logits that stand apart leave a handful of candidates."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8192, 256, generator=generator) / 16
    flat = weight[torch.tensor([3, 99, 2024, 7000])] * 40 + torch.randn(4, 256, generator=generator) * 0.1
    assert _check(flat, weight) <= 4 * 4


# --- in the loop ---------------------------------------------------------------------------------


class ScreenCounter:
    """Counts the LM head calls that were screened, and their rows."""

    def __init__(self, monkeypatch):
        self.rows = []
        original = screened_head.screened_logits

        def counting(flat, *args, **options):
            self.rows.append(flat.shape[0])
            return original(flat, *args, **options)

        monkeypatch.setattr(screened_head, "screened_logits", counting)


def _pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR, local_files_only=True, padding_side="left")
    target, draft = (AutoModelForCausalLM.from_pretrained(PAIR / name, dtype=torch.float32, local_files_only=True).eval()
                     for name in ("target", "draft"))
    batch = tokenizer(["def fibonacci(n):\n", "import os\n\n\ndef main("], return_tensors="pt", padding=True)
    return target, draft, batch


def _pin(monkeypatch, faster: bool = True):
    """Packed from 2 rows and bfloat16 faster (or slower) for the pair's LM heads and larger weights."""
    pin_packing(monkeypatch, start=2, smallest=1 << 20, bfloat16=faster)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    monkeypatch.setattr(packed_linear, "_PACKED_BF16", packed_linear.WeakIdKeyDictionary())


@needs_bfloat16
@needs_pair
def test_the_bundled_pair_with_a_screened_head_equals_generate(monkeypatch):
    """The bundled pair in float32, greedy: with the target's head screened at every verify the
    output is generate's at batch 1 and on a padded batch of 2; plain steps at batch 1 stay
    generate's own head; the draft model's head is never screened."""
    _pin(monkeypatch)
    counter = ScreenCounter(monkeypatch)
    target, draft, batch = _pair()
    expected = target.generate(**batch, max_new_tokens=32, do_sample=False)
    assert screened_head.applies_to(target)
    for drafter in (ModelDrafter(draft), NGramDrafter(max_ngram=3)):
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
        for rows in (slice(0, 1), slice(0, 2)):
            inputs = {name: value[rows] for name, value in batch.items()}
            reference = expected[rows] if rows.stop == 2 else target.generate(**inputs, max_new_tokens=32, do_sample=False)
            counter.rows.clear()
            out = decoder.generate(**inputs, max_new_tokens=32)
            assert torch.equal(out.sequences, reference[:, : out.sequences.shape[1]]), (drafter.name, rows)
            assert counter.rows and all(2 <= width <= screened_head.MAX_ROWS for width in counter.rows)
            if drafter.name == "model":  # a draft at every iteration but the last ones: each verify screened
                assert len(counter.rows) >= out.stats.iterations - 2
    assert target.lm_head.weight in packed_linear._PACKED_BF16
    assert draft.lm_head.weight not in screened_head._PLANS

    counter.rows.clear()
    plain = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=0))
    out = plain.generate(**{name: value[:1] for name, value in batch.items()}, max_new_tokens=16)
    assert counter.rows == [] and out.stats.new_tokens == 16, "a plain step at batch 1 reads generate's head"


@needs_bfloat16
@needs_pair
def test_the_head_is_read_in_full_wherever_the_scores_matter(monkeypatch):
    """No screen: under sampling, with a logits processor (the output then generate's with the
    same processor), with ``screened_head=False``, and where bfloat16 is timed slower."""
    target, draft, batch = _pair()
    inputs = {name: value[:1] for name, value in batch.items()}

    def screened(faster=True, **options):
        _pin(monkeypatch, faster)
        counter = ScreenCounter(monkeypatch)
        decoder_options = {key: options.pop(key) for key in ("verifier", "screened_head") if key in options}
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=3),
                                     **decoder_options)
        out = decoder.generate(**inputs, max_new_tokens=16, **options)
        return out, counter.rows

    torch.manual_seed(0)
    _, rows = screened(verifier=RejectionVerifier(), do_sample=True, temperature=0.8)
    assert rows == []
    out, rows = screened(repetition_penalty=1.3)
    assert rows == []
    reference = target.generate(**inputs, max_new_tokens=16, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(out.sequences, reference[:, : out.sequences.shape[1]])
    _, rows = screened(screened_head=False)
    assert rows == []
    out, rows = screened(faster=False)
    assert rows == [] and target.lm_head.weight not in packed_linear._PACKED_BF16
    _, rows = screened()
    assert rows, "the same decoder screens where nothing above holds"


def test_screened_head_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="screened_head must be True or False, got 'yes'"):
        SpeculativeDecoder(target=_tiny_target(), drafter=NGramDrafter(), screened_head="yes")
    toml = tmp_path / "plugins.toml"
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\nscreened_head = 1\n\n[drafter]\nuse = "ngram"\n')
    with pytest.raises(ConfigError, match=r"plugins.toml: \[target\] screened_head must be true or false, got 1"):
        SpecdecConfig.from_toml(toml)
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\nscreened_head = false\n\n[drafter]\nuse = "ngram"\n')
    assert SpecdecConfig.from_toml(toml).screened_head is False
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\n\n[drafter]\nuse = "ngram"\n')
    assert SpecdecConfig.from_toml(toml).screened_head is True


def _tiny_target():
    from .conftest import tiny_model

    return tiny_model("llama")


# --- the real chat model -------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parent.parent / "models/smollm2-135m-instruct-head/plugins.toml"
SMOLLM2 = Path(SpecdecConfig.from_toml(SHIPPED).target["model"]).expanduser()  # where `specdec models fetch` puts it


@needs_bfloat16
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="SmolLM2 not fetched (specdec models fetch smollm2-135m-instruct)")
def test_smollm2s_shipped_config_with_a_screened_head_equals_generate(monkeypatch):
    """SmolLM2-135M-Instruct with its shipped config (prompt lookup, the hidden-state head and its
    first-position alternatives) and the screen at every verify: generate's tokens."""
    pin_packing(monkeypatch, start=2, smallest=1 << 20, bfloat16=True)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    counter = ScreenCounter(monkeypatch)
    config = SpecdecConfig.from_toml(SHIPPED)
    target, tokenizer = config.load_target()
    decoder = SpeculativeDecoder.from_config(config, target=target)
    for prompt in ("Write a Python function that reverses a string.", "Explain why the sky is blue."):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        out = decoder.generate(**inputs, max_new_tokens=40)
        reference = target.generate(**inputs, max_new_tokens=40, do_sample=False)
        assert torch.equal(out.sequences, reference[:, : out.sequences.shape[1]]), prompt
    assert counter.rows


# --- processors that only suppress tokens (Whisper's) ----------------------------------------------


def test_suppression_masks_follow_the_processors():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from transformers.generation.logits_process import SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor

    model = torch.nn.Module()
    head = torch.nn.Linear(4, 10, bias=False)
    model.get_output_embeddings = lambda: head
    assert screened_head.suppression_masks(LogitsProcessorList(), model) == ()
    always = SuppressTokensLogitsProcessor([1, 7])
    (mask,) = screened_head.suppression_masks([always], model)
    assert mask.tolist() == [i in (1, 7) for i in range(10)]
    at_begin = SuppressTokensAtBeginLogitsProcessor([3], begin_index=4)
    first, second = screened_head.suppression_masks([always, at_begin], model)
    assert first.tolist() == mask.tolist() and second.tolist() == [i in (1, 3, 7) for i in range(10)]
    assert screened_head.suppression_masks([always, RepetitionPenaltyLogitsProcessor(1.2)], model) is None
    # Whisper's timestamp grammar after the suppressions keeps the screen, the tail from eot in float32
    grammar = _grammar(eot=6, no_timestamps=7)
    first, second = screened_head.suppression_masks([always, at_begin, grammar], model)
    assert first.tolist() == mask.tolist() and screened_head.exact_from([always, at_begin, grammar]) == 6
    assert screened_head.exact_from([always]) is None
    assert screened_head.suppression_masks([grammar, always], model) is None  # a suppression its comparison never saw


def _grammar(eot: int, no_timestamps: int, begin_index: int = 3):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    config = GenerationConfig(eos_token_id=eot, no_timestamps_token_id=no_timestamps, max_initial_timestamp_index=50)
    return WhisperTimeStampLogitsProcessor(config, begin_index=begin_index)


@needs_bfloat16
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lean=st.floats(-4.0, 4.0))
def test_under_the_timestamp_grammar_the_argmax_after_it_is_float32s(seed, lean):
    """Whisper's layout (text, eot, specials, notimestamps, timestamps), rows whose histories take
    each branch of the grammar, timestamps leaning by ``lean`` against the text: the tail's logits
    are float32's, and the grammar's choice on the screened logits is its choice on float32's
    wherever float64 does not call it a tie."""
    from .tiny_whisper import EOT, NO_TIMESTAMPS, SOT, TIMESTAMP_BEGIN, VOCAB

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, 64, generator=generator) / 8
    weight[TIMESTAMP_BEGIN:] += lean / 8 * torch.randn(64, generator=generator)  # a shared direction
    histories = [[SOT, 258, 262], [SOT, 258, 262, TIMESTAMP_BEGIN], [SOT, 258, 262, TIMESTAMP_BEGIN, 40],
                 [SOT, 258, 262, TIMESTAMP_BEGIN, 40, TIMESTAMP_BEGIN + 90],
                 [SOT, 258, 262, TIMESTAMP_BEGIN, 40, TIMESTAMP_BEGIN + 90, TIMESTAMP_BEGIN + 90]]
    flat = torch.randn(len(histories), 64, generator=generator) * 4
    flat += lean * weight[TIMESTAMP_BEGIN:].mean(0)
    grammar = _grammar(eot=EOT, no_timestamps=NO_TIMESTAMPS)
    largest = float(torch.linalg.vector_norm(weight, dim=1).max())
    logits, _ = screened_head.screened_logits(flat, weight, largest, exact_from=EOT)
    full = F.linear(flat, weight)
    torch.testing.assert_close(logits[:, EOT:], full[:, EOT:], rtol=1e-5, atol=1e-5)  # float32 throughout
    exact = flat.double() @ weight.double().T
    for row, history in enumerate(histories):
        ids = torch.tensor([history])
        chosen = grammar(ids, logits[row : row + 1]).argmax()
        wanted = grammar(ids, full[row : row + 1]).argmax()
        reference = grammar(ids, exact[row : row + 1].float())
        top = reference.topk(2).values[0]
        if top[0] - top[1] > 1e-4:
            assert int(chosen) == int(wanted), (row, history)


@needs_bfloat16
@torch.no_grad()
def test_long_form_transcription_screens_its_head_and_stays_exact(monkeypatch):
    """A float32 Whisper transcribing with timestamps (the grammar long-form transcription runs): the
    verifies screen ``proj_out`` and the tokens are generate's."""
    from specdec.drafters import SharedEncoderDrafter
    from specdec.whisper import WhisperSpeculativeDecoder

    from .tiny_whisper import decoder_of, features, tiny_whisper

    pin_packing(monkeypatch, smallest=0, bfloat16=True)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    counter = ScreenCounter(monkeypatch)
    target = tiny_whisper(seed=0).float()
    x = features(1, seed=11).float()
    options = dict(language="en", task="transcribe", return_timestamps=True)
    reference = target.generate(x, **options)
    whisper = WhisperSpeculativeDecoder(SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=decoder_of(target)),
                                                           policy=ConstantLookahead(k=3)))
    assert torch.equal(whisper.generate(x, **options), reference)
    assert counter.rows


@needs_bfloat16
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), suppressed=st.integers(1, 8))
def test_a_suppressed_argmax_leaves_the_next_one_among_the_candidates(seed, suppressed):
    """With the top tokens of every row suppressed, the largest unsuppressed one is a candidate, in
    both cases of an at-begin set, and the suppressed argmax of the screened logits is float32's."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(1024, 128, generator=generator) / 128 ** 0.5
    flat = torch.randn(4, 128, generator=generator) * 3
    exact = F.linear(flat, weight)
    top = exact.topk(suppressed + 1, dim=1).indices
    always = torch.zeros(1024, dtype=torch.bool)
    always[top[:, : suppressed // 2 + 1].flatten()] = True
    begin = always.clone()
    begin[top[:, :suppressed].flatten()] = True
    largest = float(torch.linalg.vector_norm(weight, dim=1).max())
    logits, (rows, tokens) = screened_head.screened_logits(flat, weight, largest, (always, begin))
    chosen = set(zip(rows.tolist(), tokens.tolist()))
    for mask in (always, begin):
        expected = exact.masked_fill(mask, -float("inf")).argmax(1)
        assert all((r, int(t)) in chosen for r, t in enumerate(expected))
        assert torch.equal(logits.masked_fill(mask, -float("inf")).argmax(1), expected)


@needs_bfloat16
@torch.no_grad()
def test_a_whisper_target_screens_its_head_under_suppression_and_stays_exact(monkeypatch):
    """A float32 Whisper, greedy, with its checkpoint's suppressed and begin-suppressed tokens: the
    decoder's verifies screen ``proj_out`` and the transcript is generate's."""
    from transformers import GenerationMixin

    from specdec.drafters import SharedEncoderDrafter

    from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, decoder_of, features, tiny_whisper

    pin_packing(monkeypatch, smallest=0, bfloat16=True)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    counter = ScreenCounter(monkeypatch)
    target = tiny_whisper(seed=0).float()
    x = features(2, seed=11).float()  # 2 rows x 4 tokens: verifies within MAX_ROWS
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=16)
    for drafter in (SharedEncoderDrafter(model=decoder_of(target)), NGramDrafter()):
        counter.rows.clear()
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
        out = decoder.generate(prompt, input_features=x, max_new_tokens=16)
        assert torch.equal(out.sequences, reference), drafter.name
        assert counter.rows, drafter.name
        # the first read too (2 rows x 4 prompt tokens and 3 drafts, 14 > MAX_ROWS, is not screened)
    for rows in (1, 2):
        counter.rows.clear()
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=decoder_of(target)),
                                     policy=ConstantLookahead(k=3))
        out = decoder.generate(prompt[:rows], input_features=x[:rows], max_new_tokens=16)
        assert torch.equal(out.sequences, reference[:rows])
        assert (counter.rows[0] == 7) is (rows == 1), counter.rows  # its 4 prompt tokens and 3 drafts


@needs_bfloat16
def test_the_first_timing_of_a_head_is_said_once_naming_the_model(monkeypatch, caplog):
    """As the packed layers' first timings are: which model, where it is kept, how long it took;
    the next request, the shape known, says nothing and keeps the plan."""
    import logging

    pin_packing(monkeypatch, start=2, smallest=1 << 16, bfloat16=True)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(256, 4096, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    model = Head()
    assert screened_head.applies_to(model)
    with caplog.at_level(logging.INFO, logger="specdec.core.packed_linear"):
        widths = screened_head.prepare(model)
    said = [record.getMessage() for record in caplog.records]
    assert said[0].startswith("timing the LM head of Head in bfloat16")
    assert str(packed_linear.measurements_file()) in said[0] and said[1].startswith("timed in")
    assert widths == frozenset(packed_linear.TRIAL_ROWS) and model.lm_head.weight in packed_linear._PACKED_BF16
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec.core.packed_linear"):
        assert screened_head.prepare(model) == widths
    assert not caplog.records


@needs_bfloat16
def test_wide_calls_and_unsure_rows_read_the_float32_head():
    """Calls of more than ``MAX_ROWS`` rows go to the forward the head had; where the candidates
    span most of the vocabulary (an unsure target) the call returns float32's logits for every token."""
    generator = torch.Generator().manual_seed(0)
    # head rows all but equal: every token's logit within bfloat16's bound of the largest
    weight = torch.randn(64, generator=generator) / 8 + 1e-5 * torch.randn(4096, 64, generator=generator)
    flat = torch.randn(3, 64, generator=generator)
    largest = float(torch.linalg.vector_norm(weight, dim=1).max())
    full = []
    logits, (rows, _) = screened_head.screened_logits(flat, weight, largest, full=lambda x: full.append(1) or x @ weight.T)
    assert full and rows.numel() > 3 * screened_head.MOST_OF_THE_HEAD * 4096
    torch.testing.assert_close(logits, flat @ weight.T)

    head = torch.nn.Linear(64, 4096, bias=False)
    fallback = []
    forward = lambda x: fallback.append(x.shape) or torch.nn.functional.linear(x, head.weight)  # noqa: E731
    screened_head._screened_forward(head, forward, (), None, torch.randn(2, screened_head.MAX_ROWS // 2 + 1, 64))
    assert fallback == [torch.Size([2, screened_head.MAX_ROWS // 2 + 1, 64])]


@needs_bfloat16
def test_a_lone_rows_screened_head_gets_no_packed_float32_copy(monkeypatch):
    """At batch 1 every verify is screened, wider than MAX_ROWS too, so the head's packed float32
    copy (101 MiB on whisper-base) is not made as the request begins nor later; a batched request,
    whose verifies past MAX_ROWS read the copy, packs it as it begins."""
    from transformers import GenerationMixin

    from specdec.drafters import SharedEncoderDrafter

    from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, decoder_of, features, tiny_whisper

    pin_packing(monkeypatch, smallest=0, bfloat16=True)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.WeakIdKeyDictionary())
    target = tiny_whisper(seed=0).float()
    head, layer = target.proj_out.weight, target.model.decoder.layers[0].fc1.weight
    x = features(2, seed=11).float()
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=40)
    screened = []
    screen = screened_head.screened_logits
    monkeypatch.setattr(screened_head, "screened_logits", lambda flat, *a, **o: screened.append(len(flat)) or screen(flat, *a, **o))
    for rows, k, packed in ((1, 3, False), (1, 9, False), (2, 3, True)):  # k = 9: verifies of 10 tokens
        monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.WeakIdKeyDictionary())
        screened.clear()
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=decoder_of(target)),
                                     policy=ConstantLookahead(k=k))
        out = decoder.generate(prompt[:rows], input_features=x[:rows], max_new_tokens=40)
        assert torch.equal(out.sequences, reference[:rows, : out.sequences.shape[1]])
        assert layer in packed_linear._PACKED
        assert (head in packed_linear._PACKED) is packed, (rows, k)
        assert rows * (k + 1) in screened  # a lone row's 10-token verifies are screened too
    # where bfloat16 is timed slower the head is not screened: its verifies read the float32 copy, made as it begins
    pin_packing(monkeypatch, smallest=0, bfloat16=False)
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.WeakIdKeyDictionary())
    decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=decoder_of(target)),
                                 policy=ConstantLookahead(k=0))
    decoder.generate(prompt[:1], input_features=x[:1], max_new_tokens=4)
    assert head in packed_linear._PACKED


@needs_bfloat16
@torch.no_grad()
@pytest.mark.parametrize("timestamps", [False, True])
def test_without_packed_weights_the_head_is_still_screened_and_no_float32_copy_is_made(monkeypatch, timestamps):
    """``packed_weights = false`` with ``screened_head`` on (whisper.toml's lean setting): the decoder's
    layers verify on copy-free routes, its LM head on the bfloat16 screen, no packed float32 copy of
    any weight is made, at batch 1 and batched, and the transcript is generate's; with
    ``screened_head = false`` too, no copy at all."""
    from specdec.drafters import SharedEncoderDrafter
    from specdec.whisper import WhisperSpeculativeDecoder

    from .tiny_whisper import decoder_of, features, tiny_whisper

    pin_packing(monkeypatch, smallest=0, bfloat16=True, copy_free="oneDNN")
    monkeypatch.setattr(screened_head, "_PLANS", screened_head.WeakIdKeyDictionary())
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.WeakIdKeyDictionary())
    counter = ScreenCounter(monkeypatch)
    copy_free = []
    original = packed_linear._copy_free_forward
    monkeypatch.setattr(packed_linear, "_copy_free_forward",
                        lambda module, routes, x: copy_free.append(module.weight) or original(module, routes, x))
    target = tiny_whisper(seed=0).float()
    x = features(2, seed=11).float()
    # A random decoder runs to the 448 positions' end; 64 tokens hold the timestamp grammar and the
    # batched rows, at a seventh of the time.
    options = dict(language="en", task="transcribe", return_timestamps=timestamps, max_new_tokens=64)
    for screened in (True, False):
        monkeypatch.setattr(packed_linear, "_PACKED_BF16", packed_linear.WeakIdKeyDictionary())
        counter.rows.clear()
        copy_free.clear()
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=decoder_of(target)),
                                     policy=ConstantLookahead(k=3), packed_weights=False, screened_head=screened)
        whisper = WhisperSpeculativeDecoder(decoder)
        for rows in (1, 2):
            assert torch.equal(whisper.generate(x[:rows], **options), target.generate(x[:rows], **options)), (screened, rows)
        assert bool(counter.rows) is screened
        assert any(weight is target.model.decoder.layers[0].fc1.weight for weight in copy_free)
        assert not any(p in packed_linear._PACKED for p in target.parameters())
        assert (target.proj_out.weight in packed_linear._PACKED_BF16) is screened
