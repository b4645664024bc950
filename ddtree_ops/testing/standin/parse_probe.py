"""TEST PROBE of the launch check: with DDTREE_STANDIN_PARSE_RECORD set (an Environment= of the
unit, which the launch check must pass on), `--parse-only` appends one JSON line saying how the
parse ran: its uid and groups, HOME/USER, working directory, the interpreter's isolation flags and
sys.path, and the variables a test names in DDTREE_STANDIN_PARSE_ECHO. The launch-check tests read
it to prove the parse ran as the unit's User=, with the unit's environment, isolated."""

from __future__ import annotations

import json
import os
import sys

RECORD_VAR = "DDTREE_STANDIN_PARSE_RECORD"
ECHO_VAR = "DDTREE_STANDIN_PARSE_ECHO"


def record_parse(outcome: int) -> None:
    path = os.environ.get(RECORD_VAR)
    if not path:
        return
    echo = [n for n in os.environ.get(ECHO_VAR, "").split(",") if n]
    doc = {
        "outcome": outcome, "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
        "groups": sorted(os.getgroups()), "home": os.environ.get("HOME"), "user": os.environ.get("USER"),
        "cwd": os.getcwd(), "isolated": sys.flags.isolated, "no_site": sys.flags.no_site,
        "site_imported": "site" in sys.modules, "sys_path": sys.path,
        "echo": {n: os.environ.get(n) for n in echo},
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(doc) + "\n")
