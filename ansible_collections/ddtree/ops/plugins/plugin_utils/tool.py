# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""Run one ddtree-ops command for one host, from an action plugin, on the controller.

The collection wraps the product and copies none of it: each task runs the tool's own command
(`python -m ddtree_ops deploy|plan|rollback|status ... --json`) with the controller's Python, so
the lock, lease and heartbeat, journal, host heal, gates and automatic rollback are the CLI's,
over the tool's own SSH session. The host's inventory is the variables Ansible resolved for it,
picked and validated by the product (ddtree_ops.config.ansible_hostvars), written to a private
temporary folder for the one command.

Why a child process and not a call: AWX (ansible-runner) cancels a job by SIGKILL to the process
group of ansible-playbook, and a terminal's Ctrl-C reaches the whole foreground group. The command
runs in a session of its own, so neither kills it mid-step; it is asked to stop instead (SIGTERM,
which the tool handles as Ctrl-C: every host in flight rolled back, exit 3) when this task is
interrupted, when ansible-playbook is gone (the task's worker runs in a session of its own since
ansible-core 2.15 and outlives it: its parent changes), and by the kernel (PR_SET_PDEATHSIG) when
the worker itself dies, SIGKILL included. Its output goes to files, not pipes: a pipe whose reader
died would fail the rollback's first line.

Progress: the tool's per-phase lines (stderr) are shown as they come, `host | line`, which Ansible
prints live and ansible-runner streams as `verbose` events (what AWX shows while the task runs).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

POLL_S = 0.2
# After its task is interrupted, the command's rollback is waited for at most this long (it
# bounds its own steps); then it is left to finish on its own, as a killed worker leaves it.
STOP_WAIT_S = 600.0
_PR_SET_PDEATHSIG = 1


class ToolMissing(Exception):
    """ddtree-ops is not importable by the controller's Python."""


def tool_python():
    """The controller's Python (the one running Ansible), which must have ddtree-ops installed."""
    import importlib.util

    if importlib.util.find_spec("ddtree_ops") is None:
        raise ToolMissing("ddtree-ops is not installed in the controller's Python (%s): install it there "
                          "(pip install ddtree-ops), or in the execution environment" % sys.executable)
    return sys.executable


def host_inventory(host, hostvars, inventory_dir):
    """The one-host inventory document of `host` (raises the tool's InventoryError, a message)."""
    from ddtree_ops.config.ansible_hostvars import host_inventory_doc

    return host_inventory_doc(host, hostvars, inventory_dir=inventory_dir,
                              where="ansible vars of %s" % host)


def _die_with_parent():
    # Runs in the child before exec: SIGTERM when the thread that started it (the task's worker)
    # dies, however it dies. Linux only; elsewhere the host's lease-loss heal still covers it.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Run(object):
    """The outcome of one command: exit code, its JSON document (None when it printed none),
    and its log lines."""

    def __init__(self, rc, doc, lines):
        self.rc = rc
        self.doc = doc
        self.lines = lines

    def last_lines(self, n=8):
        return "\n".join(self.lines[-n:])


def run_tool(argv, host, doc, show, env=None):
    """Run `ddtree-ops ARGV -i <doc> --limit HOST --json`; `show(line)` gets each log line as it
    comes. Returns a Run."""
    import yaml

    python = tool_python()
    folder = tempfile.mkdtemp(prefix="ddtree-ops-ansible-")
    try:
        inv = os.path.join(folder, "inventory.yaml")
        fd = os.open(inv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        out_path, err_path = os.path.join(folder, "out.json"), os.path.join(folder, "log.txt")
        cmd = [python, "-m", "ddtree_ops"] + list(argv) + ["-i", inv, "--limit", host, "--json"]
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=child_env,
                                    start_new_session=True, preexec_fn=_die_with_parent, close_fds=True)
        lines = _follow(proc, err_path, show)
        with open(out_path, "rb") as f:
            text = f.read().decode("utf-8", "replace").strip()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return Run(proc.returncode, parsed, lines)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _follow(proc, err_path, show):
    """Show the command's log lines while it runs; on an interrupt of this task, ask the command to
    stop (its rollback runs) and wait for it, then let the interrupt go on."""
    lines = []
    pos = [0]
    partial = [b""]

    def drain():
        with open(err_path, "rb") as f:
            f.seek(pos[0])
            chunk = f.read()
        pos[0] += len(chunk)
        data = partial[0] + chunk
        *whole, partial[0] = data.split(b"\n")
        for raw in whole:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                lines.append(line)
                show(line)

    parent = os.getppid()
    try:
        while proc.poll() is None:
            drain()
            if os.getppid() != parent:  # ansible-playbook was killed (a cancelled AWX job)
                show("ansible-playbook is gone (the job was cancelled): stopping, the host is rolled back")
                _stop(proc, drain)
                break
            time.sleep(POLL_S)
    except BaseException:
        _stop(proc, drain)
        raise
    drain()
    if partial[0].strip():
        line = partial[0].decode("utf-8", "replace").rstrip()
        lines.append(line)
        show(line)
    return lines


def _stop(proc, drain):
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except OSError:
            return
    deadline = time.monotonic() + STOP_WAIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            drain()
            time.sleep(POLL_S)
        except BaseException:  # a second interrupt: stop waiting, the command finishes on its own
            return
    try:
        drain()
    except BaseException:
        pass


def phase_seconds(steps):
    """[{step, seconds}] from the tool's timestamped steps: each lasts until the next begins."""
    out = []
    for i, s in enumerate(steps or []):
        nxt = steps[i + 1]["t"] if i + 1 < len(steps) else s["t"]
        out.append({"step": s["step"], "seconds": round(max(0.0, nxt - s["t"]), 3), "detail": s.get("detail", "")})
    return out
