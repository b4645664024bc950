"""`plan` on a real sandbox host as a dry run of deploy: the four cases a deploy would refuse (an
`extra_args` typo SGLang's parser rejects, a port another process holds, a missing router key, a
model_path that does not exist) each exit 2 with deploy's message, a clean host exits 0, and
nothing on the host changed: its unit files, state folder, site-packages (no bytecode written)
and /tmp (the scratch folder removed) are as they were, the units still serving as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit import DFLASH_INFO, TestHost, _clean, make_patchset, run_cli, upstream_file

PORT_HOLDER_UNIT = "plan-test-port-holder.service"
FREE_PORT = 30077

# Mode, owner and sha256 of the unit folder and the state folder, the folders of site-packages and
# size and mtime of its files (a __pycache__ written there shows), the scratch folders in /tmp, in
# one round trip. A folder's own mtime is left out: preflight's write check (facts) creates and
# removes a probe file in each target folder, which changes nothing in it but that.
SNAPSHOT = r"""
import hashlib, json, os, sys
state, site = sys.argv[1], sys.argv[2]
out = {}
for root in ("/etc/systemd/system", state):
    for d, dirs, files in os.walk(root):
        for n in sorted(files):
            p = os.path.join(d, n)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else b""
            out[p] = [oct(st.st_mode), st.st_uid, hashlib.sha256(data).hexdigest()]
for d, dirs, files in os.walk(site):
    out.update({os.path.join(d, n): "dir" for n in dirs})
    for n in files:
        st = os.lstat(os.path.join(d, n))
        out[os.path.join(d, n)] = [st.st_size, st.st_mtime_ns]
out["/tmp"] = sorted(n for n in os.listdir("/tmp") if n.startswith("ddtree-ops-plan-"))
print(json.dumps(out))
"""


def snapshot(th: TestHost) -> dict:
    h = th.host
    tree = json.loads(th.ssh([h.python, "-c", SNAPSHOT, h.state_dir, h.site_packages]).stdout)
    units = {u: (th.unit_state(u), th.main_pid(u)) for u in (h.unit, *h.conflicts)}
    return {"tree": tree, "units": units}


def changes(before: dict, after: dict) -> dict:
    """What differs, by path (and the units), for the assertion's message."""
    b, a = before["tree"], after["tree"]
    return {"units": (before["units"], after["units"]) if before["units"] != after["units"] else None,
            **{k: (b.get(k), a.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}}


@pytest.fixture(scope="module")
def host(sandbox) -> TestHost:
    th = _clean(sandbox, "sbx1")
    yield th
    sandbox.inside(th.name, ["systemctl", "stop", PORT_HOLDER_UNIT], check=False)


@pytest.fixture(scope="module")
def patchset(tmp_path_factory) -> Path:
    return make_patchset(tmp_path_factory.mktemp("ps"), {
        "sglang/srt/speculative/ddtree_probe.py": b"PROBE = 'plan'\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# plan dry run\n"}, name="plan-dryrun")


def plan(th: TestHost, ps: Path, **host_vars) -> tuple[int, dict]:
    inv = th.with_vars(th.inventory.parent, **host_vars).inventory if host_vars else th.inventory
    r = run_cli("plan", "-i", str(inv), "-l", th.name, "-p", str(ps), "--json", timeout=120)
    assert r.stdout.strip(), r.stderr
    doc = r.json()
    assert r.code == doc["exit_code"], r.stderr
    return r.code, doc["plans"][0] if doc["plans"] else doc


def test_plan_refuses_what_deploy_would_and_changes_nothing(host, patchset, tmp_path):
    th = host.with_vars(tmp_path)  # an inventory copy in this test's folder, beside the variants below
    before = snapshot(th)

    code, clean = plan(th, patchset)
    assert code == 0 and clean["refusals"] == [], clean["refusals"]
    assert any(c.startswith("launch line: ddtree_ops.testing.standin accepts it with the new files")
               for c in clean["checked"]), clean["checked"]

    base_args = th.base_extra_args()
    code, typo = plan(th, patchset, extra_args=base_args + ["--mem-fraction-statc", "0.8"])
    assert code == 2
    assert any(r.startswith("launch check: ddtree_ops.testing.standin --parse-only refuses the new launch line")
               and "unrecognized arguments: --mem-fraction-statc" in r for r in typo["refusals"]), typo["refusals"]

    python = th.host.python
    host.sandbox.inside(th.name, ["systemd-run", f"--unit={PORT_HOLDER_UNIT}", python, "-c",
                                  f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {FREE_PORT})); "
                                  "s.listen(1); time.sleep(600)"])
    try:
        code, port = plan(th, patchset, port=FREE_PORT)
    finally:
        host.sandbox.inside(th.name, ["systemctl", "stop", PORT_HOLDER_UNIT], check=False)
    assert code == 2
    assert any(r.startswith(f"launch check: port {FREE_PORT} is held by pid ") for r in port["refusals"]), \
        port["refusals"]

    code, router = plan(th, patchset, router={"url": "http://127.0.0.1:9", "admin_key_env": "PLAN_SBX_UNSET_KEY"})
    assert code == 2
    assert any("PLAN_SBX_UNSET_KEY (router.admin_key_env) is not set" in r for r in router["refusals"]), \
        router["refusals"]

    missing = "/opt/models/not-there"
    code, model = plan(th, patchset, model_path=missing)
    assert code == 2
    [line] = [r for r in model["refusals"] if r.startswith(f"model_path {missing} does not exist on {th.name}")]

    after = snapshot(th)
    assert after == before, changes(before, after)

    # deploy refuses the same host with the same line, in preflight (exit 2, before any change)
    inv = th.with_vars(tmp_path, model_path=missing).inventory
    r = run_cli("deploy", "-i", str(inv), "-l", th.name, "-p", str(patchset), "--yes", timeout=120)
    assert r.code == 2 and line in r.stdout + r.stderr, r.stderr
    assert snapshot(th)["tree"] != before["tree"]  # control: deploy's lock file in the state folder shows
