"""The ddtree.ops collection's molecule scenario (tests/ansible/molecule/default), stage by stage,
against 3 sandbox hosts behind a real smg that the scenario's own create starts (`sandbox up`)
and destroy ends; the collection is the one installed from its built tarball.

Between the stages the hosts are read directly (sha256, mode and owner of every unit file and of
sglang's speculative modules): check mode must change nothing, the broken canary must be restored
byte for byte, and the batch after it never touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ansible_kit import SCENARIO_DIR, VENV_BIN, ansible_env, build_and_install, managed_tree, run
from kit import REPO, TestHost

pytestmark = pytest.mark.sandbox

HOSTS = ("sbx1", "sbx2", "sbx3")


def _broken_patchset(tmp: Path) -> Path:
    """The patch set with a module that raises at import: the server dies while it loads."""
    dst = tmp / "broken"
    shutil.copytree(REPO / "patches" / "ddtree-temp", dst)
    mod = dst / "files" / "sglang" / "srt" / "speculative" / "ddtree_utils.py"
    mod.write_text(mod.read_text() + '\nraise RuntimeError("deliberately broken for the molecule side effect")\n')
    manifest = dst / "manifest.yaml"
    manifest.write_text("\n".join('version: "9.9.9+broken"' if line.startswith("version:") else line
                                  for line in manifest.read_text().splitlines()) + "\n")
    return dst


def _status(env: dict, inv: Path) -> dict[str, dict]:
    p = run([str(VENV_BIN / "python"), "-m", "ddtree_ops", "status", "-i", str(inv), "--json"], cwd=REPO, env=env,
            check=False)
    return {row["host"]: row for row in json.loads(p.stdout)["hosts"]}


def _first(out: str, needle: str) -> int:
    i = out.find(needle)
    assert i >= 0, f"{needle!r} not in the output:\n{out[-4000:]}"
    return i


def test_molecule_converges_canary_then_batch_idempotently_and_a_broken_canary_stops_the_play(tmp_path):
    installed = build_and_install(tmp_path)
    sbx = tmp_path / "sbx"
    env = ansible_env(installed, DDTREE_MOLECULE_DIR=str(sbx), DDTREE_MOLECULE_BROKEN=str(_broken_patchset(tmp_path)),
                      MOLECULE_EPHEMERAL_DIRECTORY=str(tmp_path / "molecule"))
    env.pop("DDTREE_SANDBOX_ROUTER_KEY", None)

    def molecule(stage: str) -> str:
        p = run([str(VENV_BIN / "molecule"), stage], cwd=SCENARIO_DIR, env=env, timeout=240)
        return p.stdout + p.stderr

    try:
        molecule("create")
        inv = sbx / "inventory.yaml"
        env["DDTREE_SANDBOX_ROUTER_KEY"] = (sbx / "router.key").read_text().strip()
        hosts = {n: TestHost(n, None, inv) for n in HOSTS}
        pristine = {n: managed_tree(h) for n, h in hosts.items()}

        # check mode: the plan says every host would change, and nothing changes
        out = molecule("check")
        for n in HOSTS:
            assert f"changed: [{n}]" in out
        assert {n: managed_tree(h) for n, h in hosts.items()} == pristine
        assert all(row["release"] is None for row in _status(env, inv).values())

        # converge: the canary alone first, then the batch of two; one rollout on every host
        out = molecule("converge")
        assert _first(out, "sbx1 | committed") < _first(out, "sbx2 | preflight")
        assert _first(out, "sbx1 | committed") < _first(out, "sbx3 | preflight")
        rows = _status(env, inv)
        assert {rows[n]["release_outcome"] for n in HOSTS} == {"deployed"}
        assert len({rows[n]["rollout"] for n in HOSTS}) == 1
        assert {(rows[n]["budget"], rows[n]["topk_cap"], rows[n]["algorithm"]) for n in HOSTS} == {(16, 4, "DDTREE")}

        # idempotence: molecule fails the stage on any `changed`
        out = molecule("idempotence")
        assert "changed=1" not in out
        deployed = {n: managed_tree(h) for n, h in hosts.items()}
        assert deployed != pristine

        # side effect: the broken canary fails with exit code 3, restored byte for byte; the play stops
        out = molecule("side-effect")
        _first(out, "sbx1 | FAILED at")
        _first(out, "sbx1 | rolled back")
        assert "sbx2 |" not in out and "sbx3 |" not in out
        assert {n: managed_tree(h) for n, h in hosts.items()} == deployed

        molecule("verify")
    finally:
        p = run([str(VENV_BIN / "molecule"), "destroy"], cwd=SCENARIO_DIR, env=env, timeout=120, check=False)
        if (sbx / "sandbox.json").exists():  # destroy did not get there: end the hosts ourselves
            run([str(VENV_BIN / "python"), "-m", "ddtree_ops", "sandbox", "down", "--dir", str(sbx)], cwd=REPO,
                env=env, check=False)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
