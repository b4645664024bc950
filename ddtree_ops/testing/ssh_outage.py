"""An SSH outage on a sandbox host, as a flaky network or an overloaded sshd makes one: every sshd
session process of the host is killed, again and again, for a while, and the listener is left
alone, so a new connection is accepted and then dies in its handshake, its authentication or its
first command. The tool's agent runs in a transient unit of its own (systemd-run), outside sshd's
cgroup, so it outlives the outage; its SSH session (the `systemd-run --pipe` client) does not.

`SshOutage(sandbox, host).start(seconds)` runs the killer inside the host (not over SSH) and
returns once the killer has killed the sessions open then (a run held at a pause point has lost
its connection when start() returns: no sleep to guess how long nsenter takes to start on a loaded
machine). With `from_first_contact`, the `seconds` count from the first session that opens after
that, so a command started at any time meets the whole outage at its first contact. `wait()`
returns how many processes were killed. Only the sandbox's own sshd unit is touched
(ddtree-sandbox-sshd.service, KillMode=process: its sessions live in its cgroup).
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from .sandbox.layout import SSHD_UNIT

# Kill every process of sshd's cgroup but its main process (the listener), every 20 ms; "killing"
# once the sessions open at the start are gone; then for $2 ms (from the first new session with
# $3 = 1, waiting for one at most 60 s; a killer left by a failed test ends
# then, or with its container); last, how many were killed. The cgroup is the one
# sandbox.container.kill_cgroup empties.
_KILLER = r"""
unit="$1"; ms="$2"; from_contact="$3"
procs="/sys/fs/cgroup/systemd/system.slice/$unit/cgroup.procs"
main=$(systemctl show -p MainPID --value "$unit")
n=0
kill_sessions() {
  for p in $(cat "$procs" 2>/dev/null); do
    if [ "$p" != "$main" ] && kill -9 "$p" 2>/dev/null; then n=$((n+1)); fi
  done
}
kill_sessions
echo killing
if [ "$from_contact" = 1 ]; then
  before=$n; cap=$(( $(date +%s%3N) + 60000 ))
  while [ "$n" -eq "$before" ] && [ "$(date +%s%3N)" -lt "$cap" ]; do sleep 0.02; kill_sessions; done
fi
end=$(( $(date +%s%3N) + ms ))
while [ "$(date +%s%3N)" -lt "$end" ]; do
  sleep 0.02
  kill_sessions
done
echo "$n"
"""

_STARTED_WITHIN_S = 60.0


@dataclass
class SshOutage:
    """Every SSH session of `host` killed, repeatedly, for a while (see the module docstring)."""

    sandbox: Any  # ddtree_ops.testing.sandbox.Sandbox
    host: str
    unit: str = SSHD_UNIT
    killed: int | None = None
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)
    _killing: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self, seconds: float, *, from_first_contact: bool = False) -> SshOutage:
        argv = self.sandbox.inside_argv(self.host, ["sh", "-c", _KILLER, "sh", self.unit, str(int(seconds * 1000)),
                                                    "1" if from_first_contact else "0"])
        self._thread = threading.Thread(target=self._run, args=(argv,), name=f"ssh outage {self.host}", daemon=True)
        self._thread.start()
        if not self._killing.wait(_STARTED_WITHIN_S):
            raise AssertionError(f"the killer on {self.host} did not start within {_STARTED_WITHIN_S:g} s")
        if self.error is not None:
            raise AssertionError(self.error)
        return self

    def _run(self, argv: list[str]) -> None:
        try:
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
                first = proc.stdout.readline().strip()
                if first == "killing":
                    self._killing.set()
                rest, err = proc.communicate()
            if proc.returncode != 0 or first != "killing":
                said = (first + rest + err).strip()[-300:]
                self.error = f"the killer on {self.host} exited {proc.returncode}: {said}"
                return
            self.killed = int(rest.strip() or 0)
        except Exception as e:
            self.error = f"the killer on {self.host} failed: {type(e).__name__}: {e}"
        finally:
            self._killing.set()  # start() never waits for a killer that is gone

    def wait(self, timeout: float = 150.0) -> int:
        """How many session processes were killed; AssertionError if the killer itself failed."""
        assert self._thread is not None, "the outage was never started"
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the outage on {self.host} did not end within {timeout:g} s"
        assert self.error is None, self.error
        return int(self.killed or 0)
