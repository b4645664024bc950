"""Shared test kit (imported by tests/conftest.py and the test modules as `kit`): one set of real
sandbox hosts per test session, reset per test, and small patch sets built from the real sglang
0.5.23 files.

Sandbox tests need root, iproute2, util-linux and OpenSSH sshd. Without them they are skipped,
except under DDTREE_OPS_STRICT=1 (set by .ci/run), where a missing prerequisite is a failure:
CI must never go green by skipping the tests that matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent  # the checkout
STRICT = os.environ.get("DDTREE_OPS_STRICT") == "1"
SANDBOX_HOSTS = int(os.environ.get("DDTREE_OPS_TEST_HOSTS", "4"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def modules_loaded_by(code: str, *prefixes: str) -> list[str]:
    """The modules named by `prefixes` (or inside them) that one fresh interpreter has loaded after
    running `code`, sorted: what an import really pulls in."""
    probe = (f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in sys.modules "
             f"if any(m == p or m.startswith(p + '.') for p in {list(prefixes)!r}))))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _require_sandbox() -> None:
    from ddtree_ops.testing.sandbox import missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        msg = "sandbox prerequisites missing: " + "; ".join(missing)
        if STRICT:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """Real test hosts (network + mount namespaces, sshd, systemctl, sglang files)."""
    _require_sandbox()
    from ddtree_ops.testing.sandbox import Sandbox

    sb = Sandbox(tmp_path_factory.mktemp("sandbox"))
    try:
        # The hosts see the tests' temp folders: the tool's test hooks on a host write their
        # pause markers there.
        sb.up(SANDBOX_HOSTS, load_seconds=0.3, shared=(str(tmp_path_factory.getbasetemp()),))
        yield sb
    finally:
        sb.down()


@dataclass
class TestHost:
    """One sandbox host as a test sees it."""

    __test__ = False  # a helper, not a test class

    name: str
    sandbox: object
    inventory: Path  # the sandbox inventory (possibly with per-test overrides)

    @property
    def host(self):
        from ddtree_ops.config.inventory import load_inventory

        return load_inventory(self.inventory).hosts[self.name]

    def ssh(self, argv: list[str], check: bool = True, stdin: str | None = None):
        from ddtree_ops.host.transport import connect

        with connect(self.host) as conn:
            return conn.run(argv, check=check, stdin=stdin)

    def read(self, path: str) -> bytes | None:
        r = self.ssh(["sh", "-c", 'test -f "$1" && base64 -w0 "$1" || echo MISSING', "sh", path])
        out = r.stdout.strip()
        if out == "MISSING":
            return None
        import base64

        return base64.b64decode(out)

    def snapshot(self, paths: list[str]) -> dict[str, str | None]:
        """sha256 (or None) of each path, in one round trip."""
        script = 'for p in "$@"; do if [ -f "$p" ]; then sha256sum "$p"; else echo "- $p"; fi; done'
        out = self.ssh(["sh", "-c", script, "sh", *paths]).stdout
        snap = {}
        for line in out.splitlines():
            digest, path = line.split(None, 1)
            snap[path] = None if digest == "-" else digest
        return snap

    def unit_state(self, unit: str) -> str:
        return self.ssh(["systemctl", "is-active", unit], check=False).stdout.strip()

    def main_pid(self, unit: str) -> int | None:
        out = self.ssh(["systemctl", "show", "-p", "MainPID", unit], check=False).stdout.strip()
        pid = int(out.split("=", 1)[1] or 0) if out.startswith("MainPID=") else 0
        return pid or None

    def with_vars(self, tmp_path: Path, **host_vars) -> "TestHost":
        """A copy of this host's inventory where it has extra vars (e.g. fault knobs); the vars of
        an earlier with_vars are kept (it once started from the sandbox's inventory, so
        `slow_load(th).with_vars(lock_lease_s=6)` lost the slow load, and a check that the weights
        were still loading raced the 0.3 s load)."""
        doc = yaml.safe_load(Path(self.inventory).read_text())
        hosts = doc["all"]["children"]["sandbox"]["hosts"]
        hosts[self.name] = {**hosts[self.name], **host_vars}
        out = tmp_path / f"inventory-{self.name}-{len(list(tmp_path.glob('inventory-*')))}.yaml"
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
        return TestHost(self.name, self.sandbox, out)

    def base_extra_args(self) -> list[str]:
        doc = yaml.safe_load(Path(self.sandbox.inventory_path).read_text())
        return list(doc["all"]["vars"]["extra_args"])


@pytest.fixture
def fresh_host(sandbox) -> TestHost:
    """sbx1, reset to the state before any deploy (upstream files, DFlash unit running)."""
    sandbox.reset_host("sbx1")
    return TestHost("sbx1", sandbox, Path(sandbox.inventory_path))


@pytest.fixture
def fresh_hosts(sandbox) -> list[TestHost]:
    """Every sandbox host, each reset to the state before any deploy."""
    out = []
    for h in sandbox.hosts():
        sandbox.reset_host(h.name)
        out.append(TestHost(h.name, sandbox, Path(sandbox.inventory_path)))
    return out


# ---------------------------------------------------------------------------------------------
# patch sets


def upstream_file(rel: str) -> bytes:
    from ddtree_ops.testing.sandbox import sglang_site_tree

    return (sglang_site_tree() / rel).read_bytes()


def make_patchset(root: Path, files: dict[str, bytes], *, name: str = "testps", version: str = "1.0.0",
                  sglang: str = "==0.5.23", replace: tuple[str, ...] | None = None) -> Path:
    """A patch set folder: each rel path → content; paths that exist upstream are `replace`
    (with the real base hash), the others `add`."""
    from ddtree_ops.testing.sandbox import sglang_site_tree

    site = sglang_site_tree()
    d = root / name
    entries = []
    for rel, data in files.items():
        dst = d / "files" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        upstream = site / rel
        if (replace is None and upstream.exists()) or (replace is not None and rel in replace):
            entries.append({"path": rel, "action": "replace", "base_sha256": sha256_bytes(upstream.read_bytes())})
        else:
            entries.append({"path": rel, "action": "add"})
    manifest = {"name": name, "version": version, "sglang": sglang, "packages": ["sglang"], "files": entries}
    (d / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return d


DFLASH_INFO = "sglang/srt/speculative/dflash_info.py"


@pytest.fixture
def good_patchset(tmp_path) -> Path:
    """Adds a ddtree module and replaces an upstream file: the shape of the real payload."""
    return make_patchset(tmp_path, {
        "sglang/srt/speculative/ddtree_probe.py": b"PROBE = 'ddtree-ops test patch set'\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# patched by the ddtree-ops tests\n",
    })


# ---------------------------------------------------------------------------------------------
# running the CLI for real


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def cli_module(env: dict | None) -> str:
    """The command a test runs: `ddtree-ops` as an operator runs it, or, when the test hands it
    test-hook variables (ddtree_ops.testing.pause_points), the same command with those hooks."""
    from ddtree_ops.testing.pause_points import HOOK_VARIABLES

    return "ddtree_ops.testing.hooked_cli" if set(env or {}) & set(HOOK_VARIABLES) else "ddtree_ops"


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> CliResult:
    """`ddtree-ops ARGS` in a subprocess, as an operator or a pipeline runs it."""
    full_env = {**os.environ, **(env or {})}
    r = subprocess.run([sys.executable, "-m", cli_module(env), *args], capture_output=True, text=True,
                       timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
    return CliResult(r.returncode, r.stdout, r.stderr)


@pytest.fixture
def cli():
    return run_cli


# ---------------------------------------------------------------------------------------------
# signal dispositions: a test that interrupts the tool sets them itself. A process started with
# SIGINT ignored (a shell's `cmd &`, nohup, many CI wrappers) hands SIG_IGN to every child across
# exec, and Python then installs no KeyboardInterrupt handler: a test relying on what it inherited
# passes in a terminal and fails in the background.

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def default_dispositions() -> None:
    """`preexec_fn` of a child a test will interrupt: SIGINT, SIGTERM and SIGHUP at their
    defaults in the child, whatever this process inherited (the tool then handles them as an
    operator's shell would have it: cli/signals.py)."""
    for s in INTERRUPT_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


@pytest.fixture
def sigint_raises():
    """For an in-process test that interrupts its own main thread: SIGINT raises KeyboardInterrupt
    during the test (as in an interactive Python), whatever the test process inherited; the
    inherited handler comes back afterwards."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def snapshot_paths(th: TestHost, rels: list[str]) -> list[str]:
    h = th.host
    return [f"{h.site_packages}/{r}" for r in rels] + [h.unit_path] + [f"/etc/systemd/system/{u}" for u in h.conflicts]


# ---------------------------------------------------------------------------------------------
# fault tests: a cheap "pre-deploy state" check, the tool as a background process, host plumbing

_PRISTINE_SCRIPT = r"""
import hashlib, json, os, sys
out = {}
for root in sys.argv[1:]:
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for n in sorted(files + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
            p = os.path.join(d, n)
            st = os.lstat(p)
            if os.path.islink(p):
                out[p] = ["link", os.readlink(p)]
            else:
                with open(p, "rb") as fh:
                    out[p] = [oct(st.st_mode & 0o7777), st.st_uid, st.st_gid, hashlib.sha256(fh.read()).hexdigest()]
mounts = [l.split()[1] for l in open("/proc/mounts") if l.split()[1].startswith(("/var/lib/", "/opt/"))]
print(json.dumps({"files": out, "mounts": mounts}))
"""
_PRISTINE: dict[str, dict] = {}  # host name → the tree right after a full reset


def host_tree(th: "TestHost") -> dict:
    """Mode, owner and sha256 of every file under the unit folder and sglang's speculative/ (plus
    mounts under /var/lib and /opt): what the fault tests may touch, in one round trip."""
    h = th.host
    spec = f"{h.site_packages}/sglang/srt/speculative"
    r = th.ssh([h.python, "-c", _PRISTINE_SCRIPT, "/etc/systemd/system", spec])
    return json.loads(r.stdout)


def _units_as_before(th: "TestHost") -> bool:
    h = th.host
    return th.unit_state(h.conflicts[0]) == "active" and th.unit_state(h.unit) != "active"


def _clean(sandbox, name: str) -> TestHost:
    """`name` in its pre-deploy state, cheaply: when the previous test left it byte-identical to a
    freshly reset host (files, modes, owners, units, no extra mounts, its own sshd alive, DFlash
    serving, DDTree stopped) only the state dir is wiped; otherwise a full `reset_host`."""
    import httpx

    from ddtree_ops.host.localproc import pid_alive

    th = TestHost(name, sandbox, Path(sandbox.inventory_path))
    sbh = next(x for x in sandbox.hosts() if x.name == name)
    ok = False
    if name in _PRISTINE and pid_alive(sbh.container_pid):
        try:
            ok = (host_tree(th) == _PRISTINE[name] and _units_as_before(th)
                  and httpx.get(th.host.base_url + "/health", timeout=3).status_code == 200)
        except Exception:
            ok = False
    if ok:
        th.ssh(["rm", "-rf", th.host.state_dir])
    else:
        sandbox.reset_host(name)
        _PRISTINE[name] = host_tree(th)
    return th


@pytest.fixture
def clean_host(sandbox) -> TestHost:
    """sbx1 in its pre-deploy state (see `_clean`: a full reset only when it is not)."""
    return _clean(sandbox, "sbx1")


@pytest.fixture
def clean_hosts(sandbox) -> list[TestHost]:
    """Every sandbox host in its pre-deploy state (see `_clean`)."""
    return [_clean(sandbox, h.name) for h in sandbox.hosts()]


def in_parallel(scenarios: dict[str, "Callable[[], object]"]) -> dict[str, object]:
    """Run independent per-host scenarios at once (hosts are separate machines); re-raise the
    first failure, labelled with its scenario, after all have finished."""
    import threading
    import traceback

    results: dict[str, object] = {}
    errors: dict[str, str] = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below with its traceback
            errors[name] = "".join(traceback.format_exception(type(e), e, e.__traceback__))

    threads = [threading.Thread(target=run, args=(n, f), name=n) for n, f in scenarios.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        pytest.fail("\n".join(f"--- scenario {n} failed:\n{tb}" for n, tb in errors.items()), pytrace=False)
    return results


# A probe for races against the CLI's start-up: with this variable set (seconds), every
# background CLI (CliProcess) sleeps that long before it imports anything, as a CLI on a starved
# machine starts late. A test that times something from the CLI's start instead of from an event
# fails under it (the first-contact outages once did: sshd was back before the first try).
START_DELAY = "DDTREE_OPS_TEST_CLI_START_DELAY_S"


def _cli_argv(module: str) -> list[str]:
    delay = float(os.environ.get(START_DELAY) or 0)
    if delay <= 0:
        return [sys.executable, "-m", module]
    return [sys.executable, "-c", f"import runpy, sys, time; time.sleep({delay!r}); sys.argv[0] = {module!r}; "
                                  f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]


class CliProcess:
    """`ddtree-ops ARGS` running in the background (own session), output in files; SIGINT, SIGTERM
    and SIGHUP at their defaults when it starts (`default_dispositions`), as tests signal it."""

    def __init__(self, args: tuple[str, ...], workdir: Path, env: dict | None = None):
        self.out_path = workdir / f"cli-{os.getpid()}-{id(self)}.out"
        self.err_path = workdir / f"cli-{os.getpid()}-{id(self)}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([*_cli_argv(cli_module(env)), *args], stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                         start_new_session=True, preexec_fn=default_dispositions)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 300) -> CliResult:
        code = self.proc.wait(timeout=timeout)
        return CliResult(code, self.out_path.read_text(), self.err_path.read_text())

    def stderr(self) -> str:
        return self.err_path.read_text()

    def kill(self) -> None:
        import signal as _signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, _signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def start_cli(tmp_path):
    """Start the CLI in the background; every process started is killed (by PID) at teardown."""
    started: list[CliProcess] = []

    def start(*args: str, env: dict | None = None) -> CliProcess:
        p = CliProcess(args, tmp_path, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def wait_for(pred, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    """Poll `pred` until it returns something true; fail the test after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)




# ---------------------------------------------------------------------------------------------
# fleet tests: inventories with several per-host overrides, or a multi-node server


def write_inventory(sandbox, path: Path, host_vars: dict[str, dict] | None = None,
                    multinode: list[str] | None = None) -> Path:
    """A copy of the sandbox inventory with extra vars per host and, optionally, `multinode`
    hosts (rank 0 first) grouped as the multi-node server `server1`."""
    from ddtree_ops.testing.sandbox import multinode_inventory

    doc = yaml.safe_load(Path(sandbox.inventory_path).read_text())
    base_args = list(doc["all"]["vars"]["extra_args"])
    hosts = doc["all"]["children"]["sandbox"]["hosts"]
    for name, hv in (host_vars or {}).items():
        hv = dict(hv)
        if "extra_args_add" in hv:  # fault knobs on top of the sandbox's own arguments
            hv["extra_args"] = base_args + list(hv.pop("extra_args_add"))
        hosts[name] = {**hosts[name], **hv}
    if multinode:
        doc = multinode_inventory(doc, multinode)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# a busy machine, made on purpose: the gate's verdict must not follow the machine's load


@contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen]]:
    """n processes spinning on a core each (tests/busy_loop.py), ended by their PIDs."""
    loop = str(Path(__file__).with_name("busy_loop.py"))
    procs = [subprocess.Popen([sys.executable, loop], stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(10)
