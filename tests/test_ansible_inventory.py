"""Ansible inventories as they are: YAML and INI files with group_vars/ and host_vars/ read to the
same hosts and vars as `ansible-inventory --list`, and `--limit` selecting what Ansible's own
pattern matching selects, on the same files (tests/data/ansible/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.config.ansible_ini import parse_ini_value
from ddtree_ops.config.ansible_vars import ALIASES
from ddtree_ops.config.host_patterns import HostPatternError, expand_host_entry
from ddtree_ops.config.inventory import AGENT_PYTHON, HOST_FIELDS, Inventory, load_inventory
from ddtree_ops.config.limit_patterns import split_patterns
from ddtree_ops.errors import EXIT_BAD_INPUT, InputError, InventoryError
from kit import run_cli

DATA = Path(__file__).parent / "data" / "ansible"
YAML_INV = DATA / "yaml" / "inventory.yml"
INI_INV = DATA / "ini" / "hosts"
ALIAS_OF = {name: key for key, names in ALIASES.items() for name in names}
ATTR_OF = {f.name: f.attr or f.name for f in HOST_FIELDS}
BASE_VARS = ("python: /opt/v/bin/python\n    site_packages: /opt/v/lib/site-packages\n"
             "    model_path: /m\n    draft_model_path: /d\n")


@pytest.fixture(scope="module", autouse=True)
def ansible_patches_undone():
    """Importing ansible-core (ansible_limit, in this process) replaces three functions for the
    whole process: `sys.intern`, `socket.getaddrinfo` and `dataclasses._is_type` (its
    module_utils/_internal/_patches). They are put back when this file is done, as the rest of
    an xdist worker's files expect the builtins: with ansible's `sys.intern` left in place, the
    first meta-device operation of a later file (tests/payload/test_tree_step_cpu.py) imports
    torch._dynamo, whose polyfill of `sys.intern` raises TypeError on a non-builtin, and the
    tensor comparison running it turns that TypeError into "'<=' not supported between
    instances of 'Tensor' and 'int'" (about 3 full runs in 10: those where xdist gave one worker
    this file, then that one, with no torch._dynamo import in between)."""
    import dataclasses
    import socket

    saved = [(sys, "intern", sys.intern), (socket, "getaddrinfo", socket.getaddrinfo),
             (dataclasses, "_is_type", dataclasses._is_type)]
    yield
    for module, name, original in saved:
        setattr(module, name, original)


@pytest.fixture(scope="module")
def ansible_env(tmp_path_factory):
    """Ansible confined to a scratch home, reading no ansible.cfg from the machine or the checkout."""
    home = tmp_path_factory.mktemp("ansible-home")
    (home / "ansible.cfg").write_text("")
    env = {"ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
           "ANSIBLE_CONFIG": str(home / "ansible.cfg"), "ANSIBLE_HOST_PATTERN_MISMATCH": "ignore",
           "ANSIBLE_DEPRECATION_WARNINGS": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield {"env": {**os.environ}, "cwd": home}
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def listed(ansible_env) -> dict[Path, dict]:
    """`ansible-inventory -i FILE --list` of both fixtures, run side by side (each is seconds of imports)."""
    tool = Path(sys.executable).parent / "ansible-inventory"
    runs = {p: subprocess.Popen([str(tool), "-i", str(p), "--list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=ansible_env["env"], cwd=ansible_env["cwd"], stdin=subprocess.DEVNULL)
            for p in (YAML_INV, INI_INV)}
    out = {}
    for p, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        out[p] = json.loads(stdout)
    return out


# ---------------------------------------------------------------------------------------------
# hosts and vars against ansible-inventory --list


def _expected(key: str, value: Any) -> Any:
    """Ansible's resolved value as the Host field holds it."""
    if key == "ansible_python_interpreter" and str(value).startswith("auto"):
        return AGENT_PYTHON
    if key in ("ansible_ssh_private_key_file", "ansible_private_key_file", "known_hosts"):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _group_members(listed: dict, group: str) -> set[str]:
    entry = listed.get(group, {})
    found = set(entry.get("hosts", ()))
    for child in entry.get("children", ()):
        found |= _group_members(listed, child)
    return found


def differences(inv: Inventory, listed: dict) -> tuple[list[str], set[str]]:
    """What our reading of the file says otherwise than Ansible's, and which vars were compared."""
    out: list[str] = []
    compared: set[str] = set()
    hostvars = listed["_meta"]["hostvars"]
    if set(hostvars) != set(inv.hosts):
        out.append(f"hosts: ansible {sorted(hostvars)}, ours {sorted(inv.hosts)}")
    for name, hv in hostvars.items():
        host = inv.hosts.get(name)
        if host is None:
            continue
        if not {"ansible_host", "address"} & set(hv) and host.address != name:
            out.append(f"{name}: no address given, ours {host.address!r} instead of the host's name")
        for key, value in hv.items():
            if key.startswith("ansible_") and key not in ALIAS_OF:
                continue  # Ansible's business
            ours = getattr(host, ATTR_OF[ALIAS_OF.get(key, key)])
            if isinstance(value, dict):  # a settings table: the keys Ansible shows
                ours = {k: getattr(ours, k) for k in value}
            compared.add(key)
            if ours != _expected(key, value):
                out.append(f"{name}.{key}: ansible {value!r}, ours {ours!r}")
    for group in set(listed) - {"_meta"}:
        if _group_members(listed, group) != set(inv.groups.get(group, ())):
            out.append(f"group {group}: ansible {sorted(_group_members(listed, group))}, "
                       f"ours {sorted(inv.groups.get(group, ()))}")
    return out, compared


@pytest.mark.parametrize("path", [YAML_INV, INI_INV], ids=["yaml", "ini"])
def test_hosts_groups_and_resolved_vars_match_ansible_inventory_list(path, listed):
    inv = load_inventory(path)
    diffs, compared = differences(inv, listed[path])
    assert diffs == []
    # Not vacuous: every mapped Ansible var the file uses and our own keys from every layer were compared.
    assert {"ansible_host", "ansible_port", "ansible_user", "ansible_python_interpreter", "port", "tp", "budget",
            "unit", "extra_args", "known_hosts"} <= compared


def test_a_value_we_read_differently_from_ansible_is_reported(listed):
    """The control for the comparison: one field changed, one host dropped from a group."""
    inv = load_inventory(YAML_INV)
    wrong = replace(inv, hosts={**inv.hosts, "gpu02": replace(inv.hosts["gpu02"], budget=16)},
                    groups={**inv.groups, "east": ("gpu01",)})
    diffs, _ = differences(wrong, listed[YAML_INV])
    assert any(d.startswith("gpu02.budget: ansible 12, ours 16") for d in diffs)
    assert any(d.startswith("group east:") for d in diffs)


def test_the_precedence_cases_the_yaml_fixture_exists_for():
    """Where a simpler rule (file order, nearest group wins) reads these files otherwise than Ansible."""
    h = load_inventory(YAML_INV).hosts
    assert h["gpu02"].budget == 12  # canary, fleet, zeta share a depth: by name, zeta last
    assert h["gpu03"].budget == 10  # alpha's ansible_group_priority 5 puts it after fleet
    assert h["gpu01"].tp == 2  # group_vars/all.yml over fleet's inline vars
    assert h["gpu01"].ssh_port == 2201  # group_vars/east/ over east's inline ansible_port
    assert h["gpu01"].port == 34000 and h["gpu01"].identity_file == "/etc/ddtree-ops/keys/gpu01"  # host_vars/
    assert h["gpu04"].min_free_mb == 256  # group_vars/west.yml; west.yaml (bogus_key) never read
    assert h["lone.example.com"].address == "lone.example.com"
    assert h["gpu02"].groups == ("fleet", "east", "canary", "zeta")


# ---------------------------------------------------------------------------------------------
# --limit against Ansible's own pattern matching

PATTERNS = [
    "all", "*", "fleet", "east", "gpu0*", "gpu0?", "gpu0[!2]", "*.example.com", "solo", "ungrouped",
    "fleet:!east", "fleet,!gpu02", "!east", "&west", "east:&canary", "fleet:&~gpu0[34]", "~gpu0[12]",
    "~.*4$", "east[0]", "fleet[1:]", "fleet[0:1]", "fleet[-1]", "gpu01:gpu03", "gpu01, gpu03", "*[0]",
    "west:east:!gpu03",
    # Ansible selects nothing (it warns): refused here, naming the pattern.
    "nosuch", "east:&bare", "!all", "gpu0[1:2]", "gpu01:22", "fleet[9]", "~gpu9",
]


@pytest.fixture(scope="module")
def ansible_limit(ansible_env):
    """--limit as ansible-playbook applies it: InventoryManager.subset on the play's `all`."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    managers = {p: InventoryManager(loader=DataLoader(), sources=[str(p)]) for p in (YAML_INV, INI_INV)}

    def select(path: Path, limit: str) -> set[str]:
        im = managers[path]
        im.subset(limit)
        try:
            return {h.name for h in im.get_hosts("all")}
        except AnsibleError:  # a subscript past the end: Ansible refuses too
            return set()
        finally:
            im.subset(None)
            im.clear_pattern_cache()
    return select


@pytest.mark.parametrize("path", [YAML_INV, INI_INV], ids=["yaml", "ini"])
def test_limit_selects_what_ansibles_pattern_matching_selects(path, ansible_limit):
    inv = load_inventory(path)
    refused = []
    for pattern in PATTERNS:
        theirs = ansible_limit(path, pattern)
        try:
            ours = {h.name for h in inv.select(pattern)}
        except InputError as e:
            assert not theirs, f"{pattern!r}: ansible {sorted(theirs)}, ours refused: {e}"
            assert repr(pattern) in str(e) or any(repr(p) in str(e) for p in split_patterns(pattern))
            refused.append(pattern)
            continue
        assert ours == theirs, f"{pattern!r}: ansible {sorted(theirs)}, ours {sorted(ours)}"
    # The control: the patterns Ansible matches nothing with are exactly the ones refused.
    assert set(refused) >= {"nosuch", "east:&bare", "!all", "gpu0[1:2]", "fleet[9]"}
    assert "fleet" not in refused and len(refused) < len(PATTERNS) // 2


def test_limit_keeps_inventory_order_and_refuses_what_names_nothing():
    inv = load_inventory(YAML_INV)
    assert [h.name for h in inv.select("gpu04,gpu01")] == ["gpu01", "gpu04"]
    for bad, fragment in [(",", "names no host pattern"), ("!", "names no host or group"),
                          ("~gpu(", "not a valid regular expression"), ("@retry.txt", "(@FILE) is not supported"),
                          ("east[5]", "positions 0..1")]:
        with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            inv.select(bad)


# ---------------------------------------------------------------------------------------------
# the Ansible names of our keys


def _write(tmp_path: Path, text: str, name: str = "inv.yml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_both_names_of_one_setting_with_different_values_are_refused_naming_both(tmp_path):
    p = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}    ssh_user: deploy\n"
                         "  hosts:\n    h1: {ansible_host: 10.0.0.1, ansible_user: ops}\n")
    with pytest.raises(InventoryError) as e:
        load_inventory(p)
    assert e.value.host == "h1" and e.value.field == "ansible_user"
    assert "'ops' (host vars) disagrees with ssh_user 'deploy' (group all vars)" in e.value.problem
    assert e.value.exit_code == EXIT_BAD_INPUT
    # The control: the same value under both names is one setting.
    p.write_text(p.read_text().replace("ansible_user: ops", "ansible_user: deploy"))
    assert load_inventory(p).host("h1").ssh_user == "deploy"


def test_the_cli_exits_2_naming_both_names(tmp_path):
    p = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}  hosts:\n"
                         "    h1: {address: 10.0.0.1, ansible_host: 10.0.0.2}\n")
    r = run_cli("render", "--no-verify", "--host", "h1", "-i", str(p))
    assert r.code == EXIT_BAD_INPUT, r.stderr
    assert "ansible_host" in r.stderr and "address '10.0.0.1'" in r.stderr and "Traceback" not in r.stderr


def test_ansible_vars_we_do_not_use_are_ignored_and_our_typos_still_refused(tmp_path):
    p = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}    ansible_become: true\n    ansible_connection: ssh\n"
                         "  hosts:\n    h1: {ansible_host: 10.0.0.1, ansible_python_interpreter: auto}\n")
    h = load_inventory(p).host("h1")
    assert (h.address, h.agent_python) == ("10.0.0.1", AGENT_PYTHON)
    p.write_text(p.read_text().replace("ansible_connection: ssh", "ansibel_connection: ssh"))
    with pytest.raises(InventoryError, match="field 'ansibel_connection': unknown key in group all vars"):
        load_inventory(p)


def test_an_ansible_name_with_a_bad_value_is_named_as_written(tmp_path):
    p = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}  hosts:\n"
                         "    h1: {ansible_host: 10.0.0.1, ansible_port: 70000}\n")
    with pytest.raises(InventoryError, match="field 'ansible_port': must be an integer 1..65535"):
        load_inventory(p)
    p.write_text(p.read_text().replace("70000", "'2222'"))  # Ansible takes a port as text
    assert load_inventory(p).host("h1").ssh_port == 2222


def test_a_jinja_template_in_a_value_we_use_is_refused(tmp_path):
    p = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}  hosts:\n"
                         "    h1: {ansible_host: '{{ inventory_hostname }}.lan'}\n")
    with pytest.raises(InventoryError, match="field 'ansible_host': .* is a Jinja template"):
        load_inventory(p)
    p.write_text(p.read_text().replace("'{{ inventory_hostname }}.lan'", "h1.lan"))
    assert load_inventory(p).host("h1").address == "h1.lan"


# ---------------------------------------------------------------------------------------------
# reading the files: what is refused, and how the message says where


def test_ini_values_are_python_literals_or_text_as_ansible_reads_them():
    assert [parse_ini_value(v) for v in ("8", "True", "[1, 2]", "'x y'", "10.0.0.1", "/usr/bin/python3", "0x10",
                                         "(1, 2)", "b'k'")] == [8, True, [1, 2], "x y", "10.0.0.1",
                                                                "/usr/bin/python3", 16, [1, 2], "k"]


@pytest.mark.parametrize("text, fragment", [
    ("[gpu]\nh1 budget\n", "line 2: expected KEY=VALUE after the host name, got 'budget'"),
    ("[gpu:hosts2]\nh1\n", "line 1: section [gpu:hosts2] has an unknown type"),
    ("[gpu]\nh1\n[all:children]\nnope\n", "line 4: section [all:children] names the group 'nope'"),
    ("[gpu:vars]\nbudget=8\n", "line 1: section [gpu:vars] is for a group that has no [gpu]"),
    ("[gpu]\nh[01:3]\n", "line 2: host entry 'h[01:3]': a zero-padded range needs BEGIN and END of one width"),
    ("[gpu]\nh[0:99999]\n", "line 2: host entry 'h[0:99999]' expands to more than 4096 hosts"),
    ("[gpu]\nh1 budget=8\n[east]\nh1 budget=16\n", "field 'budget': line 4: the host is defined twice"),
    ("[gp u]\nh1\n", "line 1: '[gp u]' is not a section"),
])
def test_ini_mistakes_name_the_line(tmp_path, text, fragment):
    p = _write(tmp_path, text, "hosts.ini")
    with pytest.raises(InventoryError) as e:
        load_inventory(p)
    assert fragment in str(e.value) and str(e.value).startswith(str(p))


def test_the_ini_mistakes_above_load_once_corrected(tmp_path):
    p = _write(tmp_path, "[gpu]\nh[01:03] budget=8\n[east]\nh01 budget=8\n[fleet:children]\ngpu\neast\n"
                         "[all:vars]\n" + BASE_VARS.replace(": ", "=").replace("    ", ""), "hosts.ini")
    inv = load_inventory(p)
    assert list(inv.hosts) == ["h01", "h02", "h03"] and inv.groups["fleet"] == ("h01", "h02", "h03")


def test_host_entries_expand_ranges_and_ports_like_ansible():
    assert expand_host_entry("gpu[01:03]") == (["gpu01", "gpu02", "gpu03"], None)
    assert expand_host_entry("db[a:c]-[1:2]:2222") == (["dba-1", "dba-2", "dbb-1", "dbb-2", "dbc-1", "dbc-2"], 2222)
    assert expand_host_entry("n[0:6:3]") == (["n0", "n3", "n6"], None)
    for bad in ("h:", "h[3:1]", "h[1:]", "h[1:2:0]", "h:70000"):
        with pytest.raises(HostPatternError):
            expand_host_entry(bad)


def test_a_vault_file_and_a_non_mapping_vars_file_are_refused_naming_the_file(tmp_path):
    inv = _write(tmp_path, f"all:\n  vars:\n    {BASE_VARS}  hosts:\n    h1: {{address: 10.0.0.1}}\n")
    (tmp_path / "host_vars").mkdir()
    vault = tmp_path / "host_vars" / "h1.yml"
    vault.write_text("$ANSIBLE_VAULT;1.1;AES256\n6132\n")
    with pytest.raises(InventoryError, match=f"^{vault}: the file is encrypted with ansible-vault"):
        load_inventory(inv)
    vault.write_text("budget: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6132\n")
    with pytest.raises(InventoryError, match="a value \\(`!vault`\\) is encrypted with ansible-vault"):
        load_inventory(inv)
    vault.write_text("- budget\n")
    with pytest.raises(InventoryError, match="must be a mapping of vars, got a list"):
        load_inventory(inv)
    vault.write_text("budget: 32\n")
    assert load_inventory(inv).host("h1").budget == 32


def test_top_level_groups_other_than_all_and_plugin_files(tmp_path):
    p = _write(tmp_path, f"gpu:\n  vars:\n    {BASE_VARS}  hosts:\n    h1: {{address: 10.0.0.1}}\n")
    assert load_inventory(p).groups["all"] == ("h1",)
    p.write_text("plugin: amazon.aws.aws_ec2\nregions: [us-east-1]\n")
    with pytest.raises(InventoryError, match="plugin's configuration.*ansible-inventory -i FILE --list --yaml"):
        load_inventory(p)
    with pytest.raises(InventoryError, match="is a folder: name one inventory file"):
        load_inventory(tmp_path)
