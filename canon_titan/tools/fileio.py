"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write to a temporary file beside ``path``, then rename it over ``path`` (mode 0644); its
    folder is made when it does not exist (an ``--out outputs/data/x.jsonl`` of a fresh
    checkout)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_from(path: str | os.PathLike) -> str:
    """Where a relative ``path`` is read from, for a message that it does not exist (empty for an
    absolute one, which names its folder itself): every command reads relative paths from the
    current directory, whatever launched it."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" in {os.getcwd()} (a relative path is read from the current directory)"
