"""The sandbox's request router: a real smg (SGLang Model Gateway, PyPI `smg`) in front of the hosts.

`sandbox up --router` starts it after the hosts serve: on 127.0.0.1 (the hosts' servers at
10.200.K.2:30000 are reachable from here over their veth pairs, as the controller reaches them),
`--worker-urls` every host's server (rank 0 only of a multi-node server), round robin, health
checks every second (a host's restart shows as not_ready after two failed checks, about 2 s; ready
again about a second after its /health answers; one slow answer on a busy machine is not enough
to take a host out). The control-plane key is random, in DIR/router.key (mode 0600,
the folder is 0700), and read from there by the launcher: it is never in smg's argv, where every
local user could read it in /proc/PID/cmdline. The inventory names it by ROUTER_KEY_ENV:

    export DDTREE_SANDBOX_ROUTER_KEY="$(cat DIR/router.key)"

`down` ends smg by its PID (checked against its start time, so a reused PID is never hit) and
deletes the key and the log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddtree_ops.host.localproc import pid_alive, start_time

from .errors import SandboxError
from .system import SYSTEM_PATH

ROUTER_KEY_ENV = "DDTREE_SANDBOX_ROUTER_KEY"
KEY_FILE = "router.key"
LOG_FILE = "router.log"
SMG_VERSION = "1.13.0"
START_TIMEOUT_S = 30.0
# smg's own command line (`smg launch ...`, smg.cli.main, as the `smg` console script runs it)
# with the control-plane key appended from the 0600 file named first.
_LAUNCHER = (
    "import sys\n"
    "from smg.cli import main\n"
    "key = open(sys.argv[1]).read().strip()\n"
    "sys.argv[0] = 'smg'\n"
    "main(['launch', *sys.argv[2:], '--control-plane-api-keys', 'ddtree-ops:ddtree-ops-sandbox:admin:' + key])\n"
)
# Fast health checks for tests (smg's defaults: every 60 s, 3 failures, 2 successes, retry an
# unreachable new worker every 30 s); no tokenizer (HTTP workers need none; never a download).
SMG_FLAGS = (
    "--policy", "round_robin",
    "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
    "--health-failure-threshold", "2", "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1",
    "--disable-tokenizer-autoload", "--shutdown-grace-period-secs", "1", "--log-level", "info",
)


def smg_missing() -> str | None:
    """Why smg cannot run from this environment, or None."""
    if importlib.util.find_spec("smg") is None:
        return (f"the SGLang Model Gateway (smg=={SMG_VERSION}) is not installed in {sys.prefix}: "
                f"run scripts/setup, or pip install 'smg=={SMG_VERSION}'")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_key(path: Path) -> None:
    """A fresh random control-plane key in `path`, mode 0600 from its creation."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(32) + "\n")


def read_key(path: Path | str) -> str:
    return Path(path).read_text().strip()


def start(directory: Path, worker_urls: list[str], port: int) -> dict[str, Any]:
    """Start smg; returns its record for sandbox.json (pid and start time first, so that `down`
    can end it whatever happens next). The key file must exist."""
    key_file, log_file = directory / KEY_FILE, directory / LOG_FILE
    metrics_port = free_port()
    argv = [sys.executable, "-c", _LAUNCHER, str(key_file), "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-urls", *worker_urls, *SMG_FLAGS]
    # A clean environment: no proxy variables (smg's HTTP client honours them), nothing inherited.
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": str(directory), "NO_PROXY": "*", "no_proxy": "*",
           "PYTHONDONTWRITEBYTECODE": "1"}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=directory, start_new_session=True)
    return {"pid": proc.pid, "start_time": start_time(proc.pid), "url": f"http://127.0.0.1:{port}",
            "port": port, "metrics_port": metrics_port, "key_file": str(key_file), "key_env": ROUTER_KEY_ENV,
            "log": str(log_file), "workers": list(worker_urls)}


def _ours(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    return bool(pid) and pid_alive(pid) and start_time(pid) == info.get("start_time")


def _log_tail(info: dict[str, Any], n: int = 1500) -> str:
    try:
        return Path(info["log"]).read_text(errors="replace")[-n:]
    except (OSError, KeyError):
        return "(no log)"


def list_workers(info: dict[str, Any], timeout: float = 2.0) -> list[dict[str, Any]]:
    """GET /workers with the sandbox's key: [{url, status, is_healthy, load}]."""
    import httpx

    r = httpx.get(info["url"] + "/workers", timeout=timeout, trust_env=False,
                  headers={"Authorization": "Bearer " + read_key(info["key_file"])})
    r.raise_for_status()
    return [{k: w.get(k) for k in ("id", "url", "status", "is_healthy", "load")} for w in r.json()["workers"]]


def wait_ready(info: dict[str, Any], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until smg lists every worker of `info` ready and healthy; SandboxError with its log tail
    when it exits or the time is up."""
    import httpx

    want = set(info["workers"])
    deadline = time.monotonic() + timeout_s
    seen: Any = "no answer"
    while time.monotonic() < deadline:
        if not _ours(info):
            raise SandboxError(f"smg exited while starting; last log lines:\n{_log_tail(info)}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            workers = list_workers(info, timeout=1.0)
            seen = [(w["url"], w["status"]) for w in workers]
            if want <= {w["url"] for w in workers if w["status"] == "ready" and w["is_healthy"]}:
                return
        time.sleep(0.05)
    raise SandboxError(f"smg at {info['url']}: workers not ready within {timeout_s:.0f} s (listed: {seen}); "
                       f"last log lines:\n{_log_tail(info)}")


def stop(info: dict[str, Any]) -> int:
    """End smg (SIGTERM, then SIGKILL after 3 s) if it is still the process we started; 1 if it
    was running, else 0."""
    pid = info.get("pid")
    if not _ours(info):
        return 0
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):  # our child when `up` ran in this process
                os.waitpid(pid, os.WNOHANG)
            if not pid_alive(pid):
                return 1
            time.sleep(0.05)
    return 1


def status(info: dict[str, Any]) -> dict[str, Any]:
    """The router's row for `sandbox status`: url, pid, whether it runs, its workers."""
    row: dict[str, Any] = {"url": info["url"], "kind": "smg", "pid": info.get("pid"), "key_env": ROUTER_KEY_ENV,
                           "key_file": info.get("key_file"), "log": info.get("log"), "up": _ours(info),
                           "workers": []}
    if row["up"]:
        try:
            row["workers"] = list_workers(info)
        except Exception as e:  # a broken router is a row, not a crash
            row["up"] = False
            row["error"] = f"{type(e).__name__}: {e}"
    return row
