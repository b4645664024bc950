"""The programs behind the `systemctl` and `nvidia-smi` stand-ins (fake_systemctl.py): run as a
script, `python -I -S systemctl_program.py PROGRAM ARGS...`, once per call the code under test
makes. Standard library only, and only its lighter modules: a call is an interpreter start, and the
heal tests make hundreds (48 -> 20 ms each without site-packages, dataclasses and pathlib).

The answers follow real systemd 252 where the code reads them: `show` prints one block per unit
asked (the service's MainPID before Id, ActiveState, UnitFileState; blank line between blocks; a
unit that does not exist is `inactive` with an empty UnitFileState), `is-active` prints the state
and exits 3 unless active. `ports` (unit → port) makes a unit started while another unit holds its
port end `failed`, as a server that cannot bind exits. `start_as` sets the state a started unit
ends in. `fail` in the state file makes a call exit with a code (keyed "VERB UNIT" or "VERB"), as a
unit whose stop times out would.
"""


import json
import os
import sys

STATE_ENV, LOG_ENV = "FAKE_SYSTEMCTL_STATE", "FAKE_SYSTEMCTL_LOG"
SHOW_ORDER = ("MainPID", "Id", "ActiveState", "UnitFileState")


def load_state(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def save_state(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def _show(state: dict, args: list[str]) -> str:
    props, i = [], 0
    while i + 1 < len(args) and args[i] == "-p":
        props.append(args[i + 1])
        i += 2
    blocks = []
    for unit in args[i:]:
        u = state["units"].get(unit)
        values = {"Id": unit, "ActiveState": u["active"] if u else "inactive",
                  "UnitFileState": u["enabled"] if u else "", "MainPID": str((u or {}).get("pid") or 0)}
        blocks.append("".join(f"{p}={values[p]}\n" for p in SHOW_ORDER if p in props))
    return "\n".join(blocks)


def _port_taken(state: dict, unit: str) -> bool:
    ports = state.get("ports", {})
    return unit in ports and any(other != unit and ports.get(other) == ports[unit] and u["active"] in
                                 ("active", "activating") for other, u in state["units"].items())


def systemctl(state: dict, args: list[str]) -> tuple[int, str, str]:
    verb, rest = args[0], args[1:]
    failure = state.get("fail", {}).get(" ".join(args[:2])) or state.get("fail", {}).get(verb)
    if failure:
        return failure, "", f"fake failure of {' '.join(args)}\n"
    if verb == "show":
        return 0, _show(state, rest), ""
    if verb == "daemon-reload":
        return 0, "", ""
    unit = rest[0]
    u = state["units"].setdefault(unit, {"active": "inactive", "enabled": "", "pid": 0})
    if verb == "is-active":
        return (0 if u["active"] == "active" else 3), u["active"] + "\n", ""
    if verb == "stop":
        u.update(active="inactive", pid=0)
    elif verb in ("restart", "start"):
        state["next_pid"] = state.get("next_pid", 1000) + 1
        u.update(active=state.get("start_as", {}).get(unit, "active"), pid=state["next_pid"])
        if _port_taken(state, unit):  # the server cannot bind its port: it exits, the unit fails
            u.update(active="failed", pid=0)
    elif verb in ("enable", "disable"):
        u["enabled"] = "enabled" if verb == "enable" else "disabled"
    else:
        return 1, "", f"Unknown command verb {verb}.\n"
    return 0, "", ""


def main(argv: list[str]) -> int:
    state_path, log = os.environ[STATE_ENV], os.environ[LOG_ENV]
    with open(log, "a") as fh:
        fh.write(json.dumps(argv) + "\n")
    state = load_state(state_path)
    if os.path.basename(argv[0]) == "nvidia-smi":
        out = "".join(f"{a['pid']}, {a['used_mib']}\n" for a in state.get("gpu_apps", []))
        rc, err = 0, ""
    else:
        rc, out, err = systemctl(state, argv[1:])
        save_state(state_path, state)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
