"""`plan` as a dry run of deploy's checks (fast tier): the launch paths, the launch check against
the new files staged beside site-packages, the ports, the router and its key, the lock; every
refusal deploy would give, word for word, and nothing on the host changed."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import PreflightError
from ddtree_ops.host.agent.path_access import op_path_access
from ddtree_ops.host.agent.protocol import PathAccess
from ddtree_ops.host.channel import AgentChannel
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.dry_run import dry_run_host, plan_exit_code
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.plan import path_refusals
from ddtree_ops.testing.fake_host import FakeHost, fake_hosts, fake_inventory
from ddtree_ops.testing.fake_router import FakeSmg
from ddtree_ops.testing.local_agent import LOCK_LEASE_S, LOCK_RENEW_S, LocalConnection

OPTS = DeployOptions(command="ddtree-ops plan")


def host_tree(fake) -> dict[str, bytes]:
    h = fake.host
    return fake.tree(h.site_packages, h.state_dir, "/etc/systemd/system")


def dry(fake, patchset, router=None):
    return dry_run_host(fake.session(), patchset, OPTS, router)


# --------------------------------------------------------------------------- the agent's ops

def test_path_access_names_a_missing_path_and_one_the_units_user_cannot_use(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    tool = tmp_path / "tool"
    tool.write_text("x")
    tool.chmod(0o644)
    req = PathAccess([str(model), str(tmp_path / "gone"), str(tool), sys.executable], [False, False, True, True])
    reply = op_path_access(req)
    assert reply.failed is None
    got = [f.problem for f in reply.facts]
    assert got[0] is None and got[1] == "does not exist" and got[3] is None
    assert got[2].startswith("is not executable by User=")  # control: the same file, not runnable


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another user's identity needs root")
def test_path_access_asks_as_the_units_user_not_as_root(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    tmp_path.chmod(0o755)
    as_root = op_path_access(PathAccess([str(private)]))
    as_nobody = op_path_access(PathAccess([str(private)], user="nobody"))
    assert as_root.facts[0].problem is None
    assert as_nobody.facts[0].problem.startswith("is not listable by User=nobody")


LAUNCHER = ("import argparse\nfrom pkg.flags import FLAGS\np = argparse.ArgumentParser(allow_abbrev=False)\n"
            "p.add_argument('--parse-only', action='store_true')\n"
            "[p.add_argument(f) for f in FLAGS]\np.parse_args()\n")


@pytest.fixture
def site(tmp_path) -> Path:
    """A site-packages whose launcher's flags come from a module a patch set replaces."""
    sp = tmp_path / "site"
    (sp / "pkg").mkdir(parents=True)
    (sp / "pkg" / "__init__.py").write_text("")
    (sp / "pkg" / "flags.py").write_text("FLAGS = ['--port']\n")
    (sp / "pkg" / "launcher.py").write_text(LAUNCHER)
    return sp


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_the_parse_imports_the_staged_files_ahead_of_site_packages_and_leaves_nothing(tmp_path, site):
    """The new flag exists only in the staged module: accepted with the overlay, refused without
    it; the dry run leaves site-packages and the scratch folder's parent as they were, while
    deploy's own parse (no overlay, after the install) writes bytecode there (the control)."""
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    ch = _agent_with_tmpdir(scratch_parent)
    before = tree(site)
    try:
        def check(overlay):
            req = {"op": "launch_check", "python": sys.executable, "module": "pkg.launcher", "sglang": False,
                   "args": ["--new-flag", "1"], "ports": [], "site_packages": str(site)}
            return ch.call(dict(req, overlay=overlay) if overlay else req, 60)
        new = check({"pkg/flags.py": b64("FLAGS = ['--port', '--new-flag']\n")})
        assert new["rc"] == 0, new
        # A replaced package module keeps its other modules (the launcher) from site-packages.
        init = check({"pkg/__init__.py": b64("# patched\n"), "pkg/flags.py": b64("FLAGS = ['--new-flag']\n")})
        assert init["rc"] == 0, init
        assert tree(site) == before and list(scratch_parent.iterdir()) == []
        old = check({})
        assert old["rc"] == 2 and "unrecognized arguments: --new-flag" in old["stderr"]
        assert tree(site) != before
    finally:
        ch.close()


def test_a_scratch_path_outside_site_packages_is_refused_and_the_scratch_removed(tmp_path, site):
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    ch = _agent_with_tmpdir(scratch_parent)
    try:
        with pytest.raises(Exception, match="is not relative to site-packages"):
            ch.call({"op": "launch_check", "python": sys.executable, "module": "pkg.launcher", "args": [],
                     "ports": [], "site_packages": str(site), "overlay": {"../evil.py": b64("x")}}, 60)
    finally:
        ch.close()
    assert list(scratch_parent.iterdir()) == []


def _agent_with_tmpdir(folder: Path):
    """The real agent, here, staging its scratch folders in `folder` (its TMPDIR)."""
    host = SimpleNamespace(name="local", python=sys.executable, agent_python=sys.executable, connect_timeout_s=10.0,
                           become=False, lock_lease_s=LOCK_LEASE_S, lock_renew_s=LOCK_RENEW_S)
    return AgentChannel(LocalConnection(env=dict(os.environ, TMPDIR=str(folder))), host)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the dry run on a fake host

def test_a_clean_host_passes_every_check_and_nothing_changes(fake, patchset):
    before = host_tree(fake)
    plan = dry(fake, patchset)
    assert plan.refusals == () and plan.locked is None
    assert any(c.startswith("launch line: sglang.launch_server accepts it with the new files") for c in plan.checked)
    assert any(c.startswith(f"port {fake.host.port}: free") for c in plan.checked)
    assert host_tree(fake) == before
    assert plan_exit_code([plan], []) == 0


def test_the_launch_check_is_sent_with_every_new_file_staged(fake, patchset, monkeypatch):
    sent = []
    session = fake.session()
    real = session.store.launch_check
    monkeypatch.setattr(session.store, "launch_check", lambda req: sent.append(req) or real(req))
    dry_run_host(session, patchset, OPTS)
    [req] = sent
    assert sorted(req.overlay) == sorted(pf.path for pf in patchset.files)
    assert base64.b64decode(req.overlay[patchset.files[0].path]) == patchset.files[0].source.read_bytes()


def test_a_missing_model_path_refuses_plan_and_deploy_alike_before_any_change(fake, patchset):
    fake.path(fake.host.model_path).rmdir()
    plan = dry(fake, patchset)
    want = f"model_path {fake.host.model_path} does not exist on {fake.host.name}"
    [line] = [r for r in plan.refusals if r.startswith(want)]
    assert plan_exit_code([plan], []) == 2
    before = fake.tree(fake.host.site_packages, "/etc/systemd/system")
    with pytest.raises(PreflightError) as e:
        deploy_host(fake.session(), patchset, DeployOptions())
    assert line in str(e.value) and e.value.exit_code == 2
    assert fake.tree(fake.host.site_packages, "/etc/systemd/system") == before  # deploy's lock file aside


def test_a_launch_path_the_units_user_cannot_use_is_a_refusal_naming_field_path_and_user(fake, patchset):
    facts = {"launch_paths": {"paths": [
        {"field": "draft_model_path", "path": "/models/draft", "problem": "is not listable by User=sglang (uid 999)"},
        {"field": "model_path", "path": "/models/kimi", "problem": None}]}}
    [line] = path_refusals(fake.host, facts)
    assert line.startswith("draft_model_path /models/draft is not listable by User=sglang (uid 999) on fh1: the new "
                           "server would fail to load the draft model after the old one stopped")
    assert path_refusals(fake.host, {}) == []  # facts without the check (an older reader): nothing to say


def test_a_parser_refusal_is_deploys_launch_check_text(fake, patchset):
    """The typo deploy finds only after installing is a refusal of plan, in deploy's words."""
    said = "sglang serve: error: unrecognized arguments: --mem-fraction-statc 0.8"
    fake.launch_refusal = said
    plan = dry(fake, patchset)
    [line] = [r for r in plan.refusals if r.startswith("launch check: ")]
    assert line == f"launch check: SGLang's argument parser refuses the new launch line (exit 2): {said}"
    assert not any(c.startswith("launch line:") for c in plan.checked)


def test_a_port_held_by_another_process_is_refused_one_held_by_the_replaced_unit_is_not(fake, patchset):
    port = fake.host.port
    fake.port_holders[port] = [{"pid": 4242, "cmd": "nginx", "ancestors": [1]}]
    plan = dry(fake, patchset)
    assert any(r.startswith(f"launch check: port {port} is held by pid 4242 (nginx), not by a unit this deploy")
               for r in plan.refusals), plan.refusals
    dflash = fake.units[fake.host.conflicts[0]].pid
    fake.port_holders[port] = [{"pid": dflash, "cmd": "python -m sglang.launch_server", "ancestors": [1]}]
    assert dry(fake, patchset).refusals == ()  # control: the server this deploy replaces holds it


def _router_host(tmp_path, key_env: str):
    [fake] = fake_hosts(tmp_path / "r", router={"url": "http://10.200.0.9:30080", "admin_key_env": key_env})
    return fake


def test_a_missing_router_key_is_refused_and_a_good_one_names_the_worker(tmp_path, patchset, monkeypatch):
    fake = _router_host(tmp_path, "PLAN_TEST_SMG_KEY")
    smg = FakeSmg([fake.host.base_url], key="k-plan")
    monkeypatch.delenv("PLAN_TEST_SMG_KEY", raising=False)
    plan = dry(fake, patchset, smg.client(fake.host.router))
    assert any("the environment variable PLAN_TEST_SMG_KEY (router.admin_key_env) is not set" in r
               for r in plan.refusals), plan.refusals
    monkeypatch.setenv("PLAN_TEST_SMG_KEY", "wrong")
    assert any("refused (401)" in r for r in dry(fake, patchset, smg.client(fake.host.router)).refusals)
    monkeypatch.setenv("PLAN_TEST_SMG_KEY", "k-plan")
    good = dry(fake, patchset, smg.client(fake.host.router))
    assert good.refusals == ()
    assert f"would register {fake.host.router.worker}" in " ".join(good.checked)


def test_a_lock_held_by_another_run_is_deploys_lock_message_and_exit_5(fake, patchset):
    other = fake.session()
    other.store.acquire_lock("ddtree-ops deploy")
    plan = dry(fake, patchset)
    assert plan.locked and "deploy lock held by" in plan.locked and "--break-lock" in plan.locked
    assert plan_exit_code([plan], []) == 5
    assert plan_exit_code([plan], [1]) == 5 and plan_exit_code([], [1]) == 1


def test_only_rank_0_of_a_multinode_server_checks_the_router(tmp_path, patchset, monkeypatch):
    """Deploy routes and gates rank 0 only: a key missing there refuses, and only there."""
    monkeypatch.delenv("PLAN_TEST_SMG_KEY", raising=False)
    doc = fake_inventory(2, multinode=True)
    doc["all"]["children"]["server1"]["hosts"]["fh1"]["router"] = {"url": "http://10.200.0.9:30080",
                                                                   "admin_key_env": "PLAN_TEST_SMG_KEY"}
    inv = parse_inventory(doc, "inv.yaml")
    rank0, rank1 = (FakeHost(inv.hosts[n], tmp_path / n) for n in ("fh1", "fh2"))
    client = FakeSmg([rank0.host.base_url], key="k-plan").client(rank0.host.router)
    assert any("PLAN_TEST_SMG_KEY" in r for r in dry(rank0, patchset, client).refusals)
    assert dry(rank1, patchset, client).refusals == ()  # the same client, handed to rank 1: not asked


def test_a_missing_venv_interpreter_is_named_once_and_the_parse_is_not_tried(fake, patchset):
    fake.path(fake.host.python).unlink()
    plan = dry(fake, patchset)
    assert any(r.startswith(f"python {fake.host.python} does not exist on fh1") for r in plan.refusals), plan.refusals
    assert not any(r.startswith("launch check:") for r in plan.refusals)
    assert not any(c.startswith("launch line:") for c in plan.checked)  # the control above runs it
