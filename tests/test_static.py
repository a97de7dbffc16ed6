"""Static shapes (``SpeculativeDecoder(static_cache=True)``): preallocated caches written in place,
power-of-two blocks and batch buckets, and the same tokens as ``generate``, in float64."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder
from specdec.core.cache import bucket
from specdec.core.models import CausalLMRunner
from specdec.drafters import ModelDrafter, NGramDrafter, SharedEncoderDrafter
from specdec.config import SpecdecConfig
from specdec.policies import ConstantLookahead, CostAwareLookahead, DraftConfidenceLookahead, HeuristicLookahead
from specdec.verifiers import RejectionVerifier
from specdec.whisper import speculative_whisper_generate

from . import architectures
from .conftest import Recorder, greedy_reference, left_padded_prompts, perturbed_copy, tiny_model
from .test_cost_aware import Ticks
from .test_exactness import eos_mid_row
from .tiny_whisper import features, tiny_distil_decoder, tiny_whisper

LENGTHS = [9, 3, 14, 1, 6, 11, 2, 8]


class ShapeRecorder:
    """Wraps a model's forward and records the (input shape, attention mask shape) of every call."""

    def __init__(self, model):
        self.shapes = []
        self.forward = model.forward

        def record(*args, **kwargs):
            ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
            mask = kwargs.get("attention_mask")
            self.shapes.append((tuple(ids.shape), tuple(mask.shape) if isinstance(mask, torch.Tensor) else None))
            return self.forward(*args, **kwargs)

        model.forward = functools.wraps(self.forward)(record)  # the runner reads forward's signature

    def restore(self, model):
        model.forward = self.forward


def make_drafter(kind: str, arch: str):
    if kind == "model":
        return ModelDrafter(tiny_model(arch, layers=1, seed=1))
    if kind == "close":  # accepts about half: rejections, bonus tokens and holes all happen
        return ModelDrafter(perturbed_copy(tiny_model(arch), 0.15))
    return NGramDrafter(max_ngram=3)


def make_policy(kind: str):
    if kind == "heuristic":
        return HeuristicLookahead()
    if kind == "confidence":  # stops rows early
        return DraftConfidenceLookahead(threshold=0.3, max_tokens=6)
    return ConstantLookahead(k=int(kind))


class TestBucket:
    def test_powers_of_two(self):
        assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 33)] == [0, 1, 2, 4, 4, 8, 8, 16, 64]


class TestStaticExactness:
    """Greedy output with static shapes equals the target's own, token for token."""

    @pytest.mark.parametrize("arch", ["llama", "gpt2"])
    @pytest.mark.parametrize("drafter, policy", [
        (drafter, policy) for drafter in ("model", "close", "ngram") for policy in ("3", "heuristic", "confidence")
        if (drafter, policy) != ("ngram", "confidence")  # an n-gram draft is one lookup: no draft loop to stop
    ])
    @pytest.mark.parametrize("batch", [1, 5])
    def test_matches_target_generate(self, arch, drafter, policy, batch):
        target = tiny_model(arch)
        ids, mask = left_padded_prompts(LENGTHS[:batch])
        eos = eos_mid_row(target, ids, mask, 40)  # rows end at different steps: the batch bucket shrinks
        reference = greedy_reference(target, ids, mask, 40, eos_token_id=eos)
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter(drafter, arch), policy=make_policy(policy),
                                     static_cache=True)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
        assert torch.equal(out.sequences, reference)

    @pytest.mark.parametrize("early_exit", [True, False])
    def test_early_stopping_policy_both_ways(self, early_exit):
        target = tiny_model("llama")
        ids, mask = left_padded_prompts(LENGTHS)
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter("close", "llama"),
                                     policy=make_policy("confidence"), static_cache=True, draft_early_exit=early_exit)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30)
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 30))
        assert 0 < out.stats.accepted < out.stats.drafted

    def test_compacts_in_place_and_grows_only_when_a_block_does_not_fit(self):
        """Long enough that holes fill the headroom: compactions happen, the cache keeps its size."""
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([5, 2, 7])
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter("model", "llama"),
                                     policy=ConstantLookahead(k=7), static_cache=True)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=100, eos_token_id=None)
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 100, eos_token_id=None))
        slots = decoder._target.slots
        assert slots.compactions > 0 and slots.regrowths == 0
        assert slots.capacity % 64 == 0 and slots.slot_mask.shape[1] == slots.capacity

    def test_a_block_wider_than_the_free_columns_grows_the_cache_once(self):
        target = tiny_model("llama", context=512)
        ids = torch.randint(3, 61, (2, 120), generator=torch.Generator().manual_seed(0))
        valid = torch.ones_like(ids, dtype=torch.bool)
        runner = CausalLMRunner(target)
        slots = runner.new_cache(2, capacity=64)
        runner.forward(slots, ids[:, :50], valid[:, :50], 1)
        logits = runner.forward(slots, ids[:, 50:], valid[:, 50:], 1)  # 70 more: past the 64 slots
        assert slots.regrowths == 1 and slots.capacity >= 120
        expected = target(input_ids=ids).logits[:, -1:]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


    def test_the_next_request_of_a_shape_reuses_the_cache_and_stays_exact(self):
        """Back-to-back requests of one shape decode into the same key/value tensors (the addresses
        that compiled steps' CUDA graphs captured), zeroed in between, also after a request whose
        rows left for smaller buckets (which read the first rows of those tensors); a request of
        another shape gets a new cache."""
        target = tiny_model("llama")
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter("close", "llama"), policy=ConstantLookahead(k=3),
                                     static_cache=True)

        def run(lengths, seed, eos=None):
            ids, mask = left_padded_prompts(lengths, seed=seed)
            out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos)
            assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 24, eos_token_id=eos))
            cache = decoder._target.slots.cache
            return cache, [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]

        first, addresses = run([5, 2, 7, 4], seed=0)
        assert decoder._target.slots.row_cuts > 0  # rows finished apart: cut to smaller buckets
        assert run([6, 3, 1, 7], seed=1) == (first, addresses)  # other prompts, the same bucket and capacity
        ids, mask = left_padded_prompts([5, 2, 7, 4], seed=2)
        assert run([5, 2, 7, 4], seed=2, eos=eos_mid_row(target, ids, mask, 24)) == (first, addresses)
        fifth = run([5, 2, 7, 4, 3], seed=4)  # a batch of 5 is a bucket of 8: another shape
        assert fifth[0] is not first and run([5, 2, 7, 4, 3], seed=5) == fifth  # one cache is kept, the last

    def test_a_kept_cache_is_handed_out_only_for_its_own_shape_dtype_and_capacity(self):
        target = copy.deepcopy(tiny_model("llama", context=512))  # its dtype changes below
        ids = torch.randint(3, 61, (2, 120), generator=torch.Generator().manual_seed(0))
        valid = torch.ones_like(ids, dtype=torch.bool)
        runner = CausalLMRunner(target)

        def used(batch, capacity, width=8):
            slots = runner.new_cache(batch, capacity=capacity)
            runner.forward(slots, ids[:batch, :width], valid[:batch, :width], 1)
            return slots

        first = used(2, 64)
        assert used(2, 64).cache is first.cache  # zeroed and handed out again
        assert torch.count_nonzero(runner.new_cache(2, 64).cache.layers[0].keys) == 0
        assert used(1, 64).cache is not first.cache  # another batch bucket
        grown = used(2, 64, width=100)  # past 64 slots: the tensors grew
        assert grown.regrowths == 1 and used(2, 64).cache is not grown.cache
        kept = used(2, 64)
        target.to(torch.float32)
        assert used(2, 64).cache is not kept.cache  # float64 tensors for a float32 model: not kept

    @pytest.mark.parametrize("kind", ["causal", "whisper"])
    def test_a_new_cache_makes_its_write_offsets_on_the_models_device(self, kind):
        """A ``StaticLayer`` makes its write offset on the CPU and moves it at its first write: a
        blocking copy, one device sync per layer in the first forward. specdec's are made where the
        model is ("meta" here stands for an accelerator: anything but the CPU's default)."""
        from specdec.core.models import runner_for

        model = copy.deepcopy(tiny_model("llama") if kind == "causal" else tiny_whisper()).to("meta")
        slots = runner_for(model).new_cache(2, capacity=64)
        layers = slots.cache.self_attention_cache.layers if kind == "whisper" else slots.cache.layers
        assert layers and {layer.cumulative_length.device.type for layer in layers} == {"meta"}

    def test_sampling_with_a_draft_equal_to_the_target_accepts_everything(self):
        """The padded verify columns (q = 0, outside every row's length) never reach the acceptance test."""
        target = tiny_model("llama")
        ids, mask = left_padded_prompts(LENGTHS[:4])
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(tiny_model("llama")), policy=ConstantLookahead(k=3),
                                     verifier=RejectionVerifier(), static_cache=True)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, eos_token_id=None,
                               generator=torch.Generator().manual_seed(0))
        assert out.stats.drafted > 0 and out.stats.accepted == out.stats.drafted
        assert out.sequences.shape == (4, ids.shape[1] + 20)

    def test_config_selects_it(self, tmp_path):
        path = tmp_path / "plugins.toml"
        path.write_text('[target]\nmodel = "m"\ncache = "static"\n[drafter]\nuse = "ngram"\n')
        config = SpecdecConfig.from_toml(path)
        assert config.static_cache
        decoder = SpeculativeDecoder.from_config(config, target=tiny_model("llama"))
        assert decoder.static_cache is True
        path.write_text('[target]\nmodel = "m"\ncache = "fixed"\n[drafter]\nuse = "ngram"\n')
        with pytest.raises(ConfigError, match="\\[target\\] cache must be one of 'dynamic', 'static', got 'fixed'"):
            SpecdecConfig.from_toml(path)


    def test_plain_target_steps_and_probes_of_cost_aware(self):
        """k = 0 rounds (the draft skips them, so its catch-up grows) mixed with probes, statically."""
        target = tiny_model("llama")
        ids, mask = left_padded_prompts(LENGTHS[:4])
        clock = Ticks(lambda k: 1.0 + 5.0 * k)  # drafting is expensive: mostly plain target steps
        policy = CostAwareLookahead(clock=clock, probe_rate=0.2)
        clock.policy = policy
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=make_drafter("close", "llama"), policy=policy,
                                     observers=[recorder], static_cache=True)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30)
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 30))
        widths = [step.draft.width for step in recorder.steps]
        assert 0 in widths and any(widths)


class TestStaticShapes:
    """The models see few shapes: the mask always spans the capacity, blocks are powers of two."""

    @pytest.mark.parametrize("rows", [5, 6])
    def test_shapes_depend_only_on_batch_bucket_and_width(self, rows):
        target = tiny_model("llama")
        draft = perturbed_copy(tiny_model("llama"), 0.15)
        ids, mask = left_padded_prompts(LENGTHS[:rows])
        eos = eos_mid_row(target, ids, mask, 40)
        reference = greedy_reference(target, ids, mask, 40, eos_token_id=eos)
        recorder, draft_recorder = ShapeRecorder(target), ShapeRecorder(draft)
        try:
            decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=3),
                                         static_cache=True)
            out = decoder.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
        finally:
            recorder.restore(target)
            draft_recorder.restore(draft)
        assert torch.equal(out.sequences, reference)
        capacity = decoder._target.slots.capacity
        for shapes in (recorder.shapes, draft_recorder.shapes):
            after_prefill = shapes[1:]
            assert all(m[-1] == capacity for _, m in shapes), "the mask must always span the full capacity"
            batches = {ids_shape[0] for ids_shape, _ in after_prefill}
            # The request's rows, then the powers of two below as rows finish (never one shape per row count).
            assert batches <= {rows, 4, 2, 1}, batches
            widths = {ids_shape[1] for ids_shape, _ in after_prefill}
            assert all(w == bucket(w) or w - 1 == bucket(w - 1) for w in widths), widths
        # The target reads [last token, k drafts padded to 4]: 5 wide; narrower only where a row's budget
        # caps its lookahead near the end (k = 2, 1, 0).
        target_widths = [w for (_, w), _ in recorder.shapes[1:]]
        assert set(target_widths) <= {5, 3, 2, 1} and max(set(target_widths), key=target_widths.count) == 5
        # Rows finished and left mid-way, yet the target kept one physical batch until the bucket shrank.
        assert len({b for (b, _), _ in recorder.shapes}) < out.stats.iterations


class TestStaticArchitectures:
    """Windowed attention (masks counted in positions) and Whisper keep their exactness statically."""

    @pytest.mark.parametrize("family", ["sliding", "mixed_sliding", "per_layer_shapes", "chunked", "evicted_window",
                                        "alibi", "mla", "moe"])
    @pytest.mark.parametrize("drafter", ["model", "ngram"])
    def test_family_exact(self, family, drafter):
        target = architectures.tiny_family_model(family)
        ids, mask = architectures.ragged_batch()
        eos = eos_mid_row(target, ids, mask, 24)  # a row leaves part-way: the batch's bucket is cut from 4 to 2
        reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        drafter_ = ModelDrafter(architectures.tiny_family_model(family, draft=True)) if drafter == "model" else NGramDrafter()
        decoder = SpeculativeDecoder(target=target, drafter=drafter_, policy=HeuristicLookahead(), static_cache=True)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos)
        assert torch.equal(out.sequences, reference)

    @pytest.mark.parametrize("family", ["ssm", "hybrid_ssm", "short_conv"])
    def test_recurrent_models_are_refused_with_the_reason(self, family):
        target = architectures.tiny_family_model(family)
        decoder = SpeculativeDecoder(target=target, drafter=NGramDrafter(), static_cache=True)
        ids, mask = architectures.ragged_batch()
        with pytest.raises(ConfigError, match="static_cache: .*recurrent or conv states"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=4)

    @pytest.mark.filterwarnings("ignore::specdec.errors.RereadWarning")
    def test_re_read_models_are_refused_with_the_reason(self):
        target = architectures.tiny_family_model("local")  # gpt_neo: re-read, no cache to preallocate
        decoder = SpeculativeDecoder(target=target, drafter=NGramDrafter(), static_cache=True)
        ids, mask = architectures.ragged_batch()
        with pytest.raises(ConfigError, match=r"static_cache: GPTNeoForCausalLM \(gpt_neo\) is re-read without a cache"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=4)

    @pytest.mark.parametrize("drafter", ["ngram", "shared_encoder", "model-seq2seq"])
    def test_whisper(self, drafter):
        target = tiny_whisper(seed=0)
        drafter_ = {
            "ngram": lambda: NGramDrafter(),
            "shared_encoder": lambda: SharedEncoderDrafter(model=tiny_distil_decoder(seed=1)),
            "model-seq2seq": lambda: ModelDrafter(model=tiny_whisper(seed=5, d_model=16, ffn=32)),
        }[drafter]()
        decoder = SpeculativeDecoder(target=target, drafter=drafter_, policy=ConstantLookahead(k=3), static_cache=True)
        for seed in (21, 22):  # the second request decodes into the first one's static caches
            x = features(3, seed=seed)
            reference = target.generate(x, return_timestamps=True, max_new_tokens=20)
            out = speculative_whisper_generate(decoder, x, return_timestamps=True, max_new_tokens=20)
            assert torch.equal(reference, out)

    def test_bad_option_is_a_config_error(self):
        with pytest.raises(ConfigError, match="static_cache"):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=NGramDrafter(), static_cache="yes")


class TestCompiledSteps:
    """``compile="draft"`` runs the draft's steps through torch.compile: still exact, and only on the static path."""

    def test_compiled_draft_steps_are_exact(self):
        target = tiny_model("llama")
        draft = perturbed_copy(tiny_model("llama"), 0.15)
        ids, mask = left_padded_prompts([6])
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=3),
                                     static_cache=True, compile="draft")
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 12, eos_token_id=None))
        assert "_specdec_compiled_forward" in draft.__dict__ and "_specdec_compiled_forward" not in target.__dict__

    def test_every_compiled_step_is_one_graph_and_the_next_request_compiles_nothing(self):
        """``compile="all"``: each step of both models compiles whole (on a GPU a graph break splits
        its CUDA graph and puts Python between the parts), and a second request, decoding into the
        first one's static caches, finds every graph made (on a GPU: replays, records nothing)."""
        from torch._dynamo.utils import counters

        target = copy.deepcopy(tiny_model("llama"))  # compiling leaves its forward on the model
        draft = perturbed_copy(tiny_model("llama"), 0.15)
        ids, mask = left_padded_prompts([6])  # the shapes of the test above: inductor's cache serves its draft graphs
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=3),
                                     static_cache=True, compile="all")
        reference = greedy_reference(target, ids, mask, 12, eos_token_id=None)
        counters.clear()
        first = decoder.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None).sequences
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] >= 2  # the target's verify and the draft's step at least
        counters.clear()
        second = decoder.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None).sequences
        assert counters["stats"]["unique_graphs"] == 0
        assert torch.equal(first, reference) and torch.equal(second, reference)

    @pytest.mark.parametrize("draft_kind", ["distil-whisper", "reduced-head"])
    def test_whisper_steps_compile_whole_with_a_shared_encoder_draft(self, monkeypatch, draft_kind):
        """An encoder-decoder target's decoder steps compile too (``compile="all"``), as does the
        draft that reads its encoder (a Distil-Whisper decoder, or specdec's own with its reduced
        head, whose forward builds its output): exact, one graph per step, nothing new on the next
        request. Dynamo's capture is what is checked; inductor's code generation, which the Llama
        test above runs, is left out (``backend="eager"``): it would take half a minute on two cores."""
        from torch._dynamo.utils import counters

        from specdec.drafters.shared_encoder_draft import build_draft

        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        target = copy.deepcopy(tiny_whisper(seed=0))
        draft = (copy.deepcopy(tiny_distil_decoder(seed=1)) if draft_kind == "distil-whisper"
                 else build_draft(target, torch.arange(target.config.vocab_size), init_layers=[0]))
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft),
                                     policy=ConstantLookahead(k=3), static_cache=True, compile="all")
        x = features(1, seed=21)
        reference = target.generate(x, return_timestamps=True, max_new_tokens=12)
        made = []
        for _ in range(2):
            counters.clear()
            assert torch.equal(speculative_whisper_generate(decoder, x, return_timestamps=True, max_new_tokens=12),
                               reference)
            assert dict(counters["graph_break"]) == {}
            made.append(counters["stats"]["unique_graphs"])
        assert made[0] >= 2 and made[1] == 0
        assert "_specdec_compiled_forward" in target.__dict__ and "_specdec_compiled_forward" in draft.__dict__

    @pytest.mark.parametrize("options, message", [
        (dict(compile="draft"), "needs static_cache=True"),
        (dict(compile="yes", static_cache=True), "compile must be one of 'none', 'draft', 'all'"),
    ])
    def test_bad_options_are_config_errors(self, options, message):
        with pytest.raises(ConfigError, match=message):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=NGramDrafter(), **options)
