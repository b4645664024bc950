"""Deploying under live traffic, on real sandbox hosts: a real smg router in front of them, a
client sending generations through it the whole time, and the performance gate measuring the
stand-in servers for real (their speed follows the release's flags and knobs)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml

from kit import run_cli, write_inventory

DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"


class Client:
    """Generations sent one after another through the router by `threads` threads (each waiting
    `pause_s` between two), until stopped; every answer that is not a 200 with text is a failure,
    kept with its reason."""

    def __init__(self, url: str, threads: int = 3, pause_s: float = 0.0):
        self.url, self.sent, self.failed, self.pause_s = url, 0, [], pause_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        body = {"text": f"request from client {i}", "sampling_params": {"max_new_tokens": 12, "temperature": 0.7}}
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/generate", json=body)
                    bad = None if r.status_code == 200 and r.json().get("text") else f"{r.status_code} {r.text[:200]}"
                except (httpx.HTTPError, ValueError) as e:
                    bad = f"{type(e).__name__}: {e}"
                with self._lock:
                    self.sent += 1
                    if bad:
                        self.failed.append(f"{time.monotonic() - self.t0:.1f} s: {bad}")
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def __enter__(self) -> Client:
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


class RoutedSampler:
    """The router's worker list read every 0.1 s until stopped: the fewest workers it routed to
    (ready and healthy) at any look, and how many looks."""

    def __init__(self, info: dict):
        self.info, self.fewest, self.looks = info, None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ddtree_ops.testing.sandbox import smg

        while not self._stop.wait(0.1):
            try:
                routed = sum(1 for w in smg.list_workers(self.info) if w["status"] == "ready" and w["is_healthy"])
            except httpx.HTTPError:
                continue
            self.looks += 1
            self.fewest = routed if self.fewest is None else min(self.fewest, routed)

    def __enter__(self) -> RoutedSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def routed_fleet(sandbox, clean_hosts, tmp_path):
    """Every sandbox host behind a real smg (round robin, its own key); the inventory's `router:`
    names it. Yields (inventory path, environment with the key, router URL)."""
    from ddtree_ops.testing.sandbox import smg

    d = tmp_path / "router"
    d.mkdir(mode=0o700)
    smg.write_key(d / smg.KEY_FILE)
    urls = [th.host.base_url for th in clean_hosts]
    info = smg.start(d, urls, smg.free_port())
    try:
        smg.wait_ready(info)
        inv = write_inventory(sandbox, tmp_path / "inventory.yaml")
        doc = yaml.safe_load(inv.read_text())
        doc["all"]["vars"]["router"] = {"kind": "smg", "url": info["url"], "admin_key_env": smg.ROUTER_KEY_ENV,
                                        "timeout_s": 30}
        doc["all"]["vars"]["health"].update(min_healthy_s=1.0, soak_interval_s=0.5)  # a soak, under traffic
        inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        yield inv, {smg.ROUTER_KEY_ENV: smg.read_key(info["key_file"])}, info
    finally:
        smg.stop(info)


def first_host_unreachable(start_cli, sandbox, host: str, args: tuple[str, ...], env: dict, marker, down_s: float):
    """`ddtree-ops ARGS` started with `host`'s sshd stopped: once its first try has met a refused
    connection (the connect-retry pause point, so the CLI's start-up time does not count), sshd
    comes back `down_s` later. The result (sshd is started again whatever happens)."""
    from test_faults import let_go, pause_env, wait_paused

    sandbox.stop_sshd(host)
    try:
        p = start_cli(*args, env={**env, **pause_env("connect-retry", marker)})
        wait_paused(p, marker)
        t0 = time.monotonic()
        let_go(p, marker, down_s)  # each retry pauses there
    finally:
        sandbox.start_sshd(host)
    let_go(p, marker, 600 - (time.monotonic() - t0))
    return p.wait(30)


def test_a_rolling_deploy_and_a_rollback_through_smg_fail_no_request(routed_fleet, sandbox, good_patchset,
                                                                      record_property, start_cli, tmp_path):
    """The rollback's first host (sbx1) has its sshd down for 3 s as the rollback starts: its first
    contact is retried (it once ended that host's rollback at once, leaving it on the new release
    while the three others rolled back), and every host rolls back."""
    from ddtree_ops.testing.sandbox import smg

    inv, env, info = routed_fleet
    with Client(info["url"]) as client:
        time.sleep(1.0)  # traffic flowing to every host before the first one leaves
        t_dep = time.monotonic() - client.t0
        dep = run_cli("deploy", "-i", str(inv), "-p", str(good_patchset), "--canary", "1", "--batch", "2",
                      "--max-unavailable", "2", "--yes", "--json", "--report", str(tmp_path / "deploy.html"), env=env,
                      timeout=600)
        sent_deploy, failed_deploy = client.sent, len(client.failed)
        after_deploy = run_cli("status", "-i", str(inv), "--json", env=env)
        t_back = time.monotonic() - client.t0
        # The default rollback (rolling, max_unavailable 1), its first host unreachable at first.
        with RoutedSampler(info) as during_rollback:
            back = first_host_unreachable(start_cli, sandbox, "sbx1", (
                "rollback", "-i", str(inv), "--yes", "--json", "--report", str(tmp_path / "rollback.html")), env,
                tmp_path / "pause-connect-retry", down_s=3.0)
        sent_rollback, failed_rollback = client.sent - sent_deploy, len(client.failed) - failed_deploy
        time.sleep(1.0)
    after_rollback = run_cli("status", "-i", str(inv), "--json", env=env)
    assert dep.code == 0, dep.stderr
    assert back.code == 0, back.stderr
    hosts = dep.json()["hosts"]
    assert [h["outcome"] for h in hosts] == ["deployed"] * len(hosts)
    rows = after_deploy.json()["hosts"]  # every host ends on the one release, serving
    assert {(r["patchset"], r["active_unit"], r["health"]) for r in rows} == {("testps-1.0.0", DDTREE, 200)}, rows
    assert [r["release"] for r in rows] == [h["release"] for h in hosts]
    rows = after_rollback.json()["hosts"]
    assert {(r["release"], r["active_unit"], r["health"]) for r in rows} == {(None, DFLASH, 200)}, rows
    assert dep.json()["batches"][0] == ["sbx1"] and len(dep.json()["batches"]) == 3
    for h in hosts:  # each host left the router before its server stopped, and came back after its gate
        steps = [s["step"] for s in h["steps"]]
        assert steps.index("deregister") < steps.index("restart") < steps.index("health gate") \
            < steps.index("register") < steps.index("soak") < steps.index("committed"), steps
    assert [h["outcome"] for h in back.json()["hosts"]] == ["rolled_back"] * len(hosts), back.stderr[-3000:]
    assert back.json()["hosts"][0]["host"] == "sbx1" and back.json()["hosts"][0]["connect_tries"] > 1
    assert back.json()["batches"] == [[h["host"]] for h in hosts]
    assert during_rollback.looks > 20 and during_rollback.fewest == len(hosts) - 1  # never more than one out
    page = (tmp_path / "deploy.html").read_text()  # the report of the real rollout: every host, its phases
    assert all(f">{h['host']}<" in page for h in hosts) and "register" in page and "soak" in page
    page = (tmp_path / "rollback.html").read_text()
    assert all(f">{h['host']}<" in page for h in hosts) and "rollback" in page
    workers = smg.list_workers(info)  # every host in the router again, and only once
    assert sorted(w["url"] for w in workers if w["status"] == "ready" and w["is_healthy"]) == sorted(info["workers"])
    assert len(workers) == len(hosts)
    record_property("measured", f"{client.sent} requests sent through smg during the deploy and the rollback "
                                f"({sent_deploy} during the deploy), {len(client.failed)} failed ({failed_deploy} "
                                f"during the deploy); the default rollback: {sent_rollback} sent, {failed_rollback} "
                                f"failed, at least {during_rollback.fewest} of {len(hosts)} workers routed in "
                                f"{during_rollback.looks} looks")
    assert client.sent > 50
    assert client.failed == [], (f"deploy from {t_dep:.1f} s, rollback from {t_back:.1f} s", client.failed[:3],
                                 client.failed[-3:], dep.stderr[-3000:], back.stderr[-3000:])


def test_a_cuda_graph_capture_that_outlasts_its_deadline_is_caught_long_before_the_load_deadline(
        sandbox, clean_host, tmp_path, good_patchset):
    """The stand-in logs SGLang 0.5.23's capture lines and takes 60 s to capture; the phase's own
    deadline (3 s) ends the wait, well inside load_deadline_s (120)."""
    slow_capture = clean_host.base_extra_args() + ["--standin-cuda-graph-seconds", "60"]
    th = clean_host.with_vars(tmp_path, extra_args=slow_capture, health={"cuda_graphs_deadline_s": 3})
    t0 = time.monotonic()
    r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--yes", "--json")
    assert r.code == 3, r.stderr
    h = r.json()["hosts"][0]
    assert h["failed_step"] == "wait for weights" and "'cuda graphs'" in h["message"], h["message"]
    assert "health.cuda_graphs_deadline_s" in h["message"]
    steps = [s["step"] for s in h["steps"]]
    assert steps.index("weights") < steps.index("rolled back"), steps  # the phase before it ended and was timed
    assert time.monotonic() - t0 < 40
    assert th.unit_state(DFLASH) == "active"
