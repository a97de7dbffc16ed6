"""Build the speech evaluation set (or the disjoint training split) with espeak-ng and sox.

    python benchmarks/build_speech_eval.py --out /tmp/speech-eval
    python benchmarks/build_speech_eval.py --out /tmp/speech-train --split train --generated 200

Every utterance of ``speech_eval_data.py`` is spoken by espeak-ng (its voice and speed), then
resampled by sox to 16 kHz mono 16-bit WAV (repeatable mode, no dither, so a rebuild with the same
espeak-ng and sox gives the same bytes). ``DIR/utterances.json`` lists id, file, language, text
(the reference), voice, speed and seconds, with the espeak-ng and sox versions. Short utterances
must be 3-30 s and long-form ones over 30 s; the build fails otherwise. Audio stays out of git.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speech_eval_data import check_disjoint, utterances  # noqa: E402

SAMPLE_RATE = 16000


def tool_version(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]


def missing_tools() -> list[str]:
    return [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]


def speak(text: str, voice: str, speed: int, out: Path, scratch: Path) -> float:
    """Speak ``text`` into ``out`` (16 kHz mono 16-bit); returns its duration in seconds."""
    raw = scratch / "raw.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), "--", text], check=True, capture_output=True)
    subprocess.run(["sox", "-R", "-D", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(out)], check=True, capture_output=True)
    samples = int(subprocess.run(["soxi", "-s", str(out)], capture_output=True, text=True, check=True).stdout)
    return samples / SAMPLE_RATE


def build(out: Path, split: str = "eval", generated: int = 200, limit: int = 0, progress=print) -> list[dict]:
    missing = missing_tools()
    if missing:
        raise SystemExit(f"needs {' and '.join(missing)} on PATH (Debian: apt-get install espeak-ng sox)")
    check_disjoint()
    rows = utterances(split, generated=generated)
    if limit:
        rows = rows[:limit]
    out.mkdir(parents=True, exist_ok=True)
    problems = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, row in enumerate(rows):
            row["file"] = f"{row['id']}.wav"
            row["seconds"] = round(speak(row["text"], row["voice"], row["speed"], out / row["file"], Path(scratch)), 3)
            long_form = "long" in row["id"]
            if long_form and row["seconds"] <= 30:
                problems.append(f"{row['id']} is long-form but only {row['seconds']} s")
            if not long_form and not 3 <= row["seconds"] <= 30:
                problems.append(f"{row['id']} is {row['seconds']} s, outside 3-30 s")
            if progress and (index + 1) % 20 == 0:
                progress(f"{index + 1}/{len(rows)}")
    manifest = {
        "split": split,
        "espeak_ng": tool_version(["espeak-ng", "--version"]),
        "sox": tool_version(["sox", "--version"]),
        "sample_rate": SAMPLE_RATE,
        "utterances": rows,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "utterances.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if problems:
        raise SystemExit("; ".join(problems))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the WAV files and utterances.json")
    parser.add_argument("--split", choices=["eval", "train"], default="eval")
    parser.add_argument("--generated", type=int, default=200, help="train split: how many template sentences to add")
    parser.add_argument("--limit", type=int, default=0, help="only the first N utterances (a quick look)")
    args = parser.parse_args()
    rows = build(args.out, args.split, args.generated, args.limit)
    seconds = sum(r["seconds"] for r in rows)
    by_language = {}
    for row in rows:
        by_language[row["language"]] = by_language.get(row["language"], 0) + 1
    print(f"{len(rows)} utterances ({', '.join(f'{k} {v}' for k, v in by_language.items())}), "
          f"{seconds / 60:.1f} min of audio, in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
