"""Real Whisper on real speech: WER of the target, and specdec's output checked token for token.

    python benchmarks/build_speech_eval.py --out /tmp/speech-eval
    specdec models fetch whisper-base
    python benchmarks/whisper_real_eval.py --audio-dir /tmp/speech-eval --model whisper-base

For every utterance (batch 1, language forced to the utterance's, task transcribe; long-form
audio in 30-second windows with timestamps, as ``model.generate`` does it): the target's own
``generate``, then ``WhisperSpeculativeDecoder`` with each drafter (``ngram``; ``model`` = the
same checkpoint loaded a second time, so every draft is accepted; ``draft`` = the distilled
shared-encoder draft of ``models/whisper-base-draft``). The token ids must be
identical; the script exits 1 otherwise. Prints the WER per language (jiwer, Whisper's
normalisers; ``speech_wer.py``) and the seconds per utterance of each way of decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from speech_wer import word_error_rate  # noqa: E402

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.convert import cached_model_path  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter, SharedEncoderDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.verifiers import GreedyVerifier  # noqa: E402
from specdec.whisper import WhisperSpeculativeDecoder  # noqa: E402


def load(path_or_name: str):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    path = Path(path_or_name) if Path(path_or_name).is_dir() else cached_model_path(path_or_name)
    if path is None:
        raise SystemExit(f"{path_or_name}: not converted; run: specdec models fetch {path_or_name}")
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, WhisperProcessor.from_pretrained(path), path


def inputs_for(processor, audio, long_form: bool):
    extractor = processor.feature_extractor
    if long_form:
        return extractor(audio, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                         return_attention_mask=True)
    return extractor(audio, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audio-dir", type=Path, required=True)
    parser.add_argument("--model", default="whisper-base", help="a name fetched into the cache, or a folder")
    parser.add_argument("--drafters", default="ngram,model")
    parser.add_argument("--draft", type=Path, default=Path(__file__).resolve().parent.parent / "models" / "whisper-base-draft",
                        help="the shared-encoder draft for the 'draft' drafter")
    parser.add_argument("--k", type=int, default=5, help="constant lookahead")
    parser.add_argument("--precision", default="int8", help="the draft's matmul_precision (whisper.toml's: int8)")
    parser.add_argument("--lean", action="store_true",
                        help="packed_weights and screened_head off (whisper.toml since stop 65: no copy of base's weights)")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--languages", default="en,de,fr")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every transcript and timing here (after each utterance)")
    parser.add_argument("--summary", type=Path, help="only print the tables of a --json file written before")
    args = parser.parse_args()
    if args.summary:
        rows = json.loads(args.summary.read_text())
        return summarize(rows, [name for name in rows[0]["time"] if name != "target"], args.languages.split(","))

    torch.set_num_threads(args.threads)
    target, processor, path = load(args.model)
    multilingual = target.generation_config.is_multilingual
    drafters = {}
    for name in args.drafters.split(","):
        if name == "ngram":
            drafters[name] = NGramDrafter()
        elif name == "model":
            drafters[name] = ModelDrafter(model=load(str(path))[0])
        elif name == "draft":  # the distilled reduced-head draft shipped in models/whisper-base-draft
            drafters[name] = SharedEncoderDrafter(model=str(args.draft), matmul_precision=args.precision)
        elif name:
            raise SystemExit(f"unknown drafter {name!r} (ngram, model, draft)")
    decoders = {name: WhisperSpeculativeDecoder(SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=args.k),
                                                                  verifier=GreedyVerifier(), packed_weights=not args.lean,
                                                                  screened_head=not args.lean))
                for name, drafter in drafters.items()}

    languages = args.languages.split(",")
    utterances = [u for u in json.loads((args.audio_dir / "utterances.json").read_text()) if u["language"] in languages]
    if not multilingual:
        utterances = [u for u in utterances if u["language"] == "en"]
    # Short utterances first, the languages taken in turn, then long-form: a run cut short still
    # covers every language.
    turn = {}
    for u in utterances:
        u["_turn"] = turn[u["language"], u["seconds"] > 30] = turn.get((u["language"], u["seconds"] > 30), -1) + 1
    utterances.sort(key=lambda u: (u["seconds"] > 30, u["_turn"], languages.index(u["language"])))
    if args.limit:
        utterances = utterances[: args.limit]
    rows, mismatches = [], 0
    for utterance in utterances:
        audio, rate = soundfile.read(args.audio_dir / utterance["file"], dtype="float32")
        assert rate == 16000, utterance["file"]
        long_form = utterance["seconds"] > 30
        batch = inputs_for(processor, audio, long_form)
        options = dict(attention_mask=batch.attention_mask, return_timestamps=long_form or None)
        if multilingual:
            options.update(language=utterance["language"], task="transcribe")
        started = time.perf_counter()
        with torch.no_grad():
            reference = target.generate(batch.input_features, **options)
        row = dict(id=utterance["id"], language=utterance["language"], seconds=utterance["seconds"], reference=utterance["text"],
                   text=processor.tokenizer.decode(reference[0], skip_special_tokens=True).strip(),
                   time={"target": time.perf_counter() - started}, identical={}, acceptance={}, tokens_per_call={})
        for name, decoder in decoders.items():
            started = time.perf_counter()
            out = decoder.generate(batch.input_features, **options)
            row["time"][name] = time.perf_counter() - started
            same = out.tolist() == reference.tolist()
            row["identical"][name] = same
            row["acceptance"][name] = decoder.stats.decode.acceptance_rate
            row["tokens_per_call"][name] = decoder.stats.tokens_per_target_call
            if not same:
                mismatches += 1
                print(f"  MISMATCH {utterance['id']} {name}: {processor.tokenizer.decode(out[0], skip_special_tokens=True)!r}")
        rows.append(row)
        times = " ".join(f"{k} {v:5.2f}s" for k, v in row["time"].items())
        print(f"{row['id']:<16} {row['seconds']:5.1f}s audio  {times}  identical={all(row['identical'].values())}  {row['text'][:60]!r}",
              flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    summarize(rows, list(decoders), languages)
    return 1 if mismatches else 0


def summarize(rows: list[dict], decoders: list[str], languages: list[str]) -> int:
    print()
    header = f"{'language':<9}{'utts':>5}{'audio s':>9}{'WER %':>7}  {'target s/utt':>12}" + "".join(
        f"  {name + ' s/utt':>12}  {name + ' accept':>12}  {name + ' tok/call':>13}" for name in decoders)
    print(header)
    for language in languages + ["all"]:
        subset = [r for r in rows if language in ("all", r["language"])]
        if not subset:
            continue
        if language == "all":
            wer = "    -"
        else:
            wer = f"{100 * word_error_rate([r['reference'] for r in subset], [r['text'] for r in subset], language):7.1f}"
        line = f"{language:<9}{len(subset):>5}{sum(r['seconds'] for r in subset) / len(subset):>9.1f}{wer:>7}  " \
               f"{sum(r['time']['target'] for r in subset) / len(subset):>12.2f}"
        for name in decoders:
            line += f"  {sum(r['time'][name] for r in subset) / len(subset):>12.2f}" \
                    f"  {sum(r['acceptance'][name] for r in subset) / len(subset):>12.2f}" \
                    f"  {sum(r['tokens_per_call'][name] for r in subset) / len(subset):>13.2f}"
        print(line)
    checks = sum(len(r["identical"]) for r in rows)
    same = sum(sum(r["identical"].values()) for r in rows)
    print(f"\ntoken-identical to target.generate: {same}/{checks} (utterance x drafter)")
    return 0 if same == checks else 1


if __name__ == "__main__":
    raise SystemExit(main())
