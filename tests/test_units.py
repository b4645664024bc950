"""Unit rendering, systemd quoting, systemd-analyze verification, diff and read-back."""

from __future__ import annotations

import shlex
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_ops.artifacts import units
from ddtree_ops.artifacts.units import (
    UnitVerifyError,
    parse_exec_flags,
    render_unit,
    systemd_quote,
    unit_diff,
    verify_command,
    verify_unit,
)
from ddtree_ops.config.inventory import load_inventory, parse_inventory
from ddtree_ops.errors import InputError

REPO = Path(__file__).resolve().parent.parent
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)"
)


@pytest.fixture
def ct200():
    return load_inventory(REPO / "inventory" / "ct200.yaml").host("ct200")


def small_host(**vars_):
    base = {
        "address": "10.0.0.5",
        "python": "/opt/venv/bin/python",
        "site_packages": "/opt/venv/lib/python3.12/site-packages",
        "model_path": "/models/m",
        "draft_model_path": "/models/d",
    }
    base.update(vars_)
    return parse_inventory({"all": {"hosts": {"h1": base}}}, "test.yaml").host("h1")


def exec_words(unit_text: str) -> list[str]:
    """ExecStart's argv, continuations joined (approximation of systemd's parser for plain words)."""
    line = next(ln for ln in units._logical_lines(unit_text) if ln.startswith("ExecStart="))
    return shlex.split(line[len("ExecStart="):])


# --------------------------------------------------------------------------- rendering

def test_rendered_ct200_unit_has_the_production_launch_command(ct200):
    text = render_unit(ct200)
    assert exec_words(text) == [
        "/root/venv_sglang211/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/Kimi-K2.6",
        "--host", "0.0.0.0",
        "--port", "30000",
        "--tp", "8",
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", "/models/Kimi-K2.6-DFlash",
        "--speculative-ddtree-budget", "16",
        "--speculative-ddtree-topk-cap", "4",
        "--trust-remote-code", "--mem-fraction-static=0.88", "--cuda-graph-max-bs-decode=8",
    ]


def test_rendered_unit_has_service_settings_and_install_section(ct200):
    lines = render_unit(ct200).splitlines()
    for expected in (
        "[Unit]", "After=network-online.target", "Wants=network-online.target",
        "Conflicts=sglang-k26-dflash-cg.service", "[Service]", "Type=simple", "User=root",
        'Environment="NCCL_P2P_DISABLE=0"', 'Environment="SGLANG_HEALTH_CHECK_TIMEOUT=60"',
        "Restart=on-failure", "RestartSec=5", "TimeoutStopSec=60", "KillMode=control-group",
        "LimitNOFILE=65535", "[Install]", "WantedBy=multi-user.target",
    ):
        assert expected in lines, expected


def test_header_comment_names_template_and_host(ct200):
    first = render_unit(ct200).splitlines()[0]
    assert first == (
        "# Managed by ddtree-ops; rendered from sglang-ddtree.service.j2 for host ct200. "
        "Local edits are overwritten."
    )


def test_description_mentions_budget_and_topk(ct200):
    text = render_unit(replace(ct200, budget=32, topk_cap=6))
    desc = [ln for ln in text.splitlines() if ln.startswith("Description=")]
    assert len(desc) == 1 and "budget 32" in desc[0] and "topk cap 6" in desc[0]


def test_rendered_unit_ends_with_exactly_one_newline(ct200):
    text = render_unit(ct200)
    assert text.endswith("WantedBy=multi-user.target\n")


def test_host_without_extra_args_env_or_conflicts_renders_clean_exec_line():
    text = render_unit(small_host())
    words = exec_words(text)
    assert words[-2:] == ["--speculative-ddtree-topk-cap", "4"]
    assert "Conflicts=" not in text and "Environment=" not in text
    assert "\nRestart=on-failure\n" in text


@pytest.mark.parametrize(
    "field, value",
    [("budget", 0), ("budget", 1025), ("budget", True), ("budget", "16"),
     ("topk_cap", 17), ("topk_cap", 0), ("port", 0), ("port", 70000), ("tp", 0)],
)
def test_budget_out_of_range_is_rejected_before_rendering(ct200, field, value, tmp_path):
    # A template that would fail loudly if it were ever reached.
    (tmp_path / "sglang-ddtree.service.j2").write_text("{{ this_is_undefined }}")
    with pytest.raises(InputError) as ei:
        render_unit(replace(ct200, **{field: value}), templates_dir=tmp_path)
    assert "ct200" in str(ei.value) and repr(field) in str(ei.value)
    assert "this_is_undefined" not in str(ei.value)


@pytest.mark.parametrize("unit", ["sglang", "bad name.service", "x.service\nExecStartPre=/bin/sh"])
def test_invalid_unit_name_is_rejected_before_rendering(ct200, unit):
    with pytest.raises(InputError, match="'unit'"):
        render_unit(replace(ct200, unit=unit))


def test_newline_in_a_launch_value_is_rejected(ct200):
    with pytest.raises(InputError, match="'model_path'"):
        render_unit(replace(ct200, model_path="/models/x\nExecStartPre=/bin/rm"))


def test_missing_template_is_an_input_error(ct200, tmp_path):
    with pytest.raises(InputError, match="not found"):
        render_unit(ct200, templates_dir=tmp_path)


def test_undefined_template_variable_is_an_input_error_not_blank(ct200, tmp_path):
    (tmp_path / "sglang-ddtree.service.j2").write_text("[Service]\nExecStart={{ pyhton }}\n")
    with pytest.raises(InputError, match="pyhton"):
        render_unit(ct200, templates_dir=tmp_path)


def test_custom_template_dir_and_name_are_used(ct200, tmp_path):
    (tmp_path / "mine.service.j2").write_text("budget={{ budget }} unit={{ unit }} name={{ name }}\n")
    assert render_unit(replace(ct200, template="mine.service.j2"), templates_dir=tmp_path) == (
        "budget=16 unit=sglang-k26-ddtree.service name=ct200\n"
    )


# --------------------------------------------------------------------------- quoting

def test_systemd_quote_escapes_percent_dollar_and_quotes():
    assert systemd_quote("plain/path-1.0") == "plain/path-1.0"
    assert systemd_quote(16) == "16"
    assert systemd_quote("50%") == "50%%"
    assert systemd_quote("$HOME") == "$$HOME"
    assert systemd_quote('a "b"') == '"a \\"b\\""'
    assert systemd_quote("back\\slash") == '"back\\\\slash"'
    assert systemd_quote("two words") == '"two words"'
    assert systemd_quote("") == '""'
    assert systemd_quote(";") == '";"'
    assert systemd_quote("100% of $X y") == '"100%% of $$X y"'


def test_systemd_quote_keeps_a_newline_from_breaking_the_line():
    q = systemd_quote("a\nExecStartPre=/bin/sh")
    assert "\n" not in q and q == '"a\\nExecStartPre=/bin/sh"'


def test_environment_filter_always_quotes_and_doubles_percent():
    assert units.systemd_env("A=1") == '"A=1"'
    assert units.systemd_env("A=50%") == '"A=50%%"'
    assert units.systemd_env('A=x"y') == '"A=x\\"y"'


# --------------------------------------------------------------------------- verification

@needs_systemd_analyze
def test_rendered_ct200_unit_passes_systemd_analyze_verify(ct200):
    verify_unit(render_unit(ct200), ct200.unit, check_executables=False)


@needs_systemd_analyze
def test_minimal_host_unit_passes_systemd_analyze_verify():
    h = small_host()
    verify_unit(render_unit(h), h.unit, check_executables=False)


@needs_systemd_analyze
def test_checking_executables_locally_reports_the_missing_remote_python(ct200):
    with pytest.raises(UnitVerifyError) as ei:
        verify_unit(render_unit(ct200), ct200.unit, check_executables=True)
    assert any("/root/venv_sglang211/bin/python" in p for p in ei.value.problems)


@needs_systemd_analyze
def test_unknown_key_in_template_is_rejected_by_verify(ct200, tmp_path):
    good = (REPO / "templates" / "sglang-ddtree.service.j2").read_text()
    bogus = good.replace("RestartSec=5\n", "RestartSec=5\nRestartSecs=5\n")
    assert bogus != good
    (tmp_path / "sglang-ddtree.service.j2").write_text(bogus)
    text = render_unit(ct200, templates_dir=tmp_path)
    with pytest.raises(UnitVerifyError) as ei:
        verify_unit(text, ct200.unit, check_executables=False)
    assert any("RestartSecs" in p for p in ei.value.problems)
    # The problem names the unit, not the throw-away temp file.
    assert all("ddtree-ops-verify-" not in p for p in ei.value.problems)


@needs_systemd_analyze
def test_bad_value_in_template_is_rejected_by_verify(ct200, tmp_path):
    good = (REPO / "templates" / "sglang-ddtree.service.j2").read_text()
    (tmp_path / "sglang-ddtree.service.j2").write_text(good.replace("Restart=on-failure", "Restart=sometimes"))
    with pytest.raises(UnitVerifyError, match="restart specifier.*sometimes"):
        verify_unit(render_unit(ct200, templates_dir=tmp_path), ct200.unit, check_executables=False)


def test_substituting_executables_changes_only_the_program(ct200):
    text = render_unit(ct200)
    sub = units.substitute_executables(text)
    diff = [(a, b) for a, b in zip(text.splitlines(), sub.splitlines(), strict=True) if a != b]
    assert diff == [(
        "ExecStart=/root/venv_sglang211/bin/python -m sglang.launch_server \\",
        "ExecStart=/bin/true -m sglang.launch_server \\",
    )]


def test_substituting_executables_keeps_exec_prefixes_and_handles_quotes():
    text = 'ExecStartPre=-"/opt/my dir/x" arg\nExecStart=@/usr/bin/y z\n'
    assert units.substitute_executables(text) == "ExecStartPre=-/bin/true arg\nExecStart=@/bin/true z\n"


def fake_runner(rc, stderr="", stdout=""):
    calls = []

    def run(argv):
        calls.append((argv, Path(argv[-1]).read_text()))
        return SimpleNamespace(returncode=rc, stdout=stdout, stderr=stderr)

    run.calls = calls
    return run


def test_verify_treats_warning_as_error_even_when_exit_status_is_zero():
    run = fake_runner(0, "/tmp/x/a.service:9: Unknown key 'Bogus' in section [Service], ignoring.\n")
    with pytest.raises(UnitVerifyError, match="Bogus"):
        verify_unit("[Service]\nExecStart=/bin/true\n", "a.service", runner=run)


def test_verify_fails_on_nonzero_exit_even_without_a_known_message():
    with pytest.raises(UnitVerifyError, match="something odd"):
        verify_unit("[Service]\nExecStart=/bin/true\n", "a.service", runner=fake_runner(1, "something odd\n"))


def test_verify_passes_clean_output_and_writes_the_file_named_as_the_unit():
    run = fake_runner(0, "")
    verify_unit("[Service]\nExecStart=/x/python\n", "a.service", check_executables=False, runner=run)
    (argv, content), = run.calls
    assert argv[:4] == ["systemd-analyze", "verify", "--man=no", "--recursive-errors=no"]
    assert Path(argv[-1]).name == "a.service"
    assert content == "[Service]\nExecStart=/bin/true\n"


def test_missing_systemd_analyze_is_reported_with_install_hint(monkeypatch):
    monkeypatch.setattr(units.shutil, "which", lambda name: None)
    with pytest.raises(UnitVerifyError, match="apt-get install systemd"):
        verify_unit("[Service]\nExecStart=/bin/true\n", "a.service")


def test_verify_command_builds_the_argv_for_the_remote_check():
    assert verify_command("/var/lib/ddtree-ops/staging/sglang-k26-ddtree.service", "sglang-k26-ddtree.service") == [
        "systemd-analyze", "verify", "--man=no", "--recursive-errors=no",
        "/var/lib/ddtree-ops/staging/sglang-k26-ddtree.service",
    ]


def test_verify_command_refuses_a_file_not_named_as_the_unit():
    with pytest.raises(InputError):
        verify_command("/tmp/unit.tmp", "sglang-k26-ddtree.service")
    with pytest.raises(InputError):
        verify_command("/tmp/x.timer", "x.timer")


def test_verify_problems_classifies_remote_output():
    assert units.verify_problems(0, "", "") == []
    assert units.verify_problems(0, "", "x.service: Command /p is not executable: No such file\n") == [
        "x.service: Command /p is not executable: No such file"
    ]
    assert units.verify_problems(3, "", "") != []


def test_verify_problems_ignores_warnings_about_other_units_but_not_ours():
    other = "/lib/systemd/system/foo.service:3: Unknown key 'X' in section [Unit], ignoring."
    ours = "/tmp/d/a.service:7: Unknown key 'Y' in section [Service], ignoring."
    assert units.verify_problems(0, "", other, "a.service") == []
    assert units.verify_problems(0, "", other + "\n" + ours, "a.service") == [ours]
    assert units.verify_problems(0, "", other) == [other]
    assert units.verify_problems(1, "", other, "a.service") == [other]


# --------------------------------------------------------------------------- diff

def test_unit_diff_is_empty_when_equal():
    assert unit_diff("a\nb\n", "a\nb\n", "/etc/systemd/system/x.service") == ""


def test_unit_diff_labels_and_changed_lines():
    d = unit_diff("a\nbudget 7\n", "a\nbudget 16\n", "/etc/systemd/system/x.service")
    lines = d.splitlines()
    assert lines[0] == "--- a/etc/systemd/system/x.service"
    assert lines[1] == "+++ b/etc/systemd/system/x.service"
    assert "-budget 7" in lines and "+budget 16" in lines and " a" in lines


def test_unit_diff_against_a_missing_unit_uses_dev_null():
    d = unit_diff(None, "x\n", "/etc/systemd/system/x.service")
    assert d.splitlines()[0] == "--- /dev/null" and "+x" in d.splitlines()


def test_unit_diff_marks_a_missing_final_newline():
    d = unit_diff("a\nb", "a\nb\n", "x.service")
    assert "\\ No newline at end of file" in d and "-b" in d.splitlines() and "+b" in d.splitlines()


# --------------------------------------------------------------------------- read-back

OLD_CT200_UNIT = """\
[Unit]
Description=SGLang Kimi K2.6 DDTree
After=network-online.target

[Service]
Type=simple
User=root
Environment=NCCL_P2P_DISABLE=0
{exec_start}
Restart=on-failure

[Install]
WantedBy=multi-user.target
""".format(exec_start=(  # one long line, as it was written by hand
    "ExecStart=/root/venv_sglang211/bin/python -m sglang.launch_server --model-path /models/Kimi-K2.6 --tp 8 "
    "--trust-remote-code --speculative-algorithm DDTREE --speculative-draft-model-path /models/Kimi-K2.6-DFlash "
    "--speculative-ddtree-budget 7 --speculative-ddtree-topk-cap 3 --port 30000"))


def test_parse_exec_flags_reads_old_ct200_unit():
    assert parse_exec_flags(OLD_CT200_UNIT) == {"algorithm": "DDTREE", "budget": 7, "topk_cap": 3}


def test_parse_exec_flags_reads_back_a_rendered_unit(ct200):
    text = render_unit(replace(ct200, budget=48, topk_cap=5))
    assert parse_exec_flags(text) == {"algorithm": "DDTREE", "budget": 48, "topk_cap": 5}


def test_parse_exec_flags_handles_equals_form_and_continuations():
    text = "[Service]\nExecStart=/p -m s \\\n  --speculative-ddtree-budget=12 \\\n  --speculative-ddtree-topk-cap=2\n"
    assert parse_exec_flags(text) == {"budget": 12, "topk_cap": 2}


def test_parse_exec_flags_returns_empty_without_ddtree_flags():
    assert parse_exec_flags("[Service]\nExecStart=/p -m sglang.launch_server --tp 8\n") == {}
    assert parse_exec_flags("[Unit]\nDescription=x\n") == {}


def test_parse_exec_flags_skips_unreadable_values():
    text = "[Service]\nExecStart=/p --speculative-ddtree-budget lots --speculative-ddtree-topk-cap 2\n"
    assert parse_exec_flags(text) == {"topk_cap": 2}


@pytest.mark.parametrize("body", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch /tmp/ddtree-ops-pwned') }}",
    "{% set l = ['a'] %}{{ l.append('b') }}",  # even mutating its own values
])
def test_a_template_cannot_call_into_python(tmp_path, body):
    """Templates may come from someone else's bundle and render on the operator's machine."""
    from ddtree_ops.artifacts.units import render_unit
    from ddtree_ops.config.inventory import parse_inventory
    from ddtree_ops.testing.fake_host import fake_inventory

    (tmp_path / "evil.j2").write_text("[Service]\nExecStart=/bin/true " + body + "\n")
    host = parse_inventory(fake_inventory(1, template="evil.j2"), "inv.yaml").hosts["fh1"]
    with pytest.raises(InputError, match="refused: the template reaches outside"):
        render_unit(host, tmp_path)
    assert not Path("/tmp/ddtree-ops-pwned").exists()


def test_a_template_changed_on_disk_is_rendered_anew_though_its_folder_is_cached(ct200, tmp_path):
    import os

    tpl = tmp_path / "mine.service.j2"
    tpl.write_text("budget={{ budget }}\n")
    host = replace(ct200, template="mine.service.j2")
    assert render_unit(host, templates_dir=tmp_path) == f"budget={ct200.budget}\n"
    tpl.write_text("topk={{ topk_cap }}\n")
    st = tpl.stat()
    os.utime(tpl, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # a later write, whatever the clock's grain
    assert render_unit(host, templates_dir=tmp_path) == f"topk={ct200.topk_cap}\n"
