"""`tune --write`: the picked budget / topk_cap goes into the layer the host takes it from, and
nothing else in the inventory's files changes (config/inventory_edit.py)."""

from __future__ import annotations

import difflib
import os
import stat
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ddtree_ops.config.ansible_vars import ALIASES
from ddtree_ops.config.host_vars import load_folder_vars
from ddtree_ops.config.inventory import _layers, _merge, load_inventory
from ddtree_ops.config.inventory_edit import (
    WRITABLE_KEYS,
    FileEdit,
    apply_plan,
    locate,
    plan_write,
)
from ddtree_ops.config.inventory_file import read_graph
from ddtree_ops.errors import InputError

# The vars every host needs, kept out of the inventory files so that those read as written here.
ALL_VARS = {"group_vars/all.yml": "python: /opt/v/bin/python\nsite_packages: /opt/v/lib/python3.12/site-packages\n"
                                  "model_path: /models/m\ndraft_model_path: /models/d\n"}


def write(root: Path, files: dict[str, str]) -> Path:
    """The files (dedented) under root, group_vars/all.yml among them; the first is the inventory."""
    for name, text in {**files, **ALL_VARS}.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8", newline="")
    return root / next(iter(files))


# A fleet where every layer sets budget to a value of its own, so a wrong precedence shows.
FLEET_YAML = {
    "hosts.yml": """\
        # Fleet inventory: comments above, inline and trailing must survive.
        all:
          vars:
            budget: 8          # all's own
            health: &slow      # an anchor near the values
              load_deadline_s: 60
          children:
            gpu:
              vars:
                budget: 16     # the guess typed into a sed
                topk_cap: 4
                health: *slow
                # the last line of gpu's vars is a comment
              hosts:
                a: {address: 10.0.0.1}
                b:
                  address: 10.0.0.2
                  budget: 32   # b is special
                c: {address: 10.0.0.3}
                d: {address: 10.0.0.4}
              children:
                kimi:
                  hosts:
                    e: {address: 10.0.0.5}
            cpu:
              hosts:
                f: {address: 10.0.0.6}
        # trailing comment of the file
        """,
    "group_vars/kimi.yml": "# kimi's own\nbudget: 24  # from the folder\n",
    "host_vars/c.yml": "budget: 40\n",
    "host_vars/d/10-first.yml": "budget: 48\n",
    "host_vars/d/20-second.yml": "# the later file wins\nbudget: 56\n",
}

# group_vars/fleet.yml beats [gpu:vars] (the folders apply over the file's own vars).
FLEET_INI = {
    "hosts.ini": """\
        ; INI fleet
        solo address=10.0.1.9
        [gpu]
        a address=10.0.1.1
        b address=10.0.1.2 budget=32  # b's own
        g[1:2] budget=12
        [gpu:vars]
        budget = 16
        topk_cap = 4
        [fleet:children]
        gpu
        [all:vars]
        budget=8
        """,
    "group_vars/fleet.yml": "budget: 20\n",
}
GPU_TOPK = "        topk_cap: 4\n"  # gpu's topk_cap line in FLEET_YAML's hosts.yml


def fleet(tmp_path: Path, files: dict[str, str]) -> Path:
    return write(tmp_path, files)


def value_at(source) -> object:
    """The value written at a source, read without inventory_edit: YAML by its mapping path, INI by its line."""
    text = Path(source.path).read_text()
    if source.kind == "ini":
        line = text.splitlines()[source.line - 1]
        if source.position.endswith(":vars]"):
            return int(line.split("=", 1)[1])
        token = next(t for t in line.split() if t.startswith(source.name + "="))
        return int(token.split("=", 1)[1])
    node = yaml.safe_load(text)
    for part in source.position:
        node = node[part]
    return node[source.name]


def origins(inv: Path, host: str) -> dict[str, str]:
    """inventory.py's own record of which layer set each var."""
    graph = read_graph(inv)
    folder = load_folder_vars(graph.fname, graph.groups, graph.host_vars)
    return _merge(graph.fname, host, _layers(graph, folder, host))[1]


# ------------------------------------------------------------------------------------------------
# locate

@pytest.mark.parametrize("files", [FLEET_YAML, FLEET_INI], ids=["yaml", "ini"])
def test_locate_finds_the_layer_load_inventory_resolves_for_every_host(tmp_path, files):
    inv = fleet(tmp_path, files)
    loaded = load_inventory(inv)
    seen_layers = set()
    for name, host in loaded.hosts.items():
        for key in WRITABLE_KEYS:
            source = locate(inv, name, key)
            if source is None:
                assert key not in origins(inv, name)
                assert getattr(host, key) == 4  # topk_cap's default: only it is unset anywhere
                continue
            assert value_at(source) == getattr(host, key), (name, key, source)
            assert source.layer == origins(inv, name)[key]
            seen_layers.add(source.layer.split()[0] if " " in source.layer else source.layer)
    # every kind of layer was exercised, each with a value of its own
    assert {"group", "host"} <= seen_layers and any("_vars/" in s for s in seen_layers)


def test_locate_names_file_kind_and_mapping_path(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    a = locate(inv, "a", "budget")
    assert (a.path, a.kind, a.layer, a.position) == (str(inv), "yaml", "group gpu vars", ("all", "children", "gpu",
                                                                                           "vars"))
    b = locate(inv, "b", "budget")
    assert (b.layer, b.position, b.value) == ("host vars", ("all", "children", "gpu", "hosts", "b"), 32)
    d = locate(inv, "d", "budget")
    assert (d.path, d.position, d.value) == (str(tmp_path / "host_vars/d/20-second.yml"), (), 56)
    assert locate(inv, "f", "topk_cap") is None


def test_locate_in_ini_names_the_section_or_the_host_line(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    a, b = locate(inv, "a", "topk_cap"), locate(inv, "b", "budget")
    assert (a.kind, a.position, a.line) == ("ini", "[gpu:vars]", 9)
    assert (b.position, b.line, b.value) == ("[gpu] b", 5, 32)
    assert locate(inv, "solo", "budget").position == "[all:vars]"


def test_budget_and_topk_cap_have_no_ansible_spellings():
    """inventory_edit writes them under their own name only: an alias would need to be found too."""
    assert not set(WRITABLE_KEYS) & set(ALIASES)
    assert not {n for names in ALIASES.values() for n in names} & set(WRITABLE_KEYS)


def test_locate_of_an_aliased_key_finds_the_ansible_name(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          hosts:
            a: {address: 10.0.0.1, ansible_port: 2222}
        """})
    s = locate(inv, "a", "ssh_port")
    assert (s.name, s.value, s.layer) == ("ansible_port", 2222, "host vars")


# ------------------------------------------------------------------------------------------------
# plan_write: where the edit goes and what else it changes

def added_lines(before: str, after: str) -> list[str]:
    """The lines `after` adds to `before`; it must not change or drop any."""
    ops = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False).get_opcodes()
    assert all(op in ("equal", "insert") for op, *_ in ops), ops
    return [ln for op, _, _, j1, j2 in ops if op == "insert" for ln in after.splitlines()[j1:j2]]


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    b, a = before.splitlines(), after.splitlines()
    assert len(b) == len(a), "a line was added or removed"
    return [(x, y) for x, y in zip(b, a, strict=True) if x != y]


def test_group_var_edit_changes_exactly_its_line_and_keeps_the_comment(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a"], {"budget": 12})
    [edit] = plan.edits
    assert edit.path == str(inv)
    assert changed_lines(edit.before, edit.after) == [
        ("        budget: 16     # the guess typed into a sed", "        budget: 12     # the guess typed into a sed")]
    assert edit.before == inv.read_text()  # nothing written yet


def test_edit_reports_the_other_hosts_that_take_the_value_from_the_same_place(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a"], {"budget": 12, "topk_cap": 2})
    by_key = {c.key: c for c in plan.changes}
    assert by_key["budget"].others == ()  # b, c, d, e each have a budget of their own
    assert set(by_key["topk_cap"].others) == {"b", "c", "d", "e"}  # the whole gpu group, kimi included
    assert set(plan.other_hosts) == {"b", "c", "d", "e"}
    assert "also changes hosts" in plan.summary()[1]


def test_inline_host_vars_in_a_flow_mapping_are_edited_in_place(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    inv.write_text(inv.read_text().replace("a: {address: 10.0.0.1}", "a: {address: 10.0.0.1, budget: 16}  # a"))
    [edit] = plan_write(inv, ["a"], {"budget": 64}).edits
    assert changed_lines(edit.before, edit.after) == [("        a: {address: 10.0.0.1, budget: 16}  # a",
                                                       "        a: {address: 10.0.0.1, budget: 64}  # a")]


def test_group_vars_file_is_edited_and_the_inventory_file_is_not(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    [edit] = plan_write(inv, ["e"], {"budget": 4}).edits
    assert edit.path == str(tmp_path / "group_vars/kimi.yml")
    assert edit.after == "# kimi's own\nbudget: 4  # from the folder\n"


def test_the_later_file_of_a_host_vars_folder_is_the_one_edited(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    [edit] = plan_write(inv, ["d"], {"budget": 4}).edits
    assert edit.path == str(tmp_path / "host_vars/d/20-second.yml")
    assert edit.after == "# the later file wins\nbudget: 4\n"


def test_host_vars_file_beats_the_group_it_overrides(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["c"], {"budget": 4})
    assert [e.path for e in plan.edits] == [str(tmp_path / "host_vars/c.yml")]
    assert plan.other_hosts == ()


def test_an_anchor_on_the_value_itself_is_kept(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    inv.write_text(inv.read_text().replace("topk_cap: 4\n", "topk_cap: &k 4  # anchored, never aliased\n"))
    [edit] = plan_write(inv, ["a"], {"topk_cap": 2}).edits
    assert changed_lines(edit.before, edit.after) == [("        topk_cap: &k 4  # anchored, never aliased",
                                                       "        topk_cap: &k 2  # anchored, never aliased")]


def test_a_value_shared_through_an_alias_is_refused(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    text = inv.read_text().replace("topk_cap: 4\n", "topk_cap: &k 4\n").replace(
        "c: {address: 10.0.0.3}", "c: {address: 10.0.0.3, topk_cap: *k}")
    inv.write_text(text)
    with pytest.raises(InputError, match=r"hosts\.yml line \d+: topk_cap is shared through a YAML anchor"):
        plan_write(inv, ["a"], {"topk_cap": 2})


def test_group_vars_shared_by_two_groups_are_refused(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          children:
            gpu:
              vars: &common
                budget: 16
              hosts: {a: {address: 10.0.0.1}}
            other:
              vars: *common
              hosts: {b: {address: 10.0.0.2}}
        """})
    with pytest.raises(InputError, match="shared through a YAML anchor"):
        plan_write(inv, ["a"], {"budget": 8})


def test_a_value_written_through_a_merge_key_is_refused_naming_the_line(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          hosts:
            a:
              <<: {budget: 16}
              address: 10.0.0.1
        """})
    with pytest.raises(InputError, match=r"through the YAML merge key \(<<\) on line 4"):
        plan_write(inv, ["a"], {"budget": 8})


def test_hosts_taking_the_value_from_different_places_are_refused_naming_both(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    with pytest.raises(InputError) as e:
        plan_write(inv, ["a", "b", "f"], {"budget": 12})
    msg = str(e.value)
    assert "a from " in msg and "group gpu vars" in msg and "b from " in msg and "host vars" in msg
    assert "f from " in msg and "group all vars" in msg and "narrow --limit" in msg


def test_a_set_value_and_the_default_are_different_places(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    with pytest.raises(InputError, match="the default"):
        plan_write(inv, ["a", "f"], {"topk_cap": 2})


def test_a_value_already_equal_gives_no_edit(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a"], {"budget": 16, "topk_cap": 4})
    assert (plan.edits, plan.changes, plan.unchanged) == ((), (), ("budget", "topk_cap"))
    assert plan.diff() == ""
    assert apply_plan(plan) is None
    plan = plan_write(inv, ["f"], {"topk_cap": 4})  # the default, and no layer sets it: nothing to add
    assert plan.edits == ()


def test_two_hosts_of_one_group_are_written_together(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a", "e"], {"topk_cap": 1})
    [edit] = plan.edits
    assert len(changed_lines(edit.before, edit.after)) == 1
    assert set(plan.other_hosts) == {"b", "c", "d"}


# ------------------------------------------------------------------------------------------------
# a key no layer sets

def test_a_missing_key_is_added_after_the_last_key_of_the_group_vars_at_its_indentation(tmp_path):
    inv = write(tmp_path, {"hosts.yaml": """\
        all:
            vars:
                port: 30000
            children:
                gpu:
                    vars:
                        tp: 8   # eight GPUs
                        extra_args:
                            - --trust-remote-code  # a comment on the last value
                    # hosts follow
                    hosts:
                        a: {address: 10.0.0.1}
        """})
    plan = plan_write(inv, ["a"], {"topk_cap": 2})
    [edit] = plan.edits
    lines = edit.after.splitlines()
    i = lines.index("                topk_cap: 2")  # tp's indentation
    assert lines[i - 1].endswith("# a comment on the last value")
    assert lines[i + 1] == "            # hosts follow"
    assert edit.before.splitlines() == lines[:i] + lines[i + 1:]
    [c] = plan.changes
    assert c.added and (c.old, c.source.layer, c.source.line) == (4, "group gpu vars", i + 1)


def test_a_missing_key_gets_a_vars_section_in_a_group_without_one(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["f"], {"topk_cap": 2})
    [edit] = plan.edits
    assert added_lines(edit.before, edit.after) == ["      vars:", "        topk_cap: 2"]
    assert edit.after.endswith("        topk_cap: 2\n# trailing comment of the file\n")
    assert plan.changes[0].source.position == ("all", "children", "cpu", "vars")


def test_a_missing_key_goes_into_the_most_specific_group_the_hosts_share(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    inv.write_text(inv.read_text().replace(GPU_TOPK, ""))
    kimi = plan_write(inv, ["e"], {"topk_cap": 2}).changes[0]
    both = plan_write(inv, ["a", "e"], {"topk_cap": 2}).changes[0]
    apart = plan_write(inv, ["a", "f"], {"topk_cap": 2}).changes[0]
    assert (kimi.source.layer, both.source.layer, apart.source.layer) == (
        "group kimi vars", "group gpu vars", "group all vars")
    assert set(apart.others) == {"b", "c", "d", "e"}


def test_both_keys_added_to_one_group_compose_after_an_alias(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          children:
            cpu:
              vars:
                health: &slow {load_deadline_s: 60}
            gpu:
              hosts:
                a: {address: 10.0.0.1}
              vars:
                tp: 8
                health: *slow  # an alias last: marks of its anchor
        """})
    [edit] = plan_write(inv, ["a"], {"budget": 2, "topk_cap": 2}).edits
    assert added_lines(edit.before, edit.after) == ["        budget: 2", "        topk_cap: 2"]
    lines = edit.after.splitlines()
    assert lines[lines.index("        budget: 2") - 1].endswith("# an alias last: marks of its anchor")


def test_adding_to_a_flow_style_vars_mapping_is_refused_saying_so(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          children:
            gpu:
              vars: {tp: 8}
              hosts: {a: {address: 10.0.0.1}}
        """})
    with pytest.raises(InputError, match=r"flow-style mapping \(\{\.\.\.\}\).*by hand"):
        plan_write(inv, ["a"], {"topk_cap": 2})


# ------------------------------------------------------------------------------------------------
# INI

def test_ini_group_var_is_replaced_keeping_its_spacing(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    [edit] = plan_write(inv, ["a"], {"topk_cap": 2}).edits
    assert changed_lines(edit.before, edit.after) == [("topk_cap = 4", "topk_cap = 2")]


def test_ini_host_line_value_is_replaced_keeping_the_rest_of_the_line(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    [edit] = plan_write(inv, ["b"], {"budget": 64}).edits
    assert changed_lines(edit.before, edit.after) == [("b address=10.0.1.2 budget=32  # b's own",
                                                       "b address=10.0.1.2 budget=64  # b's own")]


def test_ini_range_host_line_reaches_every_host_of_the_range(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    plan = plan_write(inv, ["g1"], {"budget": 6})
    assert changed_lines(plan.edits[0].before, plan.edits[0].after) == [("g[1:2] budget=12", "g[1:2] budget=6")]
    assert plan.other_hosts == ("g2",)


def test_ini_missing_key_is_added_to_the_group_vars_section(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    inv.write_text(inv.read_text().replace("topk_cap = 4\n", ""))
    [edit] = plan_write(inv, ["a"], {"topk_cap": 2}).edits
    lines = edit.after.splitlines()
    assert lines[lines.index("budget = 16") + 1] == "topk_cap = 2"  # the siblings' ` = `
    assert len(lines) == len(edit.before.splitlines()) + 1


def test_ini_missing_key_adds_a_vars_section_when_the_group_has_none(tmp_path):
    inv = write(tmp_path, {"hosts": """\
        [gpu]
        a address=10.0.1.1
        [all:vars]
        port=30000
        """})
    plan = plan_write(inv, ["a"], {"budget": 8})
    assert plan.edits[0].after == plan.edits[0].before + "\n[gpu:vars]\nbudget=8\n"
    assert plan.changes[0].source.kind == "ini"


# ------------------------------------------------------------------------------------------------
# the diff, and checks on the values

def test_diff_is_a_unified_diff_of_the_one_line(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    diff = plan_write(inv, ["e"], {"budget": 4}).diff()
    path = tmp_path / "group_vars/kimi.yml"
    assert diff == (f"--- {path}\n+++ {path}\n@@ -1,2 +1,2 @@\n # kimi's own\n-budget: 24  # from the folder\n"
                    f"+budget: 4  # from the folder\n")


def test_diff_marks_a_file_without_a_final_newline():
    diff = FileEdit("x.yml", "budget: 16", "budget: 8").diff()
    assert diff.count("\\ No newline at end of file\n") == 2 and diff.endswith("\n")


def test_a_value_that_another_host_cannot_take_is_refused(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    inv.write_text(inv.read_text().replace("    topk_cap: 4\n", "    topk_cap: 8\n"))
    with pytest.raises(InputError, match=r"host c: topk_cap must be an integer 1..budget \(4\)"):
        plan_write(inv, ["c"], {"budget": 4})


def test_bad_requests_are_refused_before_anything_is_read_into_an_edit(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    with pytest.raises(InputError, match="no host named 'zz'"):
        plan_write(inv, ["zz"], {"budget": 4})
    with pytest.raises(InputError, match="'tp' is not a key this tool writes"):
        plan_write(inv, ["a"], {"tp": 4})
    with pytest.raises(InputError, match="budget must be an integer"):
        plan_write(inv, ["a"], {"budget": True})
    with pytest.raises(InputError, match=r"host a: budget must be an integer 1\.\.1024"):
        plan_write(inv, ["a"], {"budget": 0})
    with pytest.raises(InputError, match="no hosts"):
        plan_write(inv, [], {"budget": 4})


def test_crlf_line_endings_are_kept(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    inv.write_bytes(inv.read_bytes().replace(b"\n", b"\r\n"))
    [edit] = plan_write(inv, ["f"], {"topk_cap": 2}).edits
    assert "\r\n      vars:\r\n        topk_cap: 2\r\n" in edit.after
    assert edit.after.count("\n") == edit.after.count("\r\n")


# ------------------------------------------------------------------------------------------------
# apply_plan

def test_apply_plan_writes_and_the_hosts_resolve_to_the_new_values(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    kimi = tmp_path / "group_vars/kimi.yml"
    kimi.chmod(0o600)
    plan = plan_write(inv, ["e"], {"budget": 4, "topk_cap": 2})
    after = apply_plan(plan)
    assert (after.host("e").budget, after.host("e").topk_cap) == (4, 2)
    assert (after.host("a").topk_cap, after.host("a").budget) == (2, 16)  # a shares gpu's topk_cap, not budget
    assert load_inventory(inv).host("e").budget == 4
    assert stat.S_IMODE(os.stat(kimi).st_mode) == 0o600
    assert [p.name for p in tmp_path.rglob(".*.tmp")] == []


def test_apply_plan_refuses_a_file_changed_since_it_was_planned(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a", "e"], {"topk_cap": 2})
    inv.write_text(inv.read_text() + "# someone else's edit\n")
    mine = inv.read_text()
    with pytest.raises(InputError, match="changed since it was read"):
        apply_plan(plan)
    assert inv.read_text() == mine


def test_apply_plan_restores_the_files_when_the_reread_disagrees(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a"], {"topk_cap": 2})
    [edit] = plan.edits
    wrong = replace(edit, after=edit.after.replace("topk_cap: 2", "topk_cap: 3"))  # what a faulty edit would do
    with pytest.raises(InputError, match="resolves topk_cap to 3, not 2.*restored"):
        apply_plan(replace(plan, edits=(wrong,)))
    assert inv.read_text() == edit.before


def test_apply_plan_restores_the_files_when_the_inventory_no_longer_loads(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["e"], {"budget": 4})
    [edit] = plan.edits
    broken = replace(edit, after="budget: [4\n")
    with pytest.raises(InputError, match="restored"):
        apply_plan(replace(plan, edits=(broken,)))
    assert (tmp_path / "group_vars/kimi.yml").read_text() == edit.before


def test_apply_plan_writes_through_a_symlinked_vars_file(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    real = tmp_path / "shared-kimi.yml"
    (tmp_path / "group_vars/kimi.yml").rename(real)
    (tmp_path / "group_vars/kimi.yml").symlink_to(real)
    apply_plan(plan_write(inv, ["e"], {"budget": 4}))
    assert (tmp_path / "group_vars/kimi.yml").is_symlink()
    assert real.read_text() == "# kimi's own\nbudget: 4  # from the folder\n"


def test_an_ini_inventory_round_trips_through_apply(tmp_path):
    inv = fleet(tmp_path, FLEET_INI)
    before = inv.read_text()
    after = apply_plan(plan_write(inv, ["b"], {"budget": 64, "topk_cap": 2}))
    assert (after.host("b").budget, after.host("b").topk_cap, after.host("a").topk_cap) == (64, 2, 2)
    assert len(changed_lines(before, inv.read_text())) == 2


def test_a_host_listed_in_two_groups_gets_the_value_in_both_places(tmp_path):
    inv = write(tmp_path, {"hosts.yml": """\
        all:
          children:
            gpu:
              hosts:
                a: {address: 10.0.0.1, budget: 16}
            canary:
              hosts:
                a: {budget: 16}  # the same host, said again
        """})
    source = locate(inv, "a", "budget")
    assert (source.position, source.more) == (("all", "children", "gpu", "hosts", "a"),
                                              (("all", "children", "canary", "hosts", "a"),))
    plan = plan_write(inv, ["a"], {"budget": 8})
    assert len(changed_lines(plan.edits[0].before, plan.edits[0].after)) == 2
    assert apply_plan(plan).host("a").budget == 8


def test_an_edit_that_would_not_read_back_as_planned_is_refused(tmp_path, monkeypatch):
    """The safety net under every splice: the edited text is read again before it is offered."""
    import ddtree_ops.config.inventory_edit as inventory_edit

    inv = fleet(tmp_path, FLEET_YAML)
    monkeypatch.setattr(inventory_edit, "_splice", lambda text, spots, value:  # the value, and a stray key
                        text.replace("budget: 16 ", f"budget: {value}\n        tp: 2"))
    with pytest.raises(InputError, match="would not read back as intended"):
        plan_write(inv, ["a"], {"budget": 12})


def test_hosts_from_different_places_already_at_the_value_need_no_edit(tmp_path):
    inv = fleet(tmp_path, FLEET_YAML)
    plan = plan_write(inv, ["a", "f"], {"topk_cap": 4})  # gpu's 4 and the default 4
    assert (plan.edits, plan.unchanged) == ((), ("topk_cap",))
    assert "already resolve to the value asked for" in plan.summary()[0]
