"""compute_plan from data (fast tier): what each file would become and every refusal, from the
facts the remote agent reports. No host."""

from __future__ import annotations

import hashlib
import os

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.runbook.plan import compute_plan, plan_host, read_host
from ddtree_ops.testing.fake_host import UPSTREAM_BYTES, UPSTREAM_REL, fake_hosts, fake_inventory
from fast_kit import PROBE_REL

SHA_UP = hashlib.sha256(UPSTREAM_BYTES).hexdigest()
SHA_OTHER = "e" * 64


@pytest.fixture
def host():
    return parse_inventory(fake_inventory(1), "inv.yaml").hosts["fh1"]


def facts(host, *, files=None, version="0.5.23", current=None, installed=None, free_mb=10_000, units=None,
          site_packages_exists=True):
    return {
        "site_packages_exists": site_packages_exists, "sglang_version": version,
        "files": {f"{host.site_packages}/{rel}": ({"exists": True, "sha256": sha} if sha else {"exists": False})
                  for rel, sha in (files or {}).items()},
        "current": current, "current_release": {"installed": installed or {}} if current else None,
        "free_mb": {"site_packages": free_mb, "state_dir": free_mb}, "unit_text": None,
        "units": units or {}, "journal": None, "lock": None,
    }


def p(host, rel):
    return f"{host.site_packages}/{rel}"


CASES = [
    # (name, files on the host, current release installed {rel: sha}, expected {rel: status}, refusal fragment)
    ("fresh host", {PROBE_REL: None, UPSTREAM_REL: SHA_UP}, None,
     {PROBE_REL: "new", UPSTREAM_REL: "change"}, None),
    ("already deployed", {PROBE_REL: "NEW:" + PROBE_REL, UPSTREAM_REL: "NEW:" + UPSTREAM_REL}, None,
     {PROBE_REL: "same", UPSTREAM_REL: "same"}, None),
    ("upstream drifted", {PROBE_REL: None, UPSTREAM_REL: SHA_OTHER}, None,
     {PROBE_REL: "new", UPSTREAM_REL: "drift"}, "neither the upstream file nor what the current release installed"),
    ("upstream missing", {PROBE_REL: None, UPSTREAM_REL: None}, None,
     {UPSTREAM_REL: "drift"}, "upstream file missing"),
    ("unknown file in the way", {PROBE_REL: SHA_OTHER, UPSTREAM_REL: SHA_UP}, None,
     {PROBE_REL: "drift"}, "a file of unknown origin is in the way"),
    ("from the current release", {PROBE_REL: SHA_OTHER, UPSTREAM_REL: SHA_OTHER},
     {PROBE_REL: SHA_OTHER, UPSTREAM_REL: SHA_OTHER}, {PROBE_REL: "change", UPSTREAM_REL: "change"}, None),
]


@pytest.mark.parametrize("name, on_host, installed, expected, refusal", CASES, ids=[c[0] for c in CASES])
def test_file_statuses_and_drift_refusals(host, patchset, name, on_host, installed, expected, refusal):
    new = {f.path: f.sha256 for f in patchset.files}
    on_host = {rel: (new[rel] if isinstance(sha, str) and sha.startswith("NEW:") else sha)
               for rel, sha in on_host.items()}
    inst = {p(host, rel): sha for rel, sha in (installed or {}).items()}
    plan = compute_plan(host, patchset, facts(host, files=on_host, current="r1" if installed else None,
                                              installed=inst), "unit text\n")
    got = {f.rel: f.status for f in plan.files}
    assert {rel: got[rel] for rel in expected} == expected
    if refusal:
        assert any(refusal in r and "--force overrides" in r for r in plan.refusals), plan.refusals
        forced = compute_plan(host, patchset, facts(host, files=on_host), "unit text\n", force=True)
        assert not forced.refusals
    else:
        assert plan.refusals == ()


@pytest.mark.parametrize("kw, fragment", [
    ({"version": "0.5.22"}, "does not satisfy the patch set's sglang==0.5.23"),
    ({"version": None}, "no sglang dist-info"),
    ({"site_packages_exists": False}, "does not exist"),
    ({"free_mb": 10}, "not enough disk"),
])
def test_host_level_refusals(host, patchset, kw, fragment):
    plan = compute_plan(host, patchset, facts(host, files={UPSTREAM_REL: SHA_UP}, **kw), "u\n")
    assert any(fragment in r for r in plan.refusals), plan.refusals


def test_the_unit_diff_is_redacted_and_only_active_conflicts_are_stopped(host, patchset):
    unit = "ExecStart=/x --api-key sk-live-123 --port 1\nEnvironment=\"HF_TOKEN=hf_abc\"\n"
    plan = compute_plan(host, patchset, facts(host, files={UPSTREAM_REL: SHA_UP},
                                              units={"sglang-k26-dflash-cg.service": "active"}), unit)
    assert "sk-live-123" not in plan.unit_diff and "hf_abc" not in plan.unit_diff
    assert "--api-key ***" in plan.unit_diff and plan.stop_units == ("sglang-k26-dflash-cg.service",)
    assert plan.changes
    idle = compute_plan(host, patchset, facts(host, files={UPSTREAM_REL: SHA_UP},
                                              units={"sglang-k26-dflash-cg.service": "inactive"}), unit)
    assert idle.stop_units == ()


# --------------------------------------------------------------------------- secrets_config
# The API key reaches SGLang through a 0600 YAML file passed with `--config` (secrets_config); the
# preflight checks the file's facts (exists, regular file, mode, owner), never its content.

SECRETS = "/etc/sglang/ddtree-secrets.yaml"


def with_secrets(host, service_user="root", **vars_):
    inv = parse_inventory(fake_inventory(1, secrets_config=SECRETS, service_user=service_user, **vars_), "inv.yaml")
    return inv.hosts["fh1"]


def secrets_facts(host, secrets_file: dict | None, **extra):
    f = facts(host, files={UPSTREAM_REL: SHA_UP})
    if secrets_file is not None:
        f["files"][SECRETS] = {"path": SECRETS, **secrets_file}
    f.update(extra)
    return f


OK_FILE = {"exists": True, "is_file": True, "mode": 0o600, "uid": 0, "gid": 0}

SECRETS_CASES = [
    # (name, service_user, the file's facts (None: not asked for), extra facts, refusal fragment or None)
    ("root-owned 0600", "root", OK_FILE, {}, None),
    ("root-owned 0400", "root", {**OK_FILE, "mode": 0o400}, {}, None),
    ("missing", "root", {"exists": False}, {}, f"secrets_config {SECRETS} does not exist on the host"),
    ("not in the facts", "root", None, {}, "does not exist on the host"),
    ("a symlink", "root", {**OK_FILE, "is_file": False, "mode": 0o777}, {}, "is not a regular file"),
    ("a folder", "root", {"exists": True, "is_file": False, "mode": 0o700, "uid": 0}, {}, "is not a regular file"),
    ("group-readable", "root", {**OK_FILE, "mode": 0o640}, {}, "has mode 0640: group and others must have no access"),
    ("world-readable", "root", {**OK_FILE, "mode": 0o644}, {}, "(chmod 600 /etc/sglang/ddtree-secrets.yaml)"),
    ("group-writable", "root", {**OK_FILE, "mode": 0o620}, {}, "has mode 0620"),
    ("owned by another user", "root", {**OK_FILE, "uid": 1000}, {}, "is owned by uid 1000, not root"),
    ("non-root unit, root-owned", "sglang", OK_FILE, {},
     "owned by root, but the server runs as User=sglang, which cannot read a 0600 file it does not own"),
    ("non-root unit, its own file", "sglang", {**OK_FILE, "uid": 1001}, {}, None),
    ("non-root unit, uid known and equal", "sglang", {**OK_FILE, "uid": 1001}, {"service_user_uid": 1001}, None),
    ("non-root unit, another user's file", "sglang", {**OK_FILE, "uid": 1002}, {"service_user_uid": 1001},
     "is owned by uid 1002, not by sglang (uid 1001)"),
    ("non-root unit, owner cannot read", "sglang", {**OK_FILE, "uid": 1001, "mode": 0o200}, {},
     "its owner sglang cannot read it"),
]


@pytest.mark.parametrize("name, user, secrets_file, extra, fragment", SECRETS_CASES, ids=[c[0] for c in SECRETS_CASES])
def test_the_secrets_config_file_is_checked_in_preflight(host, patchset, name, user, secrets_file, extra, fragment):
    h = with_secrets(host, service_user=user)
    plan = compute_plan(h, patchset, secrets_facts(h, secrets_file, **extra), "u\n")
    if fragment is None:
        assert plan.refusals == (), plan.refusals
    else:
        assert any(fragment in r for r in plan.refusals), plan.refusals
        # --force overrides drift, never a secrets problem
        assert compute_plan(h, patchset, secrets_facts(h, secrets_file, **extra), "u\n", force=True).refusals


def test_without_secrets_config_its_facts_are_not_checked(host, patchset):
    assert host.secrets_config is None
    plan = compute_plan(host, patchset, secrets_facts(host, {**OK_FILE, "mode": 0o644}), "u\n")
    assert plan.refusals == ()


def test_read_host_asks_for_the_secrets_file_and_keeps_no_hash_of_it(tmp_path, patchset):
    """On a fake host (the real agent, in a folder): the file's facts reach the plan without
    its sha256; its owner is this process's user, so the owner check follows os.getuid()."""
    fake = fake_hosts(tmp_path / "h", secrets_config=SECRETS)[0]
    session = fake.session()
    assert "does not exist on the host" in " ".join(plan_host(session, patchset).refusals)
    fake.write(SECRETS, b"api-key: 'sk-plan-test'\n", mode=0o644)
    got = read_host(session, patchset)["files"][SECRETS]
    assert got["exists"] and got["is_file"] and got["mode"] == 0o644 and got.get("sha256") is None
    fake.write(SECRETS, b"api-key: 'sk-plan-test'\n", mode=0o600)
    refusals = plan_host(session, patchset).refusals
    assert not any("mode" in r for r in refusals), refusals
    assert any("not root" in r for r in refusals) == (os.getuid() != 0), refusals
    assert "sk-plan-test" not in repr(plan_host(session, patchset).to_dict())


@pytest.mark.parametrize("extra, words", [
    ({"journal_error": "/var/lib/ddtree-ops/journal.json is not valid JSON: Expecting value"}, "not valid JSON"),
    ({"journal": {"release": "r1", "step": 3}}, "names no step"),
])
def test_a_corrupt_journal_is_a_refusal_naming_the_way_out(host, patchset, extra, words):
    plan = compute_plan(host, patchset, {**facts(host), **extra}, "u\n")
    assert any(r.startswith("corrupt journal: ") and words in r and "docs/guarantees.md" in r for r in plan.refusals)
