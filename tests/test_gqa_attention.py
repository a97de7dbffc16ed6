"""A verify's grouped-query attention as one grouped kernel (``core/gqa_attention.py``): it computes
what Transformers' ``sdpa`` computes over copied key/value heads, only inside specdec's multi-token
steps, and decoding stays exact."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import sdpa_attention

from specdec import SpeculativeDecoder
from specdec.core import gqa_attention
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead

from .architectures import tiny_family_model
from .conftest import left_padded, perturbed_copy


def grouped_llama(dtype=torch.float64, heads=6, kv_heads=2, attn="sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).to(dtype).eval()


class CopyCounter:
    """Counts Transformers' ``repeat_kv`` calls that copy (more than one group)."""

    def __init__(self, monkeypatch):
        self.copies = 0
        original = sdpa_attention.repeat_kv

        def counting(hidden_states, n_rep):
            self.copies += n_rep > 1
            return original(hidden_states, n_rep)

        monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_a_masked_block_reads_the_grouped_heads_bit_for_bit_without_copying_them(monkeypatch, dtype):
    model = grouped_llama(dtype)
    counter = CopyCounter(monkeypatch)
    prompt = torch.randint(1, 48, (2, 20))
    block = torch.randint(1, 48, (2, 4))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row: a 4D mask reaches the attention
    outs = []
    for grouped in (False, True):
        cache = model(prompt, attention_mask=mask[:, :20], use_cache=True).past_key_values
        with gqa_attention.gqa_steps(model) if grouped else torch.no_grad():
            assert model.config._attn_implementation == (gqa_attention.NAME if grouped else "sdpa")
            outs.append(model(block, attention_mask=mask, cache=cache, use_cache=True).logits)
        assert model.config._attn_implementation == "sdpa"  # the model's own again
    assert torch.equal(outs[0], outs[1])
    assert counter.copies == 3 * 2 * 2  # keys and values of two layers in the two prefills and the plain block


def test_it_applies_only_to_grouped_sdpa_models_on_a_cpu():
    assert gqa_attention.applies_to(grouped_llama())
    assert not gqa_attention.applies_to(grouped_llama(kv_heads=6))  # one query head per key/value head
    assert not gqa_attention.applies_to(grouped_llama(attn="eager"))  # the user's choice of kernel stands


@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_decoding_of_a_grouped_model_equals_generate_and_copies_no_heads(monkeypatch, batch):
    target = grouped_llama()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 6, 7, 8]][:batch]
    input_ids, mask = left_padded(prompts)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    counter = CopyCounter(monkeypatch)
    for drafter in (ModelDrafter(perturbed_copy(target, 0.05)), NGramDrafter()):
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
        decoder.generate(input_ids, attention_mask=mask, max_new_tokens=2)  # the prefills, and a verify of 2
        prefills, counter.copies = counter.copies, 0
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=24)
        assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])
        # Only the prefills copy heads (generate's does too where a row is padded); no verify or
        # catch-up does, though each reads several tokens with a mask.
        assert counter.copies == prefills
        counter.copies = 0


def test_a_sliding_window_grouped_model_stays_exact():
    """Mistral: grouped heads and a sliding-window mask, which gqa_steps' layers take as they are."""
    target = tiny_family_model("sliding")
    assert gqa_attention.applies_to(target) == (target.config.num_key_value_heads < target.config.num_attention_heads)
    input_ids, mask = left_padded([[3, 4, 5, 3, 4, 5, 3, 4] * 3, [7, 8, 9]])
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=4)).generate(
        input_ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])


def test_the_model_outside_specdecs_steps_is_unchanged():
    model = grouped_llama()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    before = model.generate(prompt, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    SpeculativeDecoder(target=model, drafter=NGramDrafter(), policy=ConstantLookahead(k=3)).generate(prompt, max_new_tokens=8)
    after = model.generate(prompt, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before.sequences, after.sequences)
    assert all(torch.equal(a, b) for a, b in zip(before.scores, after.scores))
