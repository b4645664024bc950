"""The operators' everyday commands against real sandbox hosts (real journald, sshd, agent):
what only a real host proves -- journalctl's output and cursors, the --since spellings it
accepts, the agent's scrubbing of secret files, following until Ctrl-C while one host is lost,
`status --watch` and `metrics` over SSH, and `diff` reading a real release store's backups."""

from __future__ import annotations

import dataclasses
import re
import signal
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from ddtree_ops.artifacts.patchset import load_patchset
from ddtree_ops.cli.commands import app
from ddtree_ops.config.inventory import load_inventory, with_overrides
from ddtree_ops.fleet.logs import make_query, read_journal
from ddtree_ops.host.session import open_session
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.testing.ssh_outage import SshOutage
from kit import _clean, make_patchset, run_cli, wait_for, write_inventory

SECRET = "hf-tok-" + uuid.uuid4().hex[:12]
ENV_FILE = "/etc/ddtree-ops-logtest.env"
SHORT_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}[+-]\d{4} ")
PROBE = "sglang/srt/speculative/ddtree_probe.py"


@pytest.fixture(scope="module")
def ticking(sandbox, tmp_path_factory):
    """sbx1 and sbx2 each with a unit that logs a numbered line (and the secret) every 0.3 s, and
    an environment_file holding the secret; an inventory naming that file. All removed after."""
    names = ["sbx1", "sbx2"]
    unit = f"ddtree-logtest-{uuid.uuid4().hex[:6]}.service"
    script = f'i=0; while true; do echo "tick $i token {SECRET}"; i=$((i+1)); sleep 0.3; done'
    for n in names:
        sandbox.inside(n, ["sh", "-c", f"printf 'HF_TOKEN={SECRET}\\n' > {ENV_FILE}; chmod 600 {ENV_FILE}"])
        sandbox.inside(n, ["systemd-run", f"--unit={unit}", "sh", "-c", script])
    inv = write_inventory(sandbox, tmp_path_factory.mktemp("ops") / "inv.yaml",
                          {n: {"environment_file": ENV_FILE} for n in names})
    try:
        yield inv, unit
    finally:
        for n in names:
            sandbox.inside(n, ["systemctl", "stop", unit], check=False)
            sandbox.inside(n, ["rm", "-f", ENV_FILE], check=False)


def test_logs_reads_the_real_journal_host_prefixed_with_the_secret_files_values_scrubbed(ticking):
    inv, unit = ticking
    host = load_inventory(inv).hosts["sbx1"]
    session = open_session(host)
    try:
        wait_for(lambda: len(read_journal(session, make_query(3, None, unit)).lines) == 3, 20, what="3 lines")
        # The control: the same journal read without the host's secret file shows the value.
        session.host = dataclasses.replace(host, environment_file=None)
        assert any(SECRET in ln for ln in read_journal(session, make_query(3, None, unit)).lines)
    finally:
        session.close()
    r = run_cli("logs", "-i", str(inv), "-l", "sbx1,sbx2", "--unit", unit, "--since", "10 min ago", "-n", "3")
    assert r.code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert {ln.split(" | ")[0] for ln in lines} == {"sbx1", "sbx2"} and len(lines) == 6, r.stdout
    assert all(SHORT_ISO.match(ln.split(" | ", 1)[1]) for ln in lines), r.stdout
    assert SECRET not in r.stdout and all("token ***" in ln for ln in lines), r.stdout


def _ticks(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for m in (re.search(r" tick (\d+) ", ln) for ln in lines) if m]


def test_every_since_spelling_ddtree_ops_passes_is_one_journalctl_accepts(ticking):
    inv, unit = ticking
    session = open_session(load_inventory(inv).hosts["sbx1"])
    try:
        for since in ("2020-01-01 00:00", "-1h", "-30min", "10 min ago", "2 days ago", "-5s", "today", "yesterday"):
            read_journal(session, make_query(2, since, unit))  # a refusal would raise, naming journalctl's rc
        future = read_journal(session, make_query(2, "2099-01-01", unit))
        assert future.lines == []  # the control: the value is really applied
        # With --since, --lines keeps the newest lines, as without it (not the first ones since T).
        # That needs more lines than asked for in the journal: the unit may have started a moment
        # ago on a loaded machine, so wait for tick 4 instead of assuming it was written.
        wait_for(lambda: max(_ticks(read_journal(session, make_query(1, None, unit)).lines), default=-1) >= 4,
                 20, what="tick 4 in the journal")
        newest = _ticks(read_journal(session, make_query(2, None, unit)).lines)
        since_long_ago = _ticks(read_journal(session, make_query(2, "2020-01-01", unit)).lines)
        assert newest[0] >= 3 and since_long_ago[0] >= newest[0], (newest, since_long_ago)
    finally:
        session.close()


def test_follow_goes_on_when_a_host_is_lost_and_ctrl_c_exits_0(sandbox, ticking, start_cli):
    inv, unit = ticking
    p = start_cli("logs", "-i", str(inv), "-l", "sbx1,sbx2", "--unit", unit, "-f", "-n", "4", "--since", "-10min")
    wait_for(lambda: p.out_path.read_text().count("sbx2 | ") >= 3, 20, what="sbx2's followed lines")
    outage = SshOutage(sandbox, "sbx2").start(3.0)
    try:
        wait_for(lambda: "lost while following: sbx2: " in p.stderr(), 20, what="sbx2 reported lost")
        seen = p.out_path.read_text().count("sbx1 | ")
        wait_for(lambda: p.out_path.read_text().count("sbx1 | ") >= seen + 3, 20, what="sbx1 going on")
    finally:
        outage.wait()
    p.signal(signal.SIGINT)
    r = p.wait(30)
    assert r.code == 0, r.stderr
    assert r.stderr.count("lost while following: sbx2: ") == 1 and "Traceback" not in r.stderr, r.stderr
    ticks = [int(m) for m in re.findall(r"^sbx1 \| .* tick (\d+) ", r.stdout, re.M)]
    assert ticks == sorted(set(ticks)) and len(ticks) >= 6, r.stdout  # in order, none twice


def test_status_watch_and_metrics_over_ssh(ticking, start_cli, tmp_path):
    inv, _ = ticking
    p = start_cli("status", "-i", str(inv), "-l", "sbx1", "--watch", "--interval", "0.5")
    wait_for(lambda: p.out_path.read_text().count("== status at") >= 2, 30, what="two watch rounds")
    p.signal(signal.SIGINT)
    r = p.wait(30)
    assert "sbx1" in r.stdout and "Traceback" not in r.stderr, r.stderr

    out = tmp_path / "ddtree_ops.prom"
    m = CliRunner().invoke(app, ["metrics", "-i", str(inv), "-l", "sbx1,sbx2", "--out", str(out)],
                           catch_exceptions=False)
    assert m.exit_code == 0, m.stderr
    samples = {(s.name, s.labels.get("host")): s.value
               for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples}
    assert samples[("ddtree_ops_host_reachable", "sbx1")] == 1 and samples[("ddtree_ops_host_reachable", "sbx2")] == 1
    assert r.code == (0 if samples[("ddtree_ops_host_ok", "sbx1")] == 1 else 1)  # the last round's verdict


@pytest.fixture(scope="module")
def two_releases(sandbox, tmp_path_factory):
    """sbx3 with two releases: PROBE = 1 at budget 16, then PROBE = 2 at budget 10."""
    th = _clean(sandbox, "sbx3")
    root = tmp_path_factory.mktemp("diffps")
    host = load_inventory(th.inventory).hosts["sbx3"]
    rels = []
    for version, budget in (("1.0.0", 16), ("2.0.0", 10)):
        ps_dir = make_patchset(root / version, {PROBE: f"PROBE = {version[0]}\nSAME = 0\n".encode()},
                               name="diffps", version=version)
        session = open_session(with_overrides(host, budget=budget))
        try:
            res = deploy_host(session, load_patchset(str(ps_dir)), DeployOptions())
        finally:
            session.close()
        assert res.exit_code == 0, res
        rels.append(res.release)
    return th, rels


def test_diff_reads_a_real_release_store_and_refuses_an_unknown_release(two_releases):
    th, (rel1, rel2) = two_releases
    r = CliRunner().invoke(app, ["diff", "-i", str(th.inventory), "--host", "sbx3", rel1, rel2],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert "budget: 16 → 10" in r.stdout and "-PROBE = 1" in r.stdout and "+PROBE = 2" in r.stdout, r.stdout
    assert re.search(r"^-\s*--speculative-ddtree-budget 16", r.stdout, re.M), r.stdout  # the unit's diff
    assert re.search(r"^\+\s*--speculative-ddtree-budget 10", r.stdout, re.M), r.stdout
    bad = CliRunner().invoke(app, ["diff", "-i", str(th.inventory), "--host", "sbx3", rel1, "20990101T000000Z-000000"],
                             catch_exceptions=False)
    assert bad.exit_code == 2 and "20990101T000000Z-000000" in bad.stderr and "Traceback" not in bad.stderr
