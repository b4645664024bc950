"""A host as a container: real systemd as its PID 1, booted by systemd-nspawn in the host's
network namespace, with the production paths bound to the host's folders.

    /            a tmpfs (--volatile=yes); /usr is the machine's, read-only
    /etc         the machine's /etc below, HOST_DIR/etc-upper above (an overlay)
    /etc/systemd/system, /var/lib, /var/log, /opt   HOST_DIR/etc-systemd-system, var-lib, var-log, opt
    /run/ddtree-sandbox                              HOST_DIR/run (sshd's files, nvidia-smi, GPU registry,
                                                     the site-packages overlay's layers)
    the tool's interpreter, venv and checkout        read-only, at the same paths (the stand-in
                                                     server runs from them)
    `shared` folders (up(shared=...))                read-write, at the same paths: where a test
                                                     and a host's agent meet (pause markers)

`--keep-unit --register=no`: no systemd or D-Bus is needed on the machine itself. Stopping
systemd-nspawn with SIGTERM halts the container (its units stopped as systemd stops them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .errors import SandboxError
from .layout import SANDBOX_RUN, SandboxHost
from .system import SYSTEM_ENV, SYSTEM_PATH, port_open, run

BOOT_TIMEOUT_S = 30.0
HALT_TIMEOUT_S = 20.0
# Paths each host binds its own folders over: the tool must not live under them, or the host
# would not see it.
HOST_PATHS = ("/etc", "/var/lib", "/var/log", "/opt", "/run")


def tool_paths() -> list[str]:
    """What a host must see of this machine to run the stand-in server: the interpreter the host
    venv is made from, this venv, and the checkout an editable install points into. /usr is seen
    anyway; a path inside another is bound once."""
    import ddtree_ops

    wanted = [Path(sys.base_prefix), Path(sys.prefix), Path(ddtree_ops.__file__).resolve().parents[1]]
    paths: list[str] = []
    for p in sorted({str(x.resolve()) for x in wanted}, key=len):
        if p == "/usr" or p.startswith("/usr/") or any(p == q or p.startswith(q + "/") for q in paths):
            continue
        paths.append(p)
    return paths


def check_tool_visible(paths: list[str]) -> None:
    for p in paths:
        for hidden in HOST_PATHS:
            if p == hidden or p.startswith(hidden + "/"):
                raise SandboxError(f"the tool's files at {p} lie under {hidden}, which each sandbox host "
                                   "replaces with its own: install ddtree-ops elsewhere (e.g. a venv under /srv)")


def nspawn_argv(h: SandboxHost, site_tree: Path, tool: list[str], shared: list[str] = ()) -> list[str]:
    """The systemd-nspawn command line that boots host `h`. `shared`: folders of this machine the
    host sees read-write at the same path (a test's rendezvous files, never the tool's). Pure."""
    d = Path(h.dir)
    binds = [f"--bind={d / 'etc-systemd-system'}:/etc/systemd/system",
             f"--bind={d / 'var-lib'}:/var/lib", f"--bind={d / 'var-log'}:/var/log",
             f"--bind={d / 'opt'}:/opt", f"--bind={d / 'run'}:{SANDBOX_RUN}",
             f"--bind-ro={site_tree}:{SANDBOX_RUN}/site-tree"]
    return ["systemd-nspawn", "--quiet", "--keep-unit", "--register=no", f"--machine={h.netns}",
            "--directory=/", "--volatile=yes", f"--network-namespace-path=/run/netns/{h.netns}",
            f"--overlay=/etc:{d / 'etc-upper'}:/etc", *binds, *(f"--bind-ro={p}" for p in tool),
            *(f"--bind={p}" for p in shared),
            "--console=passive", "--boot"]


def start(h: SandboxHost, site_tree: Path, shared: list[str] = ()) -> subprocess.Popen:
    """Start booting the host (see `wait_booted`); records systemd-nspawn's PID in `h`."""
    tool = tool_paths()
    check_tool_visible([*tool, *shared])
    with open(Path(h.dir) / "boot.log", "wb") as log:
        proc = subprocess.Popen(nspawn_argv(h, site_tree, tool, shared), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(SYSTEM_ENV, HOME="/root"),
                                start_new_session=True)
    h.container_pid = proc.pid
    return proc


def wait_booted(h: SandboxHost, proc: subprocess.Popen) -> None:
    """Until the host's sshd listens and systemd has finished starting up."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SandboxError(f"{h.name}: the container did not boot:\n{boot_log(h)}")
        if port_open(h.address, 22, 0.2) and _booted(h):
            return
        time.sleep(0.1)
    raise SandboxError(f"{h.name}: not booted within {BOOT_TIMEOUT_S:.0f} s (sshd on {h.address}:22 and "
                       f"systemd's start-up):\n{boot_log(h)}")


def _booted(h: SandboxHost) -> bool:
    r = inside(h, ["systemctl", "is-system-running"], check=False)
    return r.stdout.strip() in ("running", "degraded")


def boot_log(h: SandboxHost) -> str:
    log = Path(h.dir) / "boot.log"
    text = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    return text + journal_tail(h, None, 30)


def leader(h: SandboxHost) -> int | None:
    """The container's PID 1 (systemd), seen from the machine: systemd-nspawn's child."""
    if not h.container_pid:
        return None
    try:
        children = Path(f"/proc/{h.container_pid}/task/{h.container_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def inside_argv(h: SandboxHost, argv: list[str]) -> list[str]:
    """The machine's command line that runs `argv` inside the host (all its namespaces), as root,
    with the host's own PATH and nothing else of the caller's environment."""
    pid = leader(h)
    if pid is None:
        raise SandboxError(f"{h.name}: the container is not running")
    return ["nsenter", "-t", str(pid), "-a", "env", "-i", f"PATH={SYSTEM_PATH}", "LANG=C.UTF-8", *argv]


def inside(h: SandboxHost, argv: list[str], check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """`argv` run inside the host, to its end; with `check`, a failure is a SandboxError naming it."""
    return run(inside_argv(h, argv), check=check, timeout=timeout)


def kill_cgroup(h: SandboxHost, unit: str) -> None:
    """SIGKILL every process left in `unit`'s cgroup (sshd's sessions after a stop with
    KillMode=process), whatever state the unit is in: `systemctl kill` of a unit that is no longer
    active may not reach them."""
    procs = f"/sys/fs/cgroup/systemd/system.slice/{unit}/cgroup.procs"
    # SIGKILL is not instant: wait (up to 5 s) until the cgroup is empty, so that what comes next
    # (unmounting site-packages, which they may hold open) does not find them still there.
    script = ('for p in $(cat "$1" 2>/dev/null); do kill -9 "$p"; done; '
              'i=0; while [ -n "$(cat "$1" 2>/dev/null)" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done')
    inside(h, ["sh", "-c", script, "sh", procs], check=False)


def journal_tail(h: SandboxHost, unit: str | None, lines: int = 40) -> str:
    """The host's journal (read from its folder by the machine's journalctl): the last `lines`,
    of `unit` or of everything."""
    journal = Path(h.dir) / "var-log" / "journal"
    argv = ["journalctl", "-D", str(journal), "--no-pager", "-q", "-n", str(lines)] + (["-u", unit] if unit else [])
    r = run(argv, check=False)
    return r.stdout if r.returncode == 0 else f"(journal unreadable: {r.stderr.strip()[:200]})"


def halt(h: SandboxHost, timeout_s: float = HALT_TIMEOUT_S) -> bool:
    """Stop the container as systemd shuts down (SIGTERM to systemd-nspawn, which asks PID 1 to
    halt); True when it ended within `timeout_s`. Our own child is reaped here."""
    pid = h.container_pid
    if not pid:
        return True
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (another process started it): poll /proc
            done = 0 if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" else pid
        if done:
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
