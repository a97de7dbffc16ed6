"""The offline chat corpus for the hidden-state head: its prompts stay clear of the held-out benchmark's."""

from __future__ import annotations

import json
import random

from tests.test_speech_eval import BENCHMARKS, load

# The held-out prompts' topics (benchmarks/smollm2_prompts.jsonl): a training prompt on any of them
# would measure the head on what it was fitted to.
HELDOUT_TOPICS = ["bicycle", "weather", "climate", "refrigerator", "dictionar", "triangular", "stack",
                  "multiplication table", "kite", "key in", "coffee", "teapot", "honeybee", "bee ", "cholera",
                  "remote work", "reef"]


def heldout() -> list[dict]:
    return [json.loads(line) for line in (BENCHMARKS / "smollm2_prompts.jsonl").read_text().splitlines() if line.strip()]


class TestGeneralPrompts:
    def test_no_heldout_prompt_or_topic(self):
        corpus = load("chat_corpus")
        prompts = corpus.general_prompts(random.Random(1), 10**6, corpus._heldout_prompts())
        texts = [p["prompt"].lower() for p in prompts]
        assert len(texts) == len(set(texts)) > 1000
        assert not {p["prompt"] for p in heldout()} & {p["prompt"] for p in prompts}
        for topic in HELDOUT_TOPICS:
            assert not [t for t in texts if topic in t], topic

    def test_kinds_in_turn_and_deterministic(self):
        corpus = load("chat_corpus")
        first = corpus.general_prompts(random.Random(1), 30, set())
        assert [p["kind"] for p in first[:6]] == ["explain", "creative", "code"] * 2
        assert first == corpus.general_prompts(random.Random(1), 30, set())


class TestSummaryPrompts:
    def test_passages_are_whole_sentences_of_prose(self):
        corpus = load("chat_corpus")
        sentence = "A rainbow forms when sunlight is bent and split inside raindrops. "
        answers = [{"kind": "explain", "answer": "1. " + sentence * 30},
                   {"kind": "explain", "answer": "```python\nprint(1)\n``` " + sentence * 10},
                   {"kind": "explain", "answer": "Too short."},
                   {"kind": "creative", "answer": sentence * 10}]
        prompts = corpus.summary_prompts(random.Random(0), answers, 10)
        assert len(prompts) == 1 and prompts[0]["kind"] == "summarise"
        passage = prompts[0]["prompt"].split("\n\n", 1)[1]
        assert passage.startswith("A rainbow") and passage.endswith("raindrops.")
        assert 40 <= len(passage.split()) <= 160

    def test_not_the_benchmarks_phrasing(self):
        """The benchmark's own ways of asking for a summary are not trained on (its passages differ anyway)."""
        corpus = load("chat_corpus")
        asked = {p["prompt"].split("\n\n")[0] for p in heldout() if p["kind"] == "summarise"}
        used = {t.split("\n\n")[0] for t in corpus.SUMMARY_TEMPLATES}
        assert asked - used, "every phrasing of the benchmark is trained on"
        assert "Give me a short summary of this text:" not in used


class TestEverydayText:
    def test_everyday_prompts_are_explanations_and_stories_only_and_never_held_out(self):
        everyday = load("everyday_text")
        prompts = everyday.everyday_prompts(300, seed=44)
        assert len(prompts) == len({p["prompt"] for p in prompts}) == 300
        assert {p["kind"] for p in prompts} == {"explain", "creative"}  # prose to speak, no code
        assert not {p["prompt"] for p in heldout()} & {p["prompt"] for p in prompts}
        assert everyday.everyday_prompts(300, seed=44) == prompts  # the same file on every machine
