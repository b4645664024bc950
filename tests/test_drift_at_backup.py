"""A file edited on a real host between preflight and backup is not backed up and replaced.

The deploy is held at the pause point "before-backup" (ddtree_ops.testing.pause_points; the lock
is held, preflight has read every target's sha256), a target is edited on the host, and the
deploy goes on: the backup refuses (exit 2, one line naming host, file and "changed since
preflight"), the host byte-identical to how the edit left it, DFlash still serving, no journal,
no current release. The control: the same edit with --force is backed up and replaced (exit 0).
Sandbox tier (a real systemd host over SSH).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree_ops.testing.pause_points import PAUSE_AT, PAUSE_FILE
from kit import DFLASH_INFO, host_tree, make_patchset, sha256_bytes, upstream_file, wait_for

DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"
PROBE = "sglang/srt/speculative/ddtree_probe.py"
STATE = "/var/lib/ddtree-ops"


def _deploy_paused(th, ps: Path, start_cli, marker: Path, *extra: str):
    p = start_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(ps), "--yes", "--json", *extra,
                  env={PAUSE_AT: "before-backup", PAUSE_FILE: str(marker)})

    def there():
        assert p.proc.poll() is None, f"the tool exited before the pause point:\n{p.stderr()[-3000:]}"
        return marker.exists() and marker.read_text().strip()

    wait_for(there, 120, what="the deploy to pause before its backup")
    return p


def _hand_edit(th, rel: str, line: str) -> None:
    th.ssh(["sh", "-c", 'printf "%s\\n" "$2" >> "$1"', "sh", f"{th.host.site_packages}/{rel}", line])


def test_a_file_edited_between_preflight_and_backup_is_refused_and_with_force_replaced(clean_host, start_cli,
                                                                                       tmp_path):
    th = clean_host
    h = th.host
    ps = make_patchset(tmp_path, {DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# patched\n", PROBE: b"P = 1\n"},
                       name="drift")
    marker = tmp_path / "pause"
    p = _deploy_paused(th, ps, start_cli, marker)
    _hand_edit(th, DFLASH_INFO, "# an operator's hot fix")
    edited_tree = host_tree(th)
    edited = th.read(f"{h.site_packages}/{DFLASH_INFO}")
    marker.unlink()
    r = p.wait(180)

    assert r.code == 2, r.stderr
    # one refusal line for the host, and the rollout's abort line gives the same reason once
    errors = [ln for ln in r.stderr.splitlines() if "changed since preflight" in ln]
    assert len(errors) == 2 and all(DFLASH_INFO in e for e in errors), r.stderr
    assert errors[0].startswith(f"[{h.name}] refused: {h.name}: ") and errors[0].count(h.name) == 2, r.stderr
    assert errors[1].startswith("== rollout aborted: canary refused") and errors[1].count(h.name) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert host_tree(th) == edited_tree  # nothing installed, nothing restored, bytecode untouched
    assert th.unit_state(DFLASH) == "active" and th.unit_state(DDTREE) != "active"
    assert th.read(f"{STATE}/journal.json") is None and th.read(f"{STATE}/current") is None
    releases = json.loads(th.ssh(["sh", "-c", f"cat {STATE}/releases/*/release.json"]).stdout)
    assert releases["outcome"].startswith("refused at backup")

    # control: --force backs the edited file up and replaces it, edited again at the same point
    marker2 = tmp_path / "pause2"
    p = _deploy_paused(th, ps, start_cli, marker2, "--force")
    _hand_edit(th, DFLASH_INFO, "# and edited once more")
    marker2.unlink()
    r = p.wait(300)
    assert r.code == 0, r.stderr
    snap = th.snapshot([f"{h.site_packages}/{DFLASH_INFO}"])
    assert snap[f"{h.site_packages}/{DFLASH_INFO}"] == sha256_bytes((ps / "files" / DFLASH_INFO).read_bytes())
    assert th.unit_state(DDTREE) == "active"
    assert edited is not None and edited.endswith(b"# an operator's hot fix\n")
