"""The ddtree.ops collection as Ansible's own tools judge it, offline: `ansible-test sanity`
(validate-modules, import, pylint, pep8, yamllint and the rest the collection's Python allows)
and `ansible-test units` on the installed tarball, `ansible-lint` on its playbooks and the
molecule scenario, and the execution environment's build context from `ansible-builder create`.

ansible-test fetches a pip bootstrap script from ci-files.testing.ansible.com for each sanity
virtual environment, which cannot be reached here: tests/ansible/get_pip_offline.py stands in
for it in ansible-test's cache (scripts/setup-ansible-test, which the test command runs, also
prepares the environments ahead with `--prime-venvs`; their packages come from the package index)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml

from ansible_kit import SCENARIO_DIR, VENV_BIN, ansible_env, build_and_install, run
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


def test_ansible_test_sanity_passes_offline_on_the_installed_collection(installed):
    _seed_get_pip()
    p = run([str(VENV_BIN / "ansible-test"), "sanity", "--python", PYTHON, "--color", "no"], cwd=installed.root,
            env=ansible_env(installed), timeout=600, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for test in ("validate-modules", "import", "pylint", "pep8", "yamllint", "action-plugin-docs", "ansible-doc"):
        assert f'Running sanity test "{test}"' in out, test
    assert "ERROR" not in out, out[-4000:]


def test_a_broken_module_document_fails_sanity(installed, tmp_path):
    """The sanity run above can fail: a copy with an option its document does not describe."""
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


def test_ansible_test_units_pass(installed):
    p = run([str(VENV_BIN / "ansible-test"), "units", "--python", PYTHON, "--color", "no", "--num-workers", "1"],
            cwd=installed.root,
            env=ansible_env(installed), timeout=300)
    assert " passed" in p.stdout and " failed" not in p.stdout


def test_ansible_lint_passes_the_playbooks_and_the_scenario_and_finds_a_bare_module_name(installed, tmp_path):
    """One ansible-lint run (it costs seconds of CPU to start) over the collection's playbooks, the
    molecule scenario and a playbook with a bare module name: the last is its only finding."""
    work = tmp_path / "lint"
    shutil.copytree(installed.root / "playbooks", work / "playbooks")
    shutil.copytree(SCENARIO_DIR / "molecule", work / "molecule")
    (work / "bad.yml").write_text("---\n- name: Bad\n  hosts: all\n  tasks:\n    - name: Not fully qualified\n"
                                  "      debug:\n        msg: hi\n")
    p = run([str(VENV_BIN / "ansible-lint"), "--offline", "--nocolor", "-f", "pep8", "playbooks/", "molecule/",
             "bad.yml"], cwd=work, env=ansible_env(installed), timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    findings = re.findall(r"^(\S+\.yml):\d+:\d+: (\S+):", p.stdout, re.M)
    assert findings == [("bad.yml", "fqcn[action-core]")], out[-4000:]


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
