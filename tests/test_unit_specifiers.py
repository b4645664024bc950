"""A `%` in an inventory value reaches the unit as `%%`, so systemd reads the value itself, never
a specifier (`%H` would become the host name, `%n` the unit name)."""

from __future__ import annotations

import re

import pytest

from ddtree_ops.artifacts.units import _logical_lines, render_unit, systemd_value
from ddtree_ops.config.inventory import parse_inventory

PERCENT_VALUES = {
    "python": "/opt/venv%H/bin/python",
    "model_path": "/models/kimi%n",
    "draft_model_path": "/models/draft%%m",
    "environment_file": "/etc/ddtree/%H.env",
    "secrets_config": "/etc/ddtree/%u-secrets.yaml",
    "extra_args": ["--served-model-name", "k2%i"],
}


def host_with_percents(template: str = "sglang-ddtree.service.j2", **extra):
    doc = {"address": "10.0.0.5", "site_packages": "/opt/venv/lib/python3.12/site-packages",
           "template": template, **PERCENT_VALUES, **extra}
    return parse_inventory({"all": {"hosts": {"h1": doc}}}, "test.yaml").host("h1")


def lone_percents(unit_text: str) -> list[str]:
    """Setting lines holding a `%` that is not part of `%%` (comments are never expanded)."""
    return [ln for ln in _logical_lines(unit_text)
            if not ln.lstrip().startswith(("#", ";")) and "%" in re.sub("%%", "", ln)]


@pytest.mark.parametrize("template", ["sglang-ddtree.service.j2", "sglang-dflash.service.j2"])
def test_every_percent_in_a_rendered_unit_is_doubled(template):
    text = render_unit(host_with_percents(template))
    assert "%H.env" not in text.replace("%%H.env", "")
    assert lone_percents(text) == []


def test_the_check_finds_a_percent_left_raw():
    # The control: a template that puts the value in raw is caught by the same check.
    text = render_unit(host_with_percents()).replace("EnvironmentFile=/etc/ddtree/%%H.env",
                                                     "EnvironmentFile=/etc/ddtree/%H.env")
    assert [ln for ln in lone_percents(text) if ln.startswith("EnvironmentFile=")]


def test_systemd_value_doubles_every_percent():
    assert systemd_value("/etc/%H/%%x") == "/etc/%%H/%%%%x"
    assert systemd_value("sglang") == "sglang"


@pytest.mark.sandbox
def test_real_systemd_reads_the_values_back_unexpanded(sandbox):
    """The rendered unit loaded by the host's systemd: `systemctl show` gives back each value
    exactly as the inventory wrote it."""
    h = host_with_percents(unit="ddtree-percent-probe.service")
    text = render_unit(h)
    path = "/run/systemd/system/ddtree-percent-probe.service"  # runtime only: gone at the host's next boot
    name = sandbox.hosts()[0].name
    try:
        _write_inside(sandbox, name, path, text)
        sandbox.inside(name, ["systemctl", "daemon-reload"])
        shown = sandbox.inside(name, ["systemctl", "show", "-p", "EnvironmentFiles", "-p", "ExecStart",
                                      "ddtree-percent-probe.service"]).stdout
    finally:
        sandbox.inside(name, ["rm", "-f", path], check=False)
        sandbox.inside(name, ["systemctl", "daemon-reload"], check=False)
    assert "EnvironmentFiles=/etc/ddtree/%H.env " in shown, shown
    assert "/opt/venv%H/bin/python" in shown and "/models/kimi%n" in shown and "k2%i" in shown, shown
    assert "/models/draft%%m" in shown, shown
    host_name = sandbox.inside(name, ["hostname"]).stdout.strip()
    assert f"/etc/ddtree/{host_name}.env" not in shown


def _write_inside(sandbox, name: str, path: str, text: str) -> None:
    write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    sandbox.inside(name, ["python3", "-c", write, path, text])
