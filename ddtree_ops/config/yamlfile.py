"""The one YAML loader: safe, strict about duplicate keys, one way of naming a position.

PyYAML's `safe_load` keeps the *last* of two equal keys in a mapping without a word, so an
inventory with `budget: 16` and, twenty lines further down, `budget: 64` silently deploys 64.
`load_yaml` refuses that. Every problem is a `YamlProblem` whose text says where ("line L,
column C", counted from 1) and what; each caller wraps it in its own error type (InventoryError,
PatchSetError) with the file named.

The result is plain data as `yaml.safe_load` gives it (dict, list, str, int, float, bool, None;
YAML 1.1 scalars such as dates keep their safe_load types); merge keys (`<<: *base`) work as
usual, and a key given explicitly after a merge overrides the merged one, as YAML intends.

Anchors and aliases are allowed (a group of hosts may share `<<: *defaults`) but bounded: an alias
bomb ("billion laughs": nine aliases of nine aliases of ...) is a few hundred bytes of text that
expands to billions of values, which is harmless while the values are shared and fatal the moment
anything walks them (a merge key copies them, an error message quotes them). Before anything is
constructed, the document's size *with every alias expanded* is computed (values plus characters
of text, linear in the text) and a document larger than `MAX_EXPANDED` plus twice its own length
is refused, naming the line of the node that crossed the bound; an alias that refers to a node
containing itself is refused too. Keys quoted in messages are cut to 80 characters.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import shown

__all__ = ["MAX_EXPANDED", "YamlProblem", "load_yaml", "position"]

# The expanded size a document may reach beyond twice its own length: each value counts 1, each
# scalar also its length. An inventory of a thousand hosts written out in full stays far below.
MAX_EXPANDED = 1_000_000


def position(mark: Any) -> str:
    """'line L, column C' (1-based) of a PyYAML mark."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


class YamlProblem(ValueError):
    """The text is not valid YAML, or a mapping repeats a key. `line`/`column` are 1-based."""

    def __init__(self, what: str, mark: Any = None, detail: str = ""):
        self.line = mark.line + 1 if mark is not None else None
        self.column = mark.column + 1 if mark is not None else None
        super().__init__(f"{what} at {position(mark)}{detail}" if mark is not None else f"{what}{detail}")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<`: the merged keys may be overridden, that is what merging means
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # unhashable: SafeConstructor reports it below
                if first is not key_node.start_mark:
                    raise YamlProblem(f"duplicate key {shown(key)}", key_node.start_mark,
                                      f" (already given at {position(first)})")
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def _check_expansion(root: yaml.Node, limit: int) -> None:
    """Refuse a node graph whose size with every alias expanded exceeds `limit`, or that contains
    itself through an alias. Iterative and memoised: linear in the number of distinct nodes."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being sized: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if isinstance(node, yaml.ScalarNode):
            size[key] = 1 + len(node.value)
            continue
        kids = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        if children_done:
            open_.discard(key)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > limit:
                raise YamlProblem("alias expansion too large", node.start_mark,
                                  f": with its aliases expanded this value exceeds {limit:,} values and "
                                  f"characters (an alias bomb?); write the values out instead")
            size[key] = total
        elif key not in size:
            if key in open_:
                raise YamlProblem("an alias refers to a node that contains it", node.start_mark,
                                  ": recursive structures are not allowed")
            open_.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in size)


def load_yaml(text: str | bytes) -> Any:
    """Parse one YAML document into plain data. Raises YamlProblem (position included)."""
    loader = None
    try:
        loader = _StrictLoader(text)  # reads the first bytes: a decoding error can come from here
        node = loader.get_single_node()  # composed, not constructed: aliases are still shared nodes
        if node is None:
            return None
        _check_expansion(node, MAX_EXPANDED + 2 * len(text))
        return loader.construct_document(node)
    except RecursionError:  # thousands of nested '[': PyYAML composes recursively
        raise YamlProblem("not valid YAML", None, ": nested too deeply") from None
    except yaml.MarkedYAMLError as e:
        problem = e.problem or e.context or "invalid YAML"
        if e.context and e.problem and e.context_mark is not None and e.problem_mark is not None:
            # e.g. "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence
            # that starts at line 3, column 8)": the end of file is rarely where the mistake is.
            problem += f" ({e.context} that starts at {position(e.context_mark)})"
        raise YamlProblem("not valid YAML", e.problem_mark or e.context_mark, f": {problem}") from None
    except yaml.reader.ReaderError as e:  # not UTF-8, or a control character: no line to name
        raise YamlProblem("not valid YAML", None, f": {str(e).splitlines()[0]} (at offset {e.position})") from None
    except yaml.YAMLError as e:
        raise YamlProblem("not valid YAML", None, f": {e}") from None
    finally:
        if loader is not None:
            loader.dispose()
