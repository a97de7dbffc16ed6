"""Tiny named models built from configs, in float64 so numeric ties cannot hide bugs."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

# The test machines share two cores: under contention torch's default thread pool makes these
# tiny models up to 30x slower, and every model here is tiny.
torch.set_num_threads(1)

VOCAB = 61
EOS = 2
PAD = 0


@functools.cache
def tiny_model(arch: str, layers: int = 2, seed: int = 0, vocab: int = VOCAB, context: int = 128):
    """A random float64 model; cached, so treat it as read-only."""
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=context,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model.double().eval()


def left_padded_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB):
    """A left-padded batch with one prompt of each length (tokens avoid eos and pad)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return input_ids, mask


def greedy_reference(model, input_ids, mask, max_new_tokens, **kwargs):
    return model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def llama_draft():
    return tiny_model("llama", layers=1, seed=1)
