"""Reading sound files for Whisper targets: any format libsndfile reads, at any sample rate and
channel count, as 16 kHz mono float32. Library code: ``specdec transcribe`` uses it, and so can
anyone without the command line. Needs the ``audio`` extra (``pip install 'specdec[audio]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from .errors import ConfigError

SAMPLE_RATE = 16_000
WINDOW_SECONDS = 30.0  # Whisper's window: longer audio is transcribed long-form


class AudioError(Exception):
    """One file cannot be transcribed (unreadable, empty); the others go on."""


@attrs.frozen
class Audio:
    path: Path
    samples: Any  # numpy float32 [n], mono, 16 kHz

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def read_audio(path: str | Path) -> Audio:
    """Read a sound file as 16 kHz mono float32, or raise ``AudioError`` saying why not (a
    ``ConfigError`` when the audio libraries are not installed)."""
    try:
        import numpy as np
        import soundfile
        from scipy.signal import resample_poly
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"reading audio needs soundfile, numpy and scipy: pip install 'specdec[audio]' ({exc})") from exc
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"{path}: no such file")
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)  # [n, channels]
    except Exception as exc:  # libsndfile's errors vary by format and version
        raise AudioError(f"{path}: cannot read audio: {exc}") from exc
    if data.shape[0] == 0 or data.shape[1] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    samples = data.mean(axis=1)  # [n] mono
    if rate != SAMPLE_RATE:
        common = math.gcd(int(rate), SAMPLE_RATE)
        samples = resample_poly(samples, SAMPLE_RATE // common, int(rate) // common).astype(np.float32)
    if samples.shape[0] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    if not np.isfinite(samples).all():
        raise AudioError(f"{path}: the audio holds NaN or infinite samples")
    return Audio(path=path, samples=np.ascontiguousarray(samples, dtype=np.float32))
