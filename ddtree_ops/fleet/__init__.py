"""The fleet: which hosts, in which order (canary, batches, the failure budget), a multi-node
server as one target, the request router's client handed to each target's runbook, and the
status of many hosts at once.

May import runbook and the rooms below it; never cli.
"""
