"""Inventory: Ansible-style YAML (hosts, groups with children, vars) → validated `Host` values.

Layout, as an Ansible user writes it::

    all:
      vars: {...}              # lowest precedence
      children:
        gpu:
          vars: {...}          # group vars (a child group overrides its parent)
          hosts:
            ct200:
              address: ...     # host vars, highest precedence

Precedence is host > child group > parent group > all. Every value is checked here, at the
edge, so that nothing later has to wonder whether a path contains a newline or a budget is
`16; rm -rf /`. Errors name the file, the host and the field, and say what is allowed.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import yaml

from .errors import InputError, InventoryError

BUDGET_MAX = 1024

# systemd.unit(5): "valid unit names consist of a 'unit name prefix' and a suffix ...
# ASCII letters, digits, ':', '-', '_', '.', and '\'"; '@' separates a template instance.
_UNIT_SUFFIXES = (
    "service", "socket", "device", "mount", "automount", "swap", "target", "path",
    "timer", "slice", "scope",
)
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.(%s)$" % "|".join(_UNIT_SUFFIXES))
_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Launch arguments travel into a systemd ExecStart= line; we allow what flags and paths need.
_ARG_RE = re.compile(r"^[A-Za-z0-9_./:=,@+%-]+$")
# Flags whose value is a secret: never in a unit's ExecStart (see environment_file).
_SECRET_FLAGS = {"--api-key", "--admin-api-key"}
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_URL_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$")


def is_valid_unit_name(name: str) -> bool:
    return isinstance(name, str) and len(name) <= 255 and bool(_UNIT_RE.match(name))


@dataclass(frozen=True)
class HealthSettings:
    """How the health gate decides a restarted server is good."""

    load_deadline_s: float = 1800.0  # weights of a 1T model take many minutes
    poll_interval_s: float = 2.0
    consecutive_successes: int = 3  # a flapping /health must not pass
    request_timeout_s: float = 30.0  # > SGLang's 20 s detokenizer window
    min_accept_length: float | None = None
    generate_prompt: str = "The capital of France is"
    generate_max_new_tokens: int = 8


@dataclass(frozen=True)
class Host:
    """One host, every var resolved (host > group > all) and validated."""

    name: str
    address: str
    ssh_port: int
    ssh_user: str
    identity_file: str | None
    known_hosts: str
    connect_timeout_s: float
    python: str
    site_packages: str
    unit: str
    conflicts: tuple[str, ...]
    state_dir: str
    port: int
    base_url: str
    listen_host: str
    launch_module: str
    model_path: str
    draft_model_path: str
    tp: int
    budget: int
    topk_cap: int
    extra_args: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    service_user: str
    template: str
    keep_releases: int
    min_free_mb: int
    api_key_env: str | None
    environment_file: str | None
    health: HealthSettings
    groups: tuple[str, ...] = ()
    source: str = ""
    # A multi-node server (one SGLang server over several hosts): the group that declares it
    # (`multinode: true`), this node's rank, the node count and the torch.distributed address.
    server: str | None = None
    node_rank: int = 0
    nnodes: int = 1
    dist_init_addr: str | None = None

    @property
    def multinode(self) -> bool:
        return self.server is not None

    @property
    def become(self) -> bool:
        """Non-root users run privileged steps through `sudo -n`."""
        return self.ssh_user != "root"

    @property
    def unit_path(self) -> str:
        return f"/etc/systemd/system/{self.unit}"


@dataclass(frozen=True)
class Inventory:
    path: str
    hosts: dict[str, Host]
    groups: dict[str, tuple[str, ...]]  # group → member host names (children included)

    def select(self, limit: str | None) -> list[Host]:
        """Hosts matching `--limit`: comma-separated host names, group names or globs.

        A pattern that matches nothing is an error: a typo must not silently deploy nowhere.
        """
        if not limit:
            return list(self.hosts.values())
        chosen: dict[str, Host] = {}
        for pattern in [p.strip() for p in limit.split(",") if p.strip()]:
            matched = False
            for group, members in self.groups.items():
                if fnmatch.fnmatchcase(group, pattern):
                    matched = True
                    for m in members:
                        chosen[m] = self.hosts[m]
            for name, host in self.hosts.items():
                if fnmatch.fnmatchcase(name, pattern):
                    matched = True
                    chosen[name] = host
            if not matched:
                raise InputError(
                    f"{self.path}: --limit pattern {pattern!r} matches no host or group "
                    f"(hosts: {', '.join(self.hosts) or 'none'}; groups: {', '.join(self.groups) or 'none'})"
                )
        # Keep inventory order so rollouts are predictable.
        return [h for n, h in self.hosts.items() if n in chosen]

    def servers(self) -> dict[str, tuple[str, ...]]:
        """Multi-node servers: group name → member host names, rank 0 first."""
        out: dict[str, list[Host]] = {}
        for h in self.hosts.values():
            if h.server:
                out.setdefault(h.server, []).append(h)
        return {g: tuple(h.name for h in sorted(m, key=lambda h: h.node_rank)) for g, m in out.items()}

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise InputError(f"{self.path}: no host named {name!r} (known: {', '.join(self.hosts)})")
        return self.hosts[name]


# Defaults every host gets unless a var overrides them (the lowest precedence of all).
DEFAULTS: dict[str, Any] = {
    "ssh_port": 22,
    "ssh_user": "root",
    "identity_file": None,
    "known_hosts": "~/.ssh/known_hosts",
    "connect_timeout": 10,
    "python": None,
    "site_packages": None,
    "unit": "sglang-k26-ddtree.service",
    "conflicts": [],
    "state_dir": "/var/lib/ddtree-ops",
    "port": 30000,
    "base_url": None,
    "listen_host": "0.0.0.0",
    "launch_module": "sglang.launch_server",
    "model_path": None,
    "draft_model_path": None,
    "tp": 1,
    "budget": 16,
    "topk_cap": 4,
    "extra_args": [],
    "environment": {},
    "service_user": "root",
    "template": "sglang-ddtree.service.j2",
    "keep_releases": 5,
    "min_free_mb": 64,
    "api_key_env": None,
    "environment_file": None,
    "health": {},
    # multi-node servers (see _resolve_servers)
    "multinode": False,
    "node_rank": None,
    "nnodes": None,
    "dist_init_addr": None,
}
DIST_INIT_PORT = 20000  # default port of --dist-init-addr on the rank-0 node

_HEALTH_KEYS = {f.name for f in fields(HealthSettings)}
_KNOWN_KEYS = set(DEFAULTS) | {"address"}


def load_inventory(path: str | os.PathLike) -> Inventory:
    """Read and validate an inventory file. Raises InventoryError naming file/host/field."""
    p = Path(path)
    fname = str(p)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InventoryError(fname, None, None, "file not found") from None
    except OSError as e:
        raise InventoryError(fname, None, None, f"cannot read: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InventoryError(fname, None, None, f"not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_inventory(doc, fname)


def parse_inventory(doc: Any, fname: str = "<inventory>") -> Inventory:
    if not isinstance(doc, dict) or "all" not in doc or not isinstance(doc["all"], dict):
        raise InventoryError(fname, None, None, "the top level must be a mapping with the group 'all'")
    if set(doc) != {"all"}:
        extra = ", ".join(sorted(set(doc) - {"all"}))
        raise InventoryError(fname, None, None, f"unexpected top-level keys {extra}: put groups under all.children")

    host_chain: dict[str, list[tuple[str, dict]]] = {}  # host → [(group, vars) from all down to its group]
    host_vars: dict[str, dict] = {}
    groups: dict[str, list[str]] = {}

    def walk(gname: str, gdef: Any, chain: list[tuple[str, dict]], seen: tuple[str, ...]) -> list[str]:
        if gdef is None:
            gdef = {}
        if not isinstance(gdef, dict):
            raise InventoryError(fname, None, f"group {gname}", "a group must be a mapping of hosts/vars/children")
        bad = set(gdef) - {"hosts", "vars", "children"}
        if bad:
            raise InventoryError(
                fname, None, f"group {gname}",
                f"unknown keys {', '.join(sorted(bad))}; a group has only hosts, vars and children",
            )
        if gname in seen:
            raise InventoryError(fname, None, f"group {gname}", "groups form a cycle")
        gvars = gdef.get("vars") or {}
        if not isinstance(gvars, dict):
            raise InventoryError(fname, None, f"group {gname}.vars", "vars must be a mapping")
        chain = chain + [(gname, gvars)]
        members: list[str] = []
        hosts = gdef.get("hosts") or {}
        if not isinstance(hosts, dict):
            raise InventoryError(fname, None, f"group {gname}.hosts", "hosts must be a mapping of name → vars")
        for hname, hv in hosts.items():
            hname = str(hname)
            if not _NAME_RE.match(hname):
                raise InventoryError(fname, hname, None, "host names use letters, digits, '_', '.', '-' (max 64)")
            hv = hv or {}
            if not isinstance(hv, dict):
                raise InventoryError(fname, hname, None, "host vars must be a mapping")
            if hname in host_vars and host_vars[hname] != hv and hv:
                raise InventoryError(fname, hname, None, "host defined twice with different vars")
            if hname not in host_vars or hv:
                host_vars[hname] = hv
            # The deepest group wins; a host in two sibling groups takes them in file order.
            host_chain.setdefault(hname, [])
            for link in chain:
                if link not in host_chain[hname]:
                    host_chain[hname].append(link)
            members.append(hname)
        children = gdef.get("children") or {}
        if not isinstance(children, dict):
            raise InventoryError(fname, None, f"group {gname}.children", "children must be a mapping of groups")
        for cname, cdef in children.items():
            cname = str(cname)
            if not _NAME_RE.match(cname) or cname == "all":
                raise InventoryError(fname, None, f"group {cname}", "invalid group name")
            members.extend(walk(cname, cdef, chain, seen + (gname,)))
        uniq = list(dict.fromkeys(members))
        groups[gname] = groups.get(gname, []) + [m for m in uniq if m not in groups.get(gname, [])]
        return uniq

    walk("all", doc["all"], [], ())
    if not host_vars:
        raise InventoryError(fname, None, None, "no hosts defined")

    hosts: dict[str, Host] = {}
    for hname in host_vars:
        merged: dict[str, Any] = dict(DEFAULTS)
        merged_health: dict[str, Any] = {}
        for gname, gvars in host_chain[hname]:
            _check_keys(fname, hname, gvars, f"group {gname} vars")
            merged.update({k: v for k, v in gvars.items() if k != "health"})
            merged_health.update(gvars.get("health") or {})
        _check_keys(fname, hname, host_vars[hname], "host vars")
        merged.update({k: v for k, v in host_vars[hname].items() if k != "health"})
        merged_health.update(host_vars[hname].get("health") or {})
        merged["health"] = merged_health
        member_of = tuple(g for g, m in groups.items() if hname in m and g != "all")
        hosts[hname] = _build_host(fname, hname, merged, member_of)
    hosts = _resolve_servers(fname, hosts, host_chain, host_vars, groups)
    return Inventory(path=fname, hosts=hosts, groups={g: tuple(m) for g, m in groups.items()})


_DIST_ADDR_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


def _resolve_servers(fname: str, hosts: dict[str, Host], host_chain: dict[str, list[tuple[str, dict]]],
                     host_vars: dict[str, dict], groups: dict[str, list[str]]) -> dict[str, Host]:
    """Multi-node servers: a group with `multinode: true` in its vars is ONE SGLang server whose
    members are its nodes. Each member needs a distinct `node_rank` 0..n-1; `nnodes` (if given)
    must equal the member count; `dist_init_addr` defaults to the rank-0 node's address:20000."""
    from dataclasses import replace

    server_of: dict[str, str] = {}
    for hname, chain in host_chain.items():
        declared = [g for g, gv in chain if gv.get("multinode") is not None]
        for g, gv in chain:
            if "multinode" in gv and not isinstance(gv["multinode"], bool):
                raise InventoryError(fname, None, f"group {g}.vars.multinode", "must be true or false")
        if "multinode" in host_vars[hname]:
            raise InventoryError(fname, hname, "multinode", "is a group var: declare the multi-node server as a group")
        if declared:
            g = declared[-1]
            if dict(chain)[g]["multinode"]:
                server_of[hname] = g
    members: dict[str, list[str]] = {}
    for hname, g in server_of.items():
        members.setdefault(g, []).append(hname)
    out = dict(hosts)
    for hname in hosts:
        merged: dict[str, Any] = {}
        for _, gv in host_chain[hname]:
            merged.update({k: gv[k] for k in ("node_rank", "nnodes", "dist_init_addr") if k in gv})
        merged.update({k: host_vars[hname][k] for k in ("node_rank", "nnodes", "dist_init_addr") if k in host_vars[hname]})
        if hname not in server_of:
            for k in ("node_rank", "nnodes", "dist_init_addr"):
                if merged.get(k) is not None:
                    raise InventoryError(fname, hname, k, "only hosts of a multi-node server group (`multinode: true`) "
                                                          "take node_rank/nnodes/dist_init_addr")
    for g, names in members.items():
        ranks: dict[int, str] = {}
        n = len(names)
        if n < 2:
            raise InventoryError(fname, None, f"group {g}", "a multi-node server needs at least 2 hosts")
        for hname in names:
            h = hosts[hname]
            hv = {}
            for _, gv in host_chain[hname]:
                hv.update({k: gv[k] for k in ("node_rank", "nnodes", "dist_init_addr") if k in gv})
            hv.update({k: host_vars[hname][k] for k in ("node_rank", "nnodes", "dist_init_addr") if k in host_vars[hname]})
            r = hv.get("node_rank")
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
                raise InventoryError(fname, hname, "node_rank", f"must be an integer 0..{n - 1} (server {g} has {n} hosts), got {r!r}")
            if r in ranks:
                raise InventoryError(fname, hname, "node_rank", f"rank {r} is also given to {ranks[r]} (server {g})")
            ranks[r] = hname
            nn = hv.get("nnodes")
            if nn is not None and (isinstance(nn, bool) or nn != n):
                raise InventoryError(fname, hname, "nnodes", f"must equal the number of hosts in server {g} ({n}), got {nn!r}")
        rank0 = hosts[ranks[0]]
        for hname in names:
            h = hosts[hname]
            addr = None
            for _, gv in host_chain[hname]:
                addr = gv.get("dist_init_addr", addr)
            addr = host_vars[hname].get("dist_init_addr", addr)
            if addr is None:
                a = rank0.address
                addr = f"[{a}]:{DIST_INIT_PORT}" if ":" in a else f"{a}:{DIST_INIT_PORT}"
            m = _DIST_ADDR_RE.match(addr) if isinstance(addr, str) else None
            if not m or not 1 <= int(m.group(2)) <= 65535:
                raise InventoryError(fname, hname, "dist_init_addr", f"must be HOST:PORT such as 10.0.0.5:20000, got {addr!r}")
            for other in names:
                if hosts[other].unit != h.unit:
                    raise InventoryError(fname, hname, "unit", f"all nodes of server {g} must run the same unit "
                                                               f"({h.unit} vs {hosts[other].unit} on {other})")
            rank = next(r for r, nm in ranks.items() if nm == hname)
            out[hname] = replace(h, server=g, node_rank=rank, nnodes=n, dist_init_addr=addr)
    return out


def _check_keys(fname: str, hname: str, vars_: dict, where: str) -> None:
    unknown = set(vars_) - _KNOWN_KEYS
    if unknown:
        raise InventoryError(
            fname, hname, sorted(unknown)[0],
            f"unknown key in {where}; allowed: {', '.join(sorted(_KNOWN_KEYS))}",
        )


class _Checker:
    """Field validators that raise InventoryError with file/host/field filled in."""

    def __init__(self, fname: str, host: str, values: dict):
        self.fname, self.host, self.v = fname, host, values

    def fail(self, fieldname: str, problem: str):
        raise InventoryError(self.fname, self.host, fieldname, problem)

    def int(self, key: str, lo: int, hi: int) -> int:
        val = self.v.get(key)
        if isinstance(val, bool) or not isinstance(val, int):
            self.fail(key, f"must be an integer {lo}..{hi}, got {val!r}")
        if not lo <= val <= hi:
            self.fail(key, f"must be an integer {lo}..{hi}, got {val}")
        return val

    def number(self, key: str, value: Any, lo: float, hi: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number {lo}..{hi}, got {value!r}")
        if not lo <= value <= hi:
            self.fail(key, f"must be a number {lo}..{hi}, got {value}")
        return float(value)

    def abs_path(self, key: str, required: bool = True, expand_user: bool = False) -> str | None:
        val = self.v.get(key)
        if val is None:
            if required:
                self.fail(key, "is required (an absolute path)")
            return None
        if not isinstance(val, str) or not val:
            self.fail(key, f"must be an absolute path, got {val!r}")
        if expand_user:
            val = os.path.expanduser(val)
        return check_path(val, lambda problem: self.fail(key, problem))

    def unit(self, key: str, value: Any) -> str:
        if not is_valid_unit_name(value):
            self.fail(
                key,
                f"{value!r} is not a valid systemd unit name (letters, digits, ':', '-', '_', '.', "
                f"'\\', one '@', and a suffix such as .service)",
            )
        return value


def check_path(val: str, fail) -> str:
    """Absolute, normalised, printable, no '..' and no whitespace-control characters."""
    if not val.startswith("/"):
        fail(f"must be an absolute path, got {val!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in val):
        fail(f"must not contain control characters (newline, tab, ...): {val!r}")
    if " " in val:
        fail(f"must not contain spaces (it travels into systemd and shell command lines): {val!r}")
    parts = val.split("/")
    if ".." in parts or "." in parts:
        fail(f"must not contain '.' or '..' components: {val!r}")
    if "//" in val or (len(val) > 1 and val.endswith("/")):
        fail(f"must be normalised (no '//' and no trailing '/'): {val!r}")
    return val


def _build_host(fname: str, hname: str, v: dict, groups: tuple[str, ...]) -> Host:
    c = _Checker(fname, hname, v)

    address = v.get("address")
    if not isinstance(address, str) or not address:
        c.fail("address", "is required: an IP address or DNS name")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        if not _HOSTNAME_RE.match(address):
            c.fail("address", f"{address!r} is neither an IP address nor a DNS name")

    ssh_port = c.int("ssh_port", 1, 65535)
    ssh_user = v.get("ssh_user")
    if not isinstance(ssh_user, str) or not _USER_RE.match(ssh_user):
        c.fail("ssh_user", f"must be a POSIX user name, got {ssh_user!r}")
    identity = c.abs_path("identity_file", required=False, expand_user=True)
    known_hosts = c.abs_path("known_hosts", expand_user=True)
    connect_timeout = c.number("connect_timeout", v.get("connect_timeout"), 0.5, 300)

    site_packages = c.abs_path("site_packages")
    python = c.abs_path("python")
    state_dir = c.abs_path("state_dir")
    if state_dir in ("/", "/etc", "/usr", "/var", "/root", "/tmp"):
        c.fail("state_dir", f"{state_dir} is a system directory; use a dedicated one such as /var/lib/ddtree-ops")

    unit = c.unit("unit", v.get("unit"))
    if not unit.endswith(".service"):
        c.fail("unit", f"{unit!r} must be a .service unit")
    conflicts = v.get("conflicts") or []
    if isinstance(conflicts, str):
        conflicts = [conflicts]
    if not isinstance(conflicts, list):
        c.fail("conflicts", "must be a list of unit names")
    for u in conflicts:
        c.unit("conflicts", u)
    if unit in conflicts:
        c.fail("conflicts", f"the unit {unit} cannot conflict with itself")

    port = c.int("port", 1, 65535)
    listen_host = v.get("listen_host")
    try:
        ipaddress.ip_address(listen_host)
    except (ValueError, TypeError):
        c.fail("listen_host", f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {listen_host!r}")

    base_url = v.get("base_url")
    if base_url is None:
        host_part = f"[{address}]" if ":" in address else address
        base_url = f"http://{host_part}:{port}"
    if not isinstance(base_url, str) or not _URL_RE.match(base_url):
        c.fail("base_url", f"must be an http(s) URL such as http://10.0.0.5:30000, got {base_url!r}")
    base_url = base_url.rstrip("/")

    launch_module = v.get("launch_module")
    if not isinstance(launch_module, str) or not _MODULE_RE.match(launch_module):
        c.fail("launch_module", f"must be a dotted Python module name, got {launch_module!r}")

    model_path = _launch_value(c, "model_path", v.get("model_path"))
    draft = _launch_value(c, "draft_model_path", v.get("draft_model_path"))
    tp = c.int("tp", 1, 1024)
    budget = c.int("budget", 1, BUDGET_MAX)
    topk_cap = v.get("topk_cap")
    if isinstance(topk_cap, bool) or not isinstance(topk_cap, int) or not 1 <= topk_cap <= budget:
        c.fail("topk_cap", f"must be an integer 1..budget ({budget}), got {topk_cap!r}")

    extra = v.get("extra_args") or []
    if isinstance(extra, str):
        extra = extra.split()
    if not isinstance(extra, list):
        c.fail("extra_args", "must be a list of arguments (or one space-separated string)")
    extra_args = []
    for a in extra:
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            c.fail("extra_args", f"each argument must be a string or number, got {a!r}")
        a = str(a)
        if not _ARG_RE.match(a):
            c.fail("extra_args", f"argument {a!r} has characters outside [A-Za-z0-9_./:=,@+%-]")
        if a.split("=", 1)[0] in _SECRET_FLAGS:
            c.fail("extra_args", f"{a.split('=', 1)[0]} must not be in extra_args: it would land in the unit file, "
                                 f"`systemctl show` and the process list. Put KEY=value in the file named by "
                                 f"environment_file (mode 0600) and name the variable with api_key_env")
        extra_args.append(a)

    env = v.get("environment") or {}
    if not isinstance(env, dict):
        c.fail("environment", "must be a mapping NAME: value")
    environment = []
    for k, val in env.items():
        if not isinstance(k, str) or not _ENV_NAME_RE.match(k):
            c.fail("environment", f"variable name {k!r} is not valid")
        if isinstance(val, bool) or not isinstance(val, (str, int, float)):
            c.fail("environment", f"{k}: value must be a string or number")
        sval = str(val)
        if any(ord(ch) < 32 for ch in sval) or '"' in sval or "\\" in sval or "%" in sval or "$" in sval:
            c.fail("environment", f"{k}: value must not contain control characters, quotes, '\\', '%' or '$'")
        environment.append((k, sval))

    service_user = v.get("service_user")
    if not isinstance(service_user, str) or not _USER_RE.match(service_user):
        c.fail("service_user", f"must be a POSIX user name, got {service_user!r}")
    template = v.get("template")
    if not isinstance(template, str) or not re.match(r"^[A-Za-z0-9_.-]+\.j2$", template):
        c.fail("template", f"must be a template file name under templates/ ending in .j2, got {template!r}")
    keep = c.int("keep_releases", 1, 100)
    min_free = c.int("min_free_mb", 0, 10**7)
    api_key_env = v.get("api_key_env")
    if api_key_env is not None and (not isinstance(api_key_env, str) or not _ENV_NAME_RE.match(api_key_env)):
        c.fail("api_key_env", "must name an environment variable that holds the API key")
    environment_file = c.abs_path("environment_file", required=False)

    health_raw = v.get("health") or {}
    if not isinstance(health_raw, dict):
        c.fail("health", "must be a mapping")
    unknown = set(health_raw) - _HEALTH_KEYS
    if unknown:
        c.fail("health." + sorted(unknown)[0], f"unknown key; allowed: {', '.join(sorted(_HEALTH_KEYS))}")
    hs = HealthSettings()
    kw: dict[str, Any] = {}
    for key, lo, hi in (
        ("load_deadline_s", 1, 86400), ("poll_interval_s", 0.05, 60),
        ("request_timeout_s", 0.5, 600),
    ):
        if key in health_raw:
            kw[key] = c.number("health." + key, health_raw[key], lo, hi)
    if "consecutive_successes" in health_raw:
        n = health_raw["consecutive_successes"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100:
            c.fail("health.consecutive_successes", f"must be an integer 1..100, got {n!r}")
        kw["consecutive_successes"] = n
    if health_raw.get("min_accept_length") is not None:
        kw["min_accept_length"] = c.number("health.min_accept_length", health_raw["min_accept_length"], 0, 1025)
    if "generate_prompt" in health_raw:
        if not isinstance(health_raw["generate_prompt"], str) or not health_raw["generate_prompt"]:
            c.fail("health.generate_prompt", "must be a non-empty string")
        kw["generate_prompt"] = health_raw["generate_prompt"]
    if "generate_max_new_tokens" in health_raw:
        n = health_raw["generate_max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            c.fail("health.generate_max_new_tokens", f"must be an integer 1..4096, got {n!r}")
        kw["generate_max_new_tokens"] = n
    health = HealthSettings(**{**hs.__dict__, **kw})

    return Host(
        name=hname, address=address, ssh_port=ssh_port, ssh_user=ssh_user,
        identity_file=identity, known_hosts=known_hosts, connect_timeout_s=connect_timeout,
        python=python, site_packages=site_packages, unit=unit, conflicts=tuple(conflicts),
        state_dir=state_dir, port=port, base_url=base_url, listen_host=listen_host,
        launch_module=launch_module, model_path=model_path, draft_model_path=draft, tp=tp,
        budget=budget, topk_cap=topk_cap, extra_args=tuple(extra_args),
        environment=tuple(environment), service_user=service_user, template=template,
        keep_releases=keep, min_free_mb=min_free, api_key_env=api_key_env, environment_file=environment_file, health=health,
        groups=groups, source=fname,
    )


def _launch_value(c: _Checker, key: str, val: Any) -> str:
    """Model paths: a local path or a hub id such as moonshotai/Kimi-K2.6 (never fetched by us)."""
    if not isinstance(val, str) or not val:
        c.fail(key, "is required: a model directory or a model id")
    if not _ARG_RE.match(val) or ".." in val.split("/"):
        c.fail(key, f"{val!r} must use only [A-Za-z0-9_./:=,@+%-] and no '..' components")
    return val


def with_overrides(host: Host, *, budget: int | None = None, topk_cap: int | None = None) -> Host:
    """The host with `--budget/--topk-cap` from the command line, validated like inventory values."""
    from dataclasses import replace

    b = host.budget if budget is None else budget
    k = host.topk_cap if topk_cap is None else topk_cap
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= BUDGET_MAX:
        raise InputError(f"--budget must be an integer 1..{BUDGET_MAX} (draft nodes, root excluded), got {b!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= b:
        raise InputError(f"--topk-cap must be an integer 1..budget ({b}), got {k!r} (host {host.name})")
    return replace(host, budget=b, topk_cap=k)


def hosts_table(hosts: Iterable[Host]) -> list[dict[str, Any]]:
    return [{"name": h.name, "address": h.address, "unit": h.unit, "budget": h.budget, "topk_cap": h.topk_cap} for h in hosts]
