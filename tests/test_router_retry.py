"""A router that is down or failing for a while (fast tier): register and deregister ask again,
with backoff, within router.retry_window_s; a 4xx (a wrong key) is final; past the window the
operation fails naming the window. A fake clock: nothing waits. Against the real smg, stopped and
started again mid-deploy: test_router_port_faults.py (sandbox)."""

from __future__ import annotations

import httpx
import pytest

from ddtree_ops.config.router_settings import RouterSettings, parse_router
from ddtree_ops.errors import InputError
from ddtree_ops.gates.router import RouterError, RouterUnavailable, SmgRouter, backoff_s
from ddtree_ops.testing.fake_router import FakeSmg

KEY_ENV = "DDTREE_TEST_ROUTER_KEY"
KEY = "k3y-retry-0123456789"
WORKER = "http://10.0.0.5:30000"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


class Outage:
    """FakeSmg behind a router that fails from `start` to `end` (fake seconds) with `how`:
    'refused' (no connection), 'timeout' (no answer), or an HTTP status."""

    def __init__(self, smg: FakeSmg, clock: Clock, start: float, end: float, how: str | int = "refused"):
        self.smg, self.clock, self.start, self.end, self.how = smg, clock, start, end, how
        self.requests: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        if self.start <= self.clock.t < self.end:
            self.clock.t += 0.1  # a failed request takes time too
            if self.how == "refused":
                raise httpx.ConnectError("connection refused", request=request)
            if self.how == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(int(self.how), text="router restarting")
        return self.smg.handle(request)


def router(transport: httpx.BaseTransport, clock: Clock, *, window: float = 60, timeout: float = 60) -> SmgRouter:
    settings = RouterSettings(kind="smg", url="http://r.test:30000", admin_key_env=KEY_ENV, worker=WORKER,
                              timeout_s=timeout, retry_window_s=window)
    return SmgRouter(settings, transport, sleep=clock.sleep, clock=clock)


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def test_the_backoff_doubles_from_half_a_second_to_five():
    assert [backoff_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("how", ["refused", "timeout", 502, 503])
def test_register_rides_out_a_ten_second_outage_within_the_window(how):
    clock, smg = Clock(), FakeSmg(key=KEY)
    outage = Outage(smg, clock, 0, 10, how)
    router(httpx.MockTransport(outage.handle), clock).register(WORKER)
    assert WORKER in smg.routed()
    assert clock.t >= 10 and len(outage.requests) > 2
    assert clock.sleeps[:4] == [0.5, 1.0, 2.0, 4.0]  # backing off, not hammering


def test_deregister_rides_out_an_outage_and_sends_one_delete():
    clock, smg = Clock(), FakeSmg([WORKER], key=KEY, drain_looks=0)
    outage = Outage(smg, clock, 0, 10)
    assert router(httpx.MockTransport(outage.handle), clock).deregister(WORKER) is True
    assert WORKER not in smg.routed()
    assert sum(r.startswith("DELETE") for r in outage.requests) == 1


def test_a_delete_whose_answer_was_lost_is_not_sent_again():
    """smg drained the worker but the answer never came: a second DELETE would end the drain
    window at once. The retry looks first and sees it draining. Control: the DELETE did reach it."""
    clock, smg = Clock(), FakeSmg([WORKER], key=KEY, drain_looks=3)
    deletes: list[str] = []

    def lost_answer(request: httpx.Request) -> httpx.Response:
        answer = smg.handle(request)
        if request.method == "DELETE":
            deletes.append(request.url.path)
            if len(deletes) == 1:
                raise httpx.ReadTimeout("timed out", request=request)
        return answer

    assert router(httpx.MockTransport(lost_answer), clock).deregister(WORKER) is True
    assert len(deletes) == 1
    assert smg.events == [f"deregister {WORKER}"]


def test_an_outage_longer_than_the_window_fails_naming_the_window():
    clock, smg = Clock(), FakeSmg(key=KEY)
    outage = Outage(smg, clock, 0, 1000)
    with pytest.raises(RouterUnavailable) as e:
        router(httpx.MockTransport(outage.handle), clock, window=60).register(WORKER)
    msg = str(e.value)
    assert "ConnectError: connection refused" in msg and "router.retry_window_s is 60 s" in msg, msg
    assert 60 <= clock.t < 66  # gave up at the window, not before, not long after
    assert smg.routed() == []


def test_a_zero_window_does_not_retry():
    clock, smg = Clock(), FakeSmg(key=KEY)
    outage = Outage(smg, clock, 0, 10)
    with pytest.raises(RouterUnavailable):
        router(httpx.MockTransport(outage.handle), clock, window=0).register(WORKER)
    assert len(outage.requests) == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_a_4xx_is_final_and_not_retried(status):
    clock = Clock()
    seen: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        return httpx.Response(status, json={"error": "no"})

    with pytest.raises(RouterError) as e:
        router(httpx.MockTransport(refuse), clock).register(WORKER)
    assert not isinstance(e.value, RouterUnavailable)
    assert seen == ["GET"] and clock.sleeps == []


def test_a_wrong_key_is_final(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    clock, smg = Clock(), FakeSmg(key=KEY)
    outage = Outage(smg, clock, 0, 0)
    with pytest.raises(RouterError, match=r"refused \(401\)"):
        router(httpx.MockTransport(outage.handle), clock).register(WORKER)
    assert len(outage.requests) == 1


def test_the_time_the_router_was_down_does_not_count_against_the_readiness_wait():
    """timeout_s 5; the router is down from 1 s to 21 s of the wait (the backoff sees it back at
    about 24 s) and the worker turns ready at 27 s: still within the wait, as the outage does not
    count. Control: the same worker turning ready 2 s after the deadline, no outage: it fails."""
    clock, smg = Clock(), FakeSmg(key=KEY)
    smg.unhealthy.add(WORKER)
    outage = Outage(smg, clock, 1, 21)

    def ready_at(t: float, handler):
        def handle(request: httpx.Request) -> httpx.Response:
            if clock.t >= t:
                for w in smg.workers.values():
                    w.update(status="ready", is_healthy=True)
            return handler(request)
        return handle

    router(httpx.MockTransport(ready_at(27, outage.handle)), clock, timeout=5).register(WORKER)
    assert WORKER in smg.routed() and clock.t >= 27

    clock, smg = Clock(), FakeSmg(key=KEY)
    smg.unhealthy.add(WORKER)
    with pytest.raises(RouterError, match="not ready within 5 s"):
        router(httpx.MockTransport(ready_at(7, smg.handle)), clock, timeout=5).register(WORKER)


def test_retry_window_s_is_read_and_range_checked():
    s = parse_router({"url": "http://r:1", "retry_window_s": 15}, "inv.yaml: host a", WORKER)
    assert s.retry_window_s == 15.0
    assert parse_router({"url": "http://r:1"}, "x", WORKER).retry_window_s == 60.0
    for bad in (-1, 3601, "soon", True):
        with pytest.raises(InputError, match=r"^inv.yaml: host a: router.retry_window_s: must be a number 0..3600"):
            parse_router({"url": "http://r:1", "retry_window_s": bad}, "inv.yaml: host a", WORKER)


# ---------------------------------------------------------------------------------------------
# a deploy on a fake host while the router is down for a while


ROUTER = {"url": "http://router.test:30000", "admin_key_env": KEY_ENV}


class Down:
    """The router goes away at the first request of `method` (which fails) for `for_s` fake
    seconds of the fake host's clock (the router's waits advance it)."""

    def __init__(self, fake, smg: FakeSmg, method: str, for_s: float):
        self.fake, self.smg, self.method, self.for_s = fake, smg, method, for_s
        self.since: float | None = None
        self.failed = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.since is None and request.method == self.method:
            self.since = self.fake.clock
        if self.since is not None and self.fake.clock - self.since < self.for_s:
            self.fake.clock += 0.1
            self.failed += 1
            raise httpx.ConnectError("connection refused", request=request)
        return self.smg.handle(request)

    def client(self) -> SmgRouter:
        def sleep(s: float) -> None:
            self.fake.clock += s
            self.fake.tick()
        return SmgRouter(self.fake.host.router, httpx.MockTransport(self.handle), sleep=sleep,
                         clock=lambda: self.fake.clock)


@pytest.fixture
def behind_router(tmp_path):
    from ddtree_ops.testing.fake_host import fake_hosts

    def make(method: str, for_s: float, window: float = 60) -> Down:
        fake = fake_hosts(tmp_path / f"{method}{for_s}", router={**ROUTER, "retry_window_s": window})[0]
        smg = FakeSmg([fake.host.base_url], key=KEY)
        return Down(fake, smg, method, for_s)
    return make


def _deploy(down: Down, ps):
    from ddtree_ops.runbook.deploy import deploy_host
    from ddtree_ops.runbook.phases import DeployOptions
    return deploy_host(down.fake.session(), ps, DeployOptions(reconnect_s=5), router=down.client())


@pytest.mark.parametrize("method", ["DELETE", "POST"])
def test_a_ten_second_router_outage_at_deregistration_or_registration_deploys(behind_router, patchset, method):
    from ddtree_ops.runbook.results import Outcome
    down = behind_router(method, 10)
    r = _deploy(down, patchset)
    assert r.outcome == Outcome.DEPLOYED
    assert down.failed > 2 and down.since is not None  # the outage really happened, during that call
    assert down.smg.routed() == [down.fake.host.base_url]


def test_an_outage_past_the_window_at_registration_rolls_back_healthy_and_says_not_routed(behind_router,
                                                                                          patchset):
    """Exit 3, not 4: the host is healthy on its previous release; the message says it is out of
    the router and how to put it back. Control: the same outage within the window deploys (above)."""
    from ddtree_ops.errors import DeployFailed
    from ddtree_ops.testing.fake_host import DFLASH_UNIT
    down = behind_router("POST", 10_000, window=30)
    with pytest.raises(DeployFailed) as e:
        _deploy(down, patchset)
    msg = str(e.value)
    assert e.value.exit_code == 3
    assert "rolled back to" in msg and f"NOT re-registered: {down.fake.host.base_url} is healthy" in msg, msg
    assert "router.retry_window_s is 30 s" in msg, msg
    assert down.fake.units[DFLASH_UNIT].active == "active"


def test_an_outage_past_the_window_at_deregistration_keeps_the_old_server_running(behind_router, patchset):
    """The old server never stopped: the rollback gates it where it runs, without a restart."""
    from ddtree_ops.errors import DeployFailed
    from ddtree_ops.testing.fake_host import DFLASH_UNIT
    down = behind_router("DELETE", 10_000, window=30)
    pid = down.fake.units[DFLASH_UNIT].pid
    with pytest.raises(DeployFailed) as e:
        _deploy(down, patchset)
    assert e.value.exit_code == 3
    assert down.fake.units[DFLASH_UNIT].active == "active" and down.fake.units[DFLASH_UNIT].pid == pid
    assert f"systemctl restart {DFLASH_UNIT}" not in down.fake.events
