"""Everyday English prose, offline: a chat model's greedy answers to everyday prompts.

    python benchmarks/everyday_text.py --target ~/.cache/specdec/models/smollm2-135m-instruct \
        --out /tmp/everyday_answers.jsonl --count 384 --tokens 160 --threads 2

The Whisper draft's training speech (``build_speech_train_prose.py``) was technical prose only
(docstrings, manuals, READMEs), and on spoken everyday sentences the draft agreed with base less
than on held-out training speech (65% against 70-79% teacher-forced top-1; ``docs/whisper.md``).
No everyday text ships with Python or its packages, but a chat model answers everyday prompts:
the explanation and creative prompts of ``chat_corpus.py`` (explain a thing, how something works,
a difference, a story or poem about a topic; none of them the SmolLM2 benchmark's held-out ones),
answered greedily in batches. The output is JSON Lines ``{"kind", "prompt", "answer", ...}``,
which ``build_speech_train_prose.py --sources texts --texts FILE`` reads; it keeps plain sentences
only and drops any that equals, contains or is contained in an eval sentence. ``--out`` is also
the store: a stopped run resumes where it was.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chat_corpus  # noqa: E402


def everyday_prompts(count: int, seed: int) -> list[dict]:
    """``count`` explanation and creative prompts of ``chat_corpus.general_prompts`` (code left out)."""
    heldout = chat_corpus._heldout_prompts()
    prompts = chat_corpus.general_prompts(random.Random(seed), count * 3 // 2 + 3, heldout)
    return [p for p in prompts if p["kind"] != "code"][:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(Path("~/.cache/specdec/models/smollm2-135m-instruct").expanduser()),
                        help="a chat model's folder (with a chat template)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=384, help="prompts to answer")
    parser.add_argument("--tokens", type=int, default=160, help="new tokens per answer")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=44)
    args = parser.parse_args()
    prompts = everyday_prompts(args.count, args.seed)
    answers = chat_corpus.generate_answers(args.target, prompts, args.tokens, args.batch_size, args.threads, args.out)
    print(f"{len(answers)} answers in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
