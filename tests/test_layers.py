"""The house's layer contracts ([tool.importlinter] in pyproject.toml), checked by import-linter as
scripts/test checks them, and shown to fail on a wrong-way import; and the CLI's plugin seam, by
which the test rig's `sandbox` commands reach the CLI without the product importing them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from kit import REPO, modules_loaded_by

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the package under `root`, with `root`'s pyproject.toml, no cache."""
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"})


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "ddtree_ops", tmp_path / "ddtree_ops", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_product_keeps_its_layer_contracts():
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout


def test_a_wrong_way_import_breaks_the_contracts_and_is_named(tmp_path):
    root = copy_of_the_package(tmp_path)
    assert lint_imports(root).returncode == 0  # the copy itself is clean
    add_import(root, "ddtree_ops.config.yamlfile", "from ddtree_ops.gates import health  # noqa")
    add_import(root, "ddtree_ops.host.transport", "from ddtree_ops.testing import fake_host  # noqa")
    r = lint_imports(root)
    assert r.returncode != 0
    assert "Contracts: 0 kept, 2 broken." in r.stdout, r.stdout
    assert "ddtree_ops.config.yamlfile -> ddtree_ops.gates.health" in r.stdout
    assert "ddtree_ops.host.transport -> ddtree_ops.testing.fake_host" in r.stdout


def test_a_room_the_contract_does_not_name_breaks_it(tmp_path):
    root = copy_of_the_package(tmp_path)
    (root / "ddtree_ops" / "annex").mkdir()
    (root / "ddtree_ops" / "annex" / "__init__.py").write_text('"""A room nobody placed on a floor."""\n')
    r = lint_imports(root)
    assert r.returncode != 0 and "ddtree_ops.annex" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_sandbox_commands_arrive_through_the_plugin_entry_point():
    from importlib import metadata

    from ddtree_ops.cli import commands

    eps = {ep.name: ep.value for ep in metadata.entry_points(group=commands.PLUGIN_GROUP)}
    assert eps == {"sandbox": "ddtree_ops.testing.cli:plugin"}
    probe = ("from ddtree_ops.cli import commands\n"
             "commands.mount_plugins_for(sys.argv[1:])\n"
             "print(json.dumps(sorted(g.name for g in commands.app.registered_groups)))\n")
    for argv, mounted in [(["sandbox", "up"], ["sandbox"]), ([], ["sandbox"]), (["--help"], ["sandbox"]),
                          (["no-such-command"], ["sandbox"]), (["status", "-i", "x"], [])]:
        r = subprocess.run([sys.executable, "-c", "import json, sys\n" + probe, *argv], capture_output=True,
                           text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0 and json.loads(r.stdout) == mounted, (argv, r.stdout, r.stderr)


def test_one_of_the_tools_own_commands_starts_without_looking_for_plugins():
    """Finding the plugins reads every installed distribution's metadata: a command of the tool's
    own (a plugin cannot replace one) does without, and loads nothing of the test rig."""
    code = "from ddtree_ops.cli import commands; commands.mount_plugins_for(['status', '-i', 'x'])"
    assert modules_loaded_by(code, "ddtree_ops.testing", "importlib.metadata") == []
    code = "from ddtree_ops.cli import commands; commands.mount_plugins_for(['sandbox'])"
    assert "importlib.metadata" in modules_loaded_by(code, "importlib.metadata")  # the control


def test_a_broken_plugin_costs_its_own_commands_only(monkeypatch, capsys):
    from importlib import metadata

    from ddtree_ops.cli import commands

    class Broken:
        name, value = "broken", "nowhere:plugin"

        def load(self):
            raise ImportError("no module named nowhere")

    class Good:
        name, value = "good", "here:plugin"

        def load(self):
            return lambda: typer.Typer(name="good")

    monkeypatch.setattr(metadata, "entry_points", lambda group: [Broken(), Good()])
    monkeypatch.setattr(commands, "app", typer.Typer())
    commands._mount_plugins()
    assert [g.name for g in commands.app.registered_groups] == ["good"]
    err = capsys.readouterr().err
    assert "command group 'broken' (nowhere:plugin) could not be loaded: ImportError" in err


@pytest.mark.parametrize("module, allowed", [
    ("ddtree_ops.fleet.actions", set()),
    # the CLI loads its plugins when it runs (main), not when it is imported
    ("ddtree_ops.cli.commands", set()),
])
def test_the_product_runs_without_the_test_rig_loaded(module, allowed):
    assert set(modules_loaded_by(f"import {module}", "ddtree_ops.testing")) <= allowed


def test_the_probe_sees_the_test_rig_when_it_is_imported():
    # the control of the test above: the same probe, after importing a fake
    assert "ddtree_ops.testing.fake_host" in modules_loaded_by("import ddtree_ops.testing.fake_host",
                                                               "ddtree_ops.testing")
