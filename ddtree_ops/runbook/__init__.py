"""One host's runbook: the plan (a plain value), the phases of a deploy and a rollback, the
executor that runs them and the outcomes it reports.

May import gates, host, artifacts, config; never fleet or cli.
"""
