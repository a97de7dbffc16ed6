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

``--sources`` takes more English than the standard library's docstrings (default: ``stdlib`` only,
which rebuilds the shipped draft's first set byte-identically), all offline:

- ``pydoc``: the Python reference manual's prose that ``pydoc`` ships (``pydoc_data.topics``);
- ``packages``: docstrings of the third-party packages installed next to this Python (read with
  ``ast``, nothing imported), each package a source of its own;
- ``metadata``: the long descriptions in the installed packages' ``METADATA``;
- ``docs``: ``/usr/share/doc`` READMEs, NEWS and copyright files, and ``/usr/share/common-licenses``;
- ``texts``: the ``answer`` (or ``text``) fields of the JSON Lines file ``--texts`` names, e.g. a
  chat model's answers to everyday prompts (``benchmarks/everyday_text.py``): the prose above is
  technical, and what people dictate is not.
- ``fortunes``: everyday English that Debian ships, the quips, quotations and proverbs of the
  ``fortunes`` and ``fortunes-min`` packages (``apt-get install fortunes fortunes-min``; every
  ``%``-separated entry of ``/usr/share/games/fortunes/*.u8`` but ``art`` and ``ascii-art``). The
  shipped whisper-base draft (stop 59) was trained with 1,153 utterances of it:

    python benchmarks/build_speech_train_prose.py --out /tmp/speech-fortunes --count 1200 --seconds 24 \
        --sources fortunes --name fortune

Only plain sentences are kept (``plain_sentences``: 6-24 words, starting with a capital and ending
with . ! or ?, no digits, code symbols, URLs, CamelCase or dotted names, no very long words). With
several sources, each source's sentences are shuffled (``--seed``) and the sources are interleaved
one sentence at a time, so every prefix of the set (a subset for quick trials) mixes all of them.

    python benchmarks/build_speech_train_prose.py --out /tmp/speech-prose-big --count 1200 --seconds 24 \
        --sources stdlib,pydoc,packages,metadata,docs --merge /tmp/speech-train --merge-templates 40
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
SYMBOLS = re.compile(r"[_=(){}\[\]<>*`#|\\/@$%^~0-9&+:;\"]|\.\w|--|\.\.|\bhttps?\b|\bwww\b")
CODE_WORD = re.compile(r"[a-z][A-Z]|[A-Z]{2,}[a-z]|^[a-z]+[A-Z]")
SOURCES = ("stdlib", "pydoc", "packages", "metadata", "docs", "texts", "fortunes")
FORTUNES = Path("/usr/share/games/fortunes")
FORTUNE_FILES_LEFT_OUT = ("art", "ascii-art")  # pictures drawn in characters, not sentences
# Third-party packages whose docstrings are read (those installed; the venv's own tools are left out).
PACKAGES = ("transformers", "torch", "numpy", "scipy", "sympy", "networkx", "hypothesis", "rich", "typer", "click",
            "pydantic", "huggingface_hub", "jinja2", "accelerate", "pygments", "attr", "anyio", "more_itertools",
            "requests", "urllib3", "markdown_it", "fsspec", "filelock", "mpmath", "jiwer", "rapidfuzz",
            "safetensors", "tokenizers", "faster_whisper", "ctranslate2", "gguf", "psutil", "packaging",
            "pluggy", "_pytest", "yaml", "tqdm", "soundfile", "av", "onnxruntime", "setuptools", "pip")


def plain_sentences(text: str) -> list[str]:
    """The plain English sentences of ``text``: 6-24 words, from a capital to . ! or ? followed by a
    space or the end, without digits, code symbols, URLs, CamelCase or dotted names, or words over 18 letters. Paragraphs are
    split at blank lines and their whitespace joined, so a sentence may span lines."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        joined = " ".join(paragraph.split())
        for match in SENTENCE.finditer(joined):
            sentence = match.group()
            if joined[match.end() : match.end() + 1] not in ("", " "):
                continue  # cut at a dotted name ("torch.nn") or an abbreviation ("e.g.")
            words = sentence.split()
            if not 6 <= len(words) <= 24 or SYMBOLS.search(sentence[:-1]):
                continue
            if any(CODE_WORD.search(w) or len(w) > 18 for w in words):
                continue
            letters = sum(c.isalpha() for c in sentence)
            if letters < 0.75 * len(sentence):
                continue
            out.append(sentence)
    return out


def interleave(sources: list[list[str]]) -> list[str]:
    """One sentence of each source in turn (a source that runs out drops out)."""
    out = []
    for index in range(max((len(s) for s in sources), default=0)):
        out += [s[index] for s in sources if index < len(s)]
    return out


def disjoint(sentences, seen: set[str]) -> list[str]:
    """``sentences`` less those seen before, and those that equal, contain or are contained in an eval
    sentence (``seen`` is updated)."""
    evals = [s.lower() for group in EVAL_SENTENCES.values() for s in group]
    out = []
    for sentence in sentences:
        low = sentence.lower()
        if low in seen or any(e in low or low in e for e in evals):
            continue
        seen.add(low)
        out.append(sentence)
    return out


def pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _site_packages() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def package_texts(package: str) -> list[str]:
    """The docstrings (module, class, function) of every .py file of ``package``, read with ``ast``."""
    import ast

    root = _site_packages() / package
    files = sorted(root.rglob("*.py")) if root.is_dir() else ([root.with_suffix(".py")] if root.with_suffix(".py").is_file() else [])
    out = []
    for file in files:
        if any(part in ("tests", "test", "testing", "_vendor", "vendor") for part in file.relative_to(root.parent).parts):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.append(doc)
    return out


def file_texts(path: Path) -> list[str]:
    """The ``answer`` field (else ``text``) of every line of a JSON Lines file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"--texts {path}: cannot read it ({exc.strerror or exc})") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--texts {path}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("answer", row.get("text")), str):
            raise SystemExit(f"--texts {path}, line {number}: needs an 'answer' or 'text' string")
        texts.append(row.get("answer", row.get("text")))
    return texts


def fortune_texts(root: Path | None = None) -> list[str]:
    """Every entry of the fortune files under ``root`` (default FORTUNES; files in name order,
    ``%``-separated, their whitespace collapsed), but those of FORTUNE_FILES_LEFT_OUT."""
    root = root or FORTUNES
    files = [f for f in sorted(root.glob("*.u8")) if f.name[: -len(".u8")] not in FORTUNE_FILES_LEFT_OUT]
    if not files:
        raise SystemExit(f"the 'fortunes' source reads {root}/*.u8, and there are none: "
                         "apt-get install fortunes fortunes-min")
    out = []
    for file in files:
        for entry in file.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            entry = " ".join(entry.split())
            if entry:
                out.append(entry)
    return out


def metadata_texts() -> list[str]:
    """The long descriptions (the body after the headers) of the installed packages' METADATA."""
    out = []
    for file in sorted(_site_packages().glob("*.dist-info/METADATA")):
        text = file.read_text(encoding="utf-8", errors="replace")
        _, _, body = text.partition("\n\n")
        out.append(body)
    return out


def doc_texts(roots=(Path("/usr/share/doc"), Path("/usr/share/common-licenses"))) -> list[str]:
    """README, NEWS and copyright files under /usr/share/doc (gzip too) and the common licenses."""
    import gzip

    out = []
    for root in roots:
        if not root.is_dir():
            continue
        for file in sorted(root.rglob("*")):
            name = file.name.lower()
            if not file.is_file() or file.is_symlink():
                continue
            if root.name == "doc" and not name.startswith(("readme", "news", "copyright", "changes", "faq")):
                continue
            try:
                data = file.read_bytes()
                if name.endswith(".gz"):
                    data = gzip.decompress(data)
                out.append(data[:200_000].decode("utf-8", errors="replace"))
            except (OSError, EOFError, ValueError):
                continue
    return out


def source_sentences(sources, seed: int = 0, texts: Path | None = None) -> list[str]:
    """The sentences of ``sources`` (names in SOURCES), disjoint from the eval set and each other:
    ``stdlib`` alone in module order (the shipped draft's set); several, each shuffled with ``seed``
    and interleaved (each third-party package a source of its own). ``texts`` is the file the
    ``texts`` source reads."""
    import random

    if list(sources) == ["stdlib"]:
        return stdlib_sentences()
    seen: set[str] = set()
    groups = []
    for source in sources:
        if source == "stdlib":
            groups.append(stdlib_sentences())
        elif source == "pydoc":
            groups.append([x for text in pydoc_texts() for x in plain_sentences(text)])
        elif source == "packages":
            groups += [[x for text in package_texts(p) for x in plain_sentences(text)] for p in PACKAGES]
        elif source == "metadata":
            groups.append([x for text in metadata_texts() for x in plain_sentences(text)])
        elif source == "docs":
            groups.append([x for text in doc_texts() for x in plain_sentences(text)])
        elif source == "texts":
            if texts is None:
                raise SystemExit("the 'texts' source reads the file --texts names")
            groups.append([x for text in file_texts(texts) for x in plain_sentences(text)])
        elif source == "fortunes":
            groups.append([x for text in fortune_texts() for x in plain_sentences(text)])
        else:
            raise SystemExit(f"unknown source {source!r}: one of {', '.join(SOURCES)}")
    kept = []
    for group in groups:
        group = disjoint(group, seen)
        random.Random(seed).shuffle(group)
        kept.append(group)
    return interleave(kept)


def stdlib_sentences() -> list[str]:
    """Plain sentences of 6-24 words from the docstrings of the standard library's modules, in module order."""
    import importlib

    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.endswith(("lib/python3.11", "python3.11"))
                   and not m.name.startswith("_"))
    seen, out = set(), []
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
                kept = [sentence for sentence in SENTENCE.findall(text) if 6 <= len(sentence.split()) <= 24
                        and not re.search(r"[_=(){}\[\]<>*`#|\\/@$%^~0-9]|\.\w", sentence[:-1])]
                out += disjoint(kept, seen)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=240, help="utterances to build")
    parser.add_argument("--seconds", type=float, default=20.0, help="join sentences up to about this long")
    parser.add_argument("--merge", type=Path, action="append", default=[],
                        help="another split to list with these in OUT/all/utterances.json (repeatable)")
    parser.add_argument("--merge-templates", type=int, default=-1,
                        help="of --merge's template sentences (ids with 'gen'), keep only the first N (-1: all)")
    parser.add_argument("--sources", default="stdlib", help=f"comma-separated, of {', '.join(SOURCES)} (see above)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of each source's sentences")
    parser.add_argument("--texts", type=Path, help="the JSON Lines file of the 'texts' source")
    parser.add_argument("--name", default="prose", help="the utterances' id and file prefix (distinct per set you merge)")
    args = parser.parse_args()
    if missing_tools():
        raise SystemExit(f"needs {' and '.join(missing_tools())} on PATH")
    sentences = source_sentences([x.strip() for x in args.sources.split(",") if x.strip()], args.seed, args.texts)
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
            row = dict(id=f"{args.name}-en-{index:04d}", language="en", voice=voice, speed=speed, text=text,
                       file=f"{args.name}-en-{index:04d}.wav")
            row["seconds"] = round(speak(text, voice, speed, args.out / row["file"], Path(scratch)), 3)
            if row["seconds"] <= 30:  # one window each
                rows.append(row)
    (args.out / "utterances.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"{len(rows)} utterances, {sum(r['seconds'] for r in rows) / 60:.1f} min, from {len(sentences)} sentences, in {args.out}")
    if args.merge:
        merged = []
        for folder in args.merge:
            other = json.loads((folder / "utterances.json").read_text())
            if args.merge_templates >= 0:
                templates = [r for r in other if "gen" in r["id"]][: args.merge_templates]
                other = [r for r in other if "gen" not in r["id"]] + templates
            merged += [dict(r, file=str((folder / r["file"]).resolve())) for r in other]
        merged += [dict(r, file=str((args.out / r["file"]).resolve())) for r in rows]
        if len({r["id"] for r in merged}) < len(merged):
            raise SystemExit("the merged sets share utterance ids: give each its own --name")
        (args.out / "all").mkdir(exist_ok=True)
        (args.out / "all" / "utterances.json").write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
        print(f"{len(merged)} utterances listed in {args.out / 'all' / 'utterances.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
