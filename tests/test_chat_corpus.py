"""The offline chat corpus for the hidden-state head: its prompts stay clear of the held-out benchmark's."""

from __future__ import annotations

import json
import random

from tests.test_speech_eval import BENCHMARKS, load

# The held-out prompts' topics (benchmarks/smollm2_prompts.jsonl): a training prompt on any of them
# would measure the head on what it was fitted to.
HELDOUT_TOPICS = load("chat_corpus").HELDOUT_TOPICS


def heldout() -> list[dict]:
    return [json.loads(line) for line in (BENCHMARKS / "smollm2_prompts.jsonl").read_text().splitlines() if line.strip()]


class TestGeneralPrompts:
    def test_no_heldout_prompt_or_topic(self):
        corpus = load("chat_corpus")
        prompts = corpus.general_prompts(random.Random(1), 10**6, corpus._heldout_prompts())
        texts = [p["prompt"].lower() for p in prompts]
        assert len(texts) == len(set(texts)) > 1000
        assert not {p["prompt"] for p in heldout()} & {p["prompt"] for p in prompts}
        # a few prompts on held-out topics are asked (the lists of stop 53 were answered so); build drops them
        kept = [t for t in texts if not corpus.on_heldout_topic(t)]
        assert len(texts) - len(kept) <= 10 and len(kept) > 1000
        for topic in HELDOUT_TOPICS:
            assert not [t for t in kept if topic in t], topic

    def test_every_heldout_prompt_is_on_a_heldout_topic(self):
        """The topic list covers the benchmark: a prompt added there needs its topic here."""
        corpus = load("chat_corpus")
        assert all(corpus.on_heldout_topic(p["prompt"]) for p in heldout())

    def test_build_leaves_out_every_pair_on_a_heldout_topic(self, tmp_path, monkeypatch):
        import transformers

        class Template:  # only the chat template is read from the target's tokenizer here
            def apply_chat_template(self, messages, tokenize=False):
                return "\n".join(f"<{m['role']}>{m['content']}" for m in messages)

        corpus = load("chat_corpus")
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Template())
        monkeypatch.setattr(corpus, "stdlib_pairs", lambda rng: [
            {"kind": "explain", "source": "inspect.stack", "prompt": "Explain what `inspect.stack` does.", "answer": "a"},
            {"kind": "explain", "source": "json.dumps", "prompt": "Explain what `json.dumps` does.", "answer": "b"}])
        monkeypatch.setattr(corpus, "package_pairs", lambda rng: [])
        out = tmp_path / "corpus.jsonl"
        counts = corpus.build("unused", out, self_count=0)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["prompt"] for r in rows] == ["Explain what `json.dumps` does."] and counts == {"explain": 1}
        assert rows[0]["text"] == "<user>Explain what `json.dumps` does.\n<assistant>b"

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
