"""`--version` and shell completion (fast tier)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ddtree_ops.artifacts.patchset import load_patchset
from ddtree_ops.cli import cmd_meta
from ddtree_ops.cli.commands import DEFAULT_PATCHSET, app
from ddtree_ops.errors import EXIT_BAD_INPUT

VENV_BIN = Path(sys.executable).parent


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_version_prints_the_installed_package_version_and_the_sglang_target():
    out = invoke("--version")
    assert out.exit_code == 0
    assert out.stdout == f"ddtree-ops {metadata.version('ddtree-ops')} (SGLang target 0.5.23)\n"


def test_version_is_read_from_the_package_metadata_not_written_in(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "9.8.7")  # read when asked: cmd_meta imports it then
    assert invoke("--version").stdout.startswith("ddtree-ops 9.8.7 ")


def test_the_sglang_target_is_the_one_the_packaged_patch_set_is_written_for():
    spec = load_patchset(DEFAULT_PATCHSET).sglang_spec
    assert spec.contains(cmd_meta.SGLANG_TARGET) and str(spec) == f"=={cmd_meta.SGLANG_TARGET}"


def bash_completions(words: list[str], script: str) -> list[str]:
    """What bash offers for `words` (the last one being typed) with `script` loaded, running the
    installed `ddtree-ops` as a shell would."""
    line = " ".join(f"'{w}'" for w in words)
    probe = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n"
             f"_ddtree_ops_completion ddtree-ops\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DDTREE_OPS_CONFIG", None)
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    return done.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_bash_script_completes_the_commands_and_a_commands_options():
    out = invoke("completion", "bash")
    assert out.exit_code == 0
    script = out.stdout
    assert "complete -o default -F _ddtree_ops_completion ddtree-ops" in script
    assert "_DDTREE_OPS_COMPLETE=complete_bash" in script
    commands = bash_completions(["ddtree-ops", ""], script)
    assert {"render", "plan", "deploy", "rollback", "status", "bundle", "history", "completion"} <= set(commands)
    assert bash_completions(["ddtree-ops", "roll"], script) == ["rollback"] + [c for c in commands
                                                                            if c.startswith("roll") and c != "rollback"]
    assert {"--forks", "--force"} <= set(bash_completions(["ddtree-ops", "deploy", "--for"], script))
    assert bash_completions(["ddtree-ops", "deploy", "--for"], "") == []  # the control: no script, nothing offered


@pytest.mark.parametrize("shell, marker", [("zsh", "#compdef ddtree-ops"), ("fish", "complete --command ddtree-ops")])
def test_zsh_and_fish_scripts_are_printed(shell, marker):
    out = invoke("completion", shell)
    assert out.exit_code == 0 and marker in out.stdout and "_DDTREE_OPS_COMPLETE" in out.stdout


def test_an_unknown_shell_is_exit_2_naming_the_choices():
    out = invoke("completion", "tcsh")
    assert out.exit_code == EXIT_BAD_INPUT and out.stdout == ""
    assert out.stderr == "error: completion: unknown shell 'tcsh'; one of: bash, zsh, fish\n"


def test_typers_own_show_completion_option_is_there_too():
    group = typer.main.get_command(app)
    names = {o for p in group.params for o in p.opts}
    assert {"--version", "--install-completion", "--show-completion"} <= names
    assert "_DDTREE_OPS_COMPLETE=complete_bash" in invoke("--show-completion", "bash").stdout
