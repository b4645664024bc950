"""Network namespaces (one per host, a veth pair into 10.200.K.0/24) and the mounts around them."""

from __future__ import annotations

import contextlib
import os

from .errors import SandboxError
from .layout import SandboxHost
from .system import run

# Held while subnets are chosen and claimed, so concurrent `sandbox up`s never pick the same one.
ALLOC_LOCK = "/run/lock/ddtree-ops-sandbox.lock"
NETNS_DIR = "/run/netns"


def _free_subnets(n: int) -> list[int]:
    """The first `n` K in 1..249 with no 10.200.K.x address on this machine."""
    out = run(["ip", "-o", "-4", "addr", "show"]).stdout
    used = set()
    for line in out.splitlines():
        for tok in line.split():
            if tok.startswith("10.200."):
                with contextlib.suppress(ValueError, IndexError):
                    used.add(int(tok.split(".")[2]))
    free = [k for k in range(1, 250) if k not in used]
    if len(free) < n:
        raise SandboxError(f"not enough free 10.200.K.0/24 subnets for {n} hosts")
    return free[:n]


def make_netns(h: SandboxHost) -> None:
    """The host's namespace with eth0 at h.address; the gateway end h.veth stays outside."""
    run(["ip", "netns", "add", h.netns])
    run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns])
    run(["ip", "addr", "add", f"{h.gateway}/24", "dev", h.veth])
    run(["ip", "link", "set", h.veth, "up"])
    run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
    run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
    run(["ip", "-n", h.netns, "link", "set", "lo", "up"])


def delete_netns(h: SandboxHost) -> None:
    """The namespace and the veth pair, whichever still exist (the processes must be gone)."""
    if _netns_exists(h.netns):
        run(["ip", "netns", "del", h.netns], check=False)
    if _link_exists(h.veth):
        run(["ip", "link", "del", h.veth], check=False)


def release_netns_mount(preexisting: bool) -> None:
    """`ip netns add` mounts /run/netns; unmount it when we caused that and it is now empty."""
    if not preexisting and _is_mountpoint(NETNS_DIR):
        with contextlib.suppress(OSError):
            if not os.listdir(NETNS_DIR):
                run(["umount", NETNS_DIR], check=False)


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"{NETNS_DIR}/{name}")


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _is_mountpoint(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as fh:
            return any(line.split()[4] == path for line in fh)
    except OSError:
        return False
