"""The agent's modules joined into the one source a host runs: it runs alone in a fresh
`python -I -S` (no package, no site), answers requests, and a package that could not run that way
(a third-party import, a name defined twice, a missing name, a cycle) is refused before it is sent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_ops.host import agent
from ddtree_ops.host import agent_source as agent_source_module
from ddtree_ops.host.agent import BOOTSTRAP
from ddtree_ops.host.agent_source import CACHE_GLOB, JoinError, agent_source, join_cached, join_package, read_modules

AGENT_DIR = Path(agent.__file__).parent


def run_alone(source: str, requests: list[dict], tmp_path: Path) -> tuple[list[dict], str]:
    """`source` as a host runs it: a fresh isolated interpreter fed the BOOTSTRAP framing, from a
    folder with nothing importable in it; its answers, one per request, and its stderr."""
    data = b"%010d" % len(source.encode()) + source.encode()
    data += b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    r = subprocess.run([sys.executable, "-I", "-S", "-c", BOOTSTRAP], input=data, capture_output=True,
                       cwd=tmp_path, timeout=60)
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()], r.stderr.decode()


def test_the_joined_source_runs_alone_and_answers(tmp_path):
    state = tmp_path / "state"
    answers, err = run_alone(agent_source(), [
        {"op": "hello"},
        {"op": "lock", "state_dir": str(state), "holder": {"token": "t1"}},
        {"op": "history", "state_dir": str(state)},
        {"op": "unlock", "state_dir": str(state), "token": "t1"},  # else it keeps the lock for its lease
    ], tmp_path)
    assert [a["ok"] for a in answers] == [True, True, True, True], err
    assert answers[1]["result"]["acquired"] and answers[1]["result"]["holder"]["generation"] == 1
    assert answers[2]["result"] == {"releases": [], "current": None, "original": False, "tunes": []}


def test_the_package_source_unjoined_does_not_run_alone(tmp_path):
    """Control for the test above: the dispatch module as it is in the package (its relative
    imports still in) cannot run on a host; only the joined source can."""
    answers, err = run_alone((AGENT_DIR / "serve.py").read_text(), [{"op": "hello"}], tmp_path)
    assert answers == [] and "ImportError" in err


def test_modules_come_after_the_modules_they_import():
    source = agent_source()
    order = re.findall(r"^# -{40} (\w+)\.py$", source, re.M)
    modules = read_modules(AGENT_DIR)
    assert order[-1] == "serve" and sorted(order) == sorted(modules)
    for name in order:
        for dep in re.findall(r"^from \.(\w+) import", modules[name].source, re.M):
            assert order.index(dep) < order.index(name), (dep, name)
    assert not re.search(r"^from \.", source, re.M)  # every relative import taken out


def _package(tmp_path: Path, **modules: str) -> Path:
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    base = {"util": "import os\n\n\ndef here():\n    return os.getcwd()\n",
            "serve": "from .util import here\n\n\ndef serve():\n    return here()\n"}
    for name, text in {**base, **modules}.items():
        (folder / f"{name}.py").write_text(text)
    return folder


def test_a_small_package_joins(tmp_path):
    """Control for the refusals below: the same package, without the fault, joins and runs."""
    source = join_package(_package(tmp_path))
    namespace: dict = {"__name__": "ddtree_agent"}
    exec(compile(source, "ddtree_agent", "exec"), namespace)
    assert namespace["serve"]() == str(Path.cwd())


@pytest.mark.parametrize("modules,why", [
    ({"util": "import httpx\n\n\ndef here():\n    return httpx\n"}, "'httpx', which is not in the standard library"),
    ({"util": "def here():\n    from yaml import safe_load\n    return safe_load\n"}, "'yaml'"),
    ({"other": "def here():\n    return 1\n"}, "'here' is bound in other.py and again in util.py"),
    ({"other": "import json as os\n"}, "'os' is bound in other.py and again in util.py"),
    ({"serve": "from .util import there\n\n\ndef serve():\n    return there()\n"}, ".util defines no there"),
    ({"serve": "from .nowhere import here\n\n\ndef serve():\n    return here()\n"}, "not an agent module"),
    ({"serve": "from . import util\n\n\ndef serve():\n    return util.here()\n"}, "only `from .module import name`"),
    ({"serve": "from .util import here as h\n\n\ndef serve():\n    return h()\n"}, "`as` and `*`"),
    ({"serve": "def serve():\n    from .util import here\n    return here()\n"}, "inside a function"),
    ({"util": "from .serve import serve\n\n\ndef here():\n    return 1\n"}, "import cycle: serve -> util -> serve"),
    ({"util": "from __future__ import annotations\n\n\ndef here():\n    return 1\n"}, "`from __future__`"),
    ({"util": "def here(x):\n    match x:\n        case _:\n            return 1\n"}, "not Python 3.8 syntax"),
])
def test_a_package_that_could_not_run_on_a_host_is_refused(tmp_path, modules, why):
    with pytest.raises(JoinError) as e:
        join_package(_package(tmp_path, **modules))
    assert why in str(e.value)


# -- the join kept between processes (join_cached) ---------------------------------------------------

def _join_refused(*_a, **_k):
    raise AssertionError("joined again, though an entry for these sources was kept")


def test_a_kept_join_is_read_back_until_a_module_changes(tmp_path, monkeypatch):
    folder, cache = _package(tmp_path), tmp_path / "cache"
    first = join_cached(folder, cache)
    assert first == join_package(folder) and len(list(cache.glob(CACHE_GLOB))) == 1
    monkeypatch.setattr(agent_source_module, "join_package", _join_refused)
    assert join_cached(folder, cache) == first  # read back: joining again would raise
    monkeypatch.undo()
    (folder / "util.py").write_text("import os\n\n\ndef here():\n    return os.sep\n")
    second = join_cached(folder, cache)
    assert second != first and "os.sep" in second
    assert [p.read_text().endswith(second) for p in cache.glob(CACHE_GLOB)] == [True]  # the old entry removed


def test_a_kept_join_does_not_hide_a_refusal(tmp_path):
    """A module changed into one that could not run on a host is refused, though the package
    joined (and was kept) before the change."""
    folder, cache = _package(tmp_path), tmp_path / "cache"
    join_cached(folder, cache)
    (folder / "util.py").write_text("import httpx\n\n\ndef here():\n    return httpx\n")
    with pytest.raises(JoinError, match="not in the standard library"):
        join_cached(folder, cache)


def test_a_damaged_entry_is_joined_again_and_an_unwritable_cache_costs_only_the_join(tmp_path):
    folder, cache = _package(tmp_path), tmp_path / "cache"
    good = join_cached(folder, cache)
    [entry] = cache.glob(CACHE_GLOB)
    entry.write_text(entry.read_text().replace("return here()", "return None"))  # stamp no longer matches
    assert join_cached(folder, cache) == good and entry.read_text().endswith(good)
    entry.write_bytes(b"\xff\xfe not text")
    assert join_cached(folder, cache) == good
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    assert join_cached(folder, blocked) == good


def test_the_agent_sent_to_hosts_is_the_package_joined():
    assert agent_source() == join_package(AGENT_DIR)
