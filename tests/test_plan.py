"""compute_plan from data (fast tier): what each file would become and every refusal, from the
facts the remote agent reports. No host."""

from __future__ import annotations

import hashlib

import pytest

from ddtree_ops.inventory import parse_inventory
from ddtree_ops.plan import compute_plan
from ddtree_ops.testing.fake_host import UPSTREAM_BYTES, UPSTREAM_REL, fake_inventory
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
