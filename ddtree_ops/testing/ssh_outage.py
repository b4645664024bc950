"""An SSH outage on a sandbox host, as a flaky network or an overloaded sshd makes one: every sshd
session process of the host is killed, again and again, for a while, and the listener is left
alone, so a new connection is accepted and then dies in its handshake, its authentication or its
first command. The tool's agent runs in a transient unit of its own (systemd-run), outside sshd's
cgroup, so it outlives the outage; its SSH session (the `systemd-run --pipe` client) does not.

`SshOutage(sandbox, host).start(seconds)` runs the killer inside the host (not over SSH) on a
thread; `wait()` returns how many processes it killed. Only the sandbox's own sshd unit is
touched (ddtree-sandbox-sshd.service, KillMode=process: its sessions live in its cgroup).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .sandbox.layout import SSHD_UNIT

# Kill every process of sshd's cgroup but its main process (the listener), every 20 ms, for $2 ms;
# print how many were killed. The cgroup is the one sandbox.container.kill_cgroup empties.
_KILLER = r"""
unit="$1"; ms="$2"
procs="/sys/fs/cgroup/systemd/system.slice/$unit/cgroup.procs"
main=$(systemctl show -p MainPID --value "$unit")
end=$(( $(date +%s%3N) + ms ))
n=0
while [ "$(date +%s%3N)" -lt "$end" ]; do
  for p in $(cat "$procs" 2>/dev/null); do
    if [ "$p" != "$main" ] && kill -9 "$p" 2>/dev/null; then n=$((n+1)); fi
  done
  sleep 0.02
done
echo "$n"
"""


@dataclass
class SshOutage:
    """Every SSH session of `host` killed, repeatedly, for a while (see the module docstring)."""

    sandbox: Any  # ddtree_ops.testing.sandbox.Sandbox
    host: str
    unit: str = SSHD_UNIT
    killed: int | None = None
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, seconds: float) -> SshOutage:
        self._thread = threading.Thread(target=self._run, args=(seconds,), name=f"ssh outage {self.host}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self, seconds: float) -> None:
        r = self.sandbox.inside(self.host, ["sh", "-c", _KILLER, "sh", self.unit, str(int(seconds * 1000))],
                                check=False)
        if r.returncode != 0:
            self.error = f"the killer on {self.host} exited {r.returncode}: {r.stderr.strip()[-300:]}"
            return
        self.killed = int(r.stdout.strip() or 0)

    def wait(self, timeout: float = 60.0) -> int:
        """How many session processes were killed; AssertionError if the killer itself failed."""
        assert self._thread is not None, "the outage was never started"
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the outage on {self.host} did not end within {timeout:g} s"
        assert self.error is None, self.error
        return int(self.killed or 0)
