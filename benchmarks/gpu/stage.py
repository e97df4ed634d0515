"""Carry files to a machine that takes a few tens of MB per call (the lent GPU machine: 64 MiB with the
working tree): pack them here into folders of at most ``--limit-mb`` each, hand over one folder a call,
and put the files together again there.

    python -m benchmarks.gpu.stage pack OUT PATH... [--limit-mb 50] [--hopper-kernel]      (here)
    python3 -m benchmarks.gpu.stage receive FOLDER DEST                                    (there, per folder)

Every folder holds ``MANIFEST.json`` (each file's path, size, sha256 and parts), so the folders may
arrive in any order; ``--hopper-kernel`` trims sglang-kernel's wheel to what Hopper loads
(docs/benchmarks.md). Only the standard library: ``receive`` runs on the machine before anything is
installed there.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

MB = 1000 * 1000
LIMIT_MB = 50
"""Per folder: the lent machine takes 64 MiB a call, working tree (about 2 MB) included."""
MANIFEST = "MANIFEST.json"
MANIFEST_ROOM = 1 * MB
"""Kept free in every folder for its manifest."""
PARTS = ".parts"
WORK_PREFIX = ".packing-"
"""A temporary directory in OUT while packing (trimmed wheels)."""
CHUNK = 8 * 1024 * 1024
KERNEL_WHEEL = re.compile(r"^sglang_kernel-(?P<version>[^-]+)-(?P<tags>[^-]+-[^-]+-[^-]+)\.whl$")
HOPPER_BUILD_TAG = "1hopper"
HOPPER_LEAVES_OUT = re.compile(r"^sgl_kernel/(flash_ops[^/]*\.so|sm100/.*|infllm_ops[^/]*)$")
"""What importing sgl_kernel on Hopper never loads: FA3, the sm100 (Blackwell) kernels, InfLLM's ops."""


@dataclass
class Entry:
    """One file to carry: where it lands under DEST and where its bytes are here."""

    path: str
    source: Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


# -- here: pack -------------------------------------------------------------------------------------

def files_to_carry(paths: Sequence[Path]) -> list[Entry]:
    """Every file under the PATHs, each landing at its PATH's base name plus its path inside it."""
    found: list[Entry] = []
    for path in paths:
        if path.is_dir():
            found += [Entry(f"{path.name}/{file.relative_to(path).as_posix()}", file)
                      for file in sorted(path.rglob("*")) if file.is_file()]
        elif path.is_file():
            found.append(Entry(path.name, path))
        else:
            raise ValueError(f"{path}: no such file or directory to carry")
    landing = [entry.path for entry in found]
    if len(set(landing)) != len(landing):
        raise ValueError("two PATHs would land at the same place under DEST: give them different base names")
    return found


def trim_kernel_for_hopper(wheel: Path, out_dir: Path) -> Path:
    """sglang-kernel's wheel without what Hopper never loads, with a true RECORD and the ``1hopper`` build
    tag in its name and WHEEL file."""
    match = KERNEL_WHEEL.match(wheel.name)
    if match is None:
        raise ValueError(f"{wheel.name} is not an sglang-kernel wheel without a build tag")
    trimmed = out_dir / f"sglang_kernel-{match['version']}-{HOPPER_BUILD_TAG}-{match['tags']}.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        record_name = next(name for name in source.namelist() if name.endswith(".dist-info/RECORD"))
        record = []
        for info in source.infolist():
            if info.filename == record_name or HOPPER_LEAVES_OUT.match(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):
                data = data.rstrip(b"\n") + f"\nBuild: {HOPPER_BUILD_TAG}\n".encode()
            target.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{info.filename},sha256={digest},{len(data)}")
        record.append(f"{record_name},,")
        target.writestr(source.getinfo(record_name), "\n".join(record) + "\n")
    return trimmed


def with_hopper_kernel(found: list[Entry], work: Path) -> list[Entry]:
    """``found`` with every sglang-kernel wheel trimmed, and the SHA256SUMS beside it naming the trimmed one."""
    renamed: dict[str, tuple[str, str]] = {}  # directory -> (old name, new line)
    result = []
    for entry in found:
        if KERNEL_WHEEL.match(entry.source.name):
            trimmed = trim_kernel_for_hopper(entry.source, work)
            directory = entry.path.rpartition("/")[0]
            renamed[directory] = (entry.source.name, f"{sha256(trimmed)}  {trimmed.name}")
            entry = Entry(f"{directory}/{trimmed.name}".lstrip("/"), trimmed)
        result.append(entry)
    for index, entry in enumerate(result):
        directory, _, name = entry.path.rpartition("/")
        if name == "SHA256SUMS" and directory in renamed:
            old, new = renamed[directory]
            lines = [new if line.endswith(f"  {old}") else line for line in entry.source.read_text().splitlines()]
            sums = work / f"SHA256SUMS-{index}"
            sums.write_text("\n".join(lines) + "\n")
            result[index] = Entry(entry.path, sums)
    return result


def split(found: list[Entry], capacity: int) -> tuple[list[dict], list[list[tuple[int, int, int, str]]]]:
    """Each file's manifest record, and the folders: lists of (file index, offset, length, part name), packed
    largest first into the first folder with room."""
    files, pieces = [], []
    for index, entry in enumerate(found):
        size = entry.source.stat().st_size
        files.append({"path": entry.path, "size": size, "sha256": sha256(entry.source), "parts": []})
        base = f"{index:03d}-{entry.source.name}"
        offsets = range(0, max(size, 1), capacity)
        for number, offset in enumerate(offsets):
            name = base if len(offsets) == 1 else f"{base}.part{number:03d}"
            pieces.append((index, offset, min(capacity, size - offset), name))
    folders: list[list[tuple[int, int, int, str]]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda piece: (-piece[2], piece[3])):
        slot = next((i for i, free in enumerate(room) if free >= piece[2]), None)
        if slot is None:
            folders.append([])
            room.append(capacity)
            slot = len(folders) - 1
        folders[slot].append(piece)
        room[slot] -= piece[2]
    for number, folder in enumerate(folders, start=1):
        for index, _, _, name in sorted(folder, key=lambda piece: piece[3]):
            files[index]["parts"].append({"folder": folder_name(number, len(folders)), "name": name})
    for record in files:
        record["parts"].sort(key=lambda part: part["name"])
    return files, folders


def folder_name(number: int, count: int) -> str:
    return str(number).zfill(max(2, len(str(count))))


def prepare_out(out: Path) -> None:
    """An empty OUT, or one holding only what an earlier pack made (replaced); anything else is refused."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    others = [child.name for child in out.iterdir() if not child.name.startswith(WORK_PREFIX)
              and not (child.is_dir() and (child / MANIFEST).is_file())]
    if others:
        raise ValueError(f"{out} holds {', '.join(sorted(others)[:5])}, which no earlier pack made: "
                         "choose an empty or new OUT")
    for child in out.iterdir():
        shutil.rmtree(child)


def pack(out: Path, paths: Sequence[Path], limit_mb: int = LIMIT_MB, hopper_kernel: bool = False) -> list[Path]:
    """Pack ``paths`` into folders ``out/01``.. of at most ``limit_mb`` MB each; returns the folders."""
    capacity = limit_mb * MB - MANIFEST_ROOM
    if capacity <= 0:
        raise ValueError(f"--limit-mb {limit_mb}: give more than {MANIFEST_ROOM // MB} MB a folder")
    found = files_to_carry(paths)
    prepare_out(out)
    with tempfile.TemporaryDirectory(prefix=WORK_PREFIX, dir=out) as work:
        if hopper_kernel:
            found = with_hopper_kernel(found, Path(work))
        files, folders = split(found, capacity)
        manifest = json.dumps({"folders": [folder_name(n, len(folders)) for n in range(1, len(folders) + 1)],
                               "files": files}, indent=1)
        made = []
        for number, folder in enumerate(folders, start=1):
            directory = out / folder_name(number, len(folders))
            directory.mkdir()
            for index, offset, length, name in folder:
                copy_range(found[index].source, offset, length, directory / name)
            (directory / MANIFEST).write_text(manifest + "\n")
            made.append(directory)
    return made


def copy_range(source: Path, offset: int, length: int, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        reader.seek(offset)
        while length > 0:
            block = reader.read(min(CHUNK, length))
            if not block:
                raise ValueError(f"{source} changed while it was packed: pack again")
            writer.write(block)
            length -= len(block)


# -- there: receive ---------------------------------------------------------------------------------

def receive(folder: Path, dest: Path) -> list[str]:
    """Keep ``folder``'s parts under ``dest/.parts``; once all are there, put every file in place (sha256
    checked) and remove the parts. Returns the folders still to come (empty: done)."""
    manifest_text = (folder / MANIFEST).read_text() if (folder / MANIFEST).is_file() else None
    if manifest_text is None:
        raise ValueError(f"{folder} holds no {MANIFEST}: carry a folder that `pack` made")
    manifest = json.loads(manifest_text)
    parts = dest / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    held = parts / MANIFEST
    if held.is_file() and held.read_text() != manifest_text:
        raise ValueError(f"{parts} holds parts of another pack; receive this one into another DEST, "
                         f"or move {parts} away")
    for piece in folder.iterdir():
        if piece.name != MANIFEST:
            temp = parts / f".{piece.name}.tmp"
            shutil.copyfile(piece, temp)
            os.replace(temp, parts / piece.name)  # a part appears whole or not at all
    held.write_text(manifest_text)
    missing = sorted({part["folder"] for record in manifest["files"] for part in record["parts"]
                      if not (parts / part["name"]).is_file()})
    if not missing:
        for record in manifest["files"]:
            assemble(record, parts, dest)
        shutil.rmtree(parts)
    return missing


def assemble(record: dict, parts: Path, dest: Path) -> None:
    target = dest / record["path"]
    if target.is_file() and target.stat().st_size == record["size"] and sha256(target) == record["sha256"]:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.joining")
    digest = hashlib.sha256()
    with open(temp, "wb") as writer:
        for part in record["parts"]:
            with open(parts / part["name"], "rb") as reader:
                while block := reader.read(CHUNK):
                    digest.update(block)
                    writer.write(block)
    if digest.hexdigest() != record["sha256"]:
        temp.unlink()
        raise ValueError(f"{record['path']}: the joined file's sha256 is not the one packed; carry its folders "
                         f"({', '.join(part['folder'] for part in record['parts'])}) again")
    os.replace(temp, target)


# -- the command line -------------------------------------------------------------------------------

def device_calls(folders: list[Path]) -> Iterator[str]:
    for folder in folders:
        shown = os.path.relpath(folder)
        yield f'  carry ["{shown}"]  command: python3 -m benchmarks.gpu.stage receive {shown} DEST'


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="here: PATHs into folders OUT/01.. of at most --limit-mb each")
    packing.add_argument("out", type=Path)
    packing.add_argument("paths", type=Path, nargs="+")
    packing.add_argument("--limit-mb", type=int, default=LIMIT_MB, help=f"MB per folder (default {LIMIT_MB})")
    packing.add_argument("--hopper-kernel", action="store_true",
                         help="carry sglang-kernel without what Hopper never loads (FA3, sm100, infllm_ops)")
    receiving = commands.add_parser("receive", help="there: keep FOLDER's parts; the last one puts files in DEST")
    receiving.add_argument("folder", type=Path)
    receiving.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            folders = pack(args.out, args.paths, args.limit_mb, args.hopper_kernel)
            sizes = [sum(f.stat().st_size for f in folder.iterdir()) for folder in folders]
            print(f"packed {len(folders)} folders under {args.out}, {sum(sizes) / MB:.0f} MB, the largest "
                  f"{max(sizes) / MB:.1f} MB; one call each, in any order, on the same warm machine:")
            print("\n".join(device_calls(folders)))
            return 0
        missing = receive(args.folder, args.dest)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if missing:
        print(f"received {args.folder}; still to receive: {', '.join(missing)}")
    else:
        landed = ", ".join(sorted(path.name for path in args.dest.iterdir()))
        print(f"received {args.folder}; complete: {args.dest} holds {landed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
