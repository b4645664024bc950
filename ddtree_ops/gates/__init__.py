"""Gates that decide whether a server is fit to serve: start-up phases from its log, the health
gate and soak, the request router, the performance gate and its workload.

May import host, artifacts, config; never runbook, fleet or cli.
"""
