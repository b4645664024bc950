"""The ddtree.ops collection as Ansible's own tools judge it, offline.

`ansible-test sanity` (validate-modules, import, pylint, pep8, yamllint and the rest the
collection's Python allows), `ansible-test units` and `ansible-lint` on the playbooks and the
molecule scenario run on the built tarball as a lint stage of the test command
(scripts/check-collection, beside ruff, while the sglang venv installs): any finding fails the
run. Here: that each of them can fail, on a copy with one planted fault, and what the build makes
(the tarball's contents, the execution environment's build context from `ansible-builder create`).

ansible-test fetches a pip bootstrap script from ci-files.testing.ansible.com for each sanity
virtual environment, which cannot be reached here: tests/ansible/get_pip_offline.py stands in
for it in ansible-test's cache (scripts/setup-ansible-test; the environments' packages come from
the package index)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml

from ansible_kit import VENV_BIN, ansible_env, build_and_install, run
from kit import REPO

pytestmark = pytest.mark.sandbox  # real tool runs into fresh virtual environments (minutes on a fresh machine)

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return build_and_install(tmp_path_factory.mktemp("collection"))


def _seed_get_pip() -> None:
    subprocess.run(["bash", str(REPO / "scripts" / "setup-ansible-test"), "--seed-only"], check=True)


def test_the_tarball_holds_the_collection_and_nothing_of_the_test_output(installed):
    with tarfile.open(installed.tarball) as tf:
        names = set(tf.getnames())
    for must in ("MANIFEST.json", "README.md", "meta/runtime.yml",
                 "plugins/action/deploy.py", "plugins/modules/deploy.py", "plugins/action/facts.py",
                 "plugins/action/rollback.py", "plugins/action/rollout.py", "plugins/plugin_utils/tool.py",
                 "playbooks/deploy.yml", "playbooks/rollback.yml", "playbooks/status.yml"):
        assert must in names, must
    assert not any(n.startswith("tests/output") for n in names)
    runtime = yaml.safe_load((installed.root / "meta" / "runtime.yml").read_text())
    assert runtime["requires_ansible"].startswith(">=")


def test_a_broken_module_document_fails_sanity(installed, tmp_path):
    """check-collection's sanity run can fail: a copy whose document has an option of no valid type
    fails validate-modules with exactly that error."""
    _seed_get_pip()
    copy = tmp_path / "ansible_collections" / "ddtree" / "ops"
    shutil.copytree(installed.root, copy)
    doc = copy / "plugins" / "modules" / "facts.py"
    doc.write_text(doc.read_text().replace("    type: path\n", "    type: pathh\n", 1))
    p = run([str(VENV_BIN / "ansible-test"), "sanity", "--python", PYTHON, "--color", "no", "--test",
             "validate-modules"], cwd=copy, env=ansible_env(installed), timeout=300, check=False)
    assert p.returncode != 0
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("ERROR: plugins/")]
    assert errors == ["ERROR: plugins/modules/facts.py:0:0: invalid-documentation: DOCUMENTATION.options.bundle.type: "
                      "not a valid value for dictionary value @ data['options']['bundle']['type']. Got 'pathh'"]


def test_ansible_lint_finds_a_bare_module_name_and_nothing_else(installed, tmp_path):
    """check-collection's ansible-lint run can fail: a playbook with a bare module name."""
    (tmp_path / "bad.yml").write_text("---\n- name: Bad\n  hosts: all\n  tasks:\n    - name: Not fully qualified\n"
                                      "      debug:\n        msg: hi\n")
    p = run([str(VENV_BIN / "ansible-lint"), "--offline", "--nocolor", "-f", "pep8", "bad.yml"], cwd=tmp_path,
            env=ansible_env(installed), timeout=300, check=False)
    assert p.returncode != 0
    findings = re.findall(r"^(\S+\.yml):\d+:\d+: (\S+):", p.stdout, re.M)
    assert findings == [("bad.yml", "fqcn[action-core]")], (p.stdout + p.stderr)[-4000:]


def test_the_test_command_runs_the_collections_checks_after_their_environments():
    script = (REPO / "scripts" / "test").read_text()
    assert "bash scripts/setup-ansible-test && bash scripts/check-collection" in script
    checks = (REPO / "scripts" / "check-collection").read_text()
    for step in ("ansible-galaxy collection build", "ansible-galaxy collection install", "ansible-test sanity",
                 "ansible-test units", "ansible-lint --offline --nocolor playbooks/ molecule/"):
        assert step in checks, step


def test_ansible_builder_creates_the_execution_environments_build_context(installed, tmp_path):
    ee = tmp_path / "ee"
    ee.mkdir()
    shutil.copy(REPO / "examples" / "awx" / "execution-environment.yml", ee)
    shutil.copy(installed.tarball, ee)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(ee)],
        cwd=tmp_path, timeout=300)
    wheels = list(ee.glob("ddtree_ops-*.whl"))
    assert len(wheels) == 1
    run([str(VENV_BIN / "ansible-builder"), "create", "-f", "execution-environment.yml", "-c", "context"], cwd=ee)
    ctx = ee / "context"
    recipe = next(p for p in (ctx / "Containerfile", ctx / "Dockerfile") if p.exists()).read_text()
    assert "ansible-core==2.19.14" in recipe and "ansible-runner==2.4.3" in recipe
    assert "pip install --no-cache-dir /tmp/ddtree-ops-wheels/*.whl" in recipe
    assert (ctx / "_build" / "collections" / installed.tarball.name).read_bytes() == installed.tarball.read_bytes()
    assert (ctx / "_build" / "wheels" / wheels[0].name).exists()
    reqs = yaml.safe_load((ctx / "_build" / "requirements.yml").read_text())
    assert reqs["collections"] == [{"name": f"/build/collections/{installed.tarball.name}", "type": "file"}]
