"""The agent never runs the venv's interpreter as root.

The agent (root) runs on the inventory's `agent_python` (a root-owned system interpreter), not on
the venv's `python`: a venv's `pyvenv.cfg` picks the standard library even under `-I -S`, so
whoever can write the venv would run code as root. The agent refuses an interpreter that anyone
but root could change. What needs the venv's Python runs it as the unit's User=: the compile (the
venv's version decides the syntax) and the launch check. Facts read the venv's version from its
files, and the unit's User= is looked up there, so a user the host lacks is refused at preflight.

On a sandbox host, a doctored `pyvenv.cfg` (its `home =` a standard library whose `encodings`
writes who ran it) proves plan and deploy never run it as root, beside controls that do.
"""

from __future__ import annotations

import base64
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_ops.config.inventory import AGENT_PYTHON, parse_inventory
from ddtree_ops.errors import EXIT_BAD_INPUT, InventoryError, PreflightError
from ddtree_ops.host.agent.facts import service_user_facts
from ddtree_ops.host.agent.interpreter import interpreter_problem, path_problem
from ddtree_ops.host.agent.protocol import Compile
from ddtree_ops.host.agent.venv_compile import op_compile
from ddtree_ops.host.agent.venv_version import venv_python_version
from ddtree_ops.host.channel import AgentChannel, agent_argv
from ddtree_ops.runbook.plan import plan_host
from ddtree_ops.testing.fake_host import fake_hosts, fake_inventory
from ddtree_ops.testing.local_agent import LocalConnection
from fast_kit import PROBE_REL, load, write_patchset

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="only a root agent checks its interpreter and switches users")
needs_system_python = pytest.mark.skipif(not os.path.exists(AGENT_PYTHON), reason=f"no {AGENT_PYTHON} here")


def b64(text: bytes) -> str:
    return base64.b64encode(text).decode()


def channel(agent_python: str, python: str = "/opt/venv_sglang/bin/python") -> AgentChannel:
    host = SimpleNamespace(name="h1", python=python, agent_python=agent_python, connect_timeout_s=10.0,
                           become=False, lock_lease_s=30.0, lock_renew_s=10.0)
    return AgentChannel(LocalConnection(), host)  # type: ignore[arg-type]


def version_of(python: str) -> str:
    return subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()


# -------------------------------------------------------------------------- the agent's interpreter

@needs_system_python
def test_the_agent_starts_on_agent_python_and_never_on_the_venvs_interpreter(tmp_path):
    ch = channel(AGENT_PYTHON, python=sys.executable)
    try:
        assert "releases" in ch.call({"op": "history", "state_dir": str(tmp_path / "state")}, 60)
        args = ch.conn.channels[0].proc.args  # type: ignore[attr-defined]
        assert args == agent_argv(AGENT_PYTHON) and args[1:3] == ["-I", "-S"]
        assert args != agent_argv(sys.executable)  # control: the venv's (here: this one) is not used
        assert ch.hello is not None and ch.hello.python == version_of(AGENT_PYTHON)
    finally:
        ch.close()


def test_agent_python_is_an_inventory_field_defaulting_to_the_system_python():
    inv = fake_inventory(2)
    inv["all"]["hosts"]["fh2"]["agent_python"] = "/usr/local/bin/python3.12"
    hosts = parse_inventory(inv, "inv.yaml").hosts
    assert hosts["fh1"].agent_python == AGENT_PYTHON == "/usr/bin/python3"
    assert hosts["fh2"].agent_python == "/usr/local/bin/python3.12"
    inv["all"]["hosts"]["fh2"]["agent_python"] = "python3"
    with pytest.raises(InventoryError, match="host 'fh2': field 'agent_python': must be an absolute path"):
        parse_inventory(inv, "inv.yaml")


def fake_lstat(overrides: dict[str, tuple[int, int]]):
    """os.lstat, but every real path reads as root's 0755 (0644 for a file) unless `overrides`
    gives (uid, mode bits) for it: the ownership cases without chown on this machine."""
    def lstat(p):
        st = os.lstat(p)
        uid, bits = overrides.get(p, (0, 0o755 if os.path.isdir(p) else 0o644))
        kind = st.st_mode & ~0o7777
        return SimpleNamespace(st_uid=uid, st_mode=kind | bits)
    return lstat


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv of this machine's base interpreter (bin/python, pyvenv.cfg), in a temp folder."""
    parent = tmp_path_factory.mktemp("agentpy")
    parent.chmod(0o777)  # world-writable, not sticky: what lies in it could be swapped by anyone
    d = parent / "venv"
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", "--without-pip", str(d)],
                   check=True)
    return d


def test_an_interpreter_only_root_can_change_passes_and_one_others_can_change_is_named(venv):
    python, cfg = str(venv / "bin" / "python"), str(venv / "pyvenv.cfg")
    stdlib = os.__file__
    assert interpreter_problem(python, stdlib, euid=0, lstat=fake_lstat({})) is None  # control
    cases = {
        cfg: ((65534, 0o644), "is owned by uid 65534, not root"),  # the service user's pyvenv.cfg
        str(venv / "bin"): ((0, 0o775), "is writable by its group (mode 0775)"),
        os.path.dirname(os.path.realpath(stdlib)): ((0, 0o757), "is writable by others (mode 0757)"),
        os.path.realpath(python): ((1000, 0o755), "is owned by uid 1000, not root"),
    }
    for path, (override, said) in cases.items():
        why = interpreter_problem(python, stdlib, euid=0, lstat=fake_lstat({path: override}))
        assert why is not None and f"{path} {said}" in why and "set agent_python" in why, (path, why)
    # Not root: the agent has no rights to protect, nothing is refused.
    assert interpreter_problem(python, stdlib, euid=1000, lstat=fake_lstat({cfg: (65534, 0o666)})) is None


def test_a_path_under_a_world_writable_folder_is_refused_as_sshd_strictmodes_would(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # anyone may rename what is in it
    why = path_problem(str(open_dir / "python3"))
    assert why is not None and f"{open_dir} is writable by group and others (mode 0777)" in why
    assert path_problem("/usr/bin") is None  # control: root's 0755 all the way down


def test_a_root_owned_sticky_folder_such_as_tmp_is_no_way_in():
    # Others may add entries to /tmp (1777) but never rename or remove root's: what lies in a
    # root-owned, closed folder below it is root's alone. The same folder without the sticky bit
    # is refused (the test above).
    sticky = tempfile.gettempdir()
    st = os.stat(sticky)
    assert st.st_mode & 0o1002 == 0o1002 and st.st_uid == 0
    inside = tempfile.mkdtemp()  # 0700, root's
    try:
        assert path_problem(inside) is None
        os.chmod(inside, 0o1777)  # the leaf itself is judged by its own mode, sticky or not
        assert "writable by group and others" in (path_problem(inside) or "")
    finally:
        os.rmdir(inside)


@needs_root
@needs_system_python
def test_an_agent_on_an_interpreter_others_can_change_refuses_with_exit_2_and_does_nothing(venv, tmp_path):
    """The venv lies in a world-writable folder: started there as root, the agent says why in its
    hello and runs nothing; the channel stops with a PreflightError (exit 2) naming agent_python.
    The control starts the same request on the system interpreter."""
    state = tmp_path / "state"
    request = {"op": "lock", "state_dir": str(state), "holder": {"token": "t"}}
    ch = channel(str(venv / "bin" / "python"))
    try:
        with pytest.raises(PreflightError) as e:
            ch.call(request, 60)
    finally:
        ch.close()
    msg = str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT and "\n" not in msg
    assert msg.startswith(f"h1: agent_python {venv}/bin/python: the agent runs as root and will not run on"), msg
    assert not state.exists()  # nothing ran
    ok = channel(AGENT_PYTHON)
    try:
        assert ok.call(request, 60)["acquired"] and state.is_dir()
        ok.call({"op": "unlock", "state_dir": str(state), "token": "t"}, 60)
    finally:
        ok.close()


# -------------------------------------------------------------------------------------- compile

def python312() -> str | None:
    """A real Python 3.12 (pyenv's shims are scripts that may not run one)."""
    for found in [*sorted(glob.glob("/root/.pyenv/versions/3.12*/bin/python3.12")), shutil.which("python3.12")]:
        if found and "/shims/" not in found and os.access(found, os.X_OK):
            return found
    return None


def test_compile_uses_the_venvs_python_version_not_the_agents(tmp_path):
    """`type X = int` is 3.12 syntax: refused for a 3.11 venv, accepted for a 3.12 one, by the
    same agent (this interpreter, 3.11)."""
    py312 = python312()
    if py312 is None or sys.version_info[:2] != (3, 11):
        pytest.skip("needs this interpreter at 3.11 and a python3.12 beside it")
    files = {"/x/sglang/alias.py": b64(b"type Alias = int\n")}
    ch = channel(sys.executable)
    try:
        old = ch.call(Compile(files, sys.executable).to_wire(), 60)
        new = ch.call(Compile(files, py312).to_wire(), 60)
    finally:
        ch.close()
    assert old["errors"] == ["/x/sglang/alias.py:1: SyntaxError: invalid syntax"] and "failed" not in old
    assert new["errors"] == [] and "failed" not in new  # the control: the 3.12 venv accepts it


@pytest.fixture
def probe_python():
    """`python` that notes who ran it (`id -u`) and runs the system interpreter, in a folder
    `nobody` can read; (its path, the log)."""
    root = Path(tempfile.mkdtemp(prefix="ddtree-agentpy-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        out = root / "out"
        out.mkdir(mode=0o777)
        os.chmod(out, 0o777)
        py = root / "python"
        py.write_text(f'#!/bin/sh\nid -u >> {out}/uid.log\nexec {AGENT_PYTHON} "$@"\n')
        os.chmod(py, 0o755)
        yield str(py), out / "uid.log"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@needs_root
@needs_system_python
def test_compile_runs_the_venvs_python_as_the_units_user_and_a_root_unit_as_root(probe_python):
    py, log = probe_python
    files = {"/x/bad.py": b64(b"def f(:\n"), "/x/good.py": b64(b"X = 1\n")}
    reply = op_compile(Compile(files, py, user="nobody"))
    nobody = pwd.getpwnam("nobody")
    assert reply.failed is None and reply.errors == ["/x/bad.py:1: SyntaxError: invalid syntax"]
    assert reply.ran_as == {"user": "nobody", "uid": nobody.pw_uid, "gid": nobody.pw_gid}
    assert log.read_text().split() == [str(nobody.pw_uid)]
    root_unit = op_compile(Compile(files, py))  # the control: a unit without User= runs as root
    assert root_unit.ran_as == {"user": "root", "uid": 0, "gid": 0}
    assert log.read_text().split() == [str(nobody.pw_uid), "0"]


def test_a_user_the_host_lacks_stops_the_compile_before_anything_runs(probe_python):
    py, log = probe_python
    reply = op_compile(Compile({"/x/a.py": b64(b"X = 1\n")}, py, user="ddtree-no-such-user"))
    assert reply.failed is not None and "User=ddtree-no-such-user does not exist on this host" in reply.failed
    assert not log.exists()
    me = pwd.getpwuid(os.geteuid()).pw_name  # control: a user it has
    assert op_compile(Compile({"/x/a.py": b64(b"X = 1\n")}, py, user=me)).failed is None


@pytest.mark.parametrize("body,timeout,said", [
    ("exec yes", 60.0, "was stopped: it printed more than 4194304 bytes"),
    ("exec sleep 30", 1.0, "was stopped: it did not finish in 1s"),
    ("echo '[1, 2]'", 60.0, "printed no list of compile errors"),
    ("echo boom >&2; exit 3", 60.0, "exited 3 while compiling: boom"),
])
def test_what_the_venvs_python_prints_is_bounded_and_read_as_data(tmp_path, body, timeout, said):
    """Whoever can write the venv decides what its interpreter prints: a flood stops at the cap, a
    hang at the timeout, anything but a list of strings is no verdict; the control compiles."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    t0 = time.monotonic()
    reply = op_compile(Compile({"/x/a.py": b64(b"X = 1\n")}, str(fake), timeout=timeout))
    assert reply.failed is not None and said in reply.failed and reply.errors == [], reply
    assert time.monotonic() - t0 < 30
    good = op_compile(Compile({"/x/a.py": b64(b"X = 1\n")}, sys.executable))
    assert good.failed is None and good.errors == []


# ---------------------------------------------------------------------------------------- facts

def test_the_venvs_version_is_read_from_its_files(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    sp = str(venv / "lib" / "python3.10" / "site-packages")
    py = str(venv / "bin" / "python")
    assert venv_python_version(py, sp) == "3.10"  # no pyvenv.cfg: the lib folder says
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.10.14\n")
    assert venv_python_version(py, sp) == "3.10.14"
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.12.1\n")  # uv's spelling
    assert venv_python_version(py, sp) == "3.12.1"
    assert venv_python_version("", "/srv/packages") is None  # neither says: unknown, not the agent's


def test_facts_report_the_venvs_python_and_the_agents_apart(tmp_path):
    [fake] = fake_hosts(tmp_path)
    facts = fake.session().store.facts([])
    assert facts["python"] == "3.11"  # the fake venv's lib/python3.11 (no pyvenv.cfg on the fake host)
    assert facts["agent_python"] == sys.version.split()[0]


def test_the_units_user_is_looked_up_on_the_host():
    assert service_user_facts("root") == {"service_user_uid": 0, "service_user_problem": None}
    assert service_user_facts("nobody")["service_user_uid"] == pwd.getpwnam("nobody").pw_uid
    missing = service_user_facts("ddtree-no-such-user")
    assert missing["service_user_uid"] is None
    assert "User=ddtree-no-such-user does not exist on this host" in missing["service_user_problem"]
    assert service_user_facts(None) == {}


def test_a_service_user_the_host_lacks_is_a_preflight_refusal(tmp_path):
    ps = load(write_patchset(tmp_path / "ps", {PROBE_REL: b"P = 1\n"}))
    [fake] = fake_hosts(tmp_path / "a", service_user="ddtree-no-such-user")
    refusals = plan_host(fake.session(), ps).refusals
    assert any("User=ddtree-no-such-user does not exist on this host" in r for r in refusals), refusals
    [ok] = fake_hosts(tmp_path / "b", service_user=pwd.getpwuid(os.geteuid()).pw_name)  # control
    assert not any("does not exist on this host" in r for r in plan_host(ok.session(), ps).refusals)


# ------------------------------------------------------------------------- on a real (sandbox) host

PROBE_DIR = "/var/lib/ddtree-agentpy-probe"  # the host's own /var/lib: emptied by a host reset
EVIL_HOME = "/opt/ddtree-evil-home"  # the host's own /opt (the venv's folder): rewritten by a reset
MARKER = f"{PROBE_DIR}/ran"

# What the doctored `encodings` runs first: append "UID CMDLINE" to MARKER, one line (bytes only:
# no codec exists yet when it runs; any failure is swallowed so the interpreter starts anyway).
PROBE_SRC = "\n".join([
    "try:",
    " import posix as _p, _io",
    " _c = _io.open('/proc/self/cmdline', 'rb').read().replace(bytes(1), b' ').replace(bytes([10]), b' ')",
    f" _f = _io.open({MARKER!r}, 'ab')",
    " _f.write(b'%d ' % _p.getuid() + _c + bytes([10]))",
    " _f.close()",
    "except Exception:",
    " pass",
    "",
])
# Run on the host by its system Python, as root (the test's own setup): a standard library at
# EVIL_HOME/lib/pythonX.Y made of links to the real one, except `encodings/__init__.py`, which is
# PROBE_SRC followed by the real module.
BUILD_EVIL_STDLIB = f"""
import os, sys
real, version, probe = sys.argv[1], sys.argv[2], sys.argv[3]
evil = {EVIL_HOME!r} + "/lib/python" + version
os.makedirs(evil + "/encodings")
os.makedirs({EVIL_HOME!r} + "/bin", exist_ok=True)
for name in os.listdir(real):
    if name != "encodings":
        os.symlink(os.path.join(real, name), os.path.join(evil, name))
for name in os.listdir(real + "/encodings"):
    if name not in ("__init__.py", "__pycache__"):
        os.symlink(os.path.join(real, "encodings", name), os.path.join(evil, "encodings", name))
with open(real + "/encodings/__init__.py") as fh:
    original = fh.read()
with open(evil + "/encodings/__init__.py", "w") as fh:
    fh.write(probe + original)
"""


def _runs(th) -> list[tuple[int, str]]:
    out = th.ssh(["sh", "-c", f"cat {MARKER} 2>/dev/null || true"]).stdout
    return [(int(line.split(" ", 1)[0]), line.split(" ", 1)[1]) for line in out.splitlines() if line.strip()]


def _clear(th) -> None:
    """An empty marker every user may append to (whoever ran first would own it otherwise)."""
    th.ssh(["sh", "-c", f": > {MARKER} && chmod 0666 {MARKER}"])


def test_plan_and_deploy_never_run_a_doctored_venv_interpreter_as_root(fresh_host, tmp_path, good_patchset, cli):
    """The host venv's pyvenv.cfg names a standard library that records who ran it. Controls
    first: the venv's interpreter run as root under `-I -S` records uid 0 (the doctoring works),
    and so does an agent put on it (`agent_python` = the venv's). Then, with the default
    agent_python and `service_user: nobody`: plan (its dry run compiles and parses the launch
    line, as deploy does) and deploy (compile, launch check, the server itself) run it only as
    nobody."""
    h = fresh_host.host
    venv = os.path.dirname(os.path.dirname(h.python))
    cfg = f"{venv}/pyvenv.cfg"
    original = fresh_host.read(cfg)
    assert original is not None
    home = next(line.split("=", 1)[1].strip() for line in original.decode().splitlines()
                if line.split("=", 1)[0].strip() == "home")
    version = "%d.%d" % sys.version_info[:2]  # the host venv is made from this machine's base interpreter
    real_stdlib = f"{os.path.dirname(home)}/lib/python{version}"
    try:
        fresh_host.ssh(["sh", "-c", f"mkdir -p -m 1777 {PROBE_DIR} && chmod 1777 {PROBE_DIR} "
                                    "&& chmod 1777 /run/ddtree-sandbox/gpu"])
        _clear(fresh_host)
        _let_nobody_reach_the_interpreter(fresh_host)
        fresh_host.ssh([AGENT_PYTHON, "-I", "-S", "-c", BUILD_EVIL_STDLIB, real_stdlib, version, PROBE_SRC])
        doctored = "".join(f"home = {EVIL_HOME}/bin\n" if line.split("=", 1)[0].strip() == "home" else line + "\n"
                           for line in original.decode().splitlines())
        fresh_host.ssh(["sh", "-c", 'cat > "$1"', "sh", cfg], stdin=doctored)

        # Control 1: the doctored venv's interpreter, as root, isolated, runs the planted code.
        fresh_host.ssh([h.python, "-I", "-S", "-c", "pass"])
        assert [uid for uid, _ in _runs(fresh_host)] == [0], _runs(fresh_host)
        _clear(fresh_host)

        # Control 2: an agent on the venv's interpreter (the old arrangement) runs it as root.
        old = fresh_host.with_vars(tmp_path, agent_python=h.python, service_user="nobody")
        r = cli("plan", "-i", str(old.inventory), "-l", h.name, "-p", str(good_patchset))
        assert r.code == 0, r.stderr[-2000:]
        assert any(uid == 0 and " -I -S -c " in cmd for uid, cmd in _runs(fresh_host)), _runs(fresh_host)
        _clear(fresh_host)

        th = fresh_host.with_vars(tmp_path, service_user="nobody")
        assert th.host.agent_python == AGENT_PYTHON
        r = cli("plan", "-i", str(th.inventory), "-l", h.name, "-p", str(good_patchset), "--json")
        assert r.code == 0, r.stderr[-2000:]
        nobody = 65534
        runs = _runs(fresh_host)  # plan's dry run: deploy's compile and launch parse, as the unit's user only
        assert runs and all(uid == nobody for uid, _ in runs), runs
        assert any("--parse-only" in cmd for _, cmd in runs), runs
        _clear(fresh_host)

        r = cli("deploy", "-i", str(th.inventory), "-l", h.name, "-p", str(good_patchset), "--yes", "--json")
        assert r.code == 0, r.stderr[-3000:]
        runs = _runs(fresh_host)
        assert runs and all(uid == nobody for uid, _ in runs), runs
        assert any(" -I -S -c " in cmd and "compile(" in cmd for _, cmd in runs), runs  # the compile ran
        assert any("--parse-only" in cmd for _, cmd in runs), runs  # and the launch check
    finally:
        fresh_host.ssh(["sh", "-c", 'cat > "$1"', "sh", cfg], stdin=original.decode(), check=False)
        fresh_host.ssh(["rm", "-rf", EVIL_HOME, PROBE_DIR], check=False)
        fresh_host.ssh(["chmod", "0700", "/root"], check=False)
    assert fresh_host.read(cfg) == original


def _let_nobody_reach_the_interpreter(th) -> None:
    """The host venv's base interpreter may lie under /root (pyenv), bound into the host at its
    own path; the host's /root is the container's own (never this machine's: checked), opened so
    that a `nobody` unit can run it, as on a real host whose venv lives in /opt."""
    inside = th.ssh(["stat", "-c", "%d:%i", "/root"]).stdout.strip()
    st = os.stat("/root")
    assert inside != f"{st.st_dev}:{st.st_ino}", "the host's /root is this machine's: not opening it"
    th.ssh(["chmod", "0755", "/root"])
