"""systemd on the host: the programs the controller may have run (systemctl, journalctl,
nvidia-smi; always an argv, never a shell), and `systemd-analyze verify` of a new unit where its
ExecStart program really exists."""

import os
import shutil
import subprocess
import tempfile

from .errors import AgentError
from .protocol import Run, VerifyUnit, VerifyUnitReply
from .scrub import scrubbed, secret_values


def op_verify_unit(req: VerifyUnit):
    """Run `systemd-analyze verify` on the host, where ExecStart's program really exists."""
    if shutil.which(req.argv[0]) is None:
        return VerifyUnitReply(False)
    d = tempfile.mkdtemp(prefix="ddtree-ops-verify-")
    try:
        path = os.path.join(d, req.unit_name)
        with open(path, "w") as fh:
            fh.write(req.text)
        argv = [path if a == "@PATH@" else a for a in req.argv]
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, timeout=120)
        return VerifyUnitReply(True, r.returncode, r.stdout.replace(path, req.unit_name),
                               r.stderr.replace(path, req.unit_name))
    finally:
        shutil.rmtree(d, ignore_errors=True)


# Only these programs, and always as an argv (no shell): the controller asks for unit states,
# actions and log tails; it never sends a command line.
_PROGRAMS = ("systemctl", "journalctl", "nvidia-smi")


def run_program(argv, timeout):
    if argv[0] not in _PROGRAMS:
        raise AgentError("not a program the agent runs: %r" % argv[0])
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout)
    except FileNotFoundError:
        return {"rc": 127, "stdout": "", "stderr": "%s: not found" % argv[0]}
    return {"rc": r.returncode, "stdout": r.stdout.decode("utf-8", "replace"),
            "stderr": r.stderr.decode("utf-8", "replace")}


def op_run(req: Run):
    """One systemctl/journalctl call, or several in a row (`argvs`): one round trip. The values
    of secret-named keys in `scrub_files` (the secrets_config SGLang reads its API key from,
    the unit's EnvironmentFile=) are replaced by *** in what goes back: SGLang logs its
    server_args, key included, and the controller must never receive it."""
    timeout = float(req.timeout)
    secrets = secret_values(req.scrub_files, req.secret_words)
    results = [scrubbed(run_program(list(a), timeout), secrets) for a in req.argvs or [req.argv]]
    return {"results": results} if req.argvs is not None else results[0]
