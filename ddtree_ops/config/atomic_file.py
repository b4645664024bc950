"""Files this machine writes for people and other programs (the HTML report, the metrics file for
the node exporter): whole or not at all."""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike, text: str, *, mode: int = 0o644) -> None:
    """`text` into `path` through a temp file in the same folder, flushed, fsynced and renamed
    over it: a reader (or a crash) sees the old file or the new one, never a part of one. Mode
    0644 by default: mkstemp's 0600 would hide the file from the people or the exporter it is
    for, who are often another user."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
