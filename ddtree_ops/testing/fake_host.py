"""A fake host for the fast test tier: the runbook runs against it in milliseconds.

`FakeHost.session()` is the real `HostSession` over a `FakeLink`, the fake end of the one seam
(host.session.HostLink); so the real `ReleaseStore` and the real `Services` run on it:

* agent requests are answered by the REAL remote agent (`ddtree_ops.host.agent`), called
  in-process instead of over SSH, with every host path mapped into a private folder standing for
  the host's root. Backups, atomic installs, restores, the lock and the journal therefore behave
  exactly as on a host; only `verify_unit`, `proc_info` and `launch_check` are answered here.
  Two ops run elsewhere, as themselves: `path_access` (it forks) in a small agent process of this
  machine (_ForkingOps), and `compile` once per distinct request in a process (_compile_verdict).
* the programs the agent's `run` op runs (systemctl, journalctl, nvidia-smi) are answered from
  the units in memory, in their real output formats (fake_systemd.py): `restart` starts a new
  process (a new MainPID) that loads for `load_polls` probes and then serves, or crashes, or
  never becomes ready, as `boot` decides from the files installed (by default: a module
  containing FAKE_CRASH crashes the server while loading, FAKE_HANG keeps it warming up forever,
  as a real module that raises at import would).
* HTTP to the server goes through an httpx.MockTransport: no listener while no unit runs,
  503 while loading, then 200; `/generate` answers text; `/server_info` the accept length.
* sleeping lets time pass for the loading servers instead (`tick`).

Faults are injected by name: `fail_next["agent install"] = "disk full"` makes the next `install`
fail as the host would report it; `fail_next["systemctl restart UNIT"]`, `drop_connection_at` likewise;
`fault_at_call = ("fail"|"drop"|"lost-answer"|"kill", k)` hits the k-th call whatever it is
("drop": the connection is lost before the call reaches the host; "lost-answer": the host does it
and the answer is lost with the connection; "kill": the controller dies there, see ControllerKilled).
`events` records every call in order, so a test reads the runbook's steps back (agent requests
as "agent OP", unit actions as their systemctl command line, reads as "systemctl states",
"systemctl show MainPID", "probe UNIT" and "nvidia-smi").
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from ..config.inventory import Host, parse_inventory
from ..errors import LeaseLost, RemoteCommandError, UnreachableError
from ..host.agent import Agent
from ..host.channel import answer_result
from ..host.gpus import GpuApp
from ..host.hooks import NO_HOOKS, Hooks
from ..host.session import HostSession
from .fake_systemd import answer_run, event_name

FAKE_CRASH = b"FAKE_CRASH"  # a shipped module with this marker kills the server while it loads
FAKE_HANG = b"FAKE_HANG"  # ... keeps it warming up (503) forever
SGLANG_VERSION = "0.5.23"
SITE_PACKAGES = "/opt/venv_sglang/lib/python3.11/site-packages"
DDTREE_UNIT = "sglang-k26-ddtree.service"
DFLASH_UNIT = "sglang-k26-dflash-cg.service"
# An upstream SGLang file the fake host has, for patch sets that `replace` one.
UPSTREAM_REL = "sglang/srt/speculative/dflash_info.py"
UPSTREAM_BYTES = b"# upstream sglang 0.5.23 dflash_info (fake)\n"


def fake_inventory(n: int = 1, *, multinode: bool = False, **host_vars: Any) -> dict[str, Any]:
    """An inventory document for `n` fake hosts fh1..fhN (one multi-node server with `multinode`)."""
    base = {"address": "127.0.0.1", "known_hosts": "/nonexistent/known_hosts", "python": "/opt/venv_sglang/bin/python",
            "site_packages": SITE_PACKAGES, "conflicts": [DFLASH_UNIT], "model_path": "/models/kimi",
            "draft_model_path": "/models/draft", "budget": 16, "topk_cap": 4,
            "health": {"poll_interval_s": 0.05, "consecutive_successes": 2, "load_deadline_s": 30,
                       "min_healthy_s": 0.1, "soak_interval_s": 0.05}}
    base.update(host_vars)
    hosts = {f"fh{i + 1}": ({"node_rank": i} if multinode else {}) for i in range(n)}
    if multinode:
        return {"all": {"vars": base, "children": {"server1": {"vars": {"multinode": True}, "hosts": hosts}}}}
    return {"all": {"vars": base, "hosts": hosts}}


def fake_hosts(tmp: Path, n: int = 1, *, multinode: bool = False, **host_vars: Any) -> list[FakeHost]:
    inv = parse_inventory(fake_inventory(n, multinode=multinode, **host_vars), "fake-inventory.yaml")
    return [FakeHost(h, tmp / name) for name, h in inv.hosts.items()]


class ControllerKilled(BaseException):
    """The controller dies (SIGKILL) at this call: no handler of the tool runs, and its
    connection, agent process and lock are gone. A BaseException so that nothing catches it."""


@dataclass
class FakeUnit:
    active: str = "inactive"
    enabled: str = "disabled"
    pid: int | None = None
    loading_polls: int = 0  # probes left until the process has loaded
    fate: str = "serve"  # what happens when it has loaded: serve | crash | hang
    ready: bool = False
    invocation: str = ""  # systemd's InvocationID: new at every start, empty until the first
    n_restarts: int = 0  # systemd's NRestarts: starts its Restart= made (a test sets it)


class FakeHost:
    def __init__(self, host: Host, root: Path, *, load_polls: int = 2):
        self.host, self.root, self.load_polls = host, root, load_polls
        root.mkdir(parents=True, exist_ok=True)
        self.events: list[str] = []
        self.fail_next: dict[str, str] = {}
        self.drop_connection_at: set[str] = set()
        # At this call the controller's lease is found lost (it was stopped for longer than the
        # lease): this call and every later one raise LeaseLost, and none reaches the host.
        self.lose_lease_at: set[str] = set()
        # Fail the k-th remote call (1-based) of whatever runs next: ("fail"|"drop"|"kill", k).
        self.fault_at_call: tuple[str, int] | None = None
        self.calls = 0
        self.answer_lost: str | None = None  # set by a "lost-answer" fault until the call has run
        self.started: list[str] = []  # every unit start (restart) the host did, in order
        self.clock = 0.0  # the fake link's clock: a sleep advances it, nothing waits
        self.reconnects = 0
        self.accept_lengths: dict[str, float] = {}  # per unit; 3.5 when not set
        self.launch_refusal: str | None = None  # what the server's parser says about the launch line
        # Requests in flight per unit, as /v1/loads reports them (None: no /v1/loads at all).
        self.in_flight: dict[str, int] | None = None
        self.stuck_requests = False  # in-flight requests never finish
        # Per unit: its /generate answers 500 after this many calls (a server that goes bad later).
        self.generate_fails_after: dict[str, int] = {}
        self.generations: dict[str, int] = {}
        # GPU memory holders as nvidia-smi lists them (None: no nvidia-smi); a stopped unit's
        # process leaves the list after `gpu_linger` more looks (a worker still exiting).
        self.gpu_apps: list[GpuApp] | None = None
        self.procs: dict[int, dict[str, Any]] = {}  # pid -> {cmd, ancestors}, for proc_info
        self.gpu_linger: dict[int, int] = {}
        self.ended_pids: set[int] = set()  # main PIDs of servers that stopped or were replaced
        self.port_holders: dict[int, list[dict[str, Any]]] = {}  # port -> [{pid, cmd, ancestors}]
        self.boot: Callable[[FakeHost, str], str] = _fate_from_installed_files
        self._next_pid = 1000
        self.units: dict[str, FakeUnit] = {u: FakeUnit() for u in (host.unit, *host.conflicts)}
        self._install_upstream()

    # -- the host as CT200 is before a DDTree deploy -------------------------------------------
    def _install_upstream(self) -> None:
        dist = f"{self.host.site_packages}/sglang-{SGLANG_VERSION}.dist-info/METADATA"
        self.write(dist, f"Metadata-Version: 2.1\nName: sglang\nVersion: {SGLANG_VERSION}\n".encode())
        self.write(f"{self.host.site_packages}/{UPSTREAM_REL}", UPSTREAM_BYTES)
        # What the launch line names: the venv's interpreter (a stand-in file) and the models.
        self.write(self.host.python, b"#!/bin/sh\n", mode=0o755)
        for model in (self.host.model_path, self.host.draft_model_path):
            if model.startswith("/"):
                self.path(model).mkdir(parents=True, exist_ok=True)
        for u in self.host.conflicts:  # the DFlash unit serves, enabled
            self.write(f"/etc/systemd/system/{u}", b"[Service]\nExecStart=/bin/true\n")
            self.units[u] = FakeUnit(enabled="enabled")
            self.start(u)
            self._finish_loading(u)

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def write(self, host_path: str, data: bytes, mode: int = 0o644) -> None:
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)

    def read(self, host_path: str) -> bytes | None:
        p = self.path(host_path)
        return p.read_bytes() if p.is_file() else None

    def tree(self, *host_dirs: str) -> dict[str, bytes]:
        """Every file under the given host folders, host path → bytes (state_dir excluded)."""
        out = {}
        for d in host_dirs:
            base = self.path(d)
            for p in sorted(base.rglob("*")) if base.exists() else []:
                if p.is_file():
                    out["/" + str(p.relative_to(self.root))] = p.read_bytes()
        return out

    def session(self, hooks: Hooks = NO_HOOKS) -> HostSession:
        """A new connection of a controller to this host: the real session over a `FakeLink`."""
        session = HostSession(self.host, FakeLink(self), hooks)
        session.store.lock_grace_s = 0.2  # in-process agents end at once; no need to wait for one
        return session

    # -- faults ----------------------------------------------------------------------------------
    def _call(self, name: str) -> None:
        self.events.append(name)
        self.calls += 1
        if self.fault_at_call and self.fault_at_call[1] == self.calls:
            kind, _ = self.fault_at_call
            if kind == "kill":
                raise ControllerKilled(f"the controller was killed at call {self.calls} ({name}) (fake)")
            if kind == "drop":
                raise UnreachableError(f"{self.host.name}: connection lost at call {self.calls} ({name}) (fake)")
            if kind == "lost-answer":  # the host does it; the answer is lost with the connection
                self.answer_lost = f"{self.host.name}: connection lost after call {self.calls} ({name}) (fake)"
                return
            raise RemoteCommandError(f"{self.host.name}: call {self.calls} ({name}) failed (fake)")
        if name in self.drop_connection_at:
            self.drop_connection_at.discard(name)
            raise UnreachableError(f"{self.host.name}: connection lost while running a command (fake)")
        if name in self.fail_next:
            raise RemoteCommandError(f"{self.host.name}: {name} failed: {self.fail_next.pop(name)}")

    # -- the remote agent, in-process, rooted in self.root ----------------------------------------
    def agent(self, request: dict[str, Any], proc: Agent) -> dict[str, Any]:
        """One request to `proc`, the agent process of one connection (the lock is its own)."""
        op = request["op"]
        if op == "verify_unit":
            return {"available": True, "returncode": 0, "stdout": "", "stderr": ""}
        if op == "proc_info":  # the fake's GPU processes are not processes of this machine
            return {str(pid): self.procs[pid] for pid in request["pids"] if pid in self.procs}
        if op == "launch_check":  # no server program here: the verdict and port holders are set by tests
            refused = self.launch_refusal
            return {"rc": 2 if refused else 0, "stdout": "", "stderr": refused or "",
                    "holders": {str(p): self.port_holders.get(p, []) for p in request["ports"]}}
        req = _map_paths(request, self._in)
        if op == "compile":  # the fake host's venv interpreter is this machine's (run as the unit's user)
            req["python"] = sys.executable
            return answer_result(self.host.name, op, _compile_verdict(req, proc))
        if op == "path_access":  # the real op, in a small agent process of its own (_ForkingOps)
            proc.lease.renew()
            return answer_result(self.host.name, op, _FORKING_OPS.handle(req))
        answer = json.loads(json.dumps(proc.handle(req)))
        if op == "facts" and answer.get("ok"):
            res = answer["result"]
            res["files"] = {self._out(p): dict(f, path=self._out(f["path"])) for p, f in res["files"].items()}
            res["unit"] = dict(res["unit"], path=self._out(res["unit"]["path"]))
        if answer.get("ok"):
            _map_records(op, answer["result"], self._out)
        return answer_result(self.host.name, op, answer)

    def _in(self, host_path: str) -> str:
        return str(self.path(host_path))

    def _out(self, local: str) -> str:
        return "/" + os.path.relpath(local, self.root)

    # -- units -----------------------------------------------------------------------------------
    def start(self, unit: str) -> None:
        u = self.units.setdefault(unit, FakeUnit())
        if u.pid:
            self.ended_pids.add(u.pid)
        self._next_pid += 1
        u.active, u.pid, u.ready = "active", self._next_pid, False
        u.invocation = uuid.uuid4().hex
        self.started.append(unit)
        u.loading_polls = self.load_polls
        u.fate = self.boot(self, unit)

    def stop(self, unit: str) -> None:
        u = self.units.setdefault(unit, FakeUnit())
        if u.pid:
            self.ended_pids.add(u.pid)
        u.active, u.pid, u.ready = "inactive", None, False

    def set_enabled(self, unit: str, enabled: bool) -> None:
        self.units.setdefault(unit, FakeUnit()).enabled = "enabled" if enabled else "disabled"

    def _finish_loading(self, unit: str) -> None:
        u = self.units[unit]
        u.loading_polls = 0
        if u.fate == "crash":
            u.active, u.pid, u.ready = "failed", None, False
        elif u.fate == "serve":
            u.ready = True

    def tick(self) -> None:
        """Time passes for every loading process (the health wait probes once per poll)."""
        for name, u in self.units.items():
            if u.active == "active" and not u.ready and u.loading_polls > 0:
                u.loading_polls -= 1
                if u.loading_polls == 0:
                    self._finish_loading(name)

    def serving_unit(self) -> str | None:
        return next((n for n, u in self.units.items() if u.active == "active"), None)

    # -- HTTP ------------------------------------------------------------------------------------
    def handle_http(self, request: httpx.Request) -> httpx.Response:
        self.events.append(f"http {request.method} {request.url.path}")
        unit = self.serving_unit()
        if unit is None:
            raise httpx.ConnectError("connection refused (no server listening)", request=request)
        ready = self.units[unit].ready
        if request.url.path == "/health":
            return httpx.Response(200 if ready else 503)
        if request.url.path == "/generate" and request.method == "POST":
            self.generations[unit] = self.generations.get(unit, 0) + 1
            if self.generations[unit] > self.generate_fails_after.get(unit, self.generations[unit]):
                return httpx.Response(500, json={"error": {"message": "CUDA error: an illegal memory access"}})
            return httpx.Response(200, json={"text": " Paris."}) if ready else httpx.Response(503)
        if request.url.path == "/v1/loads" and self.in_flight is not None:
            n = self.in_flight.get(unit, 0)
            if n:  # each look finds one request fewer, unless `stuck`
                self.in_flight[unit] = n - (0 if self.stuck_requests else 1)
            return httpx.Response(200, json={"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0}]})
        if request.url.path == "/server_info":
            accept = self.accept_lengths.get(unit, 3.5)
            return httpx.Response(200, json={"internal_states": [{"avg_spec_accept_length": accept}]})
        return httpx.Response(404)


# The `compile` op's verdicts on this machine, by request: the real agent's op (this machine's
# interpreter in a subprocess, as the unit's user) runs once per distinct request in a process,
# not at every deploy of the same files (a fault matrix deploys the same patch set a hundred
# times). The verdict is a function of the request alone: the same files, interpreter, user and
# timeout; only a verdict (errors or none) is kept, never a compile that did not finish.
_COMPILE_VERDICTS: dict[str, dict[str, Any]] = {}


def _compile_verdict(req: dict[str, Any], proc: Agent) -> dict[str, Any]:
    key = json.dumps(req, sort_keys=True)
    answer = _COMPILE_VERDICTS.get(key)
    if answer is None:
        answer = json.loads(json.dumps(proc.handle(req)))
        if answer.get("ok") and answer["result"].get("failed") is None:
            _COMPILE_VERDICTS[key] = answer
    else:
        proc.lease.renew()  # as the agent's handle() does for every request
    return json.loads(json.dumps(answer))


class _ForkingOps:
    """The real agent as a small process of this machine, for the op that forks: `path_access`
    asks in a forked child that takes the unit's identity (host/agent/path_access.py). A fork
    copies the forking process's page tables, and every xdist worker has imported torch and scipy
    by collecting tests/payload: there a fork costs about 20 ms of CPU, in this process under one,
    and the quick loop's fake deploys make about a thousand. Same op, same files, same user: only
    the process that forks is another. One per process, started at first use, ended by EOF when
    this process goes (it holds no lock: its lease running out ends nothing); a dead one is
    started again."""

    START = ("from ddtree_ops.host.agent.serve import Agent, serve\n"
             "agent = Agent()\n"
             "agent.lease.lease_s = 1e9  # idle between tests: not a controller that went away\n"
             "serve(agent=agent)\n")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    def close(self) -> None:
        """EOF to the helper, and wait for it (it exits at once: it holds no lock)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        line = (json.dumps(req) + "\n").encode()
        with self._lock:
            for _ in range(2):
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen([sys.executable, "-c", self.START], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
                try:
                    self._proc.stdin.write(line)
                    self._proc.stdin.flush()
                    answer = self._proc.stdout.readline()
                except OSError:
                    answer = b""
                if answer:
                    return json.loads(answer)
                self._proc.kill()
                self._proc.wait()
                self._proc = None
        raise RuntimeError("the fake host's helper agent process gave no answer to path_access, twice")


_FORKING_OPS = _ForkingOps()


def _fate_from_installed_files(fake: FakeHost, unit: str) -> str:
    if fake.read(f"/etc/systemd/system/{unit}") is None:
        return "crash"  # no such unit: systemctl cannot start it
    if unit == fake.host.unit:
        for data in fake.tree(fake.host.site_packages + "/sglang").values():
            if FAKE_CRASH in data:
                return "crash"
            if FAKE_HANG in data:
                return "hang"
    return "serve"


def _map_paths(req: dict[str, Any], f: Callable[[str], str]) -> dict[str, Any]:
    """The agent request with every host path mapped into the fake host's root."""
    out = dict(req)
    for key in ("state_dir", "site_packages", "unit_path", "backup_dir"):
        if key in out:
            out[key] = f(out[key])
    if "paths" in out:
        out["paths"] = [dict(p, path=f(p["path"])) if isinstance(p, dict) else f(p) for p in out["paths"]]
    for key in ("secret_paths", "scrub_files"):
        if key in out:
            out[key] = [f(p) for p in out[key]]
    if out.get("op") == "install":
        out["files"] = [dict(x, path=f(x["path"])) for x in out["files"]]
    if out.get("op") == "release_write" and isinstance(out["fields"].get("installed"), dict):
        out["fields"] = dict(out["fields"], installed={f(p): sha for p, sha in out["fields"]["installed"].items()})
    return out


def _map_record(rec: Any, f: Callable[[str], str]) -> None:
    """A release record as the host keeps it (its `installed` paths and `site_packages` are host
    paths: the fake host's, inside its root) → as the controller reads it, and the other way."""
    if not isinstance(rec, dict):
        return
    if isinstance(rec.get("installed"), dict):
        rec["installed"] = {f(p): sha for p, sha in rec["installed"].items()}
    if isinstance(rec.get("site_packages"), str):
        rec["site_packages"] = f(rec["site_packages"])


def _map_records(op: str, res: Any, f: Callable[[str], str]) -> None:
    """The host paths in an answer that reads release records or names files, mapped back."""
    if op == "history":
        for rec in res.get("releases") or []:
            _map_record(rec, f)
    elif op == "facts":
        _map_record(res.get("current_release"), f)
    elif op == "release_write":
        _map_record(res.get("release"), f)
    elif op == "restore_check":
        res["files"] = [dict(d, path=f(d["path"])) for d in res.get("files") or []]


class FakeLink:
    """One controller's connection to the fake host (host.session.HostLink): the agent process it
    runs there, HTTP to the host's server, and time that passes without sleeping.

    A dropped connection ends that process (its lock with it, as on a host) and every later call
    fails until `reconnect`; a ControllerKilled fault is the controller dying (SIGKILL: nothing
    more is said)."""

    def __init__(self, fake: FakeHost):
        self.fake = fake
        self.proc: Agent | None = None
        self.down: str | None = None
        self._lost: LeaseLost | None = None

    def _point(self, name: str) -> None:
        if self._lost is not None:
            raise self._lost
        if name in self.fake.lose_lease_at:
            self.fake.lose_lease_at.discard(name)
            self._lost = LeaseLost(f"{self.fake.host.name}: the deploy lock's lease expired (fake)")
            raise self._lost
        if self.down:
            raise UnreachableError(f"{self.fake.host.name}: {self.down}")
        try:
            self.fake._call(name)
        except UnreachableError as e:
            self._kill(f"connection lost ({e})")
            raise
        except ControllerKilled:
            self._kill("the controller was killed")
            raise

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        op = request["op"]
        self._point(event_name(request) if op == "run" else f"agent {op}")
        if self.proc is None:
            self.proc = Agent()
        try:
            return answer_run(self.fake, request) if op == "run" else self.fake.agent(request, self.proc)
        finally:  # the answer (an error too) lost with the connection
            lost, self.fake.answer_lost = self.fake.answer_lost, None
            if lost:
                self._kill(f"connection lost ({lost})")
                raise UnreachableError(lost)

    def http_transport(self) -> httpx.BaseTransport:
        return httpx.MockTransport(self.fake.handle_http)

    def lease_lost(self) -> LeaseLost | None:
        return self._lost

    def sleep(self, seconds: float) -> None:
        self.fake.clock += seconds
        self.fake.tick()

    def monotonic(self) -> float:
        return self.fake.clock

    def reconnect(self) -> None:
        self.fake.reconnects += 1
        self.fake.events.append("reconnect")
        self._kill("reconnecting")
        self.down = None

    def close(self) -> None:
        self._kill("the connection was closed")

    def _kill(self, why: str) -> None:
        if self.proc is not None:
            self.proc.exit()
        self.proc, self.down = None, why
