"""Carry folders too large for one call of the device tool to its machine, in parts, across warm calls.

A call of the device tool carries at most 64 MiB, the working tree included; real whisper-base
(float16, as its CTranslate2 checkpoint ships) is 145 MB. ``split`` packs folders into one tar
stream and cuts it into parts of at most ``--part-mib`` MiB under an ignored folder of the checkout
(add it to ``.git/info/exclude``); each device call names a few parts in its ``carry``, and the
parts stay on the warm machine from call to call; the call that uses them runs ``join``, which
checks each part's and the whole stream's SHA-256 against the manifest and unpacks the folders.

    # here: whisper-base's converted float32 weights stored as float16 (exact: they were float16),
    # its shipped draft and the speech eval set, cut in parts of 40 MiB
    python benchmarks/device_carry.py split --out .carry/whisper --part-mib 40 --float16 whisper-base \\
        whisper-base=$HOME/.cache/specdec/models/whisper-base whisper-base-draft=models/whisper-base-draft \\
        speech-eval=/tmp/speech-eval
    # there, after the calls that carried .carry/whisper/part-000 ... and the manifest:
    python benchmarks/device_carry.py join .carry/whisper --to /tmp/carried

``join`` names the missing or damaged parts (a machine given back between calls loses them all:
the device tool keeps a machine 30 s after a call). ``--float16 NAME`` stores NAME's float32
``.safetensors`` tensors in float16 and refuses where that would change a value.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
PART = "part-{:03d}"


class CarryError(Exception):
    """A folder, part or manifest that cannot be carried or joined, named."""


def _halved(file: Path) -> bytes:
    """``file``'s safetensors with every float32 tensor in float16, refused where a value would change."""
    import torch
    from safetensors.torch import load_file, save

    tensors = load_file(str(file))
    for name, tensor in tensors.items():
        if tensor.dtype == torch.float32:
            half = tensor.to(torch.float16)
            if not torch.equal(half.to(torch.float32), tensor):
                raise CarryError(f"{file}: tensor {name!r} is not exactly representable in float16; "
                                 "carry this folder without --float16")
            tensors[name] = half
    return save(tensors)


def split(folders: dict[str, Path], out: Path, part_mib: float, float16: set[str]) -> dict:
    """Pack ``folders`` (name -> folder) into parts of ``out``; returns the manifest it wrote."""
    unknown = float16 - set(folders)
    if unknown:
        raise CarryError(f"--float16 {', '.join(sorted(unknown))}: not among the folders to carry ({', '.join(folders)})")
    for name, folder in folders.items():
        if not folder.is_dir():
            raise CarryError(f"{name}={folder}: not a folder")
    if out.exists() and any(out.iterdir()):
        raise CarryError(f"{out} is not empty: split into a new folder (old parts would mix with new ones)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as stream:
        with tarfile.open(fileobj=stream, mode="w") as tar:
            for name, folder in folders.items():
                for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                    arcname = f"{name}/{file.relative_to(folder)}"
                    if name in float16 and file.suffix == ".safetensors":
                        data = _halved(file)
                        info = tarfile.TarInfo(arcname)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                    else:
                        tar.add(str(file), arcname=arcname, recursive=False)
        size, whole, parts = stream.tell(), hashlib.sha256(), []
        stream.seek(0)
        chunk = int(part_mib * 2**20)
        while data := stream.read(chunk):
            whole.update(data)
            path = out / PART.format(len(parts))
            path.write_bytes(data)
            parts.append({"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"folders": list(folders), "bytes": size, "sha256": whole.hexdigest(), "parts": parts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def join(parts_dir: Path, to: Path) -> list[str]:
    """Check ``parts_dir``'s parts against its manifest and unpack them under ``to``; returns the folders."""
    try:
        manifest = json.loads((parts_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise CarryError(f"{parts_dir / MANIFEST}: no manifest (carry it with the parts)") from None
    whole, bad = hashlib.sha256(), []
    for part in manifest["parts"]:
        path = parts_dir / part["file"]
        data = path.read_bytes() if path.is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != part["sha256"]:
            bad.append(f"{part['file']} ({'missing' if data is None else 'damaged'})")
        else:
            whole.update(data)
    if bad:
        raise CarryError(f"{parts_dir}: {len(bad)} of {len(manifest['parts'])} part(s) missing or damaged: "
                         + ", ".join(bad))
    if whole.hexdigest() != manifest["sha256"]:
        raise CarryError(f"{parts_dir}: the parts are whole but their stream is not the one split (parts of two splits?)")
    to.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as stream:
        for part in manifest["parts"]:
            stream.write((parts_dir / part["file"]).read_bytes())
        stream.seek(0)
        with tarfile.open(fileobj=stream, mode="r") as tar:
            tar.extractall(to, filter="data")
    return manifest["folders"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", help="pack NAME=FOLDER pairs into parts")
    cut.add_argument("folders", nargs="+", metavar="NAME=FOLDER")
    cut.add_argument("--out", type=Path, required=True, help="a new folder for the parts and the manifest")
    cut.add_argument("--part-mib", type=float, default=40.0)
    cut.add_argument("--float16", action="append", default=[], metavar="NAME",
                     help="store NAME's float32 safetensors in float16 (refused where a value would change)")
    glue = commands.add_parser("join", help="check the parts and unpack them")
    glue.add_argument("parts", type=Path)
    glue.add_argument("--to", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            folders = {}
            for pair in args.folders:
                name, sep, folder = pair.partition("=")
                if not sep or not name or "/" in name:
                    raise CarryError(f"{pair!r}: give each folder as NAME=FOLDER")
                folders[name] = Path(folder).expanduser()
            manifest = split(folders, args.out, args.part_mib, set(args.float16))
            for part in manifest["parts"]:
                print(f"{args.out / part['file']}  {part['bytes'] / 2**20:.1f} MiB")
            print(f"{len(manifest['parts'])} part(s), {manifest['bytes'] / 2**20:.1f} MiB in all; "
                  f"carry {args.out / MANIFEST} with any of them")
        else:
            folders = join(args.parts, args.to)
            print("joined: " + ", ".join(str(args.to / name) for name in folders))
    except CarryError as error:
        print(f"device_carry: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
