"""The compile cache: object code by IR fingerprint, in memory and on disk.

Key: SHA-256 of the serialized, optimized-for-launch IR plus the target fingerprint (CPU model,
features, code model, vector math variants, llvmlite version) and difftape's version. A second
process that builds the same IR loads the object file and skips LLVM entirely. For CUDA the
entry is the PTX, and the cubin ptxas makes of it for the device is a second entry (``.cubin``,
keyed by the PTX, the compute capability, ptxas's and the driver's versions:
``runtime/cuda.py``), so a warm process skips LLVM, ptxas and the driver's JIT. Writes go to a
temporary file and are renamed into place, so concurrent processes never read a torn entry.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_memory: dict[str, bytes] = {}


def cache_dir(configured: str | None = None) -> Path:
    if configured:
        return Path(configured)
    env = os.environ.get("DIFFTAPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "difftape"


def load(key: str, directory: Path | None, suffix: str = "o") -> bytes | None:
    """The entry under ``key`` (in memory, else ``directory/<key[:2]>/<key>.<suffix>``), or
    None."""
    data = _memory.get(key)
    if data is not None or directory is None:
        return data
    path = directory / key[:2] / f"{key}.{suffix}"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    _memory[key] = data
    return data


def store(key: str, data: bytes, directory: Path | None, suffix: str = "o") -> None:
    _memory[key] = data
    if directory is None:
        return
    folder = directory / key[:2]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"{key}.{suffix}")
    except OSError:
        pass  # a read-only or full disk must not break compilation


def clear_memory() -> None:
    _memory.clear()
