"""ddtree-ops: deploy the temperature-aware DDTree modules to SGLang hosts.

The package is a house of rooms by layer; each room's `__init__` says what lives there and what
it may import. From the top down (imports point down only; `lint-imports` checks it, see
[tool.importlinter] in pyproject.toml):

    cli        commands, tables, live view, reports
    fleet      rollout policy, multi-node servers, status of many hosts
    runbook    one host's phases, their executor, plans and outcomes
    gates      health, start-up phases, router, performance gate and workload
    host | artifacts    the connected host and its agent | patch sets, bundles, units
    config     inventory, schema, YAML, settings, redaction
    errors     one exception type per failure the operator acts on

`testing/` (sandbox hosts, the stand-in server, fakes) stands beside them: nothing in the product
imports it.
"""

__version__ = "0.1.0"
