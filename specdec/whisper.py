"""Speculative transcription with Whisper: transformers' own ``generate``, specdec's decoding loop.

``WhisperForConditionalGeneration.generate`` does everything around the decoding loop, and all of
it is kept: the decoder prompt (``<|startoftranscript|>``, the forced or detected language, the
task, ``<|notimestamps|>``), the logits processors (suppress-blank, suppressed tokens, the
timestamp grammar with its maximum initial timestamp), the encoder pass, and long-form
transcription in 30-second windows with its segments and seeking. specdec replaces only the loop
inside, through transformers' ``custom_generate`` hook (``SpeculativeDecoder.decoding_method``),
so the token ids are the target's own, greedy: token for token.

Not supported (they need per-token scores specdec does not return): ``logprob_threshold``,
``no_speech_threshold``, ``return_token_timestamps``, and beam search. Temperature fallback
samples, which the greedy verifier refuses.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs
import torch

from .core.types import DecodeOutput, DecodeStats
from .decoding import SpeculativeDecoder
from .errors import ConfigError

# Whisper's feature extractor: 16 kHz audio, one mel frame every 160 samples.
FRAMES_PER_SECOND = 100


def _whisper_target(instance, attribute, value):
    if not isinstance(value, SpeculativeDecoder):
        raise ConfigError(f"decoder must be a specdec SpeculativeDecoder, got {type(value).__name__}")
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    if not isinstance(value.target, WhisperGenerationMixin):
        raise ConfigError(
            f"the decoder's target is a {type(value.target).__name__}; speculative transcription needs a "
            "Whisper target (WhisperForConditionalGeneration)"
        )


@attrs.define
class WhisperStats:
    """Counts over one transcription: the loop's stats summed over every window, and the real-time factor.

    ``rtfx`` is audio seconds per compute second (higher is faster; 10 means ten seconds of audio
    transcribed per second).
    """

    decode: DecodeStats = attrs.field(factory=DecodeStats)
    windows: int = 0
    audio_seconds: float = 0.0
    compute_seconds: float = 0.0

    @property
    def rtfx(self) -> float:
        return self.audio_seconds / self.compute_seconds if self.compute_seconds else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Tokens committed per target forward, per row (tau, what speculation buys)."""
        return self.decode.mean_accepted_length

    def add(self, output: DecodeOutput) -> None:
        self.decode = self.decode + output.stats
        self.windows += 1

    def as_dict(self) -> dict:
        return {
            **self.decode.as_dict(),
            "windows": self.windows,
            "audio_seconds": self.audio_seconds,
            "compute_seconds": self.compute_seconds,
            "tokens_per_target_call": self.tokens_per_target_call,
            "rtfx": self.rtfx,
        }


@attrs.define(eq=False)
class WhisperSpeculativeDecoder:
    """Transcribe or translate with a Whisper target and any specdec drafter (``shared_encoder``,
    ``model`` with a small Whisper, ``ngram``).

    ``generate`` takes the arguments of ``WhisperForConditionalGeneration.generate`` and returns
    what it returns (greedy: the same token ids); ``stats`` describes the last call.
    """

    decoder: SpeculativeDecoder = attrs.field(validator=_whisper_target)
    stats: WhisperStats = attrs.field(factory=WhisperStats, init=False)

    @property
    def target(self):
        return self.decoder.target

    @torch.no_grad()
    def generate(
        self,
        input_features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        language: str | list[str] | None = None,
        task: str | None = None,
        return_timestamps: bool | None = None,
        return_segments: bool = False,
        monitor_progress: Callable[[torch.Tensor], None] | None = None,
        **kwargs: Any,
    ):
        """``target.generate(input_features, ...)``, decoded speculatively.

        ``attention_mask`` ([batch, frames], from the feature extractor with
        ``return_attention_mask=True``) tells long-form transcription where each audio ends.
        """
        for name in ("custom_generate", "assistant_model"):
            if name in kwargs:
                raise ConfigError(f"{name} cannot be combined with speculative transcription: specdec is the decoding loop")
        if not isinstance(input_features, torch.Tensor) or input_features.dim() != 3:
            shape = tuple(input_features.shape) if isinstance(input_features, torch.Tensor) else type(input_features).__name__
            raise ConfigError(f"input_features must be a [batch, mel bins, frames] tensor, got {shape}")
        self.stats = stats = WhisperStats()
        if attention_mask is not None:
            stats.audio_seconds = float(attention_mask.sum()) / FRAMES_PER_SECOND
        else:
            stats.audio_seconds = input_features.shape[0] * input_features.shape[-1] / FRAMES_PER_SECOND
        target = self.target
        started = time.perf_counter()
        try:
            result = target.generate(
                input_features.to(device=target.device, dtype=target.dtype),
                attention_mask=None if attention_mask is None else attention_mask.to(target.device),
                language=language,
                task=task,
                return_timestamps=return_timestamps,
                return_segments=return_segments,
                monitor_progress=monitor_progress,
                custom_generate=self.decoder.decoding_method(on_output=stats.add),
                **kwargs,
            )
        finally:
            stats.compute_seconds = time.perf_counter() - started
        return result


def speculative_whisper_generate(
    decoder: SpeculativeDecoder,
    input_features: torch.Tensor,
    language: str | list[str] | None = None,
    task: str | None = None,
    return_timestamps: bool | None = None,
    **kwargs: Any,
):
    """``decoder.target.generate(input_features, language=..., task=..., return_timestamps=...)``, speculatively.

    Returns what the target's ``generate`` returns: token ids ``[batch, tokens]`` (a dict with
    ``segments`` when ``return_segments=True``). Use ``WhisperSpeculativeDecoder`` for the stats.
    """
    return WhisperSpeculativeDecoder(decoder).generate(
        input_features, language=language, task=task, return_timestamps=return_timestamps, **kwargs
    )
