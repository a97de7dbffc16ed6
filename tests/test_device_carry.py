"""``benchmarks/device_carry.py``: folders cut into parts and joined back, on small made-up folders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from device_carry import main  # noqa: E402


@pytest.fixture
def folders(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # float32 values that came from float16, as a converted CTranslate2 checkpoint's do
    weights = {"w": torch.randn(64, 64, dtype=torch.float16).float(), "steps": torch.arange(5)}
    save_file(weights, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"d_model": 64}')
    audio = tmp_path / "audio" / "nested"
    audio.mkdir(parents=True)
    (audio / "clip.bin").write_bytes(bytes(range(256)) * 400)
    return tmp_path, weights


def split(tmp_path, *extra) -> int:
    return main(["split", "--out", str(tmp_path / "parts"), "--part-mib", "0.01",
                 f"model={tmp_path / 'model'}", f"audio={tmp_path / 'audio'}", *extra])


def test_parts_join_into_the_same_folders_with_float32_weights_stored_in_float16(folders, capsys):
    tmp_path, weights = folders
    assert split(tmp_path, "--float16", "model") == 0
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert len(parts) > 5 and all(p.stat().st_size <= 0.01 * 2**20 for p in parts)
    assert main(["join", str(tmp_path / "parts"), "--to", str(tmp_path / "joined")]) == 0
    joined = tmp_path / "joined"
    assert (joined / "audio" / "nested" / "clip.bin").read_bytes() == (tmp_path / "audio" / "nested" / "clip.bin").read_bytes()
    assert (joined / "model" / "config.json").read_text() == '{"d_model": 64}'
    carried = load_file(str(joined / "model" / "model.safetensors"))
    assert carried["w"].dtype == torch.float16 and torch.equal(carried["w"].float(), weights["w"])
    assert torch.equal(carried["steps"], weights["steps"])


def test_a_missing_or_damaged_part_is_named_and_nothing_is_unpacked(folders, capsys):
    tmp_path, _ = folders
    assert split(tmp_path) == 0
    (tmp_path / "parts" / "part-001").unlink()
    damaged = tmp_path / "parts" / "part-003"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    assert main(["join", str(tmp_path / "parts"), "--to", str(tmp_path / "joined")]) == 2
    error = capsys.readouterr().err
    assert "part-001 (missing)" in error and "part-003 (damaged)" in error
    assert not (tmp_path / "joined").exists()


def test_float16_is_refused_where_a_value_would_change(folders, capsys):
    tmp_path, _ = folders
    save_file({"w": torch.full((4,), 0.1, dtype=torch.float32)}, str(tmp_path / "model" / "model.safetensors"))
    assert split(tmp_path, "--float16", "model") == 2
    assert "tensor 'w' is not exactly representable in float16" in capsys.readouterr().err


def test_bad_arguments_are_named(folders, capsys):
    tmp_path, _ = folders
    assert main(["split", "--out", str(tmp_path / "parts"), "model"]) == 2
    assert "'model': give each folder as NAME=FOLDER" in capsys.readouterr().err
    assert split(tmp_path, "--float16", "weights") == 2
    assert "--float16 weights: not among the folders to carry" in capsys.readouterr().err
    assert split(tmp_path) == 0
    assert split(tmp_path) == 2  # into the same folder again
    assert "is not empty" in capsys.readouterr().err
