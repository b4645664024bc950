"""Run code against the real sglang 0.5.23 source, pristine or with the patch set.

`.venv-sglang` (scripts/setup-sglang-venv) holds the *pristine* 0.5.23 wheel. The patched tree
is an overlay built per test session: a folder of symlinks that mirrors site-packages/sglang,
except that every path the manifest lists points at the checkout's `patches/ddtree-temp/files`.
Put first on PYTHONPATH it shadows the installed package, so the tests always see the patch set
as it is in the working tree (no re-apply step, nothing written into the venv), and the same venv
still answers "what does upstream do" for the no-side-effects tests.

Each `run_sglang` call runs its code in a process of its own, forked from a fork server: one
`.venv-sglang` interpreter per test session and environment, shared by the xdist workers over a
Unix socket, that has imported torch, triton, transformers and the other third-party packages
SGLang imports (`PRELOAD`: most of the ~9 CPU-seconds an import of SGLang's worker costs) and
then only forks; it ends with the session. SGLang itself is imported by the forked process, with
the call's own environment and `sys.path` (overlay or pristine), as in a fresh interpreter: the
patched and the pristine tree, and whatever the code sets before its imports, behave as before.
No test's code runs in the server and no two calls share a process: module state, torch's
settings and seeds, monkeypatched SGLang globals and published server args end with the call's
process. What differs from a fresh interpreter: the preloaded modules are already imported (none
of them reads the variables a call may change, checked for TRITON_INTERPRET, which triton reads
when torch._dynamo imports it), and the process ends without tearing its modules down (atexit
handlers and non-daemon threads still run). `DDTREE_SGLANG_FORKSERVER=0` runs every call in a
fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import pathlib
import queue
import socket
import stat
import subprocess
import tempfile
import textwrap
import threading
import time

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / "patches" / "ddtree-temp"
VENV = pathlib.Path(os.environ.get("DDTREE_SGLANG_VENV", REPO / ".venv-sglang"))
PY = VENV / "bin" / "python"



def ancestors_or_self(parents: list[int]) -> list[set[int]]:
    """Every tree node's ancestors-or-self from its parent pointers (a padding node, parent -1:
    itself only). Plain Python, so the code a test runs in .venv-sglang can carry it too:
    `inspect.getsource(ancestors_or_self)`."""
    out = []
    for i in range(len(parents)):
        seen, j = set(), i
        while j >= 0 and j not in seen:
            seen.add(j)
            j = parents[j] if j > 0 else -1
        out.append(seen)
    return out

def need_venv() -> None:
    if not PY.exists():
        msg = f"{VENV} absent: run scripts/setup-sglang-venv"
        if os.environ.get("DDTREE_OPS_STRICT") == "1":
            pytest.fail(msg + " (DDTREE_OPS_STRICT=1)")
        pytest.skip(msg)


def site_packages() -> pathlib.Path:
    out = subprocess.run(
        [str(PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return pathlib.Path(out.stdout.strip())


def patch_set_at(rev: str, dest: pathlib.Path) -> pathlib.Path:
    """The patch set as committed at ``rev`` (read with ``git show``), written to ``dest``: a
    ``patch_dir`` for :func:`build_overlay` (the benchmarks' controls run an older patch set)."""
    rel = "patches/ddtree-temp"
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", rev, rel],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        data = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{name}"],
                              capture_output=True, check=True).stdout
        out = dest / pathlib.Path(name).relative_to(rel)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    return dest


def build_overlay(dest: pathlib.Path, patch_dir: pathlib.Path = PATCH_DIR) -> pathlib.Path:
    """A symlink mirror of site-packages/sglang with the patch set's files swapped in
    (``patch_dir``: another version of the patch set, e.g. for a before/after benchmark)."""
    site = site_packages()
    manifest = yaml.safe_load((patch_dir / "manifest.yaml").read_text())
    patched = {pathlib.PurePosixPath(f["path"]): patch_dir / "files" / f["path"]
               for f in manifest["files"]}
    split = {p for path in patched for p in path.parents if str(p) != "."}

    def mirror(rel: pathlib.PurePosixPath) -> None:
        out = dest / rel
        out.mkdir(parents=True, exist_ok=True)
        src = site / rel
        names = {e.name for e in src.iterdir() if e.name != "__pycache__"} if src.is_dir() else set()
        names |= {p.name for p in patched if p.parent == rel}
        for name in sorted(names):
            child = rel / name
            if child in patched:
                (out / name).symlink_to(patched[child])
            elif child in split:
                mirror(child)
            else:
                (out / name).symlink_to(src / name)
        _share_bytecode(src, out, {p.name for p in patched if p.parent == rel})

    mirror(pathlib.PurePosixPath("sglang"))
    return dest


def _share_bytecode(src: pathlib.Path, out: pathlib.Path, patched: set[str]) -> None:
    """The pristine .pyc files of a mirrored folder's modules that are not patched, linked into
    the mirror's own __pycache__. Python looks for a module's bytecode beside the path it imports
    it from, and for a mirrored folder that is the mirror: without these, every forked call
    compiled those modules again (with the rest of SGLang: importing the worker took 4.4 CPU-s
    after the fork server's preload instead of 1.9). A folder linked whole shares its __pycache__
    already. A patched module gets no link (its pristine .pyc is for other source), so it is
    compiled from the patch set's file as before; a .pyc Python writes here (bytecode on) replaces
    the link in the mirror, never the venv's file."""
    cache = src / "__pycache__"
    if not cache.is_dir():
        return
    stems = {name[:-3] for name in patched if name.endswith(".py")}
    mine = out / "__pycache__"
    mine.mkdir()
    for pyc in cache.iterdir():
        if pyc.name.split(".", 1)[0] not in stems:
            (mine / pyc.name).symlink_to(pyc)


@pytest.fixture(scope="session")
def sglang_overlay(tmp_path_factory) -> pathlib.Path:
    need_venv()
    return build_overlay(tmp_path_factory.mktemp("sglang-overlay"))


def run_sglang(code: str, tmp_path: pathlib.Path, overlay: pathlib.Path | None, *,
               timeout: int = 600, triton_interpret: bool = False) -> dict:
    """Run `code` in .venv-sglang (patched when `overlay` is given); it fills the dict `OUT`,
    which comes back as JSON. `MODEL` names a folder with a tiny Qwen3 config.json.
    `triton_interpret` runs SGLang's own Triton kernels on the CPU (Triton's interpreter), so
    the real index/mask kernels execute here instead of being replaced; code that sets
    TRITON_INTERPRET=1 itself before its imports (worker_fakes does) says so here too, as the
    fork server has imported triton (torch._dynamo does) under the call's environment, and a
    run that changes the variable fails. The code runs as `python -c` would run it, in a
    process of its own (forked from this pytest process's fork server; module docstring)."""
    need_venv()
    cfg = tmp_path / "model"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "block_size": 16}))
    script = "import json, sys\nMODEL = %r\nOUT = {}\n" % str(cfg) + textwrap.dedent(code) + \
        "\nprint('@@RESULT@@' + json.dumps(OUT))\n"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    if overlay is not None:
        env["PYTHONPATH"] = str(overlay)
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    if os.environ.get("DDTREE_SGLANG_FORKSERVER", "1") == "0":
        r = subprocess.run([str(PY), "-c", script], capture_output=True, text=True, timeout=timeout,
                           cwd=tmp_path, env=env)
    else:
        r = fork_server(env).run(script, tmp_path, env, timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("@@RESULT@@")][-1]
    return json.loads(line[len("@@RESULT@@"):])


# -- the fork server ---------------------------------------------------------------------------

# What the server imports before it forks: the third-party modules SGLang's server_args, schedule
# batch, model runner, triton backend and DFlash/DDTree workers import (measured with
# `python -X importtime`: about 85% of such an import's CPU time). Only third-party modules: each
# is imported under the same environment variables as a fresh interpreter would have (the server
# is keyed by them), none reads PYTHONPATH, and a module missing here is simply imported by the
# forked process. Never sglang: the server checks that none of these pulled it in.
PRELOAD = (
    "numpy", "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo",
    "triton", "triton.language", "transformers", "transformers.masking_utils", "transformers.activations",
    "transformers.modeling_layers", "transformers.models.llama", "transformers.models.auto.tokenization_auto",
    "transformers.generation.configuration_utils", "transformers.image_processing_utils",
    "transformers.tokenization_python", "IPython.display", "openai.types.responses", "fastapi",
    "compressed_tensors.config", "aiohttp", "aiohttp.web", "requests", "pydantic", "pydantic.v1", "tvm_ffi",
    "starlette.routing", "uvicorn", "gguf", "psutil", "zmq", "PIL.Image", "setproctitle", "einops",
    "msgspec", "yaml", "scipy", "scipy.stats",
)

# Variables that may differ between calls served by one server: PYTHONPATH (the forked process
# puts it on sys.path itself, as the interpreter would at start), PYTEST_CURRENT_TEST (pytest sets
# it per test) and PYTEST_XDIST_WORKER (one server serves every worker of the session); no
# preloaded module reads them. The forked process gets the call's whole environment; every other
# variable is part of the server's key, so a call with another environment (TRITON_INTERPRET=1,
# say) gets a server started under that one.
PER_CALL_ENV = ("PYTHONPATH", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")
SERVER_START_TIMEOUT = 600  # the preload: ~9 CPU-seconds, minutes on a loaded 2-core machine

SERVER = r'''
import importlib, importlib.machinery, json, os, selectors, shutil, signal, socket, sys, threading

for name in PRELOAD:
    try:
        importlib.import_module(name)
    except Exception:
        pass
if "torch" in sys.modules:  # nothing drew from torch's generator (each run reseeds it)
    import torch
    _fresh = torch.Generator()
    _fresh.manual_seed(torch.default_generator.initial_seed())
    if not torch.equal(torch.default_generator.get_state(), _fresh.get_state()):
        sys.exit("fork server: a preloaded module drew from torch's default generator")
leaked = sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang."))
if leaked or threading.active_count() != 1:
    sys.exit(f"fork server: preloading imported {leaked[:5]} / started Python threads {threading.enumerate()}")
sys.stdout.flush()
sys.stderr.flush()
import gc
gc.freeze()  # the preloaded objects stay out of the forked processes' collections (and copies)
SERVER_PID = os.getpid()

def serve():
    """Runs requested by the clients connected to SOCKET, one JSON line each: fork one process
    per run (serve() returns the request in that process), answer {"id", "pid"}, then {"id",
    "rc", "cpu"}; {"kill": id} kills a run, and so does its client hanging up. Ends when the
    pytest process that owns the session (OWNER) ends."""
    sel = selectors.DefaultSelector()
    owner = os.pidfd_open(OWNER)
    sel.register(owner, selectors.EVENT_READ, ("owner",))
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(SOCKET)
    lsock.listen(64)
    sel.register(lsock, selectors.EVENT_READ, ("listen",))
    runs = {}  # (conn fileno, id) -> (pid, pidfd)
    conns = {}  # fileno -> [socket, buffer]
    t = os.times()
    os.write(1, ("@@FORK@@ " + json.dumps({"ready": SERVER_PID, "cpu": round(t.user + t.system, 2)}) + "\n").encode())
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the client that started the server may end before it
    os.close(null)

    def reply(cfd, msg):
        if cfd in conns:
            try:
                conns[cfd][0].sendall((json.dumps(msg) + "\n").encode())
            except OSError:
                pass

    def kill(rkey):
        if rkey in runs:
            signal.pidfd_send_signal(runs[rkey][1], signal.SIGKILL)

    while True:
        for key, _ in sel.select():
            kind = key.data[0]
            if kind == "owner":
                for rkey in list(runs):
                    kill(rkey)
                shutil.rmtree(os.path.dirname(SOCKET), ignore_errors=True)
                os._exit(0)
            if kind == "listen":
                conn, _ = lsock.accept()
                conns[conn.fileno()] = [conn, b""]
                sel.register(conn, selectors.EVENT_READ, ("conn",))
                continue
            if kind == "run":  # a run ended
                _, rkey, pid = key.data
                _, status, usage = os.wait4(pid, 0)
                sel.unregister(key.fd)
                os.close(key.fd)
                del runs[rkey]
                reply(rkey[0], {"id": rkey[1], "rc": os.waitstatus_to_exitcode(status),
                                "cpu": round(usage.ru_utime + usage.ru_stime, 2)})
                continue
            cfd = key.fd
            conn = conns[cfd][0]
            chunk = conn.recv(1 << 20)
            if not chunk:  # the client hung up: its runs end with it
                for rkey in [r for r in runs if r[0] == cfd]:
                    kill(rkey)
                sel.unregister(conn)
                conn.close()
                del conns[cfd]
                continue
            conns[cfd][1] += chunk
            while b"\n" in conns[cfd][1]:
                line, conns[cfd][1] = conns[cfd][1].split(b"\n", 1)
                req = json.loads(line)
                if "kill" in req:
                    kill((cfd, req["kill"]))
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for fd in [owner, lsock.fileno(), *conns, *(f for _, f in runs.values())]:
                        os.close(fd)
                    return req
                fd = os.pidfd_open(pid)
                runs[(cfd, req["id"])] = (pid, fd)
                sel.register(fd, selectors.EVENT_READ, ("run", (cfd, req["id"]), pid))
                reply(cfd, {"id": req["id"], "pid": pid})

def become(req):
    """This process, as `python -c SCRIPT` started with the request's cwd and environment."""
    import atexit, builtins, ctypes, types
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: end with the server
    if os.getppid() != SERVER_PID:
        os._exit(137)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    interpret = os.environ.get("TRITON_INTERPRET")  # as it was when triton.language was imported

    def same_interpret():
        if os.environ.get("TRITON_INTERPRET") != interpret:
            os.write(2, b"\n@@FORK-ENV@@ this run changed TRITON_INTERPRET, which the fork server read when it "
                        b"imported triton: say so in run_sglang(triton_interpret=...)\n")
    atexit.register(same_interpret)  # the first registered: it runs last
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra  # where the interpreter puts PYTHONPATH: after the script's folder ('')
    importlib.invalidate_caches()
    # A fresh interpreter seeds these from the OS (random reseeds itself after a fork).
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter,
                         __spec__=None, __package__=None, __annotations__={})
    sys.modules["__main__"] = main
    return compile(req["script"], "<string>", "exec"), main.__dict__

def finish(run):
    """Run the code, then end this process as the interpreter would end it (the traceback, or
    SystemExit's code; non-daemon threads joined, atexit handlers, stdio flushed) without
    tearing down every preloaded module (seconds, most of it copying the server's memory)."""
    try:
        run()
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    import atexit
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            code = code or 120
    os._exit(code & 0xFF)

_code, _globals = become(serve())
del PRELOAD, serve, become
finish(lambda: exec(_code, _globals))
'''


def _session_owner() -> int:
    """The process whose end ends the session's fork servers: the xdist controller (a worker's
    parent), or this process under -n 0."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


class ForkServer:
    """A connection to the session's fork server for one environment: a `.venv-sglang`
    interpreter that has preloaded `PRELOAD` and forks a process per run. The first pytest
    process to need it starts it (under a lock); it ends with the session's owner process."""

    def __init__(self, env: dict):
        server_env = {k: v for k, v in env.items() if k not in PER_CALL_ENV}
        owner = _session_owner()
        digest = hashlib.sha256(json.dumps([str(PY), sorted(server_env.items()), PRELOAD, SERVER]).encode())
        self.dir = pathlib.Path(tempfile.gettempdir(), f"ddtree-sglang-{owner}-{digest.hexdigest()[:16]}")
        self.dir.mkdir(mode=0o700, exist_ok=True)
        st = self.dir.lstat()  # the socket runs code: a folder of ours, for us only
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise RuntimeError(f"{self.dir}: not a private folder of this user")
        sock_path, self.log_path = self.dir / "sock", self.dir / "server.log"
        with open(self.dir / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self.sock = self._connect(sock_path)
            except OSError:
                self._start(server_env, sock_path, owner)
                self.sock = self._connect(sock_path)
        self.lock = threading.Lock()
        self.next_id = 0
        self.replies: dict[int, queue.Queue] = {}
        threading.Thread(target=self._read, daemon=True, name="sglang-fork-server").start()

    @staticmethod
    def _connect(path: pathlib.Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        return sock

    def _start(self, server_env: dict, sock_path: pathlib.Path, owner: int) -> None:
        sock_path.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:
            proc = subprocess.Popen(
                [str(PY), "-c", f"PRELOAD = {PRELOAD!r}\nSOCKET = {str(sock_path)!r}\nOWNER = {owner}\n" + SERVER],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd=self.dir, env=server_env)
        self.proc = proc  # the server outlives this process if need be; it is never waited for here
        lines: queue.Queue = queue.Queue()

        def read_lines() -> None:
            for raw in proc.stdout:
                lines.put(raw)
            lines.put(b"")

        threading.Thread(target=read_lines, daemon=True).start()
        ready, deadline = None, time.monotonic() + SERVER_START_TIMEOUT
        try:
            while ready is None:  # until the server says it listens, ends, or takes too long
                raw = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if not raw:
                    break
                if raw.startswith(b"@@FORK@@ "):
                    ready = json.loads(raw[len(b"@@FORK@@ "):])
        except queue.Empty:
            proc.kill()
        if ready is None:
            proc.wait()
            raise RuntimeError("the sglang fork server did not start:\n" + self.log_path.read_text()[-6000:])
        _stat({"server_start_cpu_s": ready["cpu"], "pid": ready["ready"], "dir": str(self.dir)})

    def _read(self) -> None:
        for raw in self.sock.makefile("rb"):
            msg = json.loads(raw)
            with self.lock:
                q = self.replies.get(msg["id"])
            if q is not None:
                q.put(msg)
        self.dead = True
        with self.lock:
            for q in self.replies.values():
                q.put({"rc": None})

    dead = False

    def _send(self, msg: dict) -> None:
        with self.lock:
            self.sock.sendall((json.dumps(msg) + "\n").encode())

    def run(self, script: str, cwd: pathlib.Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """`python -c script` in `cwd` with `env`, as subprocess.run(capture_output=True, text=True,
        timeout=timeout) would give it (TimeoutExpired after killing it)."""
        with tempfile.TemporaryDirectory(prefix="sglang-run-") as tmp:
            out, err = pathlib.Path(tmp, "stdout"), pathlib.Path(tmp, "stderr")
            out.touch()
            err.touch()
            with self.lock:
                rid = self.next_id = self.next_id + 1
                q = self.replies[rid] = queue.Queue()
            try:
                self._send({"id": rid, "script": script, "cwd": str(cwd), "env": env,
                            "stdout": str(out), "stderr": str(err)})
                deadline = time.monotonic() + timeout
                try:
                    msg = q.get(timeout=timeout)
                    if "pid" in msg:
                        msg = q.get(timeout=max(0.0, deadline - time.monotonic()))
                    timed_out = False
                except queue.Empty:
                    timed_out = True
                if timed_out:
                    self._send({"kill": rid})
                    q.get(timeout=60)
                    raise subprocess.TimeoutExpired([str(PY), "-c", "..."], timeout, out.read_text(errors="replace"),
                                                    err.read_text(errors="replace"))
                if msg.get("rc") is None:
                    raise RuntimeError("the sglang fork server ended:\n" + self.log_path.read_text()[-6000:])
                _stat({"test": env.get("PYTEST_CURRENT_TEST"), "cpu_s": msg["cpu"],
                       "wall_s": round(time.monotonic() - deadline + timeout, 1)})
                stderr = err.read_text(errors="replace")
                assert "@@FORK-ENV@@" not in stderr, stderr[-6000:]
                return subprocess.CompletedProcess([str(PY), "-c", "..."], msg["rc"],
                                                   out.read_text(errors="replace"), stderr)
            finally:
                with self.lock:
                    self.replies.pop(rid, None)

    def close(self) -> None:
        """Hang up (the server kills this connection's runs; it ends with the session's owner)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


SERVERS: dict[tuple, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _stat(row: dict) -> None:
    """CPU and wall seconds of a forked run (its own: without the server's preloaded imports),
    or of a server's start, appended as a JSON line to the file DDTREE_SGLANG_STATS names."""
    if os.environ.get("DDTREE_SGLANG_STATS"):
        with open(os.environ["DDTREE_SGLANG_STATS"], "a") as f:
            f.write(json.dumps(row) + "\n")


def fork_server(env: dict) -> ForkServer:
    """This process's connection to the session's fork server for the environment `env`."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_CALL_ENV))
    with _SERVERS_LOCK:
        server = SERVERS.get(key)
        if server is None or server.dead:
            server = SERVERS[key] = ForkServer(env)
        return server


@atexit.register
def _close_servers() -> None:
    for server in SERVERS.values():
        server.close()
