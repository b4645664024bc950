"""The launch check: the new launch line through the server's own argument parser (nothing
starts), and who holds the ports the server will bind.

The parse runs the venv's code (sglang, torch, whatever they import), which whoever can write the
venv controls: it runs as the unit's own User= and Group= with the unit's environment and working
directory (unit_identity.py), never as root unless the unit itself runs as root; and isolated:
`-I` (no PYTHON* variables, no user site, no script folder) and `-S` (no `site`: no .pth file's
code, no sitecustomize/usercustomize), the venv's packages put on sys.path by the parse's own
preamble, as `site` would put them.

Privileges are dropped here, in the forked child (preexec), rather than through `systemd-run -p
User=...`: the parse stays in the agent's own unit and process group, so a timeout or the agent's
end takes it along (a transient unit would outlive both), the same code runs where there is no
system manager (the tests' local agent), and one round trip to PID 1 is saved right after a
daemon-reload. The price is reading Environment=/EnvironmentFile= here by systemd's rules.
"""

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile

from .files import text_lines
from .procs import port_holders
from .protocol import LaunchCheck
from .scrub import scrubbed, secret_values
from .unit_identity import SETUP_FAILED_PREFIX, SETUP_FAILED_RC, UnitRefusal, unit_run_as

# What the parse keeps of each stream, and reads back: a flooding parse costs disk, not memory.
OUTPUT_TAIL = 4000

# The first lines of every parse: sys.path as `site` would make it, without running anything of
# site's: [PYTHONPATH of the unit] + the interpreter's own + [site-packages, .pth folder lines].
CLEAN_SYS_PATH = "\n".join([
    "import json, sys",
    "_front, _back = json.loads(sys.argv.pop(1))",
    "sys.path[:0] = _front",
    "sys.path.extend(_back)",
    "del _front, _back",
])

# SGLang's own parser, exactly as prepare_server_args (srt/server_args.py, 0.5.23) builds and
# feeds it, without ServerArgs.__post_init__ (which needs the GPUs): unknown flags, bad values and
# choices exit 2 with argparse's message, as the server would at start.
SGLANG_PARSE_ONLY = "\n".join([
    "import argparse, sys",
    "from sglang.srt.server_args import ServerArgs",
    "argv = sys.argv[1:]",
    "parser = argparse.ArgumentParser(prog='sglang serve')",
    "ServerArgs.add_cli_args(parser)",
    "if '--config' in argv:",
    "    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger",
    "    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)",
    "parser.parse_args(argv)",
])

# `plan`'s parse: the new files, staged in a scratch folder (its path the next argument), are
# imported ahead of site-packages. A plain sys.path entry would not do: site-packages' `sglang`
# is a regular package, so a scratch `sglang/` holding only the new files would be shadowed. A
# finder first on sys.meta_path gives a module the scratch has (a new or a replaced one) from
# there, and everything else from site-packages; a replaced package keeps its other modules.
OVERLAY_FINDER = "\n".join([
    "import importlib.machinery as _machinery, os as _os",
    "_overlay = sys.argv.pop(1)",
    "class _OverlayFinder(object):",
    "    @classmethod",
    "    def find_spec(cls, name, path=None, target=None):",
    "        parts = name.split('.')",
    "        where = _os.path.join(_overlay, *parts[:-1])",
    "        spec = _machinery.PathFinder.find_spec(name, [where]) if _os.path.isdir(where) else None",
    "        if spec is None or not _os.path.isfile(spec.origin or ''):",
    "            return None",
    "        if spec.submodule_search_locations is not None:",
    "            spec.submodule_search_locations.extend(",
    "                d for d in (_os.path.join(p, *parts) for p in sys.path) if _os.path.isdir(d))",
    "        return spec",
    "sys.meta_path.insert(0, _OverlayFinder)",
])

# `python -m MODULE --parse-only ARGS`, with the clean sys.path: runpy as -m runs a module.
RUN_MODULE = "\n".join([
    "import runpy, sys",
    "sys.argv[0] = sys.argv.pop(1)",
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)",
])


def venv_sys_path(site_packages):
    """site-packages, then the folder lines of its .pth files (sorted, as `site` reads them; a
    line starting with `import` is code and is skipped, as are hidden .pth files)."""
    if not site_packages:
        return []
    out = [site_packages]
    try:
        names = sorted(n for n in os.listdir(site_packages) if n.endswith(".pth") and not n.startswith("."))
    except OSError:
        return out
    for name in names:
        for line in text_lines(os.path.join(site_packages, name), 1 << 20) or ():
            if not line.strip() or line.startswith("#") or line.startswith(("import ", "import\t")):
                continue
            folder = os.path.abspath(os.path.join(site_packages, line.rstrip()))
            if folder not in out and os.path.isdir(folder):
                out.append(folder)
    return out


def parse_argv(req: LaunchCheck, env, overlay=None):
    """The parse's command line: isolated, no site, the clean sys.path as its first argument;
    with `overlay` (a scratch folder), its files imported first and no bytecode written (-B: the
    dry run leaves no __pycache__ behind in site-packages)."""
    front = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    paths = json.dumps([front, venv_sys_path(req.site_packages)])
    flags, preamble, extra = ["-I", "-S"], CLEAN_SYS_PATH, []
    if overlay:
        flags, preamble, extra = ["-B", "-I", "-S"], CLEAN_SYS_PATH + "\n" + OVERLAY_FINDER, [overlay]
    if req.sglang:
        return [req.python] + flags + ["-c", preamble + "\n" + SGLANG_PARSE_ONLY, paths] + extra + list(req.args)
    return [req.python] + flags + ["-c", preamble + "\n" + RUN_MODULE, paths] + extra + [req.module,
                                                                                        "--parse-only"] + list(req.args)


def stage_overlay(scratch, files):
    """The new files (relative path → base64) written into `scratch`, a fresh folder of root's
    (nobody else can change what the parse imports), readable by the unit's user whatever the
    agent's umask, outside site-packages."""
    os.chmod(scratch, 0o755)
    for rel, data in sorted(files.items()):
        parts = [p for p in rel.split("/") if p]
        if not parts or rel.startswith("/") or any(p in (".", "..") for p in parts):
            raise ValueError("overlay path %r is not relative to site-packages" % rel)
        folder = scratch
        for part in parts[:-1]:
            folder = os.path.join(folder, part)
            if not os.path.isdir(folder):
                os.mkdir(folder)
                os.chmod(folder, 0o755)
        fd = os.open(os.path.join(folder, parts[-1]), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(base64.b64decode(data))
        os.chmod(os.path.join(folder, parts[-1]), 0o644)


def _tail(fh):
    fh.seek(0, os.SEEK_END)
    fh.seek(max(0, fh.tell() - OUTPUT_TAIL))
    return fh.read().decode("utf-8", "replace")


def run_parse(argv, run_as, timeout):
    """rc, and the tail of stdout and stderr; the whole process group is killed at the timeout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=run_as.env,
                                    preexec_fn=run_as.enter, start_new_session=True, close_fds=True)
        except OSError as e:  # e.g. the unit's user may not execute the venv's interpreter
            return {"rc": 126, "stdout": "", "stderr": "", "refused": "User=%s cannot run %s: %s"
                    % (run_as.name, argv[0], e.strerror or e)}
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            return {"rc": 124, "stdout": "", "stderr": "the parse did not finish in %gs" % timeout}
        return {"rc": rc, "stdout": _tail(out), "stderr": _tail(err)}


def op_launch_check(req: LaunchCheck):
    """Run the new launch line through the server's own argument parser (nothing starts), as the
    unit's user, and say who holds the ports it will bind."""
    python = req.python
    holders = {str(port): port_holders(int(port)) for port in req.ports}
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return {"rc": 127, "stdout": "", "stderr": "%s: not an executable absolute path" % python, "holders": holders}
    try:
        run_as = unit_run_as(req.user, req.group, req.supplementary_groups, req.environment,
                             req.environment_files, req.working_directory)
    except UnitRefusal as e:
        return {"rc": SETUP_FAILED_RC, "stdout": "", "stderr": "", "refused": str(e), "holders": holders}
    scratch = tempfile.mkdtemp(prefix="ddtree-ops-plan-") if req.overlay else None
    try:
        if scratch:
            stage_overlay(scratch, req.overlay)
        result = run_parse(parse_argv(req, run_as.env, scratch), run_as, float(req.timeout))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if result["rc"] == SETUP_FAILED_RC and result["stderr"].startswith(SETUP_FAILED_PREFIX):
        result["refused"] = result["stderr"].strip()
    env_files = [f[1:] if f.startswith("-") else f for f in req.environment_files]
    secrets = secret_values(list(req.scrub_files) + env_files, req.secret_words)
    result = scrubbed(result, secrets)  # SGLang's "unrecognized arguments" error repeats values
    result["ran_as"] = {"user": run_as.name, "uid": run_as.uid, "gid": run_as.gid}
    result["holders"] = holders
    return result
