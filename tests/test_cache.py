"""SlotCache: holes hidden by the mask give the logits of the compact sequence, before and after compaction."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdec.core.cache import GROWTH_LIMIT, GrowingLayer, _columns
from specdec.core.models import CausalLMRunner

from .conftest import PAD, tiny_model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_holes_and_compaction_match_the_compact_sequence(arch):
    model = tiny_model(arch)
    runner = CausalLMRunner(model)
    generator = torch.Generator().manual_seed(0)
    batch = 3
    slots = runner.new_cache(batch)
    # Three blocks of 8 tokens; after each, rows keep a different prefix and the rest become holes.
    kept_tokens = [[] for _ in range(batch)]
    keeps = [[8, 2, 5], [1, 8, 3], [4, 1, 8]]
    for keep in keeps:
        block = torch.randint(3, 61, (batch, 8), generator=generator)
        runner.forward(slots, block, torch.ones(batch, 8, dtype=torch.bool), logits_to_keep=1)
        slots.drop_tail(8, keep_columns=torch.tensor(keep))
        for row in range(batch):
            kept_tokens[row] += block[row, : keep[row]].tolist()
    probe = torch.randint(3, 61, (batch, 1), generator=generator)

    # Reference: each row's kept tokens alone, as a fresh sequence.
    expected = []
    for row in range(batch):
        ids = torch.tensor([kept_tokens[row] + [int(probe[row])]])
        expected.append(model(ids).logits[0, -1])
    expected = torch.stack(expected)

    widest = max(len(t) for t in kept_tokens)
    assert slots.length == 24 and slots.n_valid.tolist() == [len(t) for t in kept_tokens]
    slots.compact(widest)
    assert slots.length == widest and slots.compactions == 1
    got = runner.forward(slots, probe, torch.ones(batch, 1, dtype=torch.bool), logits_to_keep=1)[:, -1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_holes_without_compaction_match_too():
    model = tiny_model("llama")
    runner = CausalLMRunner(model)
    slots = runner.new_cache(2)
    block = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    runner.forward(slots, block, torch.ones(2, 4, dtype=torch.bool), logits_to_keep=1)
    slots.drop_tail(4, keep_columns=torch.tensor([2, 3]))
    probe = torch.tensor([[20], [21]])
    got = runner.forward(slots, probe, torch.ones(2, 1, dtype=torch.bool), logits_to_keep=1)[:, -1]
    expected = torch.stack(
        [model(torch.tensor([[5, 6, 20]])).logits[0, -1], model(torch.tensor([[9, 10, 11, 21]])).logits[0, -1]]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert slots.compactions == 0 and slots.length == 5


def test_what_every_row_drops_is_cut_off_not_kept_as_holes():
    """Rows keep 2 and 3 of a block of 4: the last column is dropped by both, so it leaves the
    cache; row 0's third column stays a hole. The logits are those of the compact sequences."""
    model = tiny_model("llama")
    runner = CausalLMRunner(model)
    slots = runner.new_cache(2)
    block = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    runner.forward(slots, block, torch.ones(2, 4, dtype=torch.bool), logits_to_keep=1)
    slots.drop_tail(4, keep_columns=torch.tensor([2, 3]), common=1)
    assert slots.length == 3 and slots.cuts == 1 and slots.n_valid.tolist() == [2, 3]
    assert slots.slot_mask.tolist() == [[True, True, False], [True, True, True]]
    assert slots.cache.get_seq_length() == 3
    probe = torch.tensor([[20], [21]])
    got = runner.forward(slots, probe, torch.ones(2, 1, dtype=torch.bool), logits_to_keep=1)[:, -1]
    expected = torch.stack(
        [model(torch.tensor([[5, 6, 20]])).logits[0, -1], model(torch.tensor([[9, 10, 11, 21]])).logits[0, -1]]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_batch_of_one_never_holds_a_hole(monkeypatch):
    """In the loop, a lone row's rejected drafts are cut off: its cache stays hole-free."""
    from specdec import SpeculativeDecoder
    from specdec.drafters import ModelDrafter
    from specdec.policies import ConstantLookahead

    from .conftest import finished_requests, perturbed_copy, tiny_llama

    finished = finished_requests(monkeypatch)
    target = tiny_llama(20, vocab=32, layers=2, dtype=torch.float64, init=0.3)
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(perturbed_copy(target, 0.3)),
                                 policy=ConstantLookahead(k=4))
    caches = []
    original = decoder.drafter.on_step

    def watch(state, step):
        original(state, step)
        caches.append((decoder.drafter._cached.slots.slot_mask.all().item(), int(step.accepted_host.sum()),
                       int(step.drafted_host.sum())))

    decoder.drafter.on_step = watch
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    out = decoder.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))
    assert any(accepted < drafted for _, accepted, drafted in caches)  # there were rejections
    assert all(hole_free for hole_free, _, _ in caches)
    assert not finished["draft"].slots.holes  # and known so on the host: its steps need no mask


def test_a_finished_row_stays_in_an_encoder_decoder_batch_until_it_has_cost_a_copy():
    """Row 1 of 4 leaves a Whisper batch: the physical batch keeps it, fed holes, until the forwards
    spent on it add up to KEEP_FINISHED_READS times the 3 rows a cut copies; the other rows' logits
    are those of their own sequences before the cut and after it."""
    from specdec.core.cache import KEEP_FINISHED_READS
    from specdec.core.models import Seq2SeqRunner

    from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, features, tiny_whisper

    target = tiny_whisper(seed=0)
    runner = Seq2SeqRunner(target)
    encoded = runner.begin(input_features=features(4, seed=5)).last_hidden_state
    slots = runner.new_cache(4)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 4)
    runner.forward(slots, prompt, torch.ones(4, 4, dtype=torch.bool), logits_to_keep=1)
    assert slots.select_rows(torch.tensor([0, 2, 3]), widest=4) is None
    assert slots.physical_batch == 4 and slots.row_cuts == 0
    history = [prompt[0].tolist() for _ in range(3)]
    cut_after = KEEP_FINISHED_READS * 3  # forwards with one idle row
    for step in range(cut_after + 1):
        probe = torch.randint(3, 250, (3, 1), generator=generator)
        got = runner.forward(slots, probe, torch.ones(3, 1, dtype=torch.bool), logits_to_keep=1)[:, -1]
        for row in range(3):
            history[row].append(int(probe[row]))
        expected = torch.stack([
            target(encoder_outputs=(encoded[physical : physical + 1],), decoder_input_ids=torch.tensor([tokens])).logits[0, -1]
            for physical, tokens in zip([0, 2, 3], history)])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        physical = slots.release_finished(widest=5 + step)
        if step < cut_after - 1:  # the idle row read fewer times than a cut would cost
            assert physical is None and slots.physical_batch == 4
        elif step == cut_after - 1:
            assert physical.tolist() == [0, 2, 3] and slots.physical_batch == 3 and slots.row_cuts == 1
            runner.select_rows(physical)  # what CachedModel does with the rows kept
        else:
            assert physical is None and slots.idle_reads == 0


def test_a_decoder_only_batch_lets_a_row_go_at_once():
    """A decoder-only cache holds only the rows' own tokens: cheap to copy, so rows leave at once."""
    runner = CausalLMRunner(tiny_model("llama"))
    slots = runner.new_cache(3)
    runner.forward(slots, torch.tensor([[5, 6], [7, 8], [9, 10]]), torch.ones(3, 2, dtype=torch.bool), logits_to_keep=1)
    assert slots.select_rows(torch.tensor([0, 2]), widest=2).tolist() == [0, 2]
    assert slots.physical_batch == 2 and slots.cache.layers[0].keys.shape[0] == 2


class TestGrowingLayer:
    """A dynamic cache's attention layers append in place (``GrowingLayer``), not by concatenation."""

    @staticmethod
    def block(n, batch=2, seed=0):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(batch, 3, n, 4, generator=generator), torch.randn(batch, 3, n, 4, generator=generator)

    def test_it_holds_what_concatenation_holds_and_reallocates_rarely(self):
        layer, reference = GrowingLayer(), DynamicLayer()
        reallocations, whole = 0, None
        for step in range(200):
            keys, values = self.block(5 if step == 0 else 1 + step % 3, seed=step)
            got = layer.update(keys, values)
            expected = reference.update(keys, values)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            reallocations += layer._whole_keys is not whole
            whole = layer._whole_keys
        assert layer.get_seq_length() == reference.get_seq_length() == 403
        assert reallocations <= 12  # each grows it by half: logarithmically many, where cat makes 200
        assert layer.keys.data_ptr() == layer._whole_keys.data_ptr()

    def test_compaction_picks_each_rows_columns_from_the_views(self):
        """``_columns`` reads a GrowingLayer's strided view (and any other layout) as gather would."""
        layer = GrowingLayer()
        layer.update(*self.block(7, batch=3))
        layer.update(*self.block(2, batch=3, seed=1))  # a view of the first 9 of a longer tensor
        assert not layer.keys.is_contiguous()
        order = torch.tensor([[0, 2, 3, 8], [1, 4, 5, 6], [0, 1, 7, 8]])
        expected = layer.keys.gather(2, order[:, None, :, None].expand(-1, 3, -1, 4))
        assert torch.equal(_columns(layer.keys, order, {}), expected)
        assert torch.equal(_columns(layer.keys.transpose(1, 2).contiguous().transpose(1, 2), order, {}), expected)

    def test_a_layer_that_let_old_columns_go_is_not_compacted(self):
        """Compaction's row numbers assume a column per slot: a layer holding fewer keeps its holes."""
        runner = CausalLMRunner(tiny_model("llama"))
        slots = runner.new_cache(2)
        runner.forward(slots, torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), torch.ones(2, 4, dtype=torch.bool),
                       logits_to_keep=1)
        slots.drop_tail(4, keep_columns=torch.tensor([1, 2]))
        layer = slots.cache.layers[0]
        layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]  # as a window that let one go
        slots.compact(2)
        assert slots.compactions == 0 and slots.length == 4

    def test_a_long_prompt_gets_limited_room(self):
        layer = GrowingLayer()
        layer.update(*self.block(3000, batch=1))
        assert layer._whole_keys.shape[2] == 3000 + GROWTH_LIMIT and layer.get_seq_length() == 3000

    def test_a_cut_is_written_over_and_a_replaced_tensor_is_taken_in(self):
        layer = GrowingLayer()
        first = self.block(6, seed=1)
        layer.update(*first)
        whole = layer._whole_keys
        layer.keys, layer.values = layer.keys[:, :, :-2], layer.values[:, :, :-2]  # SlotCache._cut
        second = self.block(1, seed=2)
        keys, _ = layer.update(*second)
        assert layer._whole_keys is whole and keys.shape[2] == 5
        torch.testing.assert_close(keys, torch.cat([first[0][:, :, :4], second[0]], dim=2), rtol=0, atol=0)
        # compaction's gather hands the layer a tensor of its own: the next update copies it in
        order = torch.tensor([[4, 0, 1], [2, 3, 4]])
        gathered = layer.keys.gather(2, order[:, None, :, None].expand(-1, 3, -1, 4))
        layer.keys = gathered
        layer.values = layer.values.gather(2, order[:, None, :, None].expand(-1, 3, -1, 4))
        third = self.block(1, seed=3)
        keys, _ = layer.update(*third)
        assert layer._whole_keys is not whole
        torch.testing.assert_close(keys, torch.cat([gathered, third[0]], dim=2), rtol=0, atol=0)

    def test_rows_leave_with_one_copy_and_the_rest_append_as_before(self):
        layer, reference = GrowingLayer(), DynamicLayer()
        for step in range(3):
            block = self.block(3, batch=4, seed=step)
            layer.update(*block)
            reference.update(*block)
        index = torch.tensor([0, 2, 3])
        layer.batch_select_indices(index)
        reference.batch_select_indices(index)
        assert layer.keys.data_ptr() == layer._whole_keys.data_ptr() and layer._whole_keys.shape[0] == 3
        block = self.block(2, batch=3, seed=9)
        got, expected = layer.update(*block), reference.update(*block)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    def test_a_dynamic_slot_cache_grows_in_place_and_generate_keeps_its_own(self):
        model = tiny_model("llama")
        runner = CausalLMRunner(model)
        slots = runner.new_cache(2)
        runner.forward(slots, torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.bool), logits_to_keep=1)
        assert slots.cache.layers and all(type(layer) is GrowingLayer for layer in slots.cache.layers)
        assert type(DynamicCache(config=model.config).layers[0]) is DynamicLayer  # transformers' class untouched

    def test_a_cache_built_with_its_layers_grows_in_place_too(self):
        """Hybrid models' caches come with their layers made (``config_cache``): plain attention layers
        among them are swapped before their first update, and the logits are the lazily built cache's."""
        from specdec.core.cache import SlotCache

        model = tiny_model("llama")
        runner = CausalLMRunner(model)
        built = SlotCache(DynamicCache(config=model.config), 2, torch.device("cpu"))
        assert all(type(layer) is GrowingLayer for layer in built.cache.layers)
        lazy = runner.new_cache(2)
        for block in (torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[11], [12]])):
            valid = torch.ones_like(block, dtype=torch.bool)
            got = runner.forward(built, block, valid, logits_to_keep=1)
            torch.testing.assert_close(got, runner.forward(lazy, block, valid, logits_to_keep=1), rtol=0, atol=0)


def test_rows_leave_a_whisper_batch_lazily_and_exactly(monkeypatch):
    """Rows of a Whisper batch end at different steps: the caches (and encoder outputs) are cut fewer
    times than rows leave, and the transcripts are generate's."""
    from transformers.generation.utils import GenerationMixin

    from specdec import SpeculativeDecoder
    from specdec.drafters import SharedEncoderDrafter
    from specdec.policies import ConstantLookahead

    from .conftest import finished_requests
    from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, features, tiny_distil_decoder, tiny_whisper

    finished = finished_requests(monkeypatch)
    target = tiny_whisper(seed=0)
    x = features(6, seed=43)
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 6)
    eos = 69  # this random model's row 4 says it at step 2, row 5 at step 34, the others never
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=36, eos_token_id=eos)
    decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=tiny_distil_decoder(seed=1)),
                                 policy=ConstantLookahead(k=2))
    left = []
    original = decoder._target.select_rows

    def counting(state, keep):
        left.append(int(state.iteration))
        original(state, keep)

    decoder._target.select_rows = counting
    state = decoder.prepare(prompt, max_new_tokens=36, model_inputs={"input_features": x}, eos_token_id=eos)
    out = decoder.decode(state)
    assert torch.equal(out.sequences, reference)
    assert len(left) == 2 and left[1] - left[0] > 10, left
    # Row 4 was cut out once the five others had read its share five times; row 5 left two steps
    # before the end, too late to be worth a copy of four rows.
    target_slots, draft_slots = finished["target"].slots, finished["draft"].slots
    assert target_slots.row_cuts == 1 and target_slots.physical_batch == 5
    assert finished["target"].encoder_outputs.last_hidden_state.shape[0] == 5
    # Every cache's cut is counted where a timing policy sees it (the draft's cache cuts too).
    assert state.row_cuts == target_slots.row_cuts + draft_slots.row_cuts >= 2


class TestAttentionLayout:
    """core/masks.py: windows counted in positions, one mask per layer kind."""

    def test_a_hole_does_not_use_up_the_window(self):
        from specdec.core.masks import FULL, SLIDING, AttentionLayout

        layout = AttentionLayout(kinds=(FULL, SLIDING), others=("conv",), sliding_window=2)
        # One row: slots hold positions 0, 1, (hole), 2 and the query reads slot 3 (position 2).
        slot_mask = torch.tensor([[True, True, False, True]])
        positions = torch.tensor([[0, 1, 1, 2]])
        masks = layout.masks(slot_mask, positions, positions[:, -1:], torch.float64)
        assert set(masks) == {FULL, SLIDING, "conv"}
        assert masks[FULL][0, 0, 0].tolist() == [True, True, False, True]
        # Window 2 by position: positions 1 and 2 are seen although slot 3 is three slots after slot 1.
        assert masks[SLIDING][0, 0, 0].tolist() == [False, True, False, True]
        assert masks["conv"] is None  # one token: a recurrent layer reads no padding mask

    def test_recurrent_layers_get_the_blocks_own_mask(self):
        from specdec.core.masks import SLIDING, AttentionLayout

        layout = AttentionLayout(kinds=(SLIDING,), others=("conv",), sliding_window=4)
        slot_mask = torch.tensor([[True, False, True]])
        positions = torch.tensor([[0, 0, 1]])
        masks = layout.masks(slot_mask, positions, positions[:, -2:], torch.float64)
        assert masks["conv"].tolist() == [[0, 1]]  # the last two slots: a hole, then a token

    @pytest.mark.parametrize("implementation", ["sdpa", "eager"])
    @pytest.mark.parametrize("cache", ["dynamic", "static"])
    def test_a_one_token_full_mask_is_the_general_one(self, implementation, cache, monkeypatch):
        """A one-token step's full-attention mask skips the position comparison (every valid slot's
        position is at most the new token's): it must equal the general mask, checked at every
        one-token read of real decodes whose caches hold holes (rejected drafts, a ragged batch),
        on the accelerator's path (a prepared mask at every forward) and on the static path, where
        finished rows stay in the batch and read a hole (whose own slot must see itself)."""
        from .test_exactness import eos_mid_row

        from specdec import SpeculativeDecoder
        from specdec.core.masks import FULL, SLIDING, AttentionLayout
        from specdec.drafters import ModelDrafter
        from specdec.policies import DraftConfidenceLookahead

        from .conftest import left_padded_prompts, perturbed_copy

        fast = AttentionLayout(kinds=(FULL,), implementation=implementation)
        general = AttentionLayout(kinds=(FULL, SLIDING), sliding_window=10**9, implementation=implementation)
        compared = []
        masks = AttentionLayout.masks

        def checked(self, slot_mask, positions, query_positions, dtype, **kwargs):
            out = masks(self, slot_mask, positions, query_positions, dtype, **kwargs)
            if query_positions.shape[1] == 1 and kwargs.get("branches") is None:
                one = masks(fast, slot_mask, positions, query_positions, dtype, **kwargs)
                assert torch.equal(one, masks(general, slot_mask, positions, query_positions, dtype, **kwargs)[FULL])
                compared.append(bool((~slot_mask).any()))
            return out

        monkeypatch.setattr(AttentionLayout, "masks", checked)
        monkeypatch.setattr("specdec.core.models.PREPARE_MASKS_ON_CPU", True)
        target = tiny_model("llama")
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(perturbed_copy(target, 0.3)),
                                     policy=DraftConfidenceLookahead(threshold=0.5, max_tokens=4), draft_early_exit=False,
                                     static_cache=cache == "static")
        ids, mask = left_padded_prompts([3, 9, 6, 1])
        eos = eos_mid_row(target, ids, mask, 24)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos)
        assert len(compared) > 20 and any(compared)  # many one-token masks, some over caches with holes
        assert (out.sequences[:, -1] == PAD).any()  # a row finished early (its later steps read holes)

    def test_a_window_only_generates_cache_applies_bites_after_the_prompt(self):
        """Moshi's attention builds only full masks; its window is generate's evicting sliding-window
        cache, so the prompt (read in one forward) attends fully and every later token sees the last W."""
        from specdec.core.masks import EVICTED, AttentionLayout

        from .architectures import tiny_model as tiny_architecture

        moshi, mistral = tiny_architecture("moshi"), tiny_architecture("mistral")
        layout = AttentionLayout.of(moshi)
        assert moshi.config.sliding_window and layout.kinds == (EVICTED,)
        window = AttentionLayout(kinds=(EVICTED,), sliding_window=2, implementation="sdpa")
        slot_mask = torch.ones(1, 5, dtype=torch.bool)
        positions = torch.arange(5)[None]
        seen = window.masks(slot_mask, positions, positions, torch.float64, prompt_lengths=torch.tensor([3]))[0, 0]
        assert seen.long().tolist() == [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],  # the prompt's last token still sees the whole prompt
            [0, 0, 1, 1, 0],  # after the prompt: the last two positions
            [0, 0, 0, 1, 1],
        ]
        assert AttentionLayout.of(mistral).counts_positions


def test_a_block_known_to_be_dense_extends_the_cache_as_a_scanned_one():
    """``extend(valid, dense=True)`` (the caller knows on the host that the block holds no hole) gives
    the positions and slots the general path computes from ``valid``, and keeps the cache known
    hole-free until rows keep different numbers of drafts."""
    runner = CausalLMRunner(tiny_model("llama"))
    scanned, known = runner.new_cache(2), runner.new_cache(2)
    for width in (3, 1, 2):
        valid = torch.ones(2, width, dtype=torch.bool)
        assert torch.equal(scanned.extend(valid), known.extend(valid, dense=True))
    for name in ("slot_mask", "positions", "n_valid"):
        assert torch.equal(getattr(scanned, name), getattr(known, name))
    assert scanned.holes and not known.holes
    known.drop_tail(2, keep_columns=torch.tensor([2, 2]), shared=2)  # both rows keep both columns
    assert not known.holes and known.n_valid.tolist() == [6, 6]
    known.drop_tail(2, keep_columns=torch.tensor([1, 2]), shared=1)  # row 0 drops one: a hole
    assert known.holes and known.n_valid.tolist() == [5, 6]


class TestCacheName:
    """transformers 5.24 renamed the cache argument and output field (``past_key_values`` and
    Mamba's ``cache_params`` became ``cache``): specdec speaks whichever a model declares, on either
    version of transformers, so these use stand-ins of each kind rather than the installed models."""

    @pytest.mark.parametrize("name", ["cache", "past_key_values", "cache_params"])
    def test_the_argument_the_forward_declares(self, name):
        from specdec.core.models import cache_argument

        namespace = {}
        exec(f"def forward(self, input_ids=None, {name}=None, use_cache=None, **kwargs): pass", namespace)
        model = type(f"Takes_{name}", (torch.nn.Module,), {"forward": namespace["forward"]})()
        assert cache_argument(model) == name

    @pytest.mark.parametrize("output_class", ["CausalLMOutputWithPast", "CausalLMOutputWithCrossAttentions"])
    def test_outputs_are_built_and_read_under_the_declared_field(self, output_class):
        """The installed transformers' own output classes (a stand-in declaring ``past_key_values``
        cannot be built on 5.24, whose ModelOutput renames the field as the class is made)."""
        import dataclasses

        from transformers import modeling_outputs

        from specdec.core.models import returned_cache, with_cache

        output_class = getattr(modeling_outputs, output_class)
        declared = {field.name for field in dataclasses.fields(output_class)} & {"cache", "past_key_values"}
        cache = DynamicCache()
        out = with_cache(output_class, cache, logits=torch.zeros(1))
        assert [getattr(out, name) for name in declared] == [cache]
        assert returned_cache(out) is cache
        assert returned_cache(output_class(logits=torch.zeros(1))) is None

    def test_reading_asks_no_deprecated_name(self, monkeypatch):
        """On transformers >= 5.24 asking an output for ``past_key_values`` logs a deprecation
        warning (once per process, so the call is watched, not the log): reading an output without
        a cache, which looks under every name, must not ask that way. Fails on 5.24 with ``in``."""
        from transformers import modeling_outputs
        from transformers.utils import generic

        from specdec.core.models import returned_cache

        asked = []
        monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: asked.append(message))
        assert returned_cache(modeling_outputs.CausalLMOutputWithPast(logits=torch.zeros(1))) is None
        assert returned_cache(modeling_outputs.BaseModelOutputWithPast(last_hidden_state=torch.zeros(1))) is None
        assert asked == []


@torch.no_grad()
@pytest.mark.parametrize("family", ["whisper", "llama"])
def test_a_finished_request_leaves_no_cache_or_encoder_output_alive(family):
    """Once generate returns, what the request read is freed: the target's and the draft's caches
    and the encoder's output (a dynamic cache; a static one stays for the next request of its
    shape). A decoder kept between requests holds its models only, and the next request's encoder
    pass does not run beside the last one's keys (whisper-base: about 40 MiB a row). A request that
    fails lets go of the target's too."""
    import gc
    import weakref

    from transformers.generation.utils import GenerationMixin

    from specdec import PluginError, SpeculativeDecoder
    from specdec.drafters import ModelDrafter, SharedEncoderDrafter
    from specdec.observers import Observer
    from specdec.policies import ConstantLookahead

    from .conftest import left_padded_prompts, perturbed_copy
    from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, decoder_of, features, tiny_whisper

    alive = []

    class Watch(Observer):
        def on_step(self, state, step):  # the last step's tensors: a growing cache replaces its earlier ones
            alive.clear()
            caches = [decoder._target.slots.cache, decoder.drafter._cached.slots.cache]
            if family == "whisper":
                caches = [cache.cross_attention_cache for cache in caches] + [caches[0].self_attention_cache]
                alive.append(weakref.ref(state.encoder_outputs.last_hidden_state))
            alive.extend(weakref.ref(cache.layers[0].keys) for cache in caches)

    if family == "whisper":
        target = tiny_whisper(seed=0)
        inputs = dict(input_ids=torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2), input_features=features(2, seed=5))
        reference = GenerationMixin.generate(target, inputs["input_features"], decoder_input_ids=inputs["input_ids"],
                                             max_new_tokens=8)
        drafter = SharedEncoderDrafter(model=decoder_of(target))
    else:
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([5, 2])
        inputs = dict(input_ids=ids, attention_mask=mask)
        reference = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        drafter = ModelDrafter(perturbed_copy(target, 0.05))
    decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3), observers=[Watch()])
    out = decoder.generate(**inputs, max_new_tokens=8)
    assert torch.equal(out.sequences, reference)
    gc.collect()
    assert len(alive) == (4 if family == "whisper" else 2) and all(ref() is None for ref in alive)

    class Failing(ConstantLookahead):
        def lookahead(self, state):
            if state.iteration == 1:
                raise RuntimeError("no")
            return super().lookahead(state)

    failing = SpeculativeDecoder(target=target, drafter=drafter, policy=Failing(k=3))
    with pytest.raises(PluginError, match="no"):
        failing.generate(**inputs, max_new_tokens=8)
    assert failing._target.slots is None and failing._target.runner.encoder_outputs is None
