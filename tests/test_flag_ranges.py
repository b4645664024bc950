"""Every number on the command line is range-checked before anything connects: exit 2, one
line naming the flag, and not one SSH connection opened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.cli.flag_ranges import check_rollout_flags
from ddtree_ops.errors import InputError
from ddtree_ops.host.transport import HostConnection
from ddtree_ops.testing.fake_host import fake_inventory


@pytest.fixture
def inv(tmp_path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump(fake_inventory(3)))
    return p


@pytest.fixture
def connections(monkeypatch) -> list[str]:
    """Every SSH connection the command tries (none may be tried for a bad flag)."""
    tried: list[str] = []

    def refuse(self):
        tried.append(self.host.name)
        raise AssertionError("a connection was opened")
    monkeypatch.setattr(HostConnection, "open", refuse)
    return tried


BAD_FLAGS = [
    ("deploy", ["--deadline", "-5"], "--deadline"),
    ("deploy", ["--deadline", "0"], "--deadline"),
    ("deploy", ["--deadline", "nan"], "--deadline"),
    ("deploy", ["--deadline", "inf"], "--deadline"),
    ("deploy", ["--forks", "0"], "--forks"),
    ("deploy", ["--forks", "-3"], "--forks"),
    ("deploy", ["--canary", "-1"], "--canary"),
    ("deploy", ["--batch", "0"], "--batch"),
    ("deploy", ["--batch", "150%"], "--batch"),
    ("deploy", ["--max-fail", "-1%"], "--max-fail"),
    ("deploy", ["--max-fail", "101%"], "--max-fail"),
    ("rollback", ["--forks", "0"], "--forks"),
    ("rollback", ["--batch", "-2"], "--batch"),
    ("status", ["--forks", "0"], "--forks"),
]


@pytest.mark.parametrize(("command", "flags", "named"), BAD_FLAGS, ids=[f"{c} {' '.join(f)}" for c, f, _ in BAD_FLAGS])
def test_a_number_out_of_range_is_refused_with_exit_2_before_any_connection(inv, connections, command, flags, named):
    r = CliRunner().invoke(app, [command, "-i", str(inv), "--yes" if command != "status" else "--json", *flags],
                           catch_exceptions=False)
    out = r.stdout + r.stderr
    assert r.exit_code == 2, out
    assert "Traceback" not in out
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], out
    assert connections == []


def test_numbers_in_range_pass_the_same_checks():
    # The control: the checks above refuse the values, not the flags.
    check_rollout_flags(3, forks=1, canary=0, batch="1", max_fail="0%", deadline_s=1)
    check_rollout_flags(3, forks=1000, canary=3, batch="100%", max_fail="100%", deadline_s=86400)
    check_rollout_flags(3, forks=10)
    with pytest.raises(InputError, match="--forks"):
        check_rollout_flags(3, forks=1001)
    with pytest.raises(InputError, match="--deadline"):
        check_rollout_flags(3, forks=10, deadline_s=86401)


def test_a_good_flag_goes_on_to_read_the_hosts(inv, connections):
    # The same command with an in-range value gets past the checks: every host gets its row.
    r = CliRunner().invoke(app, ["status", "-i", str(inv), "--json", "--forks", "1"])
    assert "--forks" not in r.stderr, r.stderr
    assert [row["host"] for row in json.loads(r.stdout)["hosts"]] == ["fh1", "fh2", "fh3"], r.stdout + r.stderr
