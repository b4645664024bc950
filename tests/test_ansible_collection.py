"""The product's side of the ddtree.ops collection, from data (no Ansible run, no host): a host's
Ansible vars as the tool's one-host inventory, a rollout an orchestrator runs host by host (its
batch checks and its webhooks), the CLI flags it uses, and the AWX / execution-environment
examples. The collection run for real is in test_ansible_molecule.py, test_ansible_runner.py and
test_ansible_checks.py."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.config.ansible_hostvars import host_inventory_doc
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.schema import CountOrShare
from ddtree_ops.errors import InputError, InventoryError, RouterPoolShort
from ddtree_ops.fleet.external_rollout import check_batch, finish_rollout, start_rollout
from ddtree_ops.fleet.rollout_id import is_rollout_id
from ddtree_ops.testing.fake_host import fake_inventory
from ddtree_ops.testing.fake_router import FakeSmg
from kit import REPO

# What Ansible hands an action plugin beside the host's own vars: magic vars, other roles' vars.
ANSIBLE_NOISE = {"inventory_hostname": "gpu1", "groups": {"all": ["gpu1"]}, "playbook_dir": "/p", "omit": "__omit",
                 "ansible_connection": "ssh", "ansible_check_mode": False, "nginx_port": 8080,
                 "ansible_ssh_common_args": "-o X=1"}
HOSTVARS = {"ansible_host": "10.200.9.2", "ansible_port": "2222", "ansible_user": "deploy",
            "ansible_ssh_private_key_file": "/keys/id", "ansible_python_interpreter": "/usr/bin/python3",
            "known_hosts": "/etc/ddtree/known_hosts", "site_packages": "/opt/venv/lib/python3.11/site-packages",
            "python": "/opt/venv/bin/python", "model_path": "/models/kimi", "draft_model_path": "/models/draft",
            "budget": 16, "topk_cap": 4, "conflicts": ["sglang-dflash.service"]}


def test_a_hosts_ansible_vars_become_its_inventory_with_ansibles_names_mapped_and_the_rest_left_out():
    doc = host_inventory_doc("gpu1", {**ANSIBLE_NOISE, **HOSTVARS})
    picked = doc["all"]["hosts"]["gpu1"]
    assert set(picked) == set(HOSTVARS)  # no magic var, no other role's var, no other ansible_* var
    h = parse_inventory(doc, "ansible vars of gpu1").hosts["gpu1"]
    assert (h.address, h.ssh_port, h.ssh_user, h.identity_file, h.agent_python) == (
        "10.200.9.2", 2222, "deploy", "/keys/id", "/usr/bin/python3")
    assert (h.budget, h.topk_cap, h.conflicts) == (16, 4, ("sglang-dflash.service",))


def test_ansibles_default_ansible_host_gives_way_to_the_inventorys_address():
    # Ansible sets ansible_host to the host's name when no var does: not a second address
    doc = host_inventory_doc("gpu1", {**HOSTVARS, "ansible_host": "gpu1", "address": "10.200.9.3"})
    assert parse_inventory(doc, "ansible vars of gpu1").hosts["gpu1"].address == "10.200.9.3"
    doc = host_inventory_doc("gpu1", {**HOSTVARS, "address": "10.200.9.3"})  # a real one still disagrees
    with pytest.raises(InventoryError, match="ansible_host.*disagrees with address"):
        parse_inventory(doc, "ansible vars of gpu1")


def test_ansibles_tagged_strings_are_written_as_plain_values():
    class Tagged(str):  # ansible-core 2.19's tagged values are str subclasses YAML cannot represent
        pass
    doc = host_inventory_doc(Tagged("gpu1"), {Tagged("model_path"): Tagged("/models/kimi")})
    assert yaml.safe_dump(doc) == "all:\n  hosts:\n    gpu1:\n      model_path: /models/kimi\n"


def test_a_bad_value_fails_naming_the_host_and_the_ansible_var():
    doc = host_inventory_doc("gpu1", {**HOSTVARS, "ansible_port": "twenty-two"})
    with pytest.raises(InventoryError, match=r"host 'gpu1'.*ansible_port"):
        parse_inventory(doc, "ansible vars of gpu1")
    with pytest.raises(InventoryError, match=r"gpu1.*budget.*not a value ddtree-ops reads"):
        host_inventory_doc("gpu1", {**HOSTVARS, "budget": object()})


def test_a_multinode_member_is_refused_with_a_pointer_to_the_cli():
    with pytest.raises(InventoryError, match=r"multinode.*deploy it with the ddtree-ops CLI"):
        host_inventory_doc("gpu1", {**HOSTVARS, "multinode": True, "node_rank": 0})


def test_a_relative_prompts_file_is_the_inventorys_neighbour():
    doc = host_inventory_doc("gpu1", {**HOSTVARS, "perf_gate": {"enabled": True, "prompts_file": "prompts.txt"}},
                             inventory_dir="/srv/inv")
    assert doc["all"]["hosts"]["gpu1"]["perf_gate"] == {"enabled": True, "prompts_file": "/srv/inv/prompts.txt"}


# ---------------------------------------------------------------------------------------------
# a rollout run host by host

ROUTER = {"url": "http://router.test:30000", "admin_key_env": "DDTREE_TEST_ROUTER_KEY"}


def _hosts(n: int, **all_vars):
    doc = fake_inventory(n, **all_vars)
    doc["all"]["hosts"] = {f"fh{i + 1}": {"port": 30001 + i} for i in range(n)}
    return list(parse_inventory(doc, "inv.yaml").hosts.values())


def _smg_routers(smg: FakeSmg):
    def routers(host):
        @contextlib.contextmanager
        def client():
            with smg.client(host.router, sleep=lambda s: None) as c:
                yield c
        return client()
    return routers


def test_a_batch_larger_than_max_unavailable_is_refused_before_it_leaves_service():
    hosts = _hosts(4)
    with pytest.raises(InputError, match=r"a batch of 2 \(fh2, fh3\).*max_unavailable 1 \(the default\)"):
        check_batch(hosts, ["fh2", "fh3"])
    assert "2 of at most 2" in check_batch(hosts, ["fh2", "fh3"], max_unavailable=CountOrShare(count=2))
    assert "2 of at most 2" in check_batch(hosts, ["fh2", "fh3"], max_unavailable=CountOrShare(percent=50))
    with pytest.raises(InputError, match="not one of the rollout's hosts"):
        check_batch(hosts, ["fh9"])


def test_a_batch_the_routers_pool_cannot_spare_whole_is_refused_not_split(monkeypatch):
    monkeypatch.setenv("DDTREE_TEST_ROUTER_KEY", "k-1")
    hosts = _hosts(3, router=ROUTER)
    smg = FakeSmg([h.base_url for h in hosts], key="k-1", drain_looks=0)
    routers = _smg_routers(smg)
    policy = CountOrShare(count=2)
    assert "the router keeps enough ready" in check_batch(hosts, ["fh2", "fh3"], max_unavailable=policy,
                                                          routers=routers)
    smg.unhealthy.add(hosts[0].base_url)  # fh1 is out of the pool's ready workers
    smg.workers = {}
    for h in hosts:
        smg._new(h.base_url)
    with pytest.raises(RouterPoolShort, match=r"taking fh3 out would leave 0.*make serial smaller") as e:
        check_batch(hosts, ["fh2", "fh3"], max_unavailable=policy, routers=routers, changed=True)
    assert e.value.exit_code == 1  # earlier batches ran: not "nothing changed"


def _recording():
    got: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        got.append(json.loads(request.content))
        return httpx.Response(204)
    return got, httpx.MockTransport(handle)


def test_the_webhooks_hear_one_start_and_one_finish_for_the_whole_rollout():
    hosts = _hosts(3, notify=[{"url": "https://hooks.test/x"}])
    got, transport = _recording()
    warnings: list[str] = []
    rid = start_rollout(hosts, "deploy", warnings.append, patchset="ddtree-temp", transport=transport)
    assert is_rollout_id(rid)
    rows = [{"host": "fh1", "outcome": "deployed", "exit_code": 0, "release": "r1", "message": "ok"},
            {"host": "fh2", "outcome": "rolled_back", "exit_code": 3, "release": "r0", "message": "x" * 500}]
    code = finish_rollout(hosts, "deploy", rid, rows, warnings.append, patchset="ddtree-temp", transport=transport)
    assert code == 3
    assert [d["event"] for d in got] == ["start", "finish"]
    assert {d["rollout"] for d in got} == {rid}
    assert [h["host"] for h in got[0]["hosts"]] == ["fh1", "fh2", "fh3"]
    assert got[1]["exit_code"] == 3 and [h["outcome"] for h in got[1]["hosts"]] == ["deployed", "rolled_back"]
    assert len(got[1]["hosts"][1]["message"]) == 300
    assert warnings == []


def test_an_aborted_rollout_is_told_abort_then_finish():
    hosts = _hosts(1, notify=[{"url": "https://hooks.test/x"}])
    got, transport = _recording()
    finish_rollout(hosts, "deploy", "20261204T010000Z-abcdef", [], print, aborted=True, reason="canary failed",
                   transport=transport)
    assert [(d["event"], d["reason"]) for d in got] == [("abort", "canary failed"), ("finish", "canary failed")]


# ---------------------------------------------------------------------------------------------
# the CLI flags the collection passes


@pytest.mark.parametrize("command", ["deploy", "rollback"])
def test_a_rollout_id_that_is_not_one_is_refused_before_anything_connects(tmp_path, command):
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(fake_inventory(1)))
    r = CliRunner().invoke(app, [command, "-i", str(inv), "--yes", "--rollout-id", "x; rm -rf /"])
    assert r.exit_code == 2
    assert "is not a rollout id" in r.output


# ---------------------------------------------------------------------------------------------
# the AWX and execution-environment examples


def test_the_awx_workflow_puts_an_approval_between_canary_and_promote_and_every_failure_to_the_rollback():
    doc = yaml.safe_load((REPO / "examples" / "awx" / "workflow.yml").read_text())
    tasks = doc[0]["tasks"]
    templates = {t["awx.awx.job_template"]["name"]: t["awx.awx.job_template"] for t in tasks
                 if "awx.awx.job_template" in t}
    assert {t["job_slice_count"] for t in templates.values()} == {1}  # no slicing across a router pool
    nodes = {n["identifier"]: n for t in tasks if "awx.awx.workflow_job_template" in t
             for n in t["awx.awx.workflow_job_template"]["workflow_nodes"]}

    def edges(name: str, kind: str) -> list[str]:
        return [x["identifier"] for x in nodes[name].get("related", {}).get(kind, [])]
    assert edges("canary", "success_nodes") == ["approve"]
    assert nodes["approve"]["unified_job_template"]["type"] == "workflow_approval"
    assert edges("approve", "success_nodes") == ["promote"]
    for name in ("canary", "approve", "promote"):
        assert edges(name, "failure_nodes") == ["rollback"], name
    for name in ("canary", "promote", "rollback"):
        assert nodes[name]["unified_job_template"]["name"] in templates
    for playbook, imported in (("ddtree-deploy.yml", "ddtree.ops.deploy"),
                               ("ddtree-rollback.yml", "ddtree.ops.rollback")):
        play = yaml.safe_load((REPO / "examples" / "awx" / playbook).read_text())
        assert play[0]["ansible.builtin.import_playbook"] == imported


def test_the_execution_environment_installs_the_collection_and_the_tool_as_tested():
    ee = yaml.safe_load((REPO / "examples" / "awx" / "execution-environment.yml").read_text())
    assert ee["version"] == 3
    pyproject = (REPO / "pyproject.toml").read_text()
    for dep in ("ansible_core", "ansible_runner"):  # the versions the tests run
        assert f'"{ee["dependencies"][dep]["package_pip"]}; python_version' in pyproject
    assert {f["dest"] for f in ee["additional_build_files"]} == {"collections", "wheels"}
