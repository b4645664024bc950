"""Processes on the host, read from /proc: a PID's start time (a reused PID is another process),
command line and ancestors, who listens on a TCP port; and the `proc_info` op."""

import os

from .protocol import ProcInfo


def proc_start(pid):
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): a PID
    with another start time is another process."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def op_proc_info(req: ProcInfo):
    """Command line and ancestors of each asked PID (missing: the process is gone)."""
    out = {}
    for pid in req.pids:
        if os.path.isdir("/proc/%d" % int(pid)):
            out[str(pid)] = {"cmd": proc_cmdline(int(pid)), "ancestors": proc_ancestors(int(pid))}
    return out


def _listening_inodes(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        except OSError:
            continue
    return inodes


def port_holders(port):
    """Processes with a listening TCP socket on `port` (this network namespace): pid, command
    and ancestors (so a child of a unit's main process counts as the unit's)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    wanted = set("socket:[%s]" % i for i in inodes)
    out = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                    out.append({"pid": pid, "cmd": proc_cmdline(pid), "ancestors": proc_ancestors(pid)})
                    break
            except OSError:
                continue
    return out


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return ""


def proc_ancestors(pid):
    chain = []
    while pid > 1 and len(chain) < 64:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        chain.append(pid)
    return chain


