"""Errors an operator meets first, each one line with the cause and the documented exit code
(fast tier): a wrong interpreter path, a missing SSH key file, a "no" at the prompt, a router
that does not answer. Each test also runs a control the check must reject."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import EXIT_BAD_INPUT, LocalKeyMissing, PreflightError
from ddtree_ops.host.agent.protocol import ProcInfo
from ddtree_ops.host.channel import AgentChannel, interpreter_missing
from ddtree_ops.host.transport import HostConnection, shell_join
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.testing.fake_host import FakeHost, _map_paths, fake_hosts, fake_inventory
from ddtree_ops.testing.fake_router import FakeSmg
from ddtree_ops.testing.local_agent import LocalConnection
from kit import REPO, run_cli

# -- agent_python and python -------------------------------------------------------------------


class ShellConnection(LocalConnection):
    """The agent started as sshd starts a command: the login shell runs the quoted line, so a
    missing program is the shell's exit 127, as on a host."""

    def start(self, argv, *, sudo: bool = True):
        return super().start(["/bin/sh", "-c", shell_join(argv)])


def _channel(agent_python: str) -> AgentChannel:
    host = SimpleNamespace(name="gpu7", python=sys.executable, agent_python=agent_python, connect_timeout_s=10.0,
                           become=False, lock_lease_s=30.0, lock_renew_s=5.0)
    return AgentChannel(ShellConnection(), host)  # type: ignore[arg-type]


def test_a_missing_agent_python_is_a_preflight_refusal_naming_host_field_and_path(tmp_path):
    missing = str(tmp_path / "no-such" / "python3")
    chan = _channel(missing)
    with pytest.raises(PreflightError) as e:
        chan.call(ProcInfo([os.getpid()]).to_wire(), 10)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert msg.startswith("gpu7: agent_python ") and missing in msg and "exit 127" in msg, msg
    assert "\n" not in msg
    chan.close()
    control = _channel(sys.executable)  # the same start with an interpreter that is there: no refusal
    try:
        control.call(ProcInfo([os.getpid()]).to_wire(), 30)
        assert control.hello is not None and control.starts == 1
    finally:
        control.close()


@pytest.mark.parametrize(("status", "stderr", "missing"), [
    (127, "sh: 1: /usr/bin/python9: not found", True),
    (126, "sh: 1: /etc/passwd: Permission denied", True),
    (1, "sudo: /usr/bin/python9: command not found", True),
    (1, "Traceback (most recent call last):\n  ...\nValueError: command not found", False),
    (1, "sudo: a password is required", False),
    (0, "", False),
])
def test_only_a_shell_or_sudo_that_could_not_start_the_interpreter_counts_as_missing(status, stderr, missing):
    assert interpreter_missing(status, stderr) is missing


class VenvlessHost(FakeHost):
    """A fake host whose venv interpreter is really looked for (the fake normally lends this
    machine's): the inventory's `python` decides."""

    def agent(self, request, proc):
        if request["op"] != "compile":
            return super().agent(request, proc)
        from ddtree_ops.host.channel import answer_result

        return answer_result(self.host.name, "compile", proc.handle(_map_paths(request, self._in)))


def _venvless(tmp_path, python: str) -> VenvlessHost:
    inv = parse_inventory(fake_inventory(1, python=python), "inv.yaml")
    return VenvlessHost(inv.host("fh1"), tmp_path / f"host-{abs(hash(python))}")


def test_a_wrong_venv_python_is_refused_in_preflight_naming_host_field_and_path(tmp_path, patchset):
    wrong = "/opt/venv_sglang/bin/pythno"
    fake = _venvless(tmp_path, wrong)
    before = fake.tree(fake.host.site_packages)
    with pytest.raises(PreflightError) as e:
        deploy_host(fake.session(), patchset, DeployOptions())
    msg = str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert msg.startswith("fh1: ") and f"python {wrong}:" in msg and "nothing was changed" in msg, msg
    assert fake.tree(fake.host.site_packages) == before
    good = _venvless(tmp_path, sys.executable)  # control: the interpreter exists, the deploy goes on
    assert str(deploy_host(good.session(), patchset, DeployOptions()).outcome) == "deployed"


# -- identity_file -----------------------------------------------------------------------------


def _ssh_host(tmp_path, key: str):
    kh = tmp_path / "known_hosts"
    kh.touch()
    doc = {"all": {"hosts": {"h1": {
        "address": "10.200.9.9", "known_hosts": str(kh), "identity_file": key, "python": "/opt/v/bin/python",
        "site_packages": "/opt/v/lib/python3.12/site-packages", "model_path": "/m", "draft_model_path": "/d"}}}}
    return parse_inventory(doc, "inv.yaml").host("h1")


def test_a_missing_identity_file_is_refused_before_any_connection(tmp_path):
    key = str(tmp_path / "keys" / "id_ed25519")
    conn = HostConnection(_ssh_host(tmp_path, key))
    tried = []
    conn._client.connect = lambda **kw: tried.append(kw) or (_ for _ in ()).throw(TimeoutError("timed out"))
    with pytest.raises(LocalKeyMissing) as e:
        conn.open()
    assert tried == []
    msg = str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert msg.startswith("h1: identity_file ") and key in msg and "no such file" in msg and "reach" not in msg
    os.makedirs(os.path.dirname(key))
    open(key, "w").close()  # control: with the file there, the connection is tried
    with pytest.raises(Exception, match="timed out"):
        conn.open()
    assert len(tried) == 1


def _inventory(tmp_path, **host_vars) -> str:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(fake_inventory(2, **host_vars)))
    return str(path)


def test_a_rollout_with_a_missing_key_exits_2_before_any_host_is_touched(tmp_path, patchset):
    key = str(tmp_path / "absent_key")
    r = run_cli("rollback", "-i", _inventory(tmp_path, identity_file=key), "--yes", timeout=60)
    assert r.code == EXIT_BAD_INPUT, r
    assert f"identity_file {key}: no such file" in r.stderr and "cannot reach" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- the confirmation prompt -------------------------------------------------------------------


def _answer_prompt(tmp_path, answer: bytes) -> tuple[int, str]:
    """`rollback` on a terminal (stdin a pty), answering the question with `answer`."""
    inv = _inventory(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_ops", "rollback", "-i", inv], stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True)
    os.close(slave)
    try:
        os.write(master, answer)  # the terminal holds the line until the prompt reads it
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, err


def test_declining_the_prompt_says_nothing_changed_and_exits_2(tmp_path):
    code, err = _answer_prompt(tmp_path, b"n\n")
    assert code == EXIT_BAD_INPUT, err
    assert err.rstrip().endswith("]:aborted: nothing changed"), err  # the answer's echo goes to the terminal
    assert err.count("aborted") == 1 and "error" not in err, err
    code, err = _answer_prompt(tmp_path, b"y\n")  # control: a yes goes on (to the hosts' keys, here)
    assert "aborted" not in err and "known_hosts" in err, err


# -- the router --------------------------------------------------------------------------------

ROUTER = {"url": "http://router.test:30000", "admin_key_env": "DDTREE_TEST_ROUTER_KEY"}


def test_a_router_refusal_names_the_router_once(tmp_path, patchset, monkeypatch):
    monkeypatch.setenv("DDTREE_TEST_ROUTER_KEY", "k-1")
    fake = fake_hosts(tmp_path / "h", router=ROUTER)[0]
    smg = FakeSmg([fake.host.base_url], key="k-1")
    smg.down = True
    with pytest.raises(PreflightError) as e:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5),
                    router=smg.client(fake.host.router, sleep=lambda s: fake.tick()))
    msg = str(e.value)
    assert msg.count("router http://router.test:30000") == 1, msg
    assert "router http://router.test:30000: router" not in msg
    smg.down = False  # control: the same router answering refuses nothing
    assert str(deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5),
                           router=smg.client(fake.host.router, sleep=lambda s: fake.tick())).outcome) == "deployed"


# -- on a real host (sandbox): sshd's shell, sudo-less root, the real venv -------------------------


@pytest.mark.parametrize(("field", "path", "said"), [
    ("agent_python", "/usr/bin/python9", "sbx1: agent_python /usr/bin/python9 cannot be run on the host (exit 127"),
    ("python", "/opt/no-venv/bin/python", "python /opt/no-venv/bin/python: cannot compile"),
])
def test_a_wrong_interpreter_on_a_real_host_exits_2_naming_the_field_and_changes_nothing(
        fresh_host, tmp_path, good_patchset, field, path, said):
    from kit import DFLASH_INFO, snapshot_paths

    paths = snapshot_paths(fresh_host, [DFLASH_INFO])
    before = fresh_host.snapshot(paths)
    pid = fresh_host.main_pid("sglang-k26-dflash-cg.service")
    inv = fresh_host.with_vars(tmp_path, **{field: path}).inventory
    r = run_cli("deploy", "-i", str(inv), "--limit", "sbx1", "-p", str(good_patchset), "--yes", timeout=180)
    assert r.code == EXIT_BAD_INPUT, r
    assert said in r.stderr and "agent exited" not in r.stderr, r.stderr
    assert "canary refused (1 of 1): sbx1: " in r.stdout, r.stdout
    assert fresh_host.snapshot(paths) == before and fresh_host.main_pid("sglang-k26-dflash-cg.service") == pid
