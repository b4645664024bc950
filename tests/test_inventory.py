"""Inventory format: precedence, validation errors that name file/host/field, host selection."""

from __future__ import annotations

import re

import pytest
import yaml

from ddtree_ops.config.inventory import load_inventory, parse_inventory, with_overrides
from ddtree_ops.config.redaction import SECRET_FLAGS
from ddtree_ops.errors import InputError, InventoryError
from kit import REPO

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
        inv({"c_t": {}})  # not a DNS name, so its name cannot stand for its address


def test_a_host_without_an_address_is_reached_at_its_name_as_ansible_does():
    assert inv({"gpu1.example.com": {}}).host("gpu1.example.com").address == "gpu1.example.com"
    assert inv({"gpu1": {"address": "10.0.0.5"}}).host("gpu1").address == "10.0.0.5"


def test_malformed_yaml_names_the_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("all:\n  hosts:\n    a: [unclosed\n")
    with pytest.raises(InventoryError, match=r"broken.yaml: not valid YAML at line \d+"):
        load_inventory(p)


def test_unknown_group_key_and_a_group_section_at_the_top_are_rejected():
    with pytest.raises(InventoryError, match="top level must be a mapping with the group 'all'"):
        parse_inventory({"hosts": {}}, "x.yaml")
    with pytest.raises(InventoryError, match="unknown keys hostz"):
        parse_inventory({"all": {"hostz": {}}}, "x.yaml")


def test_limit_takes_hosts_groups_and_globs_and_rejects_typos():
    i = inv({}, children={"east": {"hosts": {"gpu1": {"address": "10.0.0.1"}, "gpu2": {"address": "10.0.0.2"}}},
                          "west": {"hosts": {"gpu3": {"address": "10.0.0.3"}}}})
    assert [h.name for h in i.select("west")] == ["gpu3"]
    assert [h.name for h in i.select("gpu[!3]")] == ["gpu1", "gpu2"]
    # As in Ansible, NAME[N] is the N-th host NAME matches, not a glob: no 'gpu' host or group.
    assert [h.name for h in i.select("east[1]")] == ["gpu2"]
    with pytest.raises(InputError, match="'gpu\\[12\\]' matches no host or group"):
        i.select("gpu[12]")
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
    with pytest.raises(InventoryError, match="must not be in extra_args.*secrets_config") as e:
        inv({"ct": {"address": "10.0.0.1", "extra_args": ["--api-key=sk-123"]}})
    assert e.value.field == "extra_args"


# --------------------------------------------------------------------------- the schema, table-driven

# (YAML of host h1's vars, or of a group's vars with h1 in the group, host, field, fragment of the message)
VALIDATION = [
    ("h1: {address: '10.0.0.1', ssh_port: 0}", "h1", "ssh_port", "must be an integer 1..65535, got 0"),
    ("h1: {address: '10.0.0.1', ssh_port: yes}", "h1", "ssh_port", "must be an integer 1..65535, got True"),
    ("h1: {address: '10.0.0.1', ssh_user: Root}", "h1", "ssh_user", "must be a POSIX user name ([a-z_]"),
    ("h1: {address: '10.0.0.1', identity_file: id_ed25519}", "h1", "identity_file", "must be an absolute path"),
    ("h1: {address: '10.0.0.1', known_hosts: null}", "h1", "known_hosts", "is required: an absolute path"),
    ("h1: {address: '10.0.0.1', connect_timeout: 0}", "h1", "connect_timeout", "must be a number 0.5..300, got 0"),
    ("h1: {address: '10.0.0.1', connect_timeout: '5'}", "h1", "connect_timeout", "must be a number 0.5..300, got '5'"),
    ("h1: {address: '10.0.0.1', site_packages: null}", "h1", "site_packages", "is required: an absolute path"),
    ("h1: {address: '10.0.0.1', state_dir: /etc}", "h1", "state_dir", "/etc is a system directory"),
    ("h1: {address: '10.0.0.1', state_dir: /var/lib//x}", "h1", "state_dir", "must be normalised"),
    ("h1: {address: '10.0.0.1', state_dir: /var/lib}", "h1", "state_dir",
     "/var/lib is a system directory; use a dedicated directory such as /var/lib/ddtree-ops"),
    ("h1: {address: '10.0.0.1', state_dir: /usr/local/lib/systemd}", "h1", "state_dir",
     "/usr/local/lib/systemd contains the system directory /usr/local/lib/systemd/system; use a dedicated"),
    ("h1: {address: '10.0.0.1', state_dir: /etc/systemd/system}", "h1", "state_dir", "is a system directory"),
    ("h1: {address: '10.0.0.1', state_dir: /data}", "h1", "state_dir", "/data is a top-level directory"),
    ("h1: {address: '10.0.0.1', state_dir: /home/alice}", "h1", "state_dir", "/home/alice is a home directory"),
    ("h1: {address: '10.0.0.1', state_dir: /srv/py/lib/python3.12/site-packages/st}", "h1", "state_dir",
     "is inside a Python site-packages"),
    ("h1: {address: '10.0.0.1', state_dir: /opt/v}", "h1", "state_dir",
     "/opt/v contains the host's site_packages /opt/v/lib/site-packages"),
    ("h1: {address: '10.0.0.1', state_dir: /opt/v/state}", "h1", "state_dir", "is inside the host's venv /opt/v"),
    ("h1: {address: '10.0.0.1', state_dir: var/lib/ddtree-ops}", "h1", "state_dir", "must be an absolute path"),
    ("h1: {address: '10.0.0.1', state_dir: /var/lib/./x}", "h1", "state_dir", "must not contain '.' or '..'"),
    ("h1: {address: '10.0.0.1', conflicts: sglang-k26-ddtree.service}", "h1", "conflicts",
     "cannot conflict with itself"),
    ("h1: {address: '10.0.0.1', conflicts: {a: 1}}", "h1", "conflicts", "must be a list of unit names"),
    ("h1: {address: '10.0.0.1', listen_host: localhost}", "h1", "listen_host", "must be an IP address such as"),
    ("h1: {address: '10.0.0.1', base_url: 'ftp://x'}", "h1", "base_url", "must be an http(s) URL"),
    ("h1: {address: '10.0.0.1', model_path: null}", "h1", "model_path", "is required: a model directory or a model id"),
    ("h1: {address: '10.0.0.1', draft_model_path: a/../b}", "h1", "draft_model_path", "no '..' components"),
    ("h1: {address: '10.0.0.1', tp: 1025}", "h1", "tp", "must be an integer 1..1024, got 1025"),
    ("h1: {address: '10.0.0.1', budget: 8, topk_cap: 9}", "h1", "topk_cap", "must be an integer 1..budget (8), got 9"),
    ("h1: {address: '10.0.0.1', budget: 1.5}", "h1", "budget", "must be an integer 1..1024, got 1.5"),
    ("h1: {address: '10.0.0.1', extra_args: [[1]]}", "h1", "extra_args", "each argument must be a string, got [1]"),
    # YAML 1.1 turned an unquoted word into something else: refused with the field named, saying to quote it.
    ("h1: {address: '10.0.0.1', environment: {CUDA_VISIBLE_DEVICES: 010}}", "h1", "environment",
     "CUDA_VISIBLE_DEVICES: value must be a string, got 8 (YAML reads an unquoted number as one: 010 is 8"),
    ("h1: {address: '10.0.0.1', environment: {X: yes}}", "h1", "environment",
     "X: value must be a string, got True (YAML reads unquoted yes/no/on/off/true/false as a boolean: quote"),
    ("h1: {address: '10.0.0.1', environment: {X: 1.0}}", "h1", "environment", "X: value must be a string, got 1.0"),
    ("h1: {address: '10.0.0.1', environment: {X: }}", "h1", "environment", "got None (write it in quotes)"),
    ("h1: {address: '10.0.0.1', extra_args: [--max-running-requests, 010]}", "h1", "extra_args",
     "each argument must be a string, got 8 (YAML reads an unquoted number"),
    ("h1: {address: '10.0.0.1', unit: 123}", "h1", "unit", "must be a systemd unit name such as sglang.service, "
                                                          "got 123 (YAML reads an unquoted number"),
    ("h1: {address: '10.0.0.1', conflicts: [no]}", "h1", "conflicts", "got False (YAML reads unquoted yes/no"),
    ("h1: {address: '10.0.0.1', ssh_user: no}", "h1", "ssh_user", "got False (YAML reads unquoted yes/no"),
    ("h1: {address: '10.0.0.1', python: 3.12}", "h1", "python", "must be an absolute path, got 3.12 (YAML reads"),
    ("h1: {address: '10.0.0.1', listen_host: 0}", "h1", "listen_host", "got 0 (YAML reads an unquoted number"),
    ("h1: {address: '10.0.0.1', model_path: 2024-01-02}", "h1", "model_path",
     "got datetime.date(2024, 1, 2) (YAML reads an unquoted 2024-01-02 as a date: quote"),
    ("h1: {address: '10.0.0.1', health: {generate_prompt: off}}", "h1", "health.generate_prompt",
     "must be a non-empty string, got False (YAML reads unquoted"),
    ("h1: {address: 1:30}", "h1", "address", "got 90 (YAML reads an unquoted number as one"),
    ("h1: {address: '10.0.0.1', environment: [A]}", "h1", "environment", "must be a mapping NAME: value"),
    ("h1: {address: '10.0.0.1', environment: {1A: x}}", "h1", "environment", "variable name '1A' is not valid"),
    ("h1: {address: '10.0.0.1', environment: {A: '50%'}}", "h1", "environment", "must not contain"),
    ("h1: {address: '10.0.0.1', environment: {HF_TOKEN: x}}", "h1", "environment",
     "HF_TOKEN: looks like a secret"),
    ("h1: {address: '10.0.0.1', extra_args: ['--api-ke=sk-1']}", "h1", "extra_args",
     "--api-ke must not be in extra_args"),
    ("h1: {address: '10.0.0.1', service_user: null}", "h1", "service_user", "must be a POSIX user name"),
    ("h1: {address: '10.0.0.1', template: unit.tmpl}", "h1", "template", "ending in .j2"),
    ("h1: {address: '10.0.0.1', keep_releases: 0}", "h1", "keep_releases", "must be an integer 1..100, got 0"),
    ("h1: {address: '10.0.0.1', min_free_mb: -1}", "h1", "min_free_mb", "must be an integer 0..10000000, got -1"),
    ("h1: {address: '10.0.0.1', secrets_config: /etc/sglang/k.yaml, api_key_env: 1KEY}", "h1", "api_key_env",
     "the environment variable that holds the API key"),
    ("h1: {address: '10.0.0.1', environment_file: keys.env}", "h1", "environment_file", "must be an absolute path"),
    ("h1: {address: '10.0.0.1', health: 5}", "h1", "health", "must be a mapping of consecutive_successes"),
    ("h1: {address: '10.0.0.1', health: {bogus: 1}}", "h1", "health.bogus",
     "unknown key; allowed: consecutive_successes"),
    ("h1: {address: '10.0.0.1', health: {load_deadline_s: 0}}", "h1", "health.load_deadline_s",
     "must be a number 1..86400, got 0"),
    ("h1: {address: '10.0.0.1', health: {consecutive_successes: 2.0}}", "h1", "health.consecutive_successes",
     "must be an integer 1..100, got 2.0"),
    ("h1: {address: '10.0.0.1', health: {generate_prompt: ''}}", "h1", "health.generate_prompt", "non-empty string"),
    ("h1: {address: '10.0.0.1', health: {generate_max_new_tokens: 4097}}", "h1", "health.generate_max_new_tokens",
     "must be an integer 1..4096, got 4097"),
    ("h1: {address: '10.0.0.1', health: {min_accept_length: -1}}", "h1", "health.min_accept_length",
     "must be a number 0..1025, got -1"),
    # Without address/ansible_host a host is reached at its name, as Ansible does; 'h_1' is no DNS name.
    ("h_1: {}", "h_1", "address", "is required: an IP address or DNS name"),
    ("h1: {address: 7}", "h1", "address", "must be an IP address or DNS name, got 7"),
    ("h1: {address: '10.0.0.1', budgett: 8}", "h1", "budgett", "unknown key in host vars; allowed: address,"),
    # Group vars: the host that inherits the bad value is named.
    ("GROUP {port: 0}", "h1", "port", "must be an integer 1..65535, got 0"),
    ("GROUP {health: {poll_interval_s: 100}}", "h1", "health.poll_interval_s", "must be a number 0.05..60, got 100"),
    ("GROUP {budgett: 8}", "h1", "budgett", "unknown key in group gpu vars"),
]


def _inventory_text(snippet: str) -> str:
    head = ("all:\n  vars: {python: /opt/v/bin/python, site_packages: /opt/v/lib/site-packages, "
            "model_path: /m, draft_model_path: /d}\n  children:\n    gpu:\n")
    if snippet.startswith("GROUP "):
        return head + f"      vars: {snippet[len('GROUP '):]}\n      hosts: {{h1: {{address: 10.0.0.1}}}}\n"
    return head + f"      hosts:\n        {snippet}\n"


@pytest.mark.parametrize("snippet, host, field, fragment", VALIDATION)
def test_each_row_of_the_schema_is_enforced_with_file_host_field_and_what_is_allowed(tmp_path, snippet, host, field,
                                                                                  fragment):
    p = tmp_path / "inv.yaml"
    p.write_text(_inventory_text(snippet))
    with pytest.raises(InventoryError) as e:
        load_inventory(p)
    assert (e.value.file, e.value.host, e.value.field) == (str(p), host, field)
    assert str(e.value).startswith(f"{p}: host '{host}': field '{field}': ")
    assert fragment in e.value.problem


def test_the_table_snippets_are_valid_once_the_bad_value_is_gone(tmp_path):
    """The control for the table above: the surrounding inventory loads."""
    p = tmp_path / "inv.yaml"
    p.write_text(_inventory_text("h1: {address: '10.0.0.1', health: {min_accept_length: 2.5}}"))
    h = load_inventory(p).host("h1")
    assert h.health.min_accept_length == 2.5 and h.groups == ("gpu",)
    p.write_text(_inventory_text("GROUP {port: 31000}"))
    assert load_inventory(p).host("h1").base_url == "http://10.0.0.1:31000"


def test_every_host_field_has_one_schema_row_and_every_row_a_host_field():
    from dataclasses import fields as dc_fields

    from ddtree_ops.config.inventory import HOST_FIELDS, Host

    resolved_later = {"name", "groups", "source", "server", "node_rank", "nnodes", "dist_init_addr", "perf_gate"}
    rows = {f.attr or f.name for f in HOST_FIELDS if f.check is not None}
    assert rows == {f.name for f in dc_fields(Host)} - resolved_later
    assert len({f.name for f in HOST_FIELDS}) == len(HOST_FIELDS)


def test_defaults_come_from_the_table():
    from ddtree_ops.config.inventory import HOST_FIELDS

    h = inv({"a": {"address": "10.0.0.1"}}).host("a")
    for f in HOST_FIELDS:
        if f.check is not None and f.required is None and not callable(f.default) and f.name not in (
                "known_hosts", "health"):
            got = getattr(h, f.attr or f.name)
            assert got == (tuple(f.default) if isinstance(f.default, (list, tuple, dict)) else f.default), f.name


def test_group_health_settings_merge_key_by_key():
    i = inv({"a": {"address": "10.0.0.1", "health": {"poll_interval_s": 3}}},
            {"health": {"poll_interval_s": 1, "consecutive_successes": 5}})
    assert (i.host("a").health.poll_interval_s, i.host("a").health.consecutive_successes) == (3.0, 5)


@pytest.mark.parametrize("flag", SECRET_FLAGS)
@pytest.mark.parametrize("form", ["{flag}=s3cret", "{flag} s3cret"])
def test_every_secret_flag_of_the_one_list_is_refused_in_extra_args(flag, form):
    with pytest.raises(InventoryError) as e:
        inv({"ct": {"address": "10.0.0.1", "extra_args": form.format(flag=flag)}})
    assert e.value.field == "extra_args" and f"{flag} must not be in extra_args" in str(e.value)
    assert "s3cret" not in str(e.value)


def test_one_range_check_serves_inventory_command_line_and_render(monkeypatch):
    """with_overrides, the render-time re-check and the inventory all go through schema.check_int."""
    from dataclasses import replace

    from ddtree_ops.artifacts.units import render_unit
    from ddtree_ops.config import schema

    h = inv({"a": {"address": "10.0.0.1"}}).host("a")
    calls = []
    real = schema.check_int
    monkeypatch.setattr(schema, "check_int", lambda v, lo, hi, **kw: calls.append((v, lo, hi)) or real(v, lo, hi, **kw))
    inv({"b": {"address": "10.0.0.2", "budget": 33}})
    assert (33, 1, 1024) in calls
    calls.clear()
    with_overrides(h, budget=77)
    assert (77, 1, 1024) in calls
    calls.clear()
    with pytest.raises(InputError, match="field 'tp': must be an integer 1..1024, got 0"):
        render_unit(replace(h, tp=0))
    assert (0, 1, 1024) in calls


# --------------------------------------------------------------------------- hardened input

@pytest.mark.parametrize("state_dir", ["/var/lib/ddtree-ops", "/srv/ddtree-ops", "/opt/ddtree-ops/state",
                                       "/home/alice/ddtree-ops", "/root/ddtree-ops", "/var/lib/ddtree-ops/ct200"])
def test_a_dedicated_state_dir_is_accepted(state_dir):
    assert inv({"a": {"address": "10.0.0.1", "state_dir": state_dir}}).host("a").state_dir == state_dir


def test_every_system_directory_and_every_folder_above_one_is_refused_as_state_dir():
    from ddtree_ops.config.inventory import SYSTEM_DIRS

    above = {d.rsplit("/", k)[0] or "/" for d in SYSTEM_DIRS for k in range(1, d.count("/") + 1)}
    assert {"/", "/etc", "/usr", "/usr/lib", "/var", "/var/lib", "/tmp", "/run", "/home", "/root", "/opt",
            "/etc/systemd/system", "/usr/local/lib"} <= set(SYSTEM_DIRS) | above
    for d in set(SYSTEM_DIRS) | above:
        with pytest.raises(InventoryError) as e:
            inv({"a": {"address": "10.0.0.1", "state_dir": d}})
        assert e.value.field == "state_dir" and "use a dedicated directory such as /var/lib/ddtree-ops" in str(e.value)


def test_state_dir_may_not_hold_or_sit_in_the_hosts_venv_or_site_packages():
    venv = {"python": "/srv/sgl/bin/python", "site_packages": "/srv/sgl/lib/python3.12/site-packages"}
    for d, problem in [("/srv/sgl", "contains the host's site_packages"), ("/srv/sgl/state", "inside the host's venv"),
                       ("/srv/sgl/lib/python3.12/site-packages/x", "inside a Python site-packages")]:
        with pytest.raises(InventoryError, match=problem):
            inv({"a": {"address": "10.0.0.1", "state_dir": d, **venv}})
    # An interpreter outside a venv (/usr/bin/python3) makes no folder the venv.
    h = inv({"a": {"address": "10.0.0.1", "python": "/usr/bin/python3",
                   "site_packages": "/usr/lib/python3/dist-packages"}}).host("a")
    assert h.state_dir == "/var/lib/ddtree-ops"


@pytest.mark.parametrize("field, value", [
    ("unit", "x" * 100_000 + ".service"),
    ("model_path", "/" + "m" * 100_000 + " space"),
    ("budget", list(range(100_000))),
    ("environment", {"A": ["x" * 100_000] * 1000}),
    ("extra_args", ["--ok", "$" * 100_000]),
    ("bogus" * 10_000, 1),
])
def test_a_value_quoted_in_a_message_is_cut_to_80_characters(field, value):
    from ddtree_ops.config.inventory import HOST_FIELDS

    with pytest.raises(InventoryError) as e:
        inv({"ct": {"address": "10.0.0.1", field: value}})
    # An unknown key's message lists the allowed keys, which grow with the schema: not counted.
    allowed = ", ".join(sorted(f.name for f in HOST_FIELDS))
    assert len(str(e.value).replace(allowed, "")) < 600 and "…" in str(e.value)


def test_a_long_host_name_is_cut_in_the_message():
    with pytest.raises(InventoryError, match="host names use") as e:
        inv({"h" * 100_000: {"address": "10.0.0.1"}})
    assert len(str(e.value)) < 300 and "…" in str(e.value)


def test_quoted_strings_where_yaml_1_1_would_guess_are_kept_as_written(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text(_inventory_text("h1: {address: '10.0.0.1', environment: {CUDA_VISIBLE_DEVICES: '010', X: 'yes', "
                                 "Y: '1.0'}, extra_args: ['--max-running-requests', '010'], ssh_user: 'no'}"))
    h = load_inventory(p).host("h1")
    assert h.environment == (("CUDA_VISIBLE_DEVICES", "010"), ("X", "yes"), ("Y", "1.0"))
    assert h.extra_args == ("--max-running-requests", "010") and h.ssh_user == "no"


@pytest.mark.parametrize("text, where, fragment", [
    ("all:\n  hosts:\n    010: {address: 10.0.0.1}\n", "host '8'", "a host name must be a string, got 8: quote it"),
    ("all:\n  hosts:\n    yes: {address: 10.0.0.1}\n", "host 'True'", "a host name must be a string, got True: quote"),
    ("all:\n  children:\n    on: {hosts: {a: {address: 10.0.0.1}}}\n", "field 'group True'",
     "a group name must be a string, got True"),
])
def test_a_host_or_group_name_yaml_turned_into_a_number_or_boolean_is_refused(tmp_path, text, where, fragment):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    with pytest.raises(InventoryError, match=f"^{p}: {where}: {re.escape(fragment)}"):
        load_inventory(p)
