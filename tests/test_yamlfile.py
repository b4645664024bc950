"""The one YAML loader: duplicate keys refused, positions named once, plain data, and each caller's
own error type with the file named."""

from __future__ import annotations

import pytest
import yaml

from ddtree_ops.errors import InventoryError, PatchSetError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.patchset import load_patchset
from ddtree_ops.yamlfile import YamlProblem, load_yaml
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
