"""The bundled pair as the benchmark scripts load it: the target and tokenizer as ``plugins.toml``
names them, the draft model and the held-out prompts of ``models/python-pair/``.

    from bundled_pair import load_bundled_pair  # a script under benchmarks/, run as a file
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


SAMPLED = dict(do_sample=True, temperature=0.7, top_p=0.9)  # the benchmarks' sampled mode


def generation_options(sampled: bool) -> dict:
    """``generate``'s sampling arguments for the benchmarks' sampled mode, or greedy decoding."""
    return dict(SAMPLED) if sampled else dict(do_sample=False)


def add_run_arguments(parser, prompts: int = 16, passes: int = 3) -> None:
    """The options of a script that runs contenders prompt by prompt on the pair: ``--drafter``,
    ``--sampled``, ``--prompts``, ``--passes`` and ``--max-new-tokens``."""
    parser.add_argument("--drafter", choices=("model", "ngram"), default="model")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 (policy_grid.py's)")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--passes", type=int, default=passes)
    parser.add_argument("--max-new-tokens", type=int, default=64)


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
