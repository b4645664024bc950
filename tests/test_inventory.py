"""Inventory format: precedence, validation errors that name file/host/field, host selection."""

from __future__ import annotations

import pytest
import yaml

from kit import REPO
from ddtree_ops.errors import InputError, InventoryError
from ddtree_ops.inventory import load_inventory, parse_inventory, with_overrides

BASE = {"python": "/opt/v/bin/python", "site_packages": "/opt/v/lib/python3.12/site-packages",
        "model_path": "/models/m", "draft_model_path": "/models/d"}


def inv(hosts: dict, all_vars: dict | None = None, children: dict | None = None):
    doc = {"all": {"vars": {**BASE, **(all_vars or {})}, "hosts": hosts}}
    if children:
        doc["all"]["children"] = children
    return parse_inventory(doc, "inv.yaml")


def test_ct200_inventory_describes_the_production_host():
    i = load_inventory(REPO / "inventory" / "ct200.yaml")
    h = i.host("ct200")
    assert h.address.endswith(".invalid")  # resolves nowhere
    assert h.site_packages == "/root/venv_sglang211/lib/python3.12/site-packages"
    assert (h.unit, h.conflicts, h.tp) == ("sglang-k26-ddtree.service", ("sglang-k26-dflash-cg.service",), 8)


def test_host_vars_beat_child_group_vars_beat_parent_group_vars_beat_all():
    i = inv({}, {"port": 1000, "tp": 2, "budget": 8, "topk_cap": 2},
            {"gpu": {"vars": {"port": 2000, "tp": 4}, "children": {
                "kimi": {"vars": {"port": 3000}, "hosts": {"a": {"address": "10.0.0.1", "port": 4000},
                                                           "b": {"address": "10.0.0.2"}}}}}})
    a, b = i.host("a"), i.host("b")
    assert (a.port, a.tp, a.budget) == (4000, 4, 8)
    assert (b.port, b.tp, b.budget) == (3000, 4, 8)
    assert i.groups["gpu"] == ("a", "b") and set(a.groups) == {"gpu", "kimi"}


def test_base_url_defaults_to_address_and_port():
    h = inv({"a": {"address": "10.0.0.9", "port": 31000}}).host("a")
    assert h.base_url == "http://10.0.0.9:31000"


@pytest.mark.parametrize("field, value, problem", [
    ("unit", "evil;rm -rf /.service", "not a valid systemd unit name"),
    ("unit", "sglang.socket", "must be a .service unit"),
    ("conflicts", ["ok.service", "bad name.service"], "not a valid systemd unit name"),
    ("site_packages", "/opt/my venv/site-packages", "must not contain spaces"),
    ("site_packages", "/opt/v/../../etc", "'..'"),
    ("python", "/opt/v/bin/python\nExecStartPre=/bin/sh", "control characters"),
    ("python", "bin/python", "absolute path"),
    ("state_dir", "/", "system directory"),
    ("budget", "16; rm -rf /", "must be an integer 1..1024"),
    ("budget", 0, "must be an integer 1..1024"),
    ("budget", 1025, "must be an integer 1..1024"),
    ("budget", True, "must be an integer"),
    ("topk_cap", 17, "1..budget (16)"),
    ("port", 70000, "1..65535"),
    ("ssh_port", "22", "must be an integer"),
    ("extra_args", ["--ok", "$(reboot)"], "characters outside"),
    ("model_path", "/models/`id`", "must use only"),
    ("environment", {"A": "x\ny"}, "control characters"),
    ("address", "host name with spaces", "neither an IP address nor a DNS name"),
    ("launch_module", "sglang.launch_server; rm", "dotted Python module name"),
    ("bogus_key", 1, "unknown key"),
])
def test_bad_values_are_rejected_naming_file_host_and_field(field, value, problem):
    with pytest.raises(InventoryError) as e:
        inv({"ct": {"address": "10.0.0.1", "budget": 16, field: value}})
    assert e.value.file == "inv.yaml" and e.value.host == "ct"
    assert e.value.field == field
    assert problem in str(e.value)
    assert str(e.value).startswith("inv.yaml: host 'ct': field ")


def test_missing_required_field_is_named():
    with pytest.raises(InventoryError, match="field 'address': is required"):
        inv({"ct": {}})


def test_malformed_yaml_names_the_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("all:\n  hosts:\n    a: [unclosed\n")
    with pytest.raises(InventoryError, match=r"broken.yaml: not valid YAML at line \d+"):
        load_inventory(p)


def test_unknown_group_key_and_missing_all_are_rejected():
    with pytest.raises(InventoryError, match="top level must be a mapping with the group 'all'"):
        parse_inventory({"hosts": {}}, "x.yaml")
    with pytest.raises(InventoryError, match="unknown keys hostz"):
        parse_inventory({"all": {"hostz": {}}}, "x.yaml")


def test_limit_takes_hosts_groups_and_globs_and_rejects_typos():
    i = inv({}, children={"east": {"hosts": {"gpu1": {"address": "10.0.0.1"}, "gpu2": {"address": "10.0.0.2"}}},
                          "west": {"hosts": {"gpu3": {"address": "10.0.0.3"}}}})
    assert [h.name for h in i.select("west")] == ["gpu3"]
    assert [h.name for h in i.select("gpu[12]")] == ["gpu1", "gpu2"]
    assert [h.name for h in i.select("gpu3,east")] == ["gpu1", "gpu2", "gpu3"]
    assert len(i.select(None)) == 3
    with pytest.raises(InputError, match="matches no host or group"):
        i.select("gpu9")


def test_command_line_budget_and_topk_are_validated_like_inventory_values():
    h = inv({"a": {"address": "10.0.0.1"}}).host("a")
    assert with_overrides(h, budget=64, topk_cap=8).budget == 64
    with pytest.raises(InputError, match="--topk-cap must be an integer 1..budget \\(8\\)"):
        with_overrides(h, budget=8, topk_cap=9)
    with pytest.raises(InputError, match="--budget"):
        with_overrides(h, budget=0)


def test_sandbox_inventory_shape_round_trips_through_yaml(tmp_path):
    doc = {"all": {"vars": BASE, "children": {"g": {"hosts": {"h1": {"address": "10.200.1.2"}}}}}}
    p = tmp_path / "i.yaml"
    p.write_text(yaml.safe_dump(doc))
    assert load_inventory(p).host("h1").address == "10.200.1.2"


def test_an_api_key_in_extra_args_is_refused_with_the_way_to_do_it():
    with pytest.raises(InventoryError, match="must not be in extra_args.*environment_file") as e:
        inv({"ct": {"address": "10.0.0.1", "extra_args": ["--api-key=sk-123"]}})
    assert e.value.field == "extra_args"
