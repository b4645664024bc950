"""The SSH transport's timeouts (fast tier): `connect_timeout` below one second is honoured.

Fabric's Connection (used here before) truncated `connect_timeout` to an int (0.5 → 0) and then
passed no timeout at all; ddtree-ops gives Paramiko the float itself. Only sockets on 127.0.0.1
opened by the test.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import UnreachableError
from ddtree_ops.host.transport import HostConnection, connect_kwargs_for
from kit import modules_loaded_by


def _host(tmp_path, port: int = 22, timeout: float = 0.5):
    kh = tmp_path / "known_hosts"
    kh.touch()
    (tmp_path / "id_none").touch()  # the key file must exist here: a missing one is refused before connecting
    doc = {"all": {"hosts": {"h1": {
        "address": "127.0.0.1", "ssh_port": port, "connect_timeout": timeout, "known_hosts": str(kh),
        "identity_file": str(tmp_path / "id_none"), "python": "/opt/v/bin/python",
        "site_packages": "/opt/v/lib/python3.12/site-packages", "model_path": "/m", "draft_model_path": "/d"}}}}
    return parse_inventory(doc, "inv.yaml").host("h1")


@pytest.mark.parametrize("timeout", [0.5, 1.9, 10])
def test_the_float_timeout_reaches_paramiko(tmp_path, timeout):
    h = _host(tmp_path, timeout=timeout)
    kw = connect_kwargs_for(h)
    assert kw["timeout"] == kw["banner_timeout"] == kw["auth_timeout"] == float(timeout)
    conn = HostConnection(h)
    seen = {}

    def fake_connect(**kwargs):
        seen.update(kwargs)
        raise TimeoutError("timed out")

    conn._client.connect = fake_connect
    with pytest.raises(UnreachableError, match=f"timed out after {timeout:g} s"):
        conn.open()
    assert (seen["timeout"], seen["banner_timeout"], seen["auth_timeout"]) == (float(timeout),) * 3
    assert (seen["hostname"], seen["port"]) == ("127.0.0.1", 22)


def _open_within(conn: HostConnection, limit: float) -> tuple[BaseException | None, float]:
    """conn.open() in a thread, so that a regression (no timeout) fails the test instead of hanging."""
    out: list = [None, None]

    def go():
        t0 = time.monotonic()
        try:
            conn.open()
        except BaseException as e:  # noqa: B036 - reported to the test
            out[0] = e
        out[1] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"open() still waiting after {limit} s: the timeout was not honoured"
    conn.close()
    return out[0], out[1]


def test_a_listener_that_never_answers_ssh_gives_up_after_half_a_second(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # accepts the TCP connection (in the kernel) and never sends an SSH banner
    try:
        err, took = _open_within(HostConnection(_host(tmp_path, srv.getsockname()[1])), 10)
    finally:
        srv.close()
    assert isinstance(err, UnreachableError), err
    assert "connect_timeout 0.5 s" in str(err)
    assert 0.4 <= took < 2.0, took


def test_a_tcp_connect_that_hangs_gives_up_after_half_a_second(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)  # the accept queue is full now: the
    try:                                                                # kernel drops the next SYN
        err, took = _open_within(HostConnection(_host(tmp_path, port)), 10)
    finally:
        filler.close()
        srv.close()
    assert isinstance(err, UnreachableError), err
    assert f"connection to 127.0.0.1:{port} timed out after 0.5 s" in str(err)
    assert 0.4 <= took < 2.0, took


def test_paramiko_comes_without_invoke_and_invoke_still_imports_afterwards():
    """host/ssh_lib.py: paramiko.config's `import invoke` (0.12 CPU-s of every CLI start, with
    unittest.mock) is refused for Paramiko's import only."""
    assert "invoke" in modules_loaded_by("import paramiko", "invoke")  # the control: Paramiko alone does
    assert modules_loaded_by("import ddtree_ops.cli.commands, ddtree_ops.host.transport", "invoke",
                             "unittest.mock", "fabric") == []
    after = "import ddtree_ops.host.transport, paramiko.config\nassert paramiko.config.invoke is None\nimport invoke"
    assert "invoke" in modules_loaded_by(after, "invoke")
