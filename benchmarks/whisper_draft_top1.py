"""Teacher-forced top-1 of distilled Whisper drafts on the speech EVAL split: the share of base's own
greedy transcript tokens that a draft's greedy choice gets right given the transcript so far
(about the acceptance of its first draft token; the figure docs/whisper.md compares drafts by), and
the share of those tokens its head's token map holds, which bounds it.

    python benchmarks/build_speech_eval.py --out /tmp/speech-eval
    OMP_NUM_THREADS=1 python benchmarks/whisper_draft_top1.py --audio-dir /tmp/speech-eval \\
        --draft models/whisper-base-draft --draft /tmp/other-draft --cache /tmp/whisper-teacher-eval.pt

The eval utterances of at most 30 s in ``--languages`` (default en: the 24 short English ones) go
through the target once (encoder and greedy transcript, language forced, no timestamps; cached in
``--cache``), exactly as in training (``specdec.training.whisper_draft.cached_teacher_pass``).
``--init-layers 0`` (repeatable, e.g. 0 or 0,5) also scores an untrained draft built from the
target's layers with the map of ``--draft``'s first folder. ``--margins 100,50,0`` also scores each
draft with its cross-attention cut to each utterance's audio and that many encoder frames past it
(ceil(seconds x 50) + margin, one utterance at a time), as the ``shared-encoder`` drafter's
``encoder_frames = "audio"`` reads (stop 60: 100 frames keep 77.1 % of the draft's 77.6 %).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audio-dir", type=Path, required=True)
    parser.add_argument("--target", default="whisper-base")
    parser.add_argument("--draft", type=Path, action="append", default=[], help="a draft folder (repeatable)")
    parser.add_argument("--init-layers", action="append", default=[], help="also an untrained draft of these layers")
    parser.add_argument("--languages", default="en")
    parser.add_argument("--cache", type=Path, help="keep the eval teacher pass in this file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--margins", default="", help="comma-separated encoder frames past the audio (see above)")
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    from specdec.config import resolve_model
    from specdec.core.models import load_pretrained
    from specdec.drafters.shared_encoder_draft import build_draft, load_shared_encoder_draft
    from specdec.training.whisper_draft import TeacherData, cached_teacher_pass, heldout_top1, read_utterances

    torch.set_num_threads(args.threads)
    path = resolve_model(args.target, who="--target")
    target = load_pretrained(WhisperForConditionalGeneration, path, dtype=torch.float32, who="--target").eval()
    processor = AutoProcessor.from_pretrained(str(path))
    utterances = read_utterances(args.audio_dir, [x for x in args.languages.split(",") if x])
    started = time.perf_counter()
    data = cached_teacher_pass(target, processor, utterances, args.cache)
    teacher_s = time.perf_counter() - started
    tokens = sum(len(label) - data.prompt_length for label in data.labels)
    print(f"{len(utterances)} utterances, {sum(u.seconds for u in utterances):.0f} s of audio, {tokens} label "
          f"tokens; teacher pass {teacher_s:.1f} s ({teacher_s / len(utterances):.2f} s/utterance, 0 if cached)")
    rows = list(range(len(utterances)))
    results = []
    drafts = [(str(folder), load_shared_encoder_draft(folder, target)) for folder in args.draft]
    for layers in args.init_layers:
        if not drafts:
            raise SystemExit("--init-layers needs a --draft for its token map")
        ids = [int(x) for x in layers.split(",")]
        drafts.append((f"untrained, layers {ids}", build_draft(target, drafts[0][1].token_map, init_layers=ids)))
    for name, draft in drafts:
        started = time.perf_counter()
        top1 = heldout_top1(draft, data, rows, target.config.vocab_size)
        # The draft can only name tokens its head scores: the share of the eval tokens in its map is
        # the ceiling on its top-1 (stop 62: the 8,192-token map held 90.8 % of them).
        in_map = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        in_map[draft.token_map] = True
        spoken = torch.tensor([t for label in data.labels for t in label[data.prompt_length:]], dtype=torch.long)
        coverage = float(in_map[spoken].float().mean())
        results.append({"draft": name, "top1": top1, "layers": draft.config.decoder_layers, "map_coverage": coverage,
                        "head": int(draft.token_map.numel()), "seconds": time.perf_counter() - started})
        print(f"{name}: teacher-forced top-1 {top1:.1%} ({draft.config.decoder_layers} layer(s), "
              f"{draft.token_map.numel()}-token head holding {coverage:.1%} of the eval tokens)")
        for margin in [int(m) for m in args.margins.split(",") if m.strip()]:
            right = seen = 0
            for row, utterance in enumerate(utterances):
                frames = min(data.encoder_states.shape[1], math.ceil(utterance.seconds * 50) + margin)
                cut = TeacherData(data.encoder_states[row : row + 1, :frames], [data.labels[row]], data.prompt_length)
                tokens = len(data.labels[row]) - data.prompt_length
                right += heldout_top1(draft, cut, [0], target.config.vocab_size) * tokens
                seen += tokens
            results.append({"draft": name, "margin": margin, "top1": right / max(seen, 1)})
            print(f"{name}, the audio's encoder frames and {margin} more: teacher-forced top-1 {right / max(seen, 1):.1%}")
    if args.json:
        args.json.write_text(json.dumps({"utterances": len(utterances), "tokens": tokens, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
