"""More English training speech for the distilled Whisper draft: prose from the Python standard
library's docstrings, spoken by espeak-ng, several sentences per utterance.

    python benchmarks/build_speech_eval.py --out /tmp/speech-train --split train --generated 400
    python benchmarks/build_speech_train_prose.py --out /tmp/speech-prose --count 200 --merge /tmp/speech-train \
        --merge-templates 40

Why: the training split's template sentences use about a hundred words, and a draft trained on
them learns the templates (held-out top-1 75% on them, 25% on the eval sentences). Docstrings are
plenty of varied English offline. Sentences are joined until an utterance is about 20 s, because
Whisper's encoder always reads a 30-second window: longer utterances give more label tokens per
encoder pass (the teacher pass's main cost). No sentence equals or contains an eval sentence, or
is contained in one. ``--merge DIR`` writes ``OUT/all/utterances.json`` listing DIR's utterances
and these (absolute paths), for ``specdec drafter distill-whisper --audio-dir OUT/all``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pkgutil
import re
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_speech_eval import missing_tools, speak  # noqa: E402
from speech_eval_data import EVAL_SENTENCES, VOICES  # noqa: E402

SENTENCE = re.compile(r"[A-Z][a-z][^.!?]*[a-z][.!?]")


def stdlib_sentences() -> list[str]:
    """Plain sentences of 6-24 words from the docstrings of the standard library's modules, in module order."""
    import importlib

    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.endswith(("lib/python3.11", "python3.11"))
                   and not m.name.startswith("_"))
    seen, out = set(), []
    evals = [s.lower() for sentences in EVAL_SENTENCES.values() for s in sentences]
    for name in names:
        if name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - some modules need what is not installed
            continue
        docs = [inspect.getdoc(module) or ""]
        for _, member in sorted(vars(module).items()):
            if (inspect.isfunction(member) or inspect.isclass(member)) and getattr(member, "__module__", "") == name:
                docs.append(inspect.getdoc(member) or "")
        for doc in docs:
            for paragraph in doc.split("\n\n"):
                text = " ".join(paragraph.split())
                for sentence in SENTENCE.findall(text):
                    words = sentence.split()
                    if not 6 <= len(words) <= 24 or re.search(r"[_=(){}\[\]<>*`#|\\/@$%^~0-9]|\.\w", sentence[:-1]):
                        continue
                    low = sentence.lower()
                    if low in seen or any(e in low or low in e for e in evals):
                        continue
                    seen.add(low)
                    out.append(sentence)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=240, help="utterances to build")
    parser.add_argument("--seconds", type=float, default=20.0, help="join sentences up to about this long")
    parser.add_argument("--merge", type=Path, help="another split to list with these in OUT/all/utterances.json")
    parser.add_argument("--merge-templates", type=int, default=-1,
                        help="of --merge's template sentences (ids with 'gen'), keep only the first N (-1: all)")
    args = parser.parse_args()
    if missing_tools():
        raise SystemExit(f"needs {' and '.join(missing_tools())} on PATH")
    sentences = stdlib_sentences()
    # About 2.6 words per second at espeak's speeds here: a word budget per utterance.
    budget = int(args.seconds * 2.6)
    groups, current = [], []
    for sentence in sentences:
        current.append(sentence)
        if sum(len(s.split()) for s in current) >= budget:
            groups.append(" ".join(current))
            current = []
        if len(groups) == args.count:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, text in enumerate(groups):
            voice, speed = VOICES["en"][index % len(VOICES["en"])]
            row = dict(id=f"prose-en-{index:04d}", language="en", voice=voice, speed=speed, text=text,
                       file=f"prose-en-{index:04d}.wav")
            row["seconds"] = round(speak(text, voice, speed, args.out / row["file"], Path(scratch)), 3)
            if row["seconds"] <= 30:  # one window each
                rows.append(row)
    (args.out / "utterances.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"{len(rows)} utterances, {sum(r['seconds'] for r in rows) / 60:.1f} min, from {len(sentences)} sentences, in {args.out}")
    if args.merge:
        other = json.loads((args.merge / "utterances.json").read_text())
        if args.merge_templates >= 0:
            templates = [r for r in other if "gen" in r["id"]][: args.merge_templates]
            other = [r for r in other if "gen" not in r["id"]] + templates
        merged = [dict(r, file=str((args.merge / r["file"]).resolve())) for r in other]
        merged += [dict(r, file=str((args.out / r["file"]).resolve())) for r in rows]
        (args.out / "all").mkdir(exist_ok=True)
        (args.out / "all" / "utterances.json").write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
        print(f"{len(merged)} utterances listed in {args.out / 'all' / 'utterances.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
