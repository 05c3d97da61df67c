"""What stops a ``save_pretrained`` checkpoint directory from loading, found before any worker opens it.

``config.json`` (a JSON object, at most :data:`MAX_CONFIG_BYTES`), then ``model.safetensors`` or
``model.safetensors.index.json`` whose ``weight_map`` names files inside the directory that exist;
every weights file must hold the header its first 8 bytes announce, and its tensors' bytes must
cover the rest of it. Pure reads of the directory, each problem one line (the config's
``model.path`` and :mod:`elastic.service.preflight` name where it came from).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_CONFIG_BYTES", "MAX_INDEX_BYTES", "MAX_SAFETENSORS_HEADER", "checkpoint_problems"]

#: a checkpoint's config.json is a few KB
MAX_CONFIG_BYTES = 1 << 20
#: safetensors refuses headers above 100 MB itself; a larger length means a corrupt or foreign file
MAX_SAFETENSORS_HEADER = 100_000_000
#: a sharded checkpoint's index lists every tensor: DeepSeek-V3's is 8.9 MB
MAX_INDEX_BYTES = 64 << 20


def _json_file(path: Path, max_bytes: int) -> tuple[Any, str | None]:
    """The JSON value in ``path``, or why it cannot be read (a missing or irregular file, too large, not JSON)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return None, f"{path.name}: not a regular file"
        if info.st_size > max_bytes:
            return None, f"{path.name}: the file is {info.st_size} bytes, more than the {max_bytes} it may have; is it the right file?"
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        return None, f"{path.name}: cannot read the file: {exc.strerror or exc}"
    try:
        text = data.decode("utf-8-sig")  # an editor's byte-order mark is harmless
    except UnicodeDecodeError as exc:
        return None, f"{path.name}: not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x})"
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:
        return None, (f"{path.name} is not valid JSON ({' '.join(str(exc).split())}); "
                      "re-export the checkpoint with save_pretrained")


def _safetensors_problem(path: Path) -> str | None:
    """A truncated or foreign weights file: its 8-byte header length must fit in the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
    except OSError as exc:
        return f"{path.name}: cannot read it: {exc.strerror or exc}"
    if len(head) < 8:
        return f"{path.name} is {size} bytes, too short for a safetensors file (truncated download?)"
    length = int.from_bytes(head, "little")
    if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
        return (f"{path.name} is not a complete safetensors file (its header claims {length} bytes, the file has "
                f"{size}); download it again")
    # the tensors' bytes must cover the rest of the file exactly (what safetensors checks when it opens it)
    import json

    try:
        with path.open("rb") as fh:
            fh.seek(8)
            header = json.loads(fh.read(length))
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except OSError as exc:
        return f"{path.name}: cannot read it: {exc.strerror or exc}"
    except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path.name} has no readable safetensors header (a JSON object of tensors); download it again"
    data = size - 8 - length
    if max(ends, default=0) != data:
        return (f"{path.name} is not a complete safetensors file (its tensors take {max(ends, default=0)} bytes, the "
                f"file holds {data} after its header); download it again")
    return None


def checkpoint_problems(directory: str | Path) -> list[str]:
    """What stops ``directory`` from loading, one line each (see the module docstring); empty: nothing."""
    root = Path(directory)
    if not root.is_dir():
        return [f"{root} is not a directory; give the directory save_pretrained wrote"]
    config, problem = _json_file(root / "config.json", MAX_CONFIG_BYTES)
    if problem:
        return [problem]
    if not isinstance(config, dict):
        return [f"config.json holds a {type(config).__name__}, expected an object"]
    index_path, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index_path.exists():
        index, problem = _json_file(index_path, MAX_INDEX_BYTES)
        if problem:
            return [problem]
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            return ["model.safetensors.index.json has no weight_map of tensor -> file name"]
        files = sorted(set(weight_map.values()))
    elif single.exists():
        files = [single.name]
    else:
        return [f"{root} has neither model.safetensors nor model.safetensors.index.json"]
    problems: list[str] = []
    for name in files:
        target = (root / name).resolve()
        if root.resolve() not in target.parents:  # a weight_map entry like "../x" would read outside
            problems.append(f"the index names {name!r}, outside the checkpoint directory")
        elif not target.is_file():
            problems.append(f"the index names {name}, which is missing (incomplete download?)")
        else:
            why = _safetensors_problem(target)
            if why:
                problems.append(why)
    return problems
