"""The request router in front of the fleet (ddtree_ops/router.py): the `router:` settings, the
smg client against a fake control plane (httpx.MockTransport), and the same client against a real
smg 1.13.0 with two stand-in SGLang servers on loopback (sandbox tier)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.router_settings import RouterSettings, normalize_url, parse_router
from ddtree_ops.errors import DdtreeOpsError, InputError
from ddtree_ops.gates.router import RouterError, SmgRouter
from kit import wait_for

KEY_ENV = "DDTREE_TEST_ROUTER_KEY"
KEY = "k3y-that-must-never-be-printed-0123456789"
WORKER = "http://10.0.0.5:30000"


# ---------------------------------------------------------------------------------------------
# settings


def test_parse_router_defaults_and_null():
    assert parse_router(None, "inv.yaml: host a", WORKER) is None
    s = parse_router({"url": "http://10.0.0.9:30000/"}, "inv.yaml: host a", WORKER)
    assert s == RouterSettings(kind="smg", url="http://10.0.0.9:30000", admin_key_env=None, worker=WORKER,
                               timeout_s=60.0)
    s = parse_router({"url": "https://gw.example.com", "kind": "smg", "admin_key_env": "SMG_ADMIN_KEY",
                      "worker": "http://[fd00::5]:30000", "timeout_s": 5}, "x", WORKER)
    assert (s.url, s.admin_key_env, s.worker, s.timeout_s) == ("https://gw.example.com", "SMG_ADMIN_KEY",
                                                               "http://[fd00::5]:30000", 5.0)


@pytest.mark.parametrize("doc, field, problem", [
    ({}, "router.url", "is required: the router's http(s) URL"),
    ({"url": "ftp://10.0.0.9"}, "router.url", "must be an http(s) URL"),
    ({"url": "http://10.0.0.9:30000 --evil"}, "router.url", "must be an http(s) URL"),
    ({"url": 30000}, "router.url", "must be an http(s) URL"),
    ({"url": "http://r", "kind": "nginx"}, "router.kind", "must be smg"),
    ({"url": "http://r", "admin_key_env": "$KEY"}, "router.admin_key_env", "name of the environment variable"),
    ({"url": "http://r", "admin_key_env": "super-secret-key-value"}, "router.admin_key_env",
     "name of the environment variable"),
    ({"url": "http://r", "worker": "10.0.0.5:30000"}, "router.worker", "must be an http(s) URL"),
    ({"url": "http://r:30000", "worker": "http://R:30000/"}, "router.worker", "is the router's own url"),
    ({"url": "http://r", "timeout_s": 0}, "router.timeout_s", "must be a number 1..3600"),
    ({"url": "http://r", "timeout_s": True}, "router.timeout_s", "must be a number 1..3600"),
    ({"url": "http://r", "admin_key": "x"}, "router.admin_key", "unknown key; allowed: admin_key_env, kind,"),
    ("http://r", "router", "must be a mapping of admin_key_env, kind, retry_window_s, timeout_s, url, worker"),
])
def test_parse_router_errors_name_the_field(doc, field, problem):
    with pytest.raises(InputError) as e:
        parse_router(doc, "inv.yaml: host a", WORKER)
    assert str(e.value).startswith(f"inv.yaml: host a: {field}: "), str(e.value)
    assert problem in str(e.value)


BASE = {"python": "/opt/v/bin/python", "site_packages": "/opt/v/lib/python3.12/site-packages",
        "model_path": "/models/m", "draft_model_path": "/models/d"}


def test_inventory_router_merges_key_by_key_across_levels():
    doc = {"all": {
        "vars": {**BASE, "router": {"url": "http://10.0.0.9:30000", "admin_key_env": "SMG_KEY"}},
        "children": {
            "gpu": {"vars": {"router": {"timeout_s": 30}},
                    "hosts": {"a": {"address": "10.0.0.1", "aliases": ["10.1.0.1"],
                                    "router": {"worker": "http://10.1.0.1:30000"}},
                              "b": {"address": "10.0.0.2", "port": 31000}}},
            "other": {"hosts": {"c": {"address": "10.0.0.3"}}},
        }}}
    doc["all"]["children"]["other"]["vars"] = {}
    i = parse_inventory(doc, "inv.yaml")
    a, b = i.host("a").router, i.host("b").router
    assert (a.url, a.admin_key_env, a.timeout_s, a.worker) == ("http://10.0.0.9:30000", "SMG_KEY", 30.0,
                                                               "http://10.1.0.1:30000")
    assert (b.url, b.timeout_s, b.worker) == ("http://10.0.0.9:30000", 30.0, "http://10.0.0.2:31000")
    assert i.host("c").router.timeout_s == 60.0

    plain = parse_inventory({"all": {"vars": BASE, "hosts": {"x": {"address": "10.0.0.4"}}}}, "inv.yaml")
    assert plain.host("x").router is None


def two_routed_hosts(a_vars: dict | None = None, group_router: dict | None = None) -> dict:
    return {"all": {"vars": {**BASE, "router": {"url": "http://10.0.0.9:30000", **(group_router or {})}},
                    "hosts": {"a": {"address": "10.0.0.1", **(a_vars or {})}, "b": {"address": "10.0.0.2"}}}}


@pytest.mark.parametrize("a_vars, group_router, problem", [
    # another host's server: deploying a would take b out of the router
    ({"router": {"worker": "http://10.0.0.2:30000"}}, None, "host 'a': field 'router.worker': 'http://10.0.0.2:30000' "
                                                            "is not this host's server"),
    # set in group vars: every member shares one worker
    (None, {"worker": "http://10.0.0.1:30000"}, "host 'b': field 'router.worker'"),
    # one server under two host names: each would take the other out of the router
    ({"address": "10.0.0.2"}, None, "is also host a's worker"),
    # an address the inventory does not give this host
    ({"router": {"worker": "http://10.1.0.1:30000"}}, None, "10.1.0.1 is neither its address"),
    # the host's own address but another port: another server
    ({"router": {"worker": "http://10.0.0.1:31000"}}, None, "the same port (30000)"),
])
def test_a_worker_that_is_not_the_hosts_own_server_is_refused(a_vars, group_router, problem):
    with pytest.raises(InputError, match=r"^inv\.yaml: host '[ab]': field 'router\.worker': ") as e:
        parse_inventory(two_routed_hosts(a_vars, group_router), "inv.yaml")
    assert problem in str(e.value)


@pytest.mark.parametrize("a_vars", [
    {},  # the default: base_url
    {"router": {"worker": "http://10.0.0.1:30000/"}},
    {"aliases": ["10.1.0.1"], "router": {"worker": "http://10.1.0.1:30000"}},
    {"aliases": "gpu-a.internal", "router": {"worker": "http://GPU-A.internal:30000"}},
])
def test_the_hosts_own_server_at_any_of_its_addresses_is_accepted(a_vars):
    # The control for the refusals above: the same inventory with a's own worker loads.
    inv = parse_inventory(two_routed_hosts(a_vars), "inv.yaml")
    assert inv.host("b").router.worker == "http://10.0.0.2:30000"


def test_inventory_router_errors_name_file_host_and_field():
    doc = {"all": {"vars": {**BASE, "router": {"url": "http://10.0.0.9:30000"}},
                   "hosts": {"a": {"address": "10.0.0.1", "router": {"timeout_s": "soon"}}}}}
    with pytest.raises(InputError, match=r"^inv\.yaml: host 'a': field 'router\.timeout_s': must be a number"):
        parse_inventory(doc, "inv.yaml")
    doc["all"]["hosts"]["a"]["router"] = {"bogus": 1}
    with pytest.raises(InputError, match=r"field 'router\.bogus': unknown key; allowed: admin_key_env"):
        parse_inventory(doc, "inv.yaml")
    doc["all"]["hosts"]["a"]["router"] = {}
    doc["all"]["vars"]["router"] = {"admin_key_env": "SMG_KEY"}  # no url at any level
    with pytest.raises(InputError, match=r"field 'router\.url': is required"):
        parse_inventory(doc, "inv.yaml")


@pytest.mark.parametrize("a, b", [
    ("http://10.0.0.5:30000/", "http://10.0.0.5:30000"),
    ("HTTP://Host.Example:80", "http://host.example"),
    ("https://h:443/", "https://h"),
    ("http://[FD00::5]:30000//", "http://[fd00::5]:30000"),
    ("http://u:p@h:1/x/?q=1#f", "http://h:1/x"),
])
def test_normalize_url(a, b):
    assert normalize_url(a) == b


def test_normalize_url_keeps_ports_and_paths_apart():
    assert normalize_url("http://h:30000") != normalize_url("http://h:30001")
    assert normalize_url("http://h:80") != normalize_url("https://h:80")
    assert normalize_url("http://h/a") != normalize_url("http://h/b")


def test_router_error_is_a_ddtree_ops_error_with_exit_1():
    assert issubclass(RouterError, DdtreeOpsError) and not issubclass(RouterError, InputError)
    assert RouterError.exit_code == 1


# ---------------------------------------------------------------------------------------------
# the client against a fake smg control plane


class FakeSmg:
    """smg 1.13.0's control plane as measured (see router.py): DELETE → draining for `drain_polls`
    listings, then gone; POST → pending (not listed) for `pending_polls` GETs, then ready."""

    def __init__(self, workers: dict[str, str] | None = None, *, key: str = KEY, drain_polls: int = 3,
                 pending_polls: int = 2):
        self.key = key
        self.workers: dict[str, dict] = {}
        self.pending: dict[str, dict] = {}  # id → worker being added
        self.requests: list[tuple[str, str, dict | None]] = []
        self.drain_polls, self.pending_polls = drain_polls, pending_polls
        self.ids = (f"00000000-0000-7000-8000-{n:012d}" for n in range(1, 10**6))
        self.never_ready = False
        self.fail_add: str | None = None
        self.ignore_delete = False
        for url, status in (workers or {}).items():
            wid = next(self.ids)
            self.workers[wid] = {"id": wid, "url": url, "status": status, "is_healthy": status == "ready",
                                 "load": 0, "model_id": "m"}

    def _tick(self) -> None:
        for wid, w in list(self.workers.items()):
            if w["status"] == "draining":
                w["_left"] -= 1
                if w["_left"] <= 0:
                    del self.workers[wid]
        for wid, w in list(self.pending.items()):
            w["_left"] -= 1
            if w["_left"] <= 0 and not self.never_ready and not self.fail_add:
                del self.pending[wid]
                self.workers[wid] = {**w, "status": "ready", "is_healthy": True}
            elif self.fail_add:
                w["job_status"] = {"job_type": "AddWorker", "worker_url": w["url"], "status": "failed",
                                   "message": self.fail_add, "timestamp": 1}

    @staticmethod
    def _public(w: dict) -> dict:
        return {k: v for k, v in w.items() if not k.startswith("_")}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return httpx.Response(401, text="Invalid authentication token")
        path = request.url.path
        if path == "/workers" and request.method == "GET":
            self._tick()
            ws = [self._public(w) for w in self.workers.values()]
            return httpx.Response(200, json={"workers": ws, "total": len(ws), "stats": {}})
        if path == "/workers" and request.method == "POST":
            url = body["url"]
            for w in self.workers.values():
                if w["url"] == url:
                    return httpx.Response(409, json={"error": f"Worker already exists at URL '{url}' with ID "
                                                              f"{w['id']}.", "code": "WORKER_ALREADY_EXISTS"})
            for w in self.pending.values():
                if w["url"] == url:
                    return httpx.Response(409, json={"error": f"Worker creation already in progress for URL "
                                                              f"'{url}' with ID {w['id']}. Poll GET /workers/"
                                                              f"{w['id']}.", "code": "WORKER_CREATE_IN_PROGRESS"})
            wid = next(self.ids)
            self.pending[wid] = {"id": wid, "url": url, "status": "pending", "is_healthy": False, "load": 0,
                                 "_left": self.pending_polls,
                                 "job_status": {"job_type": "AddWorker", "status": "processing", "message": None}}
            return httpx.Response(202, json={"status": "accepted", "worker_id": wid, "url": url,
                                             "location": f"/workers/{wid}"})
        m = re.fullmatch(r"/workers/([0-9a-f-]{36})", path)
        if m and request.method == "GET":
            self._tick()
            w = self.workers.get(m.group(1)) or self.pending.get(m.group(1))
            if w is None:
                return httpx.Response(404, json={"error": "not found", "code": "WORKER_NOT_FOUND"})
            return httpx.Response(200, json=self._public(w))
        if m and request.method == "DELETE":
            w = self.workers.get(m.group(1))
            if w is None:
                return httpx.Response(404, json={"error": "not found", "code": "WORKER_NOT_FOUND"})
            if not self.ignore_delete:
                if w["status"] == "draining":  # smg: a second DELETE removes it at once
                    del self.workers[m.group(1)]
                else:
                    w.update(status="draining", is_healthy=False, _left=self.drain_polls)
            return httpx.Response(202, json={"status": "accepted", "worker_id": m.group(1)})
        return httpx.Response(404, json={"error": "no route"})

    def calls(self, method: str) -> list[tuple[str, str, dict | None]]:
        return [r for r in self.requests if r[0] == method]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def client(fake: FakeSmg, *, timeout_s: float = 5.0, key_env_name: str | None = KEY_ENV) -> SmgRouter:
    clock = FakeClock()
    settings = RouterSettings(kind="smg", url="http://10.0.0.9:30000", admin_key_env=key_env_name, worker=WORKER,
                              timeout_s=timeout_s)
    return SmgRouter(settings, httpx.MockTransport(fake), poll_interval_s=0.1, sleep=clock.sleep, clock=clock)


def test_workers_lists_entries_with_the_key_only_in_the_authorization_header(key_env):
    fake = FakeSmg({WORKER: "ready", "http://10.0.0.6:30000": "not_ready"})
    with client(fake) as r:
        ws = r.workers()
        assert r._client().trust_env is False
    assert [(w.url, w.status, w.healthy, w.routable) for w in ws] == [
        (WORKER, "ready", True, True), ("http://10.0.0.6:30000", "not_ready", False, False)]
    assert fake.requests == [("GET", "/workers", None)]


def test_missing_key_variable_and_refused_key_are_errors_without_the_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RouterError, match=f"the environment variable {KEY_ENV} \\(router.admin_key_env\\) is not set"):
        client(FakeSmg()).workers()
    monkeypatch.setenv(KEY_ENV, "wrong-" + KEY)
    with pytest.raises(RouterError) as e:
        client(FakeSmg()).deregister(WORKER)
    assert f"refused (401) with the key in ${KEY_ENV}" in str(e.value)
    assert KEY not in str(e.value)


def test_no_admin_key_env_sends_no_authorization():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"workers": []})

    settings = RouterSettings(kind="smg", url="http://r:1", admin_key_env=None, worker=WORKER)
    assert SmgRouter(settings, httpx.MockTransport(handler)).workers() == []
    assert seen == [None]


def test_urls_are_matched_after_normalisation(key_env):
    fake = FakeSmg({"http://10.0.0.5:30000/": "ready", "http://10.0.0.50:30000": "ready"})
    r = client(fake)
    (entry,) = r.entries("HTTP://10.0.0.5:30000")
    assert entry.url == "http://10.0.0.5:30000/"
    assert r.is_registered("http://10.0.0.5:30000") and not r.is_registered("http://10.0.0.5:3000")
    assert r.deregister("http://10.0.0.5:30000") is True
    assert [c[1] for c in fake.calls("DELETE")] == [f"/workers/{entry.id}"]  # not the :30000 look-alike
    assert r.is_registered("http://10.0.0.50:30000")


def test_deregister_returns_once_draining_and_is_idempotent(key_env):
    fake = FakeSmg({WORKER: "ready", "http://10.0.0.6:30000": "ready"}, drain_polls=5)
    r = client(fake)
    assert r.deregister(WORKER) is True
    (w,) = r.entries(WORKER)
    assert w.draining and not w.routable and not r.is_registered(WORKER)
    assert len(fake.calls("DELETE")) == 1
    # Again while it drains: no second DELETE (smg would cut the drain window short).
    assert r.deregister(WORKER) is True
    assert len(fake.calls("DELETE")) == 1
    for _ in range(5):
        r.workers()
    assert r.entries(WORKER) == []
    assert r.deregister(WORKER) is False  # gone: nothing to do
    assert len(fake.calls("DELETE")) == 1
    assert r.is_registered("http://10.0.0.6:30000")  # the other worker untouched


def test_deregister_times_out_when_the_router_keeps_routing(key_env):
    fake = FakeSmg({WORKER: "ready"})
    fake.ignore_delete = True
    with pytest.raises(RouterError, match=r"worker http://10.0.0.5:30000 still listed and not draining 2 s after "
                                          r"its removal was requested \(.* ready\)"):
        client(fake, timeout_s=2).deregister(WORKER)


def test_register_adds_and_waits_until_ready(key_env):
    fake = FakeSmg({"http://10.0.0.6:30000": "ready"}, pending_polls=4)
    r = client(fake)
    assert not r.is_registered(WORKER)
    r.register(WORKER + "/")
    assert fake.calls("POST") == [("POST", "/workers", {"url": WORKER})]  # the normalised URL
    (w,) = r.entries(WORKER)
    assert w.routable and r.is_registered(WORKER)
    r.register(WORKER)  # already ready: nothing to add
    assert len(fake.calls("POST")) == 1


def test_register_waits_out_an_entry_still_draining(key_env):
    fake = FakeSmg({WORKER: "ready"}, drain_polls=6, pending_polls=1)
    r = client(fake)
    r.deregister(WORKER)
    r.register(WORKER)
    assert len(fake.calls("POST")) == 1 and len(fake.calls("DELETE")) == 1
    (w,) = r.entries(WORKER)
    assert w.routable


def test_register_follows_an_add_already_in_progress(key_env):
    fake = FakeSmg(pending_polls=3)
    r = client(fake)
    fake(httpx.Request("POST", "http://r/workers", json={"url": WORKER},
                       headers={"Authorization": f"Bearer {KEY}"}))  # someone else started it
    r.register(WORKER)
    assert len(fake.calls("POST")) == 2 and r.entries(WORKER)[0].routable


def test_register_timeout_says_what_the_router_last_reported(key_env):
    fake = FakeSmg()
    fake.never_ready = True
    with pytest.raises(RouterError) as e:
        client(fake, timeout_s=3).register(WORKER)
    msg = str(e.value)
    assert msg.startswith("router http://10.0.0.9:30000: worker http://10.0.0.5:30000 not ready within 3 s "
                          "(status 'pending', job processing)"), msg
    assert "register a host after its health gate" in msg


def test_register_reports_a_failed_add_job_and_api_errors(key_env):
    fake = FakeSmg()
    fake.fail_add = "http health check failed for explicitly configured worker URL"
    with pytest.raises(RouterError, match="adding worker http://10.0.0.5:30000 failed: 'http health check failed"):
        client(fake).register(WORKER)

    def broken(request):
        return httpx.Response(500, text="internal error")

    # No retry window: the retries themselves are test_router_retry.py's.
    settings = RouterSettings(kind="smg", url="http://r:1", admin_key_env=KEY_ENV, worker=WORKER, retry_window_s=0)
    with pytest.raises(RouterError, match=r"router http://r:1: GET /workers answered 500: 'internal error'"):
        SmgRouter(settings, httpx.MockTransport(broken)).register(WORKER)

    def unreachable(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(RouterError, match=r"router http://r:1: GET /workers: ConnectError: connection refused"):
        SmgRouter(settings, httpx.MockTransport(unreachable)).is_registered(WORKER)


# ---------------------------------------------------------------------------------------------
# a real smg in front of two stand-in SGLang servers (loopback only)


def _free_port() -> int:
    from ddtree_ops.testing.sandbox.smg import free_port

    return free_port()


class Standin:
    def __init__(self, tmp: Path, name: str, generate_seconds: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddtree_ops.testing.standin", "--host", "127.0.0.1", "--port", str(self.port),
                 "--standin-load-seconds", "0", "--standin-warmup-seconds", "0",
                 "--standin-generate-seconds", str(generate_seconds), "--standin-gpu-dir", str(tmp / "gpu")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "NO_PROXY": "*"})

    def generates(self) -> int:
        """/generate requests this server answered (its access log)."""
        return self.log.read_text(errors="replace").count('"POST /generate ')

    def running(self) -> int:
        try:
            r = httpx.get(self.url + "/v1/loads", timeout=1, trust_env=False)
            return r.json()["loads"][0]["num_running_reqs"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def real_smg(tmp_path_factory):
    """A real smg (the sandbox's launcher: key from a 0600 file, fast health checks) in front of
    stand-ins `slow` (each /generate takes 2 s) and `fast`."""
    from ddtree_ops.testing.sandbox import smg

    why = smg.smg_missing()
    if why:
        if os.environ.get("DDTREE_OPS_STRICT") == "1":
            pytest.fail(why)
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("smg")
    servers = {"slow": Standin(tmp, "slow", 2.0), "fast": Standin(tmp, "fast", 0.0)}
    info = None
    try:
        for s in servers.values():
            wait_for(lambda s=s: _healthy(s.url), 30, interval=0.02, what=f"stand-in {s.url}")
        smg.write_key(tmp / smg.KEY_FILE)
        assert oct((tmp / smg.KEY_FILE).stat().st_mode & 0o777) == "0o600"
        info = smg.start(tmp, [s.url for s in servers.values()], _free_port())
        smg.wait_ready(info)
        key = smg.read_key(info["key_file"])
        assert key not in Path(f"/proc/{info['pid']}/cmdline").read_text(errors="replace")
        yield info, key, servers
    finally:
        if info:
            assert smg.stop(info) == 1
        for s in servers.values():
            s.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _generate(router_url: str, results: list, i: int) -> None:
    try:
        r = httpx.post(router_url + "/generate", json={"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 2}},
                       timeout=30, trust_env=False)
        results.append((i, r.status_code, r.json().get("text") if r.status_code == 200 else r.text))
    except httpx.HTTPError as e:
        results.append((i, type(e).__name__, str(e)))


def _router(info, timeout_s: float = 15) -> SmgRouter:
    settings = RouterSettings(kind="smg", url=info["url"], admin_key_env=KEY_ENV, worker=info["workers"][0],
                              timeout_s=timeout_s)
    return SmgRouter(settings, poll_interval_s=0.05)


@pytest.mark.sandbox
def test_real_smg_drain_in_flight_then_register(real_smg, monkeypatch):
    info, key, servers = real_smg
    slow, fast = servers["slow"], servers["fast"]
    monkeypatch.setenv(KEY_ENV, key)
    r = _router(info)
    assert r.is_registered(slow.url + "/") and r.is_registered(fast.url)
    assert {(w.url, w.routable) for w in r.workers()} == {(slow.url, True), (fast.url, True)}

    # A request in flight on the slow server (round robin: at most two tries land one there).
    inflight: list = []
    threads = []
    for i in range(2):
        t = threading.Thread(target=_generate, args=(info["url"], inflight, i))
        t.start()
        threads.append(t)
        if _wait_quiet(lambda: slow.running() >= 1, 0.5):
            break
    wait_for(lambda: slow.running() >= 1, 3, interval=0.02, what="a request in flight on the slow server")

    t0 = time.monotonic()
    assert r.deregister(slow.url) is True
    took = time.monotonic() - t0
    assert took < 1.5, took  # does not wait for the request in flight (2 s)
    assert slow.running() == 1
    assert not r.is_registered(slow.url) and [w.status for w in r.entries(slow.url)] in (["draining"], [])

    # New requests go to the other server only; the one in flight still completes.
    before = slow.generates(), fast.generates()
    after: list = []
    for i in range(10, 14):
        _generate(info["url"], after, i)
    assert [c for _, c, _ in after] == [200] * 4, after
    for t in threads:
        t.join(timeout=10)
    assert inflight and all(c == 200 for _, c, _ in inflight), inflight
    wait_for(lambda: fast.generates() >= before[1] + 4, 3, interval=0.02, what="the fast server's access log")
    assert slow.generates() == before[0] + 1  # the request in flight, nothing new

    assert r.deregister(slow.url) in (True, False)  # again: no error (still draining, or gone)

    # Back in: waits out the drain window (smg: 5 s), adds it, returns once smg routes to it.
    t0 = time.monotonic()
    r.register(slow.url)
    took = time.monotonic() - t0
    assert took < 8, took
    (entry,) = r.entries(slow.url)
    assert entry.routable and entry.url == slow.url and r.is_registered(slow.url)
    n = slow.generates()
    again: list = []
    burst = [threading.Thread(target=_generate, args=(info["url"], again, i)) for i in range(20, 24)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(timeout=10)
    assert [c for _, c, _ in again] == [200] * 4, again
    wait_for(lambda: slow.generates() >= n + 1, 3, interval=0.02, what="traffic on the registered server again")


def _wait_quiet(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.sandbox
def test_real_smg_unknown_worker_wrong_key_and_register_timeout(real_smg, monkeypatch):
    info, key, servers = real_smg
    monkeypatch.setenv(KEY_ENV, key)
    r = _router(info, timeout_s=1.5)
    nowhere = f"http://127.0.0.1:{_free_port()}"
    assert r.deregister(nowhere) is False and not r.is_registered(nowhere)
    with pytest.raises(RouterError, match=r"not ready within 1.5 s \(status 'pending', job processing\)"):
        r.register(nowhere)
    monkeypatch.setenv(KEY_ENV, "not-" + key)
    with pytest.raises(RouterError, match=r"refused \(401\)") as e:
        _router(info).workers()
    assert key not in str(e.value)


# ---------------------------------------------------------------------------------------------
# `sandbox up --router`


@pytest.mark.sandbox  # starts its own test host and router
def test_sandbox_up_router_writes_the_router_section_and_down_stops_it(tmp_path, monkeypatch):
    import yaml

    from ddtree_ops.config.inventory import load_inventory
    from ddtree_ops.host.localproc import pid_alive, start_time
    from ddtree_ops.testing.sandbox import Sandbox, smg
    from kit import _require_sandbox, run_cli

    _require_sandbox()
    if smg.smg_missing():
        pytest.fail(smg.smg_missing())
    d = tmp_path / "sbx"
    try:
        up = run_cli("sandbox", "up", "--hosts", "1", "--router", "--dir", str(d), "--json", timeout=120)
        assert up.code == 0, up.stderr
        doc = up.json()
        url = doc["router_url"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and doc["router"]["up"]
        key_file = d / smg.KEY_FILE
        assert doc["router"]["key_file"] == str(key_file) and doc["router"]["key_env"] == smg.ROUTER_KEY_ENV
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        key = key_file.read_text().strip()
        inv_doc = yaml.safe_load((d / "inventory.yaml").read_text())
        assert inv_doc["all"]["vars"]["router"] == {"kind": "smg", "url": url, "admin_key_env": smg.ROUTER_KEY_ENV,
                                                    "timeout_s": 30}
        host = load_inventory(d / "inventory.yaml").host("sbx1")
        assert host.router.url == url and host.router.worker == host.base_url
        for f in ("inventory.yaml", "sandbox.json", smg.LOG_FILE):
            assert key not in (d / f).read_text(errors="replace"), f
        pid = doc["router"]["pid"]
        started = start_time(pid)  # a PID alone is not a process: it may be reused once the router ends
        assert key not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")

        st = run_cli("sandbox", "status", "--dir", str(d), "--json")
        assert st.code == 0, st.stderr
        assert st.json()["router_url"] == url
        assert [(w["url"], w["status"]) for w in st.json()["router"]["workers"]] == [(host.base_url, "ready")]

        # The inventory's users read the key from the state file: the sandbox hands it over.
        assert Sandbox(d).router_env() == {smg.ROUTER_KEY_ENV: key}
        monkeypatch.setenv(smg.ROUTER_KEY_ENV, key)
        with SmgRouter(host.router) as r:
            assert r.is_registered(host.router.worker)
        g = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10,
                       trust_env=False)
        assert g.status_code == 200 and g.json()["text"]

        down = run_cli("sandbox", "down", "--dir", str(d), "--json")
        assert down.code == 0, down.stderr
        assert started is not None and not (pid_alive(pid) and start_time(pid) == started)
        assert not d.exists()
    finally:
        Sandbox(d).down()
