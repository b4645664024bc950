"""The server's log, SGLang style: "[YYYY-mm-dd HH:MM:SS TP0] message", every line flushed."""

from __future__ import annotations

import sys
import threading
from datetime import datetime

_log_lock = threading.RLock()


def log(msg: str, prefix: str = "") -> None:
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    head = f"[{stamp}{' ' + prefix if prefix else ''}] "
    text = "\n".join(head + line for line in str(msg).splitlines() or [""])
    with _log_lock:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def log_raw(msg: str) -> None:
    """A line without the SGLang prefix (uvicorn's, tracebacks)."""
    with _log_lock:
        sys.stdout.write(msg.rstrip("\n") + "\n")
        sys.stdout.flush()
