"""Nothing in the venv runs as root: the launch check's parse runs as the unit's User=, with the
unit's environment, isolated (`-I -S`: no .pth file's code runs). Proven with probes that record
who ran them -- a launcher module the parse imports, and a .pth file planted in site-packages --
each beside a control that runs the same probes the old way (root, with `site`) and sees root."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddtree_ops.testing.local_agent import local_agent
from kit import run_cli

# A .pth line is code that `site` runs at every interpreter start: this one notes who ran it and
# with which command line (the launch check's parse is the one with --parse-only in it).
PTH_PROBE = ("import os; open({log!r}, 'a').write('%d %s\\n' % (os.getuid(), open('/proc/self/cmdline', 'rb')"
             ".read().replace(bytes(1), b' ').decode()))\n")

LAUNCHER = """import argparse, json, os, sys
import probe_helper  # found only through the folder line of a .pth file
p = argparse.ArgumentParser(allow_abbrev=False)
p.add_argument('--parse-only', action='store_true'); p.add_argument('--port', type=int)
p.parse_args()
with open(os.environ['PROBE_RECORD'], 'a') as fh:
    fh.write(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'home': os.environ.get('HOME'),
                         'user': os.environ.get('USER'), 'cwd': os.getcwd(), 'no_site': sys.flags.no_site,
                         'isolated': sys.flags.isolated, 'from_env': os.environ.get('FROM_ENV'),
                         'from_file': os.environ.get('FROM_FILE')}) + '\\n')
"""


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def venv_dir():
    """A site-packages and a folder for the probes' records that `nobody` can read and write
    (pytest's own temp folders are root's, 0700)."""
    root = Path(tempfile.mkdtemp(prefix="ddtree-launch-user-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        site, out = root / "site-packages", root / "out"
        (site / "extra").mkdir(parents=True)
        out.mkdir()
        os.chmod(out, 0o777)
        (site / "probe_launcher.py").write_text(LAUNCHER)
        (site / "extra" / "probe_helper.py").write_text("")
        (site / "aa-probe.pth").write_text(PTH_PROBE.format(log=str(out / "pth.log")))
        (site / "bb-folders.pth").write_text("# a comment line\nextra\n")
        for p in (site, site / "extra", *site.rglob("*")):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        yield site, out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _python_nobody_runs() -> str | None:
    """An interpreter `nobody` may execute (this venv's may live under root's 0700 home)."""
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            if subprocess.run([python, "-I", "-S", "-c", ""], user="nobody", cwd="/", timeout=30).returncode == 0:
                return python
        except OSError:
            continue
    return None


def _launch_check(site: Path, python: str = sys.executable, **unit) -> dict:
    ch = local_agent()
    try:
        return ch.call({"op": "launch_check", "python": python, "module": "probe_launcher",
                        "args": ["--port", "30000"], "ports": [], "site_packages": str(site), **unit}, 60)
    finally:
        ch.close()


def test_the_local_agent_parses_as_the_units_user_with_its_environment_and_no_pth_code(venv_dir):
    python = _python_nobody_runs() if os.geteuid() == 0 else None
    if python is None:
        pytest.skip("switching to the unit's User= needs a root agent and an interpreter `nobody` may run")
    site, out = venv_dir
    env_file = out / "env"
    env_file.write_text('# the unit\'s EnvironmentFile=\nFROM_FILE="from the file"\nFROM_ENV=overridden\n')
    nobody = pwd.getpwnam("nobody")
    res = _launch_check(site, python, user="nobody",
                        environment=[f"PROBE_RECORD={out / 'parse.jsonl'}", "FROM_ENV=unit"],
                        environment_files=[str(env_file), "-/nonexistent/optional.env"])
    assert res["rc"] == 0, res
    assert res["ran_as"] == {"user": "nobody", "uid": nobody.pw_uid, "gid": nobody.pw_gid}
    [rec] = _records(out / "parse.jsonl")
    assert (rec["uid"], rec["gid"], rec["home"], rec["user"], rec["cwd"]) == (
        nobody.pw_uid, nobody.pw_gid, nobody.pw_dir, "nobody", "/")
    assert (rec["no_site"], rec["isolated"]) == (1, 1)
    assert (rec["from_file"], rec["from_env"]) == ("from the file", "overridden")  # files override Environment=
    assert not (out / "pth.log").exists()  # the .pth file's code never ran

    # The control: the same probes run the old way (root, `site` processing the folder) record
    # root, and the .pth's code runs.
    code = (f"import site, runpy, sys; site.addsitedir({str(site)!r}); sys.argv = ['probe_launcher', '--parse-only']; "
            "runpy.run_module('probe_launcher', run_name='__main__')")
    subprocess.run([python, "-c", code], check=True, env={"PROBE_RECORD": str(out / "parse.jsonl")})
    assert _records(out / "parse.jsonl")[-1]["uid"] == 0
    assert (out / "pth.log").read_text().startswith("0 ")


def test_a_user_the_host_does_not_have_is_refused_by_name(venv_dir):
    site, out = venv_dir
    res = _launch_check(site, user="ddtree-no-such-user", environment=[f"PROBE_RECORD={out / 'r'}"])
    assert "User=ddtree-no-such-user does not exist on this host" in res["refused"]
    assert not (out / "r").exists()  # nothing ran
    me = pwd.getpwuid(os.geteuid()).pw_name  # the control: a user it has
    ok = _launch_check(site, user=me, environment=[f"PROBE_RECORD={out / 'r'}"])
    assert ok["rc"] == 0 and "refused" not in ok, ok


def test_a_required_environment_file_that_is_missing_is_refused_an_optional_one_is_not(venv_dir):
    site, out = venv_dir
    env = [f"PROBE_RECORD={out / 'r'}"]
    res = _launch_check(site, environment=env, environment_files=["/nonexistent/ddtree.env"])
    assert "EnvironmentFile=/nonexistent/ddtree.env cannot be read" in res["refused"]
    assert _launch_check(site, environment=env, environment_files=["-/nonexistent/ddtree.env"])["rc"] == 0


def test_a_working_directory_the_process_cannot_enter_is_refused_an_optional_one_falls_back_to_root(venv_dir):
    site, out = venv_dir
    env = [f"PROBE_RECORD={out / 'r'}"]
    res = _launch_check(site, environment=env, working_directory="/nonexistent/ddtree-wd")
    assert res["rc"] == 217 and "WorkingDirectory=/nonexistent/ddtree-wd: No such file or directory" in res["refused"]
    assert not (out / "r").exists()
    ok = _launch_check(site, environment=env, working_directory="-/nonexistent/ddtree-wd")
    assert ok["rc"] == 0 and _records(out / "r")[-1]["cwd"] == "/"


# --------------------------------------------------------------------------- on a real host

def _let_nobody_reach_the_interpreter(th) -> None:
    """The host venv is made from this machine's interpreter, bound into the host at its own path,
    which may lie under /root (pyenv). In the host, /root is the container's own (a tmpfs folder,
    never this machine's): opened to others there, a `nobody` unit can run it, as on a real host
    whose venv lives in /opt. Never this machine's /root (checked: another device or inode)."""
    inside = th.ssh(["stat", "-c", "%d:%i", "/root"]).stdout.strip()
    st = os.stat("/root")
    assert inside != f"{st.st_dev}:{st.st_ino}", "the host's /root is this machine's: not opening it"
    th.ssh(["chmod", "0755", "/root"])


PROBE_DIR = "/var/lib/ddtree-probe"  # the host's own /var/lib: emptied by a host reset
PTH_NAME = "aa-ddtree-probe.pth"


def test_a_deploy_parses_as_the_units_user_and_no_pth_runs_during_the_launch_check(fresh_host, tmp_path,
                                                                                    good_patchset):
    """A .pth planted in the host's site-packages and the stand-in's `--parse-only` record who ran
    them. Deployed with `service_user: nobody`, the parse ran as nobody with the unit's
    Environment= and the .pth never ran for it (the server itself, started by systemd with `site`,
    may run it, as nobody); the control runs the old command on the host as root and both probes
    record root."""
    from ddtree_ops.testing.sandbox import STANDIN_MODULE

    h = fresh_host.host
    pth = f"{h.site_packages}/{PTH_NAME}"
    record = f"{PROBE_DIR}/parse.jsonl"
    fresh_host.ssh(["sh", "-c", f"mkdir -p -m 1777 {PROBE_DIR} && chmod 1777 /run/ddtree-sandbox/gpu"])
    _let_nobody_reach_the_interpreter(fresh_host)
    fresh_host.ssh(["sh", "-c", 'cat > "$1"', "sh", pth], stdin=PTH_PROBE.format(log=f"{PROBE_DIR}/pth.log"))
    th = fresh_host.with_vars(tmp_path, service_user="nobody",
                              environment={"DDTREE_STANDIN_PARSE_RECORD": record,
                                           "DDTREE_STANDIN_PARSE_ECHO": "PROBE_VALUE", "PROBE_VALUE": "from the unit"})
    try:
        r = run_cli("deploy", "-i", str(th.inventory), "-p", str(good_patchset), "--yes", "--json")
        assert r.code == 0, r.stderr
        steps = r.json()["hosts"][0]["steps"]
        [check] = [s["detail"] for s in steps if s["step"] == "launch check"]
        assert "as User=nobody (uid 65534), isolated" in check, check
        parses = [json.loads(line) for line in th.ssh(["cat", record]).stdout.splitlines()]
        assert parses and all(p["uid"] == 65534 and p["euid"] == 65534 for p in parses), parses
        assert all((p["no_site"], p["isolated"], p["site_imported"]) == (1, 1, False) for p in parses)
        assert all(p["echo"] == {"PROBE_VALUE": "from the unit"} and p["home"] == "/nonexistent" for p in parses)
        pth_runs = th.ssh(["sh", "-c", f"cat {PROBE_DIR}/pth.log 2>/dev/null || true"]).stdout.splitlines()
        assert not [line for line in pth_runs if "--parse-only" in line], pth_runs

        # The control: the old launch check's command (root, no -I -S) on the same host.
        old = th.ssh(["env", f"DDTREE_STANDIN_PARSE_RECORD={record}", h.python, "-m", STANDIN_MODULE,
                      "--parse-only", "--port", str(h.port)], check=False)
        assert old.exit_code == 0, old.stderr
        last = json.loads(th.ssh(["cat", record]).stdout.splitlines()[-1])
        assert (last["uid"], last["no_site"]) == (0, 0)
        pth_runs = th.ssh(["cat", f"{PROBE_DIR}/pth.log"]).stdout.splitlines()
        assert [line for line in pth_runs if "--parse-only" in line and line.startswith("0 ")], pth_runs
    finally:
        fresh_host.ssh(["rm", "-f", pth], check=False)
        fresh_host.ssh(["chmod", "0700", "/root"], check=False)
