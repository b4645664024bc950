"""What is about the tool itself rather than the fleet: `--version`, `completion SHELL`, and the
defaults file (config/defaults_file.py) handed to every command as click's `default_map`.

The root callback runs before any command's options are parsed (click builds a command's context
after its group's callback), so setting `ctx.default_map` there reaches every command, the test
rig's plugin group excepted, without touching them: a key applies to each command that has an
option of that name (`forks` to deploy, rollback and status; `report_dir` becomes the `--report`
of deploy and rollback, one file per run).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import typer

from ..config.defaults_file import Defaults, load_defaults
from ..errors import DdtreeOpsError, InputError
from .common import log

PROG = "ddtree-ops"
COMPLETE_VAR = "_DDTREE_OPS_COMPLETE"
SHELLS = ("bash", "zsh", "fish")
# The SGLang release the packaged patch set is written for (patches/ddtree-temp/manifest.yaml;
# tests/test_cli_meta.py keeps the two equal).
SGLANG_TARGET = "0.5.23"


def version_text() -> str:
    from importlib import metadata  # only here: its import is about 0.05 CPU-s of every start

    try:
        version = metadata.version(PROG)
    except metadata.PackageNotFoundError:
        version = "unknown (not installed: pip install -e .)"
    return f"{PROG} {version} (SGLang target {SGLANG_TARGET})"


def report_file(folder: str, command: str, now: datetime.datetime) -> str:
    """`folder/<command>-<UTC time>.html`, never one that exists already."""
    stem = os.path.join(folder, f"{command}-{now.strftime('%Y%m%dT%H%M%SZ')}")
    path, n = f"{stem}.html", 1
    while os.path.exists(path):
        path, n = f"{stem}-{n}.html", n + 1
    return path


def _is_group(cmd: Any) -> bool:
    """A group of commands, click's or typer's: typer vendors its own click (typer._click), whose
    classes are not click's, and click itself is no dependency of this tool (only of import-linter,
    in the test venv), so an `isinstance(cmd, click.Group)` missed every typer group and the
    `import click` would fail where the tool is installed alone."""
    return callable(getattr(cmd, "list_commands", None))


def default_map(group: Any, ctx: typer.Context, defaults: Defaults, now: datetime.datetime) -> dict[str, Any]:
    """{command: {option: value}} for every command of `group` with an option the defaults set. A
    plugin's group (the test rig's `sandbox`) gets none: its options may share a name, not a meaning."""
    given = defaults.given()
    report_dir = given.pop("report_dir", None)
    out: dict[str, Any] = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or _is_group(cmd):
            continue
        params = {p.name for p in cmd.params}
        sub = {k: v for k, v in given.items() if k in params}
        if report_dir is not None and "report" in params:
            sub["report"] = report_file(report_dir, name, now)
        if sub:
            out[name] = sub
    return out


def _show_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


def root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                 help="Print the version (and the SGLang release it targets) and exit."),
) -> None:
    """Deploy the temperature-aware DDTree modules to SGLang hosts."""
    if ctx.resilient_parsing:  # shell completion: no file is read, nothing may be printed
        return
    try:
        defaults = load_defaults()
    except DdtreeOpsError as e:
        log(f"error: {e}")
        raise typer.Exit(e.exit_code) from None
    if defaults.source is not None:
        now = datetime.datetime.now(datetime.timezone.utc)
        ctx.default_map = {**default_map(ctx.command, ctx, defaults, now), **(ctx.default_map or {})}


def completion(shell: str = typer.Argument(..., metavar="SHELL", help="bash, zsh or fish.")) -> None:
    """Print the shell completion script for SHELL, e.g. `ddtree-ops completion bash >
    ~/.local/share/bash-completion/completions/ddtree-ops` (or `--install-completion`)."""
    from typer.completion import get_completion_script

    if shell not in SHELLS:
        e = InputError(f"completion: unknown shell {shell!r}; one of: {', '.join(SHELLS)}")
        log(f"error: {e}")
        raise typer.Exit(e.exit_code)
    sys.stdout.write(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell) + "\n")


def register(app: typer.Typer) -> None:
    """The root callback (--version, the defaults file) and the `completion` command."""
    app.info.name = PROG  # not the callback's: usage lines and test runners say `ddtree-ops`
    app.callback()(root)
    app.command("completion")(completion)
