"""The one YAML loader: duplicate keys refused, positions named once, plain data, and each caller's
own error type with the file named."""

from __future__ import annotations

import pytest
import yaml

from ddtree_ops.artifacts.patchset import load_patchset
from ddtree_ops.config.inventory import load_inventory
from ddtree_ops.config.yamlfile import YamlProblem, load_yaml
from ddtree_ops.errors import InventoryError, PatchSetError
from kit import REPO


@pytest.mark.parametrize("text, line, column, fragment", [
    ("a: 1\nb: 2\na: 3\n", 3, 1, "duplicate key 'a' at line 3, column 1 (already given at line 1, column 1)"),
    ("all:\n  vars:\n    budget: 16\n    tp: 8\n    budget: 64\n", 5, 5, "duplicate key 'budget'"),
    ("x: {k: 1, k: 2}\n", 1, 11, "duplicate key 'k' at line 1, column 11 (already given at line 1, column 5)"),
    ("- {a: 1}\n- a: 1\n  a: 1\n", 3, 3, "duplicate key 'a'"),  # equal values are still a mistake
    ("1: a\n1: b\n", 2, 1, "duplicate key 1"),
    ("yes: a\ntrue: b\n", 2, 1, "duplicate key True"),  # YAML 1.1: both are the boolean true
    ("base: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n  y: 3\n", 5, 3, "duplicate key 'y'"),
])
def test_a_key_given_twice_is_refused_with_its_line(text, line, column, fragment):
    with pytest.raises(YamlProblem) as e:
        load_yaml(text)
    assert (e.value.line, e.value.column) == (line, column)
    assert fragment in str(e.value)


@pytest.mark.parametrize("text, line, column, fragment", [
    ("all:\n  hosts:\n    a: [unclosed\n", 4, 1,
     "not valid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>' "
     "(while parsing a flow sequence that starts at line 3, column 8)"),
    ("a: 1\n\tb: 2\n", 2, 1, "not valid YAML at line 2, column 1: found character '\\t' that cannot start any token"),
    ("a: b: c\n", 1, 5, "not valid YAML at line 1, column 5: mapping values are not allowed here"),
    ("a: 1\n--- \nb: 2\n", 2, 1, "not valid YAML at line 2, column 1: but found another document"),
    ("a: !!python/object:os.system x\n", 1, 4, "not valid YAML at line 1, column 4: could not determine a constructor"),
    ("? [1]\n: 2\n", 1, 3, "not valid YAML at line 1, column 3: found unhashable key"),
])
def test_invalid_yaml_names_the_position_once(text, line, column, fragment):
    with pytest.raises(YamlProblem) as e:
        load_yaml(text)
    assert (e.value.line, e.value.column) == (line, column)
    assert str(e.value).startswith(fragment)
    # Only our "at line L, column C", never PyYAML's own 'in "<unicode string>", line 3, column 8:' too.
    msg = str(e.value)
    assert msg.count("line") == msg.count("at line") and "string>" not in msg


def test_undecodable_bytes_are_a_yaml_problem_not_a_crash():
    with pytest.raises(YamlProblem, match="not valid YAML: .*#x00ff.*at offset 3"):
        load_yaml(b"a: \xff\n")


@pytest.mark.parametrize("text", [
    "", "a: 1\n", "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n", "- 1\n- 1\n", "a: [1, 1]\nb: {c: {d: null}}\n",
    "v: 1.0\nw: no\nd: 2024-01-02\n",
])
def test_the_result_is_what_safe_load_gives(text):
    assert load_yaml(text) == yaml.safe_load(text)


def test_the_real_inventory_and_manifest_load_as_before():
    for p in (REPO / "inventory" / "ct200.yaml", REPO / "patches" / "ddtree-temp" / "manifest.yaml"):
        assert load_yaml(p.read_bytes()) == yaml.safe_load(p.read_text())


def test_an_inventory_with_a_duplicated_budget_is_an_inventory_error_naming_file_line_and_key(tmp_path):
    p = tmp_path / "prod.yaml"
    p.write_text("all:\n  vars:\n    budget: 16\n  hosts:\n    a:\n      address: 10.0.0.1\n"
                 "      budget: 8\n      budget: 64\n")
    with pytest.raises(InventoryError) as e:
        load_inventory(p)
    assert str(e.value) == (f"{p}: duplicate key 'budget' at line 8, column 7 "
                            f"(already given at line 7, column 7)")
    assert e.value.exit_code == 2


def test_a_manifest_with_a_duplicated_key_is_a_patchset_error_naming_the_manifest(tmp_path):
    d = tmp_path / "ps"
    (d / "files").mkdir(parents=True)
    (d / "manifest.yaml").write_text('name: ps\nversion: "1"\nsglang: "==0.5.23"\nversion: "2"\nfiles: []\n')
    with pytest.raises(PatchSetError) as e:
        load_patchset(str(d))
    assert str(e.value) == (f"{d.resolve() / 'manifest.yaml'}: duplicate key 'version' at line 4, column 1 "
                            f"(already given at line 2, column 1)")


def test_a_broken_manifest_names_the_manifest_and_position(tmp_path):
    d = tmp_path / "ps"
    (d / "files").mkdir(parents=True)
    (d / "manifest.yaml").write_text("name: [ps\n")
    with pytest.raises(PatchSetError, match=r"manifest.yaml: not valid YAML at line 2, column 1: "):
        load_patchset(str(d))


# --------------------------------------------------------------------------- aliases bounded

def _laughs(levels: int, width: int = 9) -> str:
    """The "billion laughs": each level a list of `width` aliases of the level below."""
    text = "a0: &a0 [" + ",".join(["lol"] * width) + "]\n"
    for i in range(1, levels + 1):
        text += f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]\n"
    return text


def _merge_bomb(levels: int) -> str:
    """Merge keys doubling at each level: `<<: [*m, *m]` copies the merged keys in PyYAML."""
    text = "m0: &m0 {x: 1, y: 2}\n"
    for i in range(1, levels + 1):
        text += f"m{i}: &m{i}\n  <<: [*m{i - 1}, *m{i - 1}]\n  k{i}: {i}\n"
    return text


@pytest.mark.parametrize("text, line", [(_laughs(9), 6), (_merge_bomb(30), 48)])
def test_an_alias_bomb_is_refused_quickly_naming_the_line(text, line):
    import time

    t0 = time.monotonic()
    with pytest.raises(YamlProblem) as e:
        load_yaml(text)
    assert time.monotonic() - t0 < 2
    assert str(e.value).startswith(f"alias expansion too large at line {line}, column ")
    assert "an alias bomb?" in str(e.value) and len(str(e.value)) < 300
    assert e.value.line == line


def test_an_alias_that_contains_itself_is_refused():
    with pytest.raises(YamlProblem, match="an alias refers to a node that contains it at line 1, column 4"):
        load_yaml("a: &a [1, *a]\n")
    with pytest.raises(YamlProblem, match="contains it at line 2"):
        load_yaml("x: 1\nb: &b {c: {d: *b}}\n")


def test_a_deeply_nested_document_is_a_yaml_problem_not_a_crash():
    with pytest.raises(YamlProblem, match="nested too deeply"):
        load_yaml("[" * 2_000 + "]" * 2_000)


def test_anchors_and_merge_keys_below_the_bound_work_as_safe_load():
    text = _laughs(4) + _merge_bomb(6) + ("defaults: &d {budget: 16, tp: 8}\nhosts:\n"
                                           + "".join(f"  h{i}: {{<<: *d, address: 10.0.0.{i}}}\n" for i in range(200)))
    assert load_yaml(text) == yaml.safe_load(text)


def test_a_long_duplicated_key_is_cut_in_the_message():
    key = "k" * 1000  # a plain key may be at most 1024 characters long
    with pytest.raises(YamlProblem, match="duplicate key 'kkk") as e:
        load_yaml(f"{key}: 1\n{key}: 2\n")
    assert len(str(e.value)) < 200 and "…" in str(e.value)


def test_an_inventory_with_an_alias_bomb_names_the_file_and_line(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(_laughs(9) + "all: {hosts: {a: {address: x}}}\n")
    with pytest.raises(InventoryError, match=rf"^{p}: alias expansion too large at line 6, column \d+: "):
        load_inventory(p)


def test_an_inventory_sharing_defaults_through_a_merge_key_loads(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("x-defaults: &defaults\n  python: /opt/v/bin/python\n  site_packages: /opt/v/lib/site-packages\n"
                 "  model_path: /m\n  draft_model_path: /d\n"
                 "all:\n  hosts:\n    h1: {<<: *defaults, address: 10.0.0.1}\n"
                 "    h2: {<<: *defaults, address: 10.0.0.2, budget: 8}\n")
    with pytest.raises(InventoryError, match="unexpected top-level keys x-defaults"):
        load_inventory(p)  # the inventory's top level holds only `all`: defaults go in group vars instead
    p.write_text("all:\n  vars: &defaults\n    python: /opt/v/bin/python\n    site_packages: /opt/v/lib/site-packages\n"
                 "    model_path: /m\n    draft_model_path: /d\n"
                 "  hosts:\n    h1: {<<: *defaults, address: 10.0.0.1}\n    h2: {<<: *defaults, address: 10.0.0.2}\n")
    i = load_inventory(p)
    assert [h.address for h in i.hosts.values()] == ["10.0.0.1", "10.0.0.2"]
