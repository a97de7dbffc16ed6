"""The bundled pair as the benchmark scripts load it: the target and tokenizer as ``plugins.toml``
names them, the draft model and the held-out prompts of ``models/python-pair/``.

    from bundled_pair import load_bundled_pair  # a script under benchmarks/, run as a file
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_bundled_pair():
    """``(target, tokenizer, draft, prompts)``: ``prompts`` is every prompt text of ``prompts.jsonl``.
    The draft in the target's dtype, as ``plugins.toml`` loads it: saved in float16, it would load as
    float16, which on a CPU ran its steps about 3 times slower (the grids of stops 10-45 did; stop 46)."""
    from transformers import AutoModelForCausalLM

    from specdec.config import SpecdecConfig

    target, tokenizer = SpecdecConfig.from_toml(ROOT / "plugins.toml").load_target()
    draft = AutoModelForCausalLM.from_pretrained(ROOT / "models/python-pair/draft", dtype=target.dtype)
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "models/python-pair/prompts.jsonl")]
    return target, tokenizer, draft, prompts


def bundled_decoder(target, draft, drafter: str, policy, sampled: bool, observers=()):
    """A ``SpeculativeDecoder`` of the pair with ``drafter`` ("model": ``draft``; "ngram": prompt
    lookup up to 3-grams), ``policy``, ``observers``, and rejection sampling if ``sampled``, greedy
    matching if not."""
    from specdec import SpeculativeDecoder
    from specdec.drafters import ModelDrafter, NGramDrafter
    from specdec.verifiers import GreedyVerifier, RejectionVerifier

    return SpeculativeDecoder(target=target, drafter=ModelDrafter(draft) if drafter == "model" else NGramDrafter(max_ngram=3),
                              policy=policy, verifier=RejectionVerifier() if sampled else GreedyVerifier(),
                              observers=list(observers))
