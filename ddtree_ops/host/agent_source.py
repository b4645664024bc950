"""The agent's source as it is sent to a host: the modules of `host/agent/` joined into one.

On the host the agent is one `exec`'d source in one namespace (nothing is installed there), while
here it is a package of modules by concern. Joining keeps that honest: the modules are put in
dependency order with their package-relative imports (`from .files import atomic_write`) taken
out, and a package the joined source could not run is refused rather than sent:

* an import of anything outside the standard library (the host's `python -I -S` has no site
  packages, and the agent runs as root: no third-party code),
* a name defined in two modules (one namespace: the later would silently replace the earlier),
* a relative import that is not `from .module import name` at module level, or names a module or
  a name that is not there, an import cycle, and `from __future__` (the host's Python may be 3.8,
  and string annotations break dataclasses in an `exec`'d namespace).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import agent

ENTRY = "serve"  # the module that defines main(), which BOOTSTRAP calls
OLDEST_HOST_PYTHON = (3, 8)  # the oldest interpreter an SGLang venv on a host may have


class JoinError(Exception):
    """The agent's modules cannot be joined into a source that runs alone on a host."""


@dataclass(frozen=True)
class Module:
    name: str
    source: str
    tree: ast.Module


@dataclass(frozen=True)
class Binding:
    """A top-level name and what binds it: `def`/`class`/assignment in a module, or an import."""

    name: str
    module: str
    imported_from: str | None  # "os", "typing.List": the same import twice is one binding


def read_modules(folder: Path) -> dict[str, Module]:
    out = {}
    for path in sorted(folder.glob("*.py")):
        if path.name == "__init__.py":
            continue
        source = path.read_text()
        out[path.stem] = Module(path.stem, source, ast.parse(source, str(path)))
    return out


def _relative_imports(module: Module) -> list[ast.ImportFrom]:
    nodes = [n for n in ast.walk(module.tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    top = {id(n) for n in module.tree.body}
    for n in nodes:
        where = f"{module.name}.py:{n.lineno}"
        if id(n) not in top:
            raise JoinError(f"{where}: a package-relative import inside a function or block cannot be joined")
        if n.level != 1 or not n.module:
            raise JoinError(f"{where}: only `from .module import name` can be joined")
        if any(a.asname or a.name == "*" for a in n.names):
            raise JoinError(f"{where}: `as` and `*` in a package-relative import cannot be joined")
    return nodes


def _check_stdlib(module: Module) -> None:
    for n in ast.walk(module.tree):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            names = [n.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "__future__":
                raise JoinError(f"{module.name}.py:{n.lineno}: `from __future__` cannot be joined (the host's Python "
                                f"runs the source as it is)")
            if top not in sys.stdlib_module_names:
                raise JoinError(f"{module.name}.py:{n.lineno}: imports {name!r}, which is not in the standard "
                                f"library: the agent runs with `python -I -S` on the host")


def _bindings(module: Module) -> list[Binding]:
    out = []
    for n in module.tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(Binding(n.name, module.name, None))
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out += [Binding(name, module.name, None) for tgt in targets for name in _target_names(tgt)]
        elif isinstance(n, ast.Import):
            out += [Binding(a.asname or a.name.split(".")[0], module.name, a.asname and a.name or a.name.split(".")[0])
                    for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            out += [Binding(a.asname or a.name, module.name, f"{n.module}.{a.name}") for a in n.names]
    return out


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for elt in target.elts for name in _target_names(elt)]
    return []  # an attribute or item of something bound elsewhere


def _check_one_namespace(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Every top-level name bound once (an import of the same thing may repeat); the names each
    module defines."""
    seen: dict[str, Binding] = {}
    defined: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules.values():
        for b in _bindings(module):
            if b.imported_from is None:
                defined[module.name].add(b.name)
            first = seen.setdefault(b.name, b)
            if first is b or (b.imported_from is not None and first.imported_from == b.imported_from):
                continue
            if first.module == b.module and first.imported_from is None and b.imported_from is None:
                continue  # a module may rebind its own name (a default, then an override)
            raise JoinError(f"{b.name!r} is bound in {first.module}.py and again in {b.module}.py: joined into one "
                            f"namespace, one would replace the other")
    return defined


def _dependencies(modules: dict[str, Module], defined: dict[str, set[str]]) -> dict[str, list[str]]:
    deps: dict[str, list[str]] = {}
    for module in modules.values():
        deps[module.name] = []
        for n in _relative_imports(module):
            if n.module not in modules:
                raise JoinError(f"{module.name}.py:{n.lineno}: imports .{n.module}, which is not an agent module")
            missing = [a.name for a in n.names if a.name not in defined[n.module]]
            if missing:
                raise JoinError(f"{module.name}.py:{n.lineno}: .{n.module} defines no {', '.join(missing)}")
            deps[module.name].append(n.module)
    return deps


def dependency_order(deps: dict[str, list[str]], entry: str) -> list[str]:
    """The modules `entry` needs, each after the modules it imports (ties by name); a cycle is refused."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise JoinError("import cycle: " + " -> ".join(visiting[visiting.index(name):] + [name]))
        visiting.append(name)
        for dep in sorted(set(deps[name])):
            visit(dep)
        visiting.pop()
        order.append(name)

    visit(entry)
    return order


def _without_relative_imports(module: Module) -> str:
    lines = module.source.splitlines(keepends=True)
    for n in _relative_imports(module):
        for i in range(n.lineno - 1, n.end_lineno or n.lineno):
            lines[i] = ""
    return "".join(lines)


def join_modules(modules: dict[str, Module], entry: str = ENTRY) -> str:
    if entry not in modules:
        raise JoinError(f"no module {entry!r} among {sorted(modules)}")
    for module in modules.values():
        _check_stdlib(module)
    defined = _check_one_namespace(modules)
    order = dependency_order(_dependencies(modules, defined), entry)
    parts = [f"# ddtree-ops agent: {', '.join(order)} joined into one source (ddtree_ops/host/agent_source.py)\n"]
    parts += [f"\n# {'-' * 40} {name}.py\n" + _without_relative_imports(modules[name]) for name in order]
    joined = "".join(parts)
    try:  # a SyntaxError here, not on a host whose Python is older than this one
        ast.parse(joined, "ddtree_agent", feature_version=OLDEST_HOST_PYTHON)
    except SyntaxError as e:
        raise JoinError(f"the joined source is not Python {'.'.join(map(str, OLDEST_HOST_PYTHON))} syntax: "
                        f"line {e.lineno}: {e.msg}") from None
    return joined


def join_package(folder: Path, entry: str = ENTRY) -> str:
    return join_modules(read_modules(folder), entry)


CACHE_GLOB = "ddtree-agent.*.joined"  # in the agent package's __pycache__, beside its bytecode


def join_cached(folder: Path, cache_dir: Path) -> str:
    """`join_package(folder)`, kept in `cache_dir` under a key of everything the join reads.

    Joining parses and walks the whole agent (about 0.18 CPU-s) and every controller process pays
    it once, the CLI at every start. The key is a hash of this module's own source (the rules),
    the Python version (its parser and its list of standard modules) and every agent module's name
    and bytes, so a change to any of them joins again; the entry carries a hash of its text and one
    that does not match is joined again too. Written to a temporary file and renamed into place
    (concurrent runs read a whole entry or none); entries of other keys are removed then. A
    folder that cannot be written costs only the join. The entry lives with the same protection
    as the bytecode Python writes beside it: whoever can change it can change the agent's .py."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(repr(sys.version_info[:2]).encode())
    for path in sorted(folder.glob("*.py")):
        h.update(b"\0%s\0%d\0" % (path.name.encode(), path.stat().st_size))
        h.update(path.read_bytes())
    entry = cache_dir / CACHE_GLOB.replace("*", h.hexdigest()[:32])
    try:
        stamp, _, text = entry.read_text().partition("\n")
        if stamp == "# sha256 " + hashlib.sha256(text.encode()).hexdigest():
            return text
    except (OSError, UnicodeDecodeError):
        pass
    joined = join_package(folder)
    try:
        cache_dir.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".ddtree-agent.")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(f"# sha256 {hashlib.sha256(joined.encode()).hexdigest()}\n{joined}")
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
        for old in cache_dir.glob(CACHE_GLOB):
            if old != entry:
                old.unlink(missing_ok=True)
    except OSError:
        pass  # read-only install: joined again by the next process
    return joined


@functools.cache
def agent_source() -> str:
    """The source the channel sends to every host (joined once per controller process, and kept
    between processes: join_cached)."""
    folder = Path(agent.__file__).parent
    return join_cached(folder, folder / "__pycache__")
