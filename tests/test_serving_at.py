"""Where the old server serves (fast tier): the address a deploy records before it changes a host
(runbook/serving.py), and the rollback checking and routing the old server there when the new
release moves the port. Fake hosts whose HTTP answers only on the port their running unit file
names; the same on sandbox hosts with a real smg: test_router_port_faults.py."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from ddtree_ops.errors import DeployFailed
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.runbook.serving import ServingAt, before_deploy, from_record, moved, today, unit_port
from ddtree_ops.testing.fake_host import fake_hosts
from ddtree_ops.testing.fake_router import FakeSmg

KEY_ENV = "DDTREE_TEST_ROUTER_KEY"
ROUTER = {"url": "http://router.test:30000", "admin_key_env": KEY_ENV}


def unit(port: str) -> str:
    return f"[Service]\nExecStart=/opt/venv/bin/python -m sglang.launch_server --host 0.0.0.0 {port} --tp 8\n"


@pytest.mark.parametrize("text, port", [
    (unit("--port 30001"), 30001), (unit("--port=30002"), 30002), (unit(""), None), (None, None),
    (unit("--port"), None), (unit("--port 99999"), None), (unit("--port x"), None),
])
def test_unit_port_reads_the_execstart_port(text, port):
    assert unit_port(text) == port


def test_moved_changes_only_a_url_on_the_servers_port():
    assert moved("http://10.0.0.5:30001", 30001, 30000) == "http://10.0.0.5:30000"
    assert moved("http://[fd00::5]:30001/x", 30001, 30000) == "http://[fd00::5]:30000/x"
    assert moved("https://proxy.example:443", 30001, 30000) == "https://proxy.example:443"  # a proxy: as is


@pytest.fixture
def host(tmp_path):
    return fake_hosts(tmp_path, port=30001, router=ROUTER)[0].host


def test_before_deploy_is_the_serving_units_port_else_the_inventorys(host):
    old = before_deploy(host, unit("--port 30000"))
    assert old == ServingAt("http://127.0.0.1:30000", "http://127.0.0.1:30000")
    # controls: not running, no --port, the same port: the inventory's address
    assert before_deploy(host, None) == today(host)
    assert before_deploy(host, unit("")) == today(host)
    assert before_deploy(host, unit("--port 30001")) == today(host)


def test_a_record_without_an_address_or_a_bad_one_means_the_inventorys(host):
    kept = {"base_url": "http://127.0.0.1:30000", "worker": "http://127.0.0.1:30000"}
    assert from_record(host, kept) == ServingAt(kept["base_url"], kept["worker"])
    for bad in (None, {}, {"base_url": 5}, {"base_url": "file:///etc/passwd"}, "x"):
        assert from_record(host, bad) == today(host)


# ---------------------------------------------------------------------------------------------
# the rollback on a fake host that serves only where its running unit file says


class PortBound:
    """The fake host's HTTP answers only on the port of the unit file its serving unit was started
    from (read when it starts); any other port is refused, as a real host refuses it."""

    def __init__(self, fake):
        self.fake, self.refused = fake, []
        inner = fake.handle_http

        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.port != self.port():
                self.refused.append(request.url.port)
                raise httpx.ConnectError("connection refused", request=request)
            return inner(request)
        fake.handle_http = handle

    def port(self) -> int:
        serving = self.fake.serving_unit()
        text = self.fake.path(self.fake.host.unit_path).read_text() if serving == self.fake.host.unit else ""
        return unit_port(text) or 30000


def move_port(fake, port: int) -> None:
    """Today's inventory puts the host's server on `port` (the worker URL follows it)."""
    h = fake.host
    url = f"http://127.0.0.1:{port}"
    fake.host = dataclasses.replace(h, port=port, base_url=url,
                                    router=dataclasses.replace(h.router, worker=url) if h.router else None)


@pytest.fixture
def on_30000(tmp_path, patchset, monkeypatch):
    """A fake host behind a router, deployed with its server on port 30000 (routed there)."""
    monkeypatch.setenv(KEY_ENV, "k-1")
    fake = fake_hosts(tmp_path / "h", router=ROUTER)[0]
    smg = FakeSmg([], key="k-1")
    PortBound(fake)
    r = deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5), router=smg.client(fake.host.router))
    assert r.outcome == Outcome.DEPLOYED and smg.routed() == ["http://127.0.0.1:30000"]
    return fake, smg


def test_a_refused_new_port_rolls_back_in_seconds_with_the_old_server_checked_and_routed_where_it_serves(
        on_30000, versioned_patchset):
    fake, smg = on_30000
    move_port(fake, 22)
    fake.launch_refusal = "port 22 is held by sshd"
    pid = fake.units[fake.host.unit].pid
    with pytest.raises(DeployFailed) as e:
        deploy_host(fake.session(), versioned_patchset("2.0.0"), DeployOptions(reconnect_s=5),
                    router=smg.client(fake.host.router))
    assert e.value.exit_code == 3, str(e.value)
    assert fake.units[fake.host.unit].pid == pid  # never stopped
    assert smg.routed() == ["http://127.0.0.1:30000"]  # still routed, where it serves
    assert "register http://127.0.0.1:22" not in smg.events
    assert fake.clock < 30  # seconds, not the 120 s load deadline


def test_rollback_after_a_port_change_checks_and_routes_the_old_release_on_its_old_port(on_30000,
                                                                                       versioned_patchset):
    fake, smg = on_30000
    move_port(fake, 30001)
    r = deploy_host(fake.session(), versioned_patchset("2.0.0"), DeployOptions(reconnect_s=5),
                    router=smg.client(fake.host.router))
    assert r.outcome == Outcome.DEPLOYED and smg.routed() == ["http://127.0.0.1:30001"]
    assert "deregister http://127.0.0.1:30000" in smg.events  # the old port left before its server stopped
    r = rollback_host(fake.session(), None, DeployOptions(reconnect_s=5), router=smg.client(fake.host.router))
    assert r.outcome == Outcome.ROLLED_BACK, r.message
    assert smg.routed() == ["http://127.0.0.1:30000"]
    steps = {s["step"]: s.get("detail", "") for s in r.steps}
    assert "at http://127.0.0.1:30000" in steps["rollback: healthy"], steps
