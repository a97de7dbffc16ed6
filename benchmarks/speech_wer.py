"""Word error rate the way Whisper's papers count it: jiwer over normalised texts.

English texts go through Transformers' ``EnglishTextNormalizer`` (Whisper's English normaliser:
contractions, spelled numbers to digits, British to American spelling, punctuation and case);
German and French through ``BasicTextNormalizer`` (case, punctuation, diacritics kept).
The British-American spelling table is not part of Transformers (the Hub checkpoints ship it as
``normalizer.json``); it is read from the ``whisper-normalizer`` package when that is installed,
else the normaliser runs without it (the eval sentences avoid British spellings where it matters).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Callable, Sequence


@lru_cache(maxsize=None)
def english_spelling_mapping() -> dict[str, str]:
    try:
        from importlib.resources import files

        return json.loads(files("whisper_normalizer").joinpath("normalizers/english.json").read_text(encoding="utf-8"))
    except (ModuleNotFoundError, FileNotFoundError):
        return {}


@lru_cache(maxsize=None)
def normalizer(language: str) -> Callable[[str], str]:
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    if language == "en":
        return EnglishTextNormalizer(english_spelling_mapping())
    return BasicTextNormalizer()


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str], language: str) -> float:
    """Corpus WER (errors over reference words) of ``hypotheses`` against ``references``, after normalising."""
    import jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    normalise = normalizer(language)
    refs = [normalise(t) for t in references]
    hyps = [normalise(t) for t in hypotheses]
    keep = [i for i, r in enumerate(refs) if r.strip()]  # jiwer refuses empty references
    return jiwer.wer([refs[i] for i in keep], [hyps[i] for i in keep])
