"""Settings live in the config layer: reading an inventory with a router and a perf gate loads
neither httpx nor any gate, and the gates use the very settings types config builds."""

from __future__ import annotations

import pytest

from kit import modules_loaded_by

READ_INVENTORY = """
from ddtree_ops.config.inventory import parse_inventory
base = {"address": "10.0.0.5", "python": "/opt/venv/bin/python", "site_packages": "/opt/venv/lib/site-packages",
        "model_path": "/models/k", "draft_model_path": "/models/d",
        "router": {"url": "http://10.0.0.9:30000"}, "perf_gate": {"concurrency": 2}}
host = parse_inventory({"all": {"vars": base, "hosts": {"h1": {}}}}).hosts["h1"]
assert host.router.worker == "http://10.0.0.5:30000" and host.perf_gate.enabled
assert host.perf_gate.workload.concurrency == 2
"""


def imported_by(code: str) -> list[str]:
    """httpx and the gates, as loaded by a fresh interpreter after `code`."""
    return modules_loaded_by(code, "httpx", "ddtree_ops.gates")


def test_reading_an_inventory_with_router_and_perf_gate_imports_no_http_and_no_gate():
    assert imported_by(READ_INVENTORY) == []


def test_the_probe_sees_a_gate_and_httpx_when_they_are_imported():
    # the control: the same probe, after importing the router client
    got = imported_by("import ddtree_ops.gates.router")
    assert "httpx" in got and "ddtree_ops.gates.router" in got


@pytest.mark.parametrize("gate_module, name, config_module", [
    ("ddtree_ops.gates.router", "RouterSettings", "ddtree_ops.config.router_settings"),
    ("ddtree_ops.gates.router", "normalize_url", "ddtree_ops.config.router_settings"),
    ("ddtree_ops.gates.perfgate", "Thresholds", "ddtree_ops.config.perfgate_settings"),
    ("ddtree_ops.gates.workload", "Workload", "ddtree_ops.config.workload_settings"),
])
def test_the_gates_use_the_settings_types_of_the_config_layer(gate_module, name, config_module):
    import importlib

    gate, config = importlib.import_module(gate_module), importlib.import_module(config_module)
    assert getattr(gate, name) is getattr(config, name)
    assert getattr(config, name).__module__ == config_module


def test_the_controller_knows_the_secrets_the_inventory_names_and_no_others(monkeypatch):
    from ddtree_ops.config.inventory import parse_inventory
    from ddtree_ops.config.secrets import known_secrets

    base = {"address": "10.0.0.5", "python": "/opt/venv/bin/python", "site_packages": "/opt/venv/lib/site-packages",
            "model_path": "/models/k", "draft_model_path": "/models/d", "api_key_env": "T_SERVER_KEY",
            "secrets_config": "/etc/sglang/secrets.yaml",
            "router": {"url": "http://10.0.0.9:30000", "admin_key_env": "T_ROUTER_KEY"}}
    host = parse_inventory({"all": {"vars": base, "hosts": {"h1": {}}}}).hosts["h1"]
    monkeypatch.setenv("T_SERVER_KEY", "s3rver")
    monkeypatch.setenv("T_ROUTER_KEY", "r0uter")
    monkeypatch.setenv("T_OTHER_KEY", "other")
    assert known_secrets(host) == ("s3rver", "r0uter")
    monkeypatch.delenv("T_ROUTER_KEY")
    monkeypatch.setenv("T_SERVER_KEY", "")  # set but empty: no key, not an empty secret
    assert known_secrets(host) == ()
