"""The ddtree.ops collection under ansible-runner's Python API, as AWX runs it: the deploy's phases
reach the event stream while the task runs, and a cancel (AWX's: SIGKILL to ansible-playbook's
process group) in the middle of a deploy rolls the host back, as Ctrl-C does in the CLI.

Two sandbox hosts behind a real smg; the collection installed from its built tarball. The
router's admin key reaches the run through the environment (as an AWX credential injects it),
never through ansible-runner's `envvars`, which it writes into the private data dir."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from ansible_kit import VENV_BIN, ansible_env, build_and_install, managed_tree, run
from kit import REPO, TestHost, wait_for

pytestmark = pytest.mark.sandbox

PLAYBOOK = "---\n- name: Deploy\n  ansible.builtin.import_playbook: ddtree.ops.deploy\n"


@pytest.fixture(scope="module")
def routed_sandbox(tmp_path_factory):
    """Two hosts behind smg for the module: each test deploys a host of its own (sbx2, sbx1) and
    leaves it where it found it."""
    from ddtree_ops.testing.sandbox import Sandbox

    sb = Sandbox(tmp_path_factory.mktemp("sbx"))
    try:
        sb.up(2, load_seconds=0.3, router=True)
        yield sb
    finally:
        sb.down()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return build_and_install(tmp_path_factory.mktemp("collection"))


def _slow_inventory(sb, tmp: Path, load_s: float) -> Path:
    doc = yaml.safe_load(Path(sb.inventory_path).read_text())
    doc["all"]["vars"]["extra_args"] = [f"--standin-load-seconds={load_s}", "--standin-warmup-seconds=0.2"]
    out = tmp / "inventory.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _run(monkeypatch, tmp: Path, installed, inventory: Path, limit: str, key: str, cancel_on: str | None = None):
    """ansible-runner over the collection's deploy playbook; (runner, [(seconds, event)])."""
    import ansible_runner

    for k, v in ansible_env(installed, DDTREE_SANDBOX_ROUTER_KEY=key).items():
        monkeypatch.setenv(k, v)
    pdd = tmp / f"pdd-{limit}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "deploy.yml").write_text(PLAYBOOK)
    events: list[tuple[float, dict]] = []
    cancel = threading.Event()
    t0 = time.monotonic()

    def on_event(ev: dict) -> bool:
        events.append((time.monotonic() - t0, ev))
        if cancel_on and ev.get("event") == "verbose" and cancel_on in ev.get("stdout", ""):
            cancel.set()
        return True

    r = ansible_runner.run(private_data_dir=str(pdd), playbook="deploy.yml", inventory=str(inventory),
                           limit=limit, event_handler=on_event, cancel_callback=cancel.is_set, quiet=True,
                           timeout=180)
    return r, events


def test_phase_events_arrive_live_and_the_rollback_playbook_undoes_that_rollout(routed_sandbox, installed, tmp_path,
                                                                                 monkeypatch):
    key = routed_sandbox.router_key_file.read_text().strip()
    inv = Path(routed_sandbox.inventory_path)
    hosts = {n: TestHost(n, routed_sandbox, inv) for n in ("sbx1", "sbx2")}
    pristine = {n: managed_tree(h) for n, h in hosts.items()}
    r, events = _run(monkeypatch, tmp_path, installed, inv, "sbx2", key)
    assert r.status == "successful", r.stdout.read()[-3000:]
    started = next(t for t, e in events if e.get("event") == "playbook_on_task_start"
                   and e["event_data"].get("task") == "Deploy the host")
    ended = next(t for t, e in events if e.get("event") == "runner_on_ok" and e["event_data"].get("task") ==
                 "Deploy the host")
    phases = [(t, e["stdout"]) for t, e in events if e.get("event") == "verbose" and e["stdout"].startswith("sbx2 | ")]
    lines = [s for _, s in phases]
    for step in ("sbx2 | preflight", "sbx2 | backup", "sbx2 | phase: weights", "sbx2 | phase: health gate",
                 "sbx2 | committed: release"):
        assert any(s.startswith(step) for s in lines), lines
    # live: the first phase came well before the task's end, in order between its start and its end
    first = next(t for t, s in phases if s.startswith("sbx2 | preflight"))
    assert started < first < ended - 1.0
    assert [t for t, _ in phases] == sorted(t for t, _ in phases)
    res = next(e for _, e in events if e.get("event") == "runner_on_ok" and e["event_data"].get("task") ==
               "Deploy the host")["event_data"]["res"]
    assert res["exit_code"] == 0 and res["outcome"] == "deployed" and res["changed"] is True
    assert res["release"] and [p["step"] for p in res["phases"]][0] == "preflight"
    # set_stats: what an AWX workflow hands the next job (promote, or a rollback of the rollout)
    stats = next(e for _, e in events if e.get("event") == "playbook_on_stats")["event_data"]
    assert stats["artifact_data"] == {"ddtree_rollout_id": res["rollout_id"]}

    # The rollback job of an AWX workflow gets the deploy's rollout id as an extra var: every host
    # that rollout changed goes back (sbx2), a host it never reached is left alone (sbx1).
    env = ansible_env(installed, DDTREE_SANDBOX_ROUTER_KEY=key)
    p = run([str(VENV_BIN / "ansible-playbook"), "-i", str(inv), "ddtree.ops.rollback", "-e",
             f"ddtree_rollout_id={res['rollout_id']}"], cwd=tmp_path, env=env)
    assert "sbx2 | restore: undoing release" in p.stdout and "sbx1 | restore" not in p.stdout, p.stdout[-3000:]
    assert "changed: [sbx2]" in p.stdout and "changed: [sbx1]" not in p.stdout
    assert {n: managed_tree(h) for n, h in hosts.items()} == pristine
    p = run([str(VENV_BIN / "ansible-playbook"), "-i", str(inv), "ddtree.ops.status", "-e",
             "ddtree_fail_on_drift=true"], cwd=tmp_path, env=env, check=False)
    assert p.returncode == 0, p.stdout[-3000:]
    assert p.stdout.count("health 200") == 2


def test_a_cancel_mid_deploy_rolls_the_host_back_and_routes_it_again(routed_sandbox, installed, tmp_path,
                                                                    monkeypatch):
    from ddtree_ops.fleet.routing import router_for

    inv = _slow_inventory(routed_sandbox, tmp_path, 4.0)
    key = routed_sandbox.router_key_file.read_text().strip()
    th = TestHost("sbx1", routed_sandbox, inv)
    before = managed_tree(th)
    r, events = _run(monkeypatch, tmp_path, installed, inv, "sbx1", key, cancel_on="sbx1 | phase: weights")
    assert r.status == "canceled", r.status
    assert not any(e.get("event") == "runner_on_ok" and e["event_data"].get("task") == "Deploy the host"
                   for _, e in events)
    env = ansible_env(installed, DDTREE_SANDBOX_ROUTER_KEY=key)

    def rollout_outcome() -> str | None:
        p = run([str(VENV_BIN / "python"), "-m", "ddtree_ops", "rollouts", "-i", str(inv), "--json"], cwd=REPO,
                env=env, check=False)
        doc = json.loads(p.stdout)
        outcomes = [h["outcome"] for ro in doc["rollouts"] for h in ro["hosts"] if h["host"] == "sbx1"]
        return outcomes[0] if outcomes else None

    # The tool's command outlives the cancelled job and rolls the host back (the CLI's exit 3 path).
    wait_for(lambda: (rollout_outcome() or "").startswith("rolled back (interrupted (SIGTERM)"), timeout=90,
             what="the cancelled deploy's rollback")
    assert managed_tree(th) == before
    h = th.host
    assert th.unit_state(h.conflicts[0]) == "active" and th.unit_state(h.unit) != "active"

    def routed() -> bool:
        with router_for(h) as client:
            return any(e.url.rstrip("/") == h.router.worker.rstrip("/") and e.routable for e in client.workers())
    wait_for(routed, timeout=30, what="sbx1 routed again")
