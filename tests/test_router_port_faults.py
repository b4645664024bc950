"""No false exit 4 from a port change, a router outage or a read-only site-packages, on a real
sandbox host behind a real smg (the router stopped and started again on its port, as a restart of
the router does):

* a new port the launch check refuses: the old server never stopped, so the rollback checks it
  where it serves (the old port) and it stays routed: exit 3 in seconds, not 4 after the load
  deadline; and a deploy that moves the port, then `rollback`: the old release is checked and
  routed on its old port again;
* smg down for ~10 s during the deregistration or the registration: retried within
  router.retry_window_s, exit 0; down past the window at the registration: exit 3, the host healthy
  on its previous release, and the message says it is not re-registered;
* site-packages mounted read-only: refused in preflight (exit 2) naming host and path, the host
  untouched and serving.

Pure parts and the retry policy: test_serving_at.py, test_router_retry.py, test_readonly_site.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_faults import pause_env, wait_paused

from kit import run_cli, wait_for, write_inventory

DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"


class Router:
    """A real smg in front of one sandbox host's server, which a test stops and starts again on
    the same port."""

    def __init__(self, directory: Path, workers: list[str]):
        from ddtree_ops.testing.sandbox import smg

        self.smg, self.dir, self.workers = smg, directory, workers
        smg.write_key(directory / smg.KEY_FILE)
        self.info = smg.start(directory, workers, smg.free_port())
        smg.wait_ready(self.info)

    @property
    def env(self) -> dict[str, str]:
        return {self.smg.ROUTER_KEY_ENV: self.smg.read_key(self.info["key_file"])}

    def stop(self) -> None:
        self.smg.stop(self.info)

    def start_again(self) -> None:
        self.info = self.smg.start(self.dir, self.workers, self.info["port"])

    def routed(self) -> list[str]:
        """This host's URLs the router sends requests to (the machine is shared: other tests' hosts
        may register with a router that took over their router's port)."""
        mine = tuple(u.rsplit(":", 1)[0] + ":" for u in self.workers)
        return sorted(w["url"] for w in self.smg.list_workers(self.info) if w["status"] == "ready"
                      and w["is_healthy"] and w["url"].startswith(mine))

    def listed(self) -> list[str]:
        """Every entry of this host, routed or not."""
        mine = tuple(u.rsplit(":", 1)[0] + ":" for u in self.workers)
        return sorted(w["url"] for w in self.smg.list_workers(self.info) if w["url"].startswith(mine))


@pytest.fixture
def routed_host(sandbox, clean_host, tmp_path):
    """sbx1 behind its own smg. Yields (make_inventory(**sbx1 vars, router=extra), router)."""
    d = tmp_path / "router"
    d.mkdir(mode=0o700)
    router = Router(d, [clean_host.host.base_url])

    def inventory(router_extra: dict | None = None, **host_vars) -> Path:
        inv = write_inventory(sandbox, tmp_path / f"inv-{len(list(tmp_path.glob('inv-*')))}.yaml",
                              {"sbx1": host_vars} if host_vars else None)
        doc = yaml.safe_load(inv.read_text())
        doc["all"]["vars"]["router"] = {"kind": "smg", "url": router.info["url"],
                                        "admin_key_env": router.smg.ROUTER_KEY_ENV, "timeout_s": 30,
                                        **(router_extra or {})}
        # sbx1 is this router's only worker: deploying it empties the router, which only 100% allows
        doc["all"]["vars"]["max_unavailable"] = "100%"
        inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        return inv

    try:
        yield clean_host, inventory, router
    finally:
        router.stop()


def _health(url: str) -> int | str:
    try:
        return httpx.get(url + "/health", timeout=3, trust_env=False).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _on_port(url: str, port: int) -> str:
    return url.rsplit(":", 1)[0] + f":{port}"


def test_a_refused_new_port_rolls_back_in_seconds_with_the_old_server_serving_and_routed(routed_host, good_patchset):
    th, inventory, router = routed_host
    old = th.host.base_url
    pid = th.main_pid(DFLASH)
    t0 = time.monotonic()
    r = run_cli("deploy", "-i", str(inventory(port=22)), "-p", str(good_patchset), "--yes", env=router.env,
                timeout=300)
    took = time.monotonic() - t0
    assert r.code == 3, r.stderr[-3000:]
    assert "port 22" in r.stderr, r.stderr[-2000:]
    assert took < 60, f"{took:.0f} s"  # seconds: not the 120 s load deadline on the wrong port
    assert th.main_pid(DFLASH) == pid and _health(old) == 200  # never stopped, serving where it did
    assert router.routed() == [old]


def test_rollback_after_a_port_change_checks_and_routes_the_old_release_on_its_old_port(routed_host, good_patchset):
    th, inventory, router = routed_host
    old = th.host.base_url
    new = _on_port(old, 30001)
    inv = inventory(port=30001)
    dep = run_cli("deploy", "-i", str(inv), "-p", str(good_patchset), "--yes", env=router.env, timeout=300)
    assert dep.code == 0, dep.stderr[-3000:]
    assert _health(new) == 200 and _health(old) != 200
    # the old port's entry left the router before the old server stopped (it is gone, not unhealthy)
    wait_for(lambda: router.listed() == [new] and router.routed() == [new], 30, interval=0.2,
             what="only the new port in the router")
    back = run_cli("rollback", "-i", str(inv), "--yes", "--json", env=router.env, timeout=300)
    assert back.code == 0, back.stderr[-3000:]
    assert th.unit_state(DFLASH) == "active" and _health(old) == 200
    steps = {s["step"]: s.get("detail", "") for s in back.json()["hosts"][0]["steps"]}
    assert f"at {old}" in steps["rollback: healthy"], steps
    wait_for(lambda: router.listed() == [old] and router.routed() == [old], 30, interval=0.2,
             what="only the old port in the router again")


class Outage:
    """At the pause point: smg stopped, the tool let go into the outage, smg started again on its
    port after `for_s` (None: not until `end`). Later stops at the same point are let through."""

    def __init__(self, cli, marker: Path, router: Router, for_s: float | None):
        self.cli, self.marker, self.router, self.for_s = cli, marker, router, for_s
        self._done = threading.Event()
        self._releaser = threading.Thread(target=self._release_later_pauses, daemon=True)

    def run(self) -> None:
        wait_paused(self.cli, self.marker)
        self.router.stop()
        self.down_at = time.monotonic()
        self.marker.unlink()
        self._releaser.start()
        if self.for_s is not None:
            time.sleep(self.for_s)
            self.router.start_again()

    def _release_later_pauses(self) -> None:
        while not self._done.is_set():
            if self.marker.exists():
                self.marker.unlink()
            time.sleep(0.05)

    def end(self) -> None:
        self._done.set()
        if self.for_s is None:
            self.router.start_again()

    def through(self):
        """The outage at the pause point, then the tool's result; the router is back afterwards
        whatever happened."""
        try:
            self.run()
            return self.cli.wait(300)
        finally:
            self.end()


@pytest.mark.parametrize("point", ["before-deregister", "before-register"])
def test_a_ten_second_router_outage_while_the_host_leaves_or_joins_it_still_deploys(routed_host, good_patchset,
                                                                                   start_cli, tmp_path, point):
    th, inventory, router = routed_host
    marker = tmp_path / "pause"
    cli = start_cli("deploy", "-i", str(inventory()), "-p", str(good_patchset), "--yes", "--json",
                    env={**router.env, **pause_env(point, marker)})
    outage = Outage(cli, marker, router, 10)
    r = outage.through()
    assert r.code == 0, r.stderr[-3000:]
    assert time.monotonic() - outage.down_at > 10
    assert th.unit_state(DDTREE) == "active" and _health(th.host.base_url) == 200
    wait_for(lambda: router.routed() == [th.host.base_url], 30, interval=0.2, what="the host routed")


def test_a_router_outage_past_the_window_at_registration_rolls_back_healthy_and_says_not_routed(
        routed_host, good_patchset, start_cli, tmp_path):
    """Exit 3, not 4: the host is healthy on its previous release; only the router lacks it, and
    the message says so. Control: the 10 s outage within the window above deploys."""
    th, inventory, router = routed_host
    marker = tmp_path / "pause"
    cli = start_cli("deploy", "-i", str(inventory({"retry_window_s": 5})), "-p", str(good_patchset), "--yes",
                    env={**router.env, **pause_env("before-register", marker)})
    outage = Outage(cli, marker, router, None)
    r = outage.through()
    assert r.code == 3, r.stderr[-3000:]
    assert f"NOT re-registered: {th.host.base_url} is healthy" in r.stderr, r.stderr[-3000:]
    assert "router.retry_window_s is 5 s" in r.stderr
    assert th.unit_state(DFLASH) == "active" and th.unit_state(DDTREE) != "active"
    assert _health(th.host.base_url) == 200


def test_a_read_only_site_packages_is_refused_in_preflight_and_the_host_is_untouched(routed_host, good_patchset,
                                                                                    sandbox):
    th, inventory, router = routed_host
    sp = th.host.site_packages
    pid = th.main_pid(DFLASH)
    before = th.snapshot([f"{sp}/sglang/version.py"])
    sandbox.inside("sbx1", ["mount", "-o", "remount,ro", sp])
    try:
        r = run_cli("deploy", "-i", str(inventory()), "-p", str(good_patchset), "--yes", env=router.env,
                    timeout=300)
        ro = sandbox.inside("sbx1", ["findmnt", "-no", "OPTIONS", sp]).stdout
    finally:
        if sandbox.inside("sbx1", ["mount", "-o", "remount,rw", sp], check=False).returncode != 0:
            sandbox.reset_host("sbx1")
    assert ro.startswith("ro"), ro  # the fault was really there
    assert r.code == 2, r.stderr[-3000:]
    assert "sbx1" in r.stderr and "site-packages is read-only" in r.stderr and sp in r.stderr, r.stderr[-2000:]
    assert th.main_pid(DFLASH) == pid and _health(th.host.base_url) == 200
    assert th.snapshot([f"{sp}/sglang/version.py"]) == before
    assert th.ssh(["test", "-e", f"{th.host.state_dir}/journal.json"], check=False).exit_code != 0
    assert router.routed() == [th.host.base_url]
