"""A site-packages the install cannot write is refused in preflight (fast tier): the agent's facts
name each target directory that cannot be written (the mount's read-only flag, then a file really
created and removed), and the plan turns them into a refusal naming the host and the path. On a
sandbox host with its site-packages remounted read-only: test_router_port_faults.py."""

from __future__ import annotations

import os

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.host.agent import facts as agent_facts
from ddtree_ops.runbook.plan import compute_plan
from ddtree_ops.testing.fake_host import fake_inventory


class _Vfs:
    def __init__(self, flag: int):
        self.f_flag = flag


def test_a_read_only_mount_is_named_by_its_flag(tmp_path, monkeypatch):
    (tmp_path / "sglang").mkdir()
    assert agent_facts.write_problem(str(tmp_path / "sglang")) is None  # control: writable
    monkeypatch.setattr(agent_facts.os, "statvfs", lambda d: _Vfs(os.ST_RDONLY))
    assert agent_facts.write_problem(str(tmp_path / "sglang")) == "mounted read-only"


def test_a_directory_that_refuses_a_new_file_is_named_with_the_error(tmp_path, monkeypatch):
    def refuse(*a, **kw):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(agent_facts.tempfile, "mkstemp", refuse)
    assert agent_facts.write_problem(str(tmp_path)) == "OSError: Read-only file system"


def test_the_write_check_leaves_nothing_behind(tmp_path):
    assert agent_facts.write_problem(str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []


def test_target_directories_are_checked_inside_site_packages_only(tmp_path, monkeypatch):
    sp = tmp_path / "site-packages"
    (sp / "sglang" / "srt").mkdir(parents=True)
    tried: list[str] = []
    monkeypatch.setattr(agent_facts, "write_problem", lambda d: tried.append(d) or "mounted read-only")
    found = agent_facts.unwritable_dirs([f"{sp}/sglang/srt/new_pkg/mod.py", f"{sp}/sglang/srt/x.py",
                                         f"{tmp_path}/elsewhere/y.py"], str(sp))
    assert found == {f"{sp}/sglang/srt": "mounted read-only"}  # a new directory: its nearest parent
    assert tried == [f"{sp}/sglang/srt"]  # nothing outside site-packages is tried


def test_an_unwritable_target_is_a_refusal_naming_host_and_path(patchset):
    host = parse_inventory(fake_inventory(1), "inv.yaml").hosts["fh1"]
    base = {"site_packages_exists": True, "sglang_version": "0.5.23", "files": {}, "current": None,
            "current_release": None, "free_mb": {}, "unit_text": None, "units": {}, "journal": None, "lock": None}
    assert not [r for r in compute_plan(host, patchset, base, "u\n").refusals if "read-only" in r]  # control
    d = f"{host.site_packages}/sglang/srt"
    plan = compute_plan(host, patchset, {**base, "unwritable": {d: "mounted read-only"}}, "u\n")
    assert f"site-packages is read-only: {d} cannot be written on fh1 (mounted read-only)" in " | ".join(
        plan.refusals), plan.refusals


@pytest.mark.parametrize("value", [None, [], "x"])
def test_facts_from_an_older_agent_refuse_nothing(patchset, value):
    host = parse_inventory(fake_inventory(1), "inv.yaml").hosts["fh1"]
    base = {"site_packages_exists": True, "sglang_version": "0.5.23", "files": {}, "current": None,
            "current_release": None, "free_mb": {}, "unit_text": None, "units": {}, "journal": None, "lock": None,
            "unwritable": value}
    assert not [r for r in compute_plan(host, patchset, base, "u\n").refusals if "read-only" in r]
