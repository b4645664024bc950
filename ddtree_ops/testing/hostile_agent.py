"""A host that answers the controller as no agent would, for tests: the real `AgentChannel` drives
it over pipes (`HostileConnection`) or, on a sandbox host, as the inventory's `python:`.

`SCRIPT` is a stdlib-only program run in place of the host's Python. It reads the agent source
the channel sends, answers `hello` and `renew` as the agent does, and answers every other request
as its mode says (the first word of the file `<script>.mode`, beside it):

    flood     the answer without a line end, 64 KiB at a time, until the reader goes away
    deep      a JSON answer nested 100,000 levels (json.loads raises RecursionError)
    nested    a JSON answer nested 500 levels (parses; deeper than any real reply)
    list      a JSON array, not an object
    badhello  a `hello` answer that is not the agent's (no python, a pid that is no number)
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Sequence

from .local_agent import LocalConnection, PipeChannel

SCRIPT = r'''#!/usr/bin/env python3
import json, os, sys
here = os.path.abspath(sys.argv[0])
mode = open(here + ".mode").read().split()[0]
inp, out = sys.stdin.buffer, sys.stdout.buffer

def exact(n):
    b = b""
    while len(b) < n:
        c = inp.read(n - len(b))
        if not c:
            sys.exit(0)
        b += c
    return b

exact(int(exact(10)))
while True:
    line = inp.readline()
    if not line:
        sys.exit(0)
    op = json.loads(line)["op"]
    try:
        if op == "hello" and mode == "badhello":
            out.write(b'{"ok": true, "result": {"pid": "one"}}')
        elif op == "hello":
            out.write(json.dumps({"ok": True, "result": {"pid": os.getpid(), "python": sys.executable}}).encode())
        elif op == "renew":
            out.write(b'{"ok": true, "result": {}}')
        elif mode == "flood":
            block = b"x" * 65536
            while True:
                out.write(block)
                out.flush()
        elif mode == "deep":
            out.write(b'{"ok": true, "result": ' + b"[" * 100000 + b"]" * 100000 + b"}")
        elif mode == "nested":
            out.write(b'{"ok": true, "result": ' + b"[" * 500 + b"]" * 500 + b"}")
        else:
            out.write(b"[]")
        out.write(b"\n")
        out.flush()
    except BrokenPipeError:
        sys.exit(0)
'''


def place(folder: Path, mode: str, name: str = "python") -> Path:
    """Write the hostile program as `folder/name` (executable) in `mode`; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(SCRIPT)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    set_mode(path, mode)
    return path


def set_mode(path: Path, mode: str) -> None:
    Path(str(path) + ".mode").write_text(mode + "\n")


class HostileConnection(LocalConnection):
    """A connection whose every channel runs the hostile program (placed at `script`) with this
    interpreter, whatever argv the controller asks for."""

    def __init__(self, script: Path):
        super().__init__(env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        self.script = script

    def start(self, argv: Sequence[str], *, sudo: bool = True) -> PipeChannel:
        return super().start([sys.executable, str(self.script), *argv[1:]], sudo=sudo)
