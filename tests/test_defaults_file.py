"""The defaults file (fast tier): where it is found, what it may say, and that a flag beats the
environment, which beats the file, which beats the built-in default, on the real command line."""

from __future__ import annotations

import datetime
import json

import pytest
import typer
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.cmd_meta import default_map, report_file
from ddtree_ops.cli.commands import app
from ddtree_ops.config.defaults_file import ENV_VAR, Defaults, load_defaults
from ddtree_ops.errors import EXIT_BAD_INPUT, DefaultsFileError
from ddtree_ops.testing.fake_host import fake_inventory

NOW = datetime.datetime(2026, 12, 2, 2, 30, 5, tzinfo=datetime.timezone.utc)


@pytest.fixture(autouse=True)
def no_inherited_config(monkeypatch):
    """Whatever the test run's environment says about defaults or the inventory does not count."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# finding and reading


def test_every_key_is_read_and_paths_are_relative_to_the_file_not_the_current_folder(tmp_path):
    conf = write(tmp_path / "ops" / "team.toml", 'inventory = "inv/prod.yaml"\nforks = 4\nbatch = "25%"\n'
                                                  'report_dir = "reports"\n')
    d = load_defaults(tmp_path / "elsewhere", {ENV_VAR: str(conf)})
    assert d == Defaults(source=str(conf), inventory=str(tmp_path / "ops/inv/prod.yaml"), forks=4, batch="25%",
                         report_dir=str(tmp_path / "ops/reports"))


def test_the_environment_names_the_file_before_the_folders_own_and_pyproject_comes_last(tmp_path):
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n[tool.ddtree-ops]\nforks = 3\n')
    assert load_defaults(tmp_path, {}).forks == 3
    write(tmp_path / "ddtree-ops.toml", "forks = 2\n")
    assert load_defaults(tmp_path, {}).forks == 2
    write(tmp_path / "ci.toml", "forks = 1\n")
    assert load_defaults(tmp_path, {ENV_VAR: "ci.toml"}).forks == 1


def test_a_pyproject_without_the_section_and_a_folder_without_files_give_no_defaults(tmp_path):
    assert load_defaults(tmp_path, {}) == Defaults()
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n[tool.ruff]\nline-length = 100\n')
    assert load_defaults(tmp_path, {}) == Defaults()


@pytest.mark.parametrize("name, text, key, says", [
    ("ddtree-ops.toml", "forkz = 3\n", "forkz", "unknown key; allowed: batch, forks, inventory"),
    ("ddtree-ops.toml", 'limit = "gpu"\n', "limit", "give --limit there"),
    ("ddtree-ops.toml", 'forks = "3"\n', "forks", "must be an integer 1..1000"),
    ("ddtree-ops.toml", "forks = 0\n", "forks", "must be an integer 1..1000"),
    ("ddtree-ops.toml", "forks = true\n", "forks", "must be an integer 1..1000"),
    ("ddtree-ops.toml", 'batch = "0%"\n', "batch", "targets per batch"),
    ("ddtree-ops.toml", 'batch = "150%"\n', "batch", "at most 100%"),
    ("ddtree-ops.toml", "max_unavailable = 1\n", "max_unavailable", "set it in the inventory"),
    ("ddtree-ops.toml", "inventory = 7\n", "inventory", "must be a path"),
    ("ddtree-ops.toml", "[deploy]\nforks = 2\n", "deploy", "unknown key"),
    ("pyproject.toml", "[tool.ddtree-ops]\nreport_dir = ''\n", "report_dir", "must be a path"),
    ("ddtree-ops.toml", "forks = \n", None, "not valid TOML"),
    ("pyproject.toml", "[tool\n", None, "not valid TOML"),
])
def test_a_wrong_file_is_refused_naming_the_file_and_the_key(tmp_path, name, text, key, says):
    path = write(tmp_path / name, text)
    with pytest.raises(DefaultsFileError) as ei:
        load_defaults(tmp_path, {})
    e = ei.value
    assert (e.exit_code, e.key) == (EXIT_BAD_INPUT, key) and says in e.problem
    assert str(e).startswith(str(path)) and "\n" not in str(e)


def test_a_named_file_that_does_not_exist_is_refused_not_skipped(tmp_path):
    with pytest.raises(DefaultsFileError, match=f"\\${ENV_VAR} names this file"):
        load_defaults(tmp_path, {ENV_VAR: "missing.toml"})


# ---------------------------------------------------------------------------------------------
# the default_map


def test_each_key_reaches_every_command_with_that_option_and_the_report_dir_a_file_per_run(tmp_path):
    d = Defaults(source="x", inventory="/inv.yaml", forks=3, batch="2", report_dir=str(tmp_path))
    group = typer.main.get_command(app)
    dm = default_map(group, typer.Context(group), d, NOW)
    assert dm["deploy"]["forks"] == 3 and dm["status"]["forks"] == 3 and dm["rollback"]["batch"] == "2"
    assert "batch" not in dm["status"] and "forks" not in dm.get("render", {})
    assert dm["render"] == {"inventory": "/inv.yaml"}
    assert dm["deploy"]["report"] == str(tmp_path / "deploy-20261202T023005Z.html")
    assert dm["rollback"]["report"] == str(tmp_path / "rollback-20261202T023005Z.html")
    assert "report" not in dm["status"]


def test_a_plugin_group_gets_no_defaults_even_for_an_option_of_the_same_name():
    """A plugin's options may share a name with ours, not a meaning: here its group's own --forks.
    Built with typer, as the CLI and its plugins are (typer's vendored click: a typer group is no
    click.Group, and an isinstance check on click's class gave this group the defaults)."""
    top, plugin = typer.Typer(), typer.Typer()

    @plugin.callback()
    def plugin_root(forks: int = typer.Option(1, "--forks")) -> None: ...

    @plugin.command("up")
    def up(forks: int = typer.Option(1, "--forks")) -> None: ...

    @top.command("status")
    def status(forks: int = typer.Option(1, "--forks")) -> None: ...

    top.add_typer(plugin, name="plugin")
    group = typer.main.get_command(top)
    assert default_map(group, typer.Context(group), Defaults(source="x", forks=3), NOW) == {"status": {"forks": 3}}


def test_a_click_group_is_a_group_too():
    """A plugin may still be written with click's own classes."""
    click = pytest.importorskip("click")
    plugin = click.Group("plugin", commands=[click.Command("up", params=[click.Option(["--forks"])])],
                         params=[click.Option(["--forks"])])
    top = click.Group("top", commands=[plugin, click.Command("status", params=[click.Option(["--forks"])])])
    assert default_map(top, click.Context(top), Defaults(source="x", forks=3), NOW) == {"status": {"forks": 3}}


def test_a_report_file_of_the_same_second_gets_a_new_name(tmp_path):
    first = report_file(str(tmp_path), "deploy", NOW)
    open(first, "w").close()
    assert report_file(str(tmp_path), "deploy", NOW) == str(tmp_path / "deploy-20261202T023005Z-1.html")


# ---------------------------------------------------------------------------------------------
# precedence on the command line: flag > environment > file > built-in


@pytest.fixture
def three_inventories(tmp_path, monkeypatch):
    """Inventories whose host renders a different budget: which one a command read shows."""
    for name, budget in (("file", 11), ("env", 12), ("flag", 13)):
        write(tmp_path / f"{name}.yaml", yaml.safe_dump(fake_inventory(1, budget=budget)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def budget_rendered(args: list[str], env: dict[str, str] | None = None) -> tuple[int, int | None, str]:
    out = CliRunner().invoke(app, ["render", "--host", "fh1", "--no-verify", "--json", *args], env=env)
    if out.exit_code:
        return out.exit_code, None, out.stderr
    unit = json.loads(out.stdout)["text"]
    return 0, int(unit.split("--speculative-ddtree-budget", 1)[1].split()[0]), out.stderr


def test_the_inventory_comes_from_the_flag_then_the_environment_then_the_file(three_inventories):
    code, _, err = budget_rendered([])  # the control: no file, no variable, no flag: the option is required
    assert code == EXIT_BAD_INPUT and "--inventory" in err
    write(three_inventories / "ddtree-ops.toml", 'inventory = "file.yaml"\n')
    assert budget_rendered([])[:2] == (0, 11)
    assert budget_rendered([], {"DDTREE_OPS_INVENTORY": "env.yaml"})[:2] == (0, 12)
    assert budget_rendered(["-i", "flag.yaml"], {"DDTREE_OPS_INVENTORY": "env.yaml"})[:2] == (0, 13)


def test_a_wrong_defaults_file_stops_every_command_with_one_line_and_exit_2(three_inventories):
    write(three_inventories / "ddtree-ops.toml", "forks = 0\n")
    code, _, err = budget_rendered(["-i", "flag.yaml"])
    assert code == EXIT_BAD_INPUT
    assert err == f"error: {three_inventories / 'ddtree-ops.toml'}: key 'forks': must be an integer 1..1000, got 0\n"
