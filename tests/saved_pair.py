"""A tiny target/draft pair with a real tokenizer, saved to disk like the bundled pair."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\ndef main():\n    return 0\n",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_pair(root: Path, draft_vocab: int | None = None) -> Path:
    """Write target/, draft/ (both with the tokenizer), prompts.jsonl and plugins.toml under ``root``."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    for name, layers, seed, size in (("target", 2, 0, vocab), ("draft", 1, 1, draft_vocab or vocab)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        )
        model = LlamaForCausalLM(config)
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = eos
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.jsonl").write_text(
        '{"prompt": "def fibonacci(n):"}\n{"prompt": "class Stack:"}\n{"prompt": "import os"}\n'
    )
    config = root / "plugins.toml"
    config.write_text(
        '[target]\nmodel = "target"\ndtype = "float32"\n\n'
        '[drafter]\nuse = "model"\nmodel = "draft"\n\n'
        '[policy]\nuse = "constant"\nk = 3\n'
    )
    return config
