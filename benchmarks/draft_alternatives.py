"""How often the target's next token is among a model draft's top m at its first draft position.

That is what a token tree of m first-position candidates would add to a chain draft (SpecInfer's
and EAGLE-2's trees in their simplest shape): where the chain's first token is rejected but the
target's token is one of the other candidates, the iteration commits that candidate and the
target's next token after it, one token more than the chain. specdec's verify drafts a chain; this
measures the lever before anyone builds the tree.

    python benchmarks/draft_alternatives.py smollm2 [--per-kind 6] [--max-new-tokens 48]
    python benchmarks/draft_alternatives.py whisper --audio-dir /tmp/speech-eval [--limit 16]

Runs the shipped config (greedy, batch 1, one thread): SmolLM2 with prompt lookup else the
hidden-state head (``models/smollm2-135m-instruct-head``), or whisper-base with its distilled draft
(``models/whisper-base-draft``). Every time a model drafts, the draft's top 6 at its first
position is recorded, and once the request is done it is compared with the token the target
committed there. Counts only, no timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from specdec.core import drafting  # noqa: E402

TOP = 6


class FirstPositions:
    """Patches ``TokenByToken.add`` to keep, at each draft's first position, (state, row, position, top ids)."""

    def __init__(self):
        self.records: list[tuple] = []
        original = drafting.TokenByToken.add

        def add(token_by_token, scores):
            if token_by_token.drafted == 0:
                state = token_by_token.state
                top = scores.topk(TOP, dim=-1).indices.tolist()  # [B, TOP]
                rows = state.rows_host.tolist()
                for b, row in enumerate(rows):
                    self.records.append((state, row, int(state.lengths_host[row]), top[b]))
            return original(token_by_token, scores)

        drafting.TokenByToken.add = add

    def score(self, kind: str, counts: dict) -> None:
        """Compare this request's records with what was committed, into ``counts[kind]``."""
        for state, row, position, top in self.records:
            if position >= int(state.lengths_host[row]):
                continue  # the request ended before this position was committed
            committed = int(state.sequences_host[row, position])
            cell = counts.setdefault(kind, [0] * (TOP + 1))
            cell[0] += 1
            for m in range(1, TOP + 1):
                cell[m] += committed in top[:m]
        self.records.clear()


def smollm2(args, watch: FirstPositions) -> dict:
    from specdec import SpeculativeDecoder
    from specdec.config import SpecdecConfig

    config = SpecdecConfig.from_toml(ROOT / "models/smollm2-135m-instruct-head/plugins.toml")
    target, tokenizer = config.load_target()
    decoder = SpeculativeDecoder.from_config(config, target=target)
    prompts = [json.loads(line) for line in (ROOT / "benchmarks/smollm2_prompts.jsonl").read_text().splitlines() if line]
    taken = collections.Counter()
    counts: dict = {}
    for prompt in prompts:
        if taken[prompt["kind"]] >= args.per_kind:
            continue
        taken[prompt["kind"]] += 1
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        decoder.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=args.max_new_tokens)
        watch.score(prompt["kind"], counts)
    return counts


def whisper(args, watch: FirstPositions) -> dict:
    import whisper_real_speed as speed
    from specdec import SpeculativeDecoder
    from specdec.drafters import SharedEncoderDrafter
    from specdec.drafters.shared_encoder_draft import load_shared_encoder_draft
    from specdec.policies import CostAwareLookahead
    from specdec.whisper import WhisperSpeculativeDecoder

    target, processor = speed.load_target("whisper-base")
    draft = load_shared_encoder_draft(speed.DEFAULT_DRAFT, target)
    decoder = WhisperSpeculativeDecoder(SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft),
                                                           policy=CostAwareLookahead()))
    counts: dict = {}
    for row in speed.load_utterances(args.audio_dir, args.limit):
        decoder.generate(**speed.features_for(processor, [row], args.audio_dir), language="en", task="transcribe")
        watch.score("en", counts)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pair", choices=("smollm2", "whisper"))
    parser.add_argument("--per-kind", type=int, default=6, help="SmolLM2 held-out prompts per kind")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--audio-dir", type=Path, help="the eval set (benchmarks/build_speech_eval.py), for whisper")
    parser.add_argument("--limit", type=int, default=16, help="short English utterances, for whisper")
    args = parser.parse_args()
    if args.pair == "whisper" and args.audio_dir is None:
        parser.error("whisper needs --audio-dir")
    torch.set_num_threads(1)
    watch = FirstPositions()
    counts = smollm2(args, watch) if args.pair == "smollm2" else whisper(args, watch)
    counts["all"] = [sum(cell[i] for cell in counts.values()) for i in range(TOP + 1)]
    print("| kind | first drafts | " + " | ".join(f"top-{m}" for m in range(1, TOP + 1)) + " |")
    print("|---|---:|" + "---:|" * TOP)
    for kind, cell in counts.items():
        print(f"| {kind} | {cell[0]} | " + " | ".join(f"{cell[m] / max(cell[0], 1):.2f}" for m in range(1, TOP + 1)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
