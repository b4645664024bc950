"""Inventory: an Ansible inventory (YAML or INI, with group_vars/ and host_vars/) → validated `Host` values.

Layout, as an Ansible user writes it::

    all:
      vars: {...}              # lowest precedence
      children:
        gpu:
          vars: {...}          # group vars (a child group overrides its parent)
          hosts:
            ct200:
              ansible_host: ...  # host vars, highest precedence (or `address:`)

The files are read as Ansible reads them (inventory_file.py, ansible_yaml.py, ansible_ini.py,
host_vars.py) into one graph (inventory_graph.py); each host's vars apply in Ansible's order
(_layers): host > child group > parent group > all, and the vars folders over the file's own vars.
Ansible's connection vars stand for our keys (ansible_vars.py). Every value is checked here, at the
edge, so that nothing later has to wonder whether a path contains a newline or a budget is
`16; rm -rf /`. Errors name the file, the host and the field, and say what is allowed.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from ..errors import InputError, InventoryError, shown
from .ansible_vars import ANSIBLE_PREFIX, fold_ansible_vars
from .ansible_yaml import graph_from_yaml
from .host_vars import FolderVars, VarsFile, load_folder_vars
from .inventory_file import read_graph
from .inventory_graph import ALL, InventoryGraph
from .limit_patterns import HostIndex, select_names
from .lock_settings import LOCK_LEASE_S, LOCK_RENEW_S, RECONNECT_WINDOW_S, lease_duration, renew_interval
from .notify_settings import Webhook, notify_field
from .perfgate_settings import PerfGateSettings, parse_perf_gate
from .router_settings import RouterSettings, normalize_url, router_field
from .schema import (
    OMIT,
    Check,
    CountOrShare,
    Field,
    Invalid,
    abs_path,
    address_list,
    apply,
    boolean,
    check_int,
    count_or_share,
    env_mapping,
    env_name,
    host_address,
    http_url,
    int_range,
    ip_address,
    known_keys,
    launch_args,
    launch_value,
    matching,
    module_name,
    non_empty_string,
    number_range,
    optional,
    table,
    template_name,
    unit_list,
    unit_name,
    user_name,
    yaml_file,
)

BUDGET_MAX = 1024
# A root-owned system interpreter on every supported distribution (Python 3.8 or newer there).
AGENT_PYTHON = "/usr/bin/python3"


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
    # Before a serving unit is stopped: wait this long at most for its in-flight requests.
    drain_timeout_s: float = 120.0
    # After a server stops: wait this long at most for every process to give its GPU memory back.
    gpu_free_timeout_s: float = 120.0
    # Each start-up phase (from SGLang's log lines) must end within its own deadline: a capture
    # that hangs is caught long before load_deadline_s. None: only load_deadline_s applies.
    weights_deadline_s: float | None = 1800.0
    cuda_graphs_deadline_s: float | None = 900.0
    warmup_deadline_s: float | None = 600.0
    # After the gates, the new server must stay healthy this long (a generation every
    # soak_interval_s) before the release is committed: servers that pass a gate and then hang.
    min_healthy_s: float = 30.0
    soak_interval_s: float = 5.0


@dataclass(frozen=True)
class BundleSigners:
    """Who may sign release bundles (`bundle_signers`): checked with `ssh-keygen -Y verify -f
    allowed_signers -I identity -n ddtree-ops-bundle`. `required`: a bundle without a good
    signature is refused, and so is `deploy --patchset` unless --allow-unsigned."""

    allowed_signers: str
    identity: str
    required: bool = True


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
    secrets_config: str | None
    health: HealthSettings
    groups: tuple[str, ...] = ()
    source: str = ""
    # A multi-node server (one SGLang server over several hosts): the group that declares it
    # (`multinode: true`), this node's rank, the node count and the torch.distributed address.
    server: str | None = None
    node_rank: int = 0
    nnodes: int = 1
    dist_init_addr: str | None = None
    bundle_signers: BundleSigners | None = None  # None: bundle signatures are not checked
    router: RouterSettings | None = None  # the request router in front of the host; None: none
    perf_gate: PerfGateSettings = PerfGateSettings()  # the canary's speed gate; disabled unless set
    notify: tuple[Webhook, ...] = ()  # webhooks told of a rollout's start, canary, abort, end (notify_settings.py)
    # The deploy lock is a lease (config/lock_settings.py): renewed this often, lost after this long.
    lock_renew_s: float = LOCK_RENEW_S
    lock_lease_s: float = LOCK_LEASE_S
    # A lost SSH connection (or a first connection that fails) is retried for this long, with
    # growing pauses, before the run gives up on the host (host/first_contact.py, Runbook.reconnecting).
    reconnect_window_s: float = RECONNECT_WINDOW_S
    aliases: tuple[str, ...] = ()  # other addresses of the host, e.g. the one its router reaches it at
    # The interpreter the agent (root) runs on: the system's, never the venv's, which whoever can
    # write the venv controls (host/agent/interpreter.py refuses one that others can write).
    agent_python: str = AGENT_PYTHON
    # Targets a rollout may take out of service at once (fleet/policy.py); None: the default, 1.
    max_unavailable: CountOrShare | None = None

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

    @property
    def secret_files(self) -> tuple[str, ...]:
        """Files on the host whose secret values never leave it: the agent blanks them out of log
        tails and parser messages (SGLang repeats its API key in both)."""
        return tuple(f for f in (self.secrets_config, self.environment_file) if f)


@dataclass(frozen=True)
class Inventory:
    path: str
    hosts: dict[str, Host]
    # group → member host names (its own, then its children's), `all` and `ungrouped` included
    groups: dict[str, tuple[str, ...]]

    def select(self, limit: str | None) -> list[Host]:
        """Hosts matching `--limit`, an Ansible host pattern (limit_patterns.py), in inventory order.

        A pattern that matches nothing is an error: a typo must not silently deploy nowhere.
        """
        if not limit:
            return list(self.hosts.values())
        names = select_names(limit, HostIndex(hosts=tuple(self.hosts), groups=self.groups, where=self.path))
        return [self.hosts[n] for n in names]

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


# ------------------------------------------------------------------------------------------------
# The schema: one row per inventory key, in the order they are checked. A row names the key, its
# kind and bounds (the validator: schema.int_range(1, 65535), abs_path(), ...), its default when no
# var sets it, and, for a key that must be set, what is required. Adding a key is one row here
# plus the Host field (tests/test_inventory.py checks that the two agree).

# state_dir: the tool creates it mode 0700 and keeps lock, journal and backups there, so it must be
# a directory of its own (see _state_dir): never one of these, nor a directory that contains one.
SYSTEM_DIRS = (
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt", "/proc",
    "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var",
    "/etc/systemd", "/etc/systemd/system", "/etc/ssh", "/root/.ssh", "/dev/shm", "/run/user", "/run/systemd",
    "/lib/systemd", "/lib/systemd/system", "/usr/lib/systemd", "/usr/lib/systemd/system",
    "/usr/local/lib/systemd/system", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib64", "/usr/libexec",
    "/usr/include", "/usr/share", "/usr/src", "/usr/local", "/usr/local/bin", "/usr/local/sbin", "/usr/local/lib",
    "/usr/local/share", "/var/lib", "/var/lib/systemd", "/var/log", "/var/cache", "/var/tmp", "/var/run",
    "/var/spool", "/var/mail", "/var/opt", "/var/local", "/var/backups",
)
DIST_INIT_PORT = 20000  # default port of --dist-init-addr on the rank-0 node
_PATH, _MODEL = "an absolute path", "a model directory or a model id"  # what a required key needs
_SECRET_HINT = ("Put `api-key: 'KEY'` (SGLang's --config keys are its flags without the dashes) in a YAML file "
                "on the host, mode 0600, owned by the unit's User=, and name it with secrets_config")


def _api_key_env() -> Check:
    """api_key_env names the variable the controller reads the key from; the server gets it from
    secrets_config only. Refused without secrets_config: it used to put `--api-key ${NAME}` in
    ExecStart, and an inventory written for that must not silently deploy a server without a key."""
    name_check = env_name("the name of the environment variable that holds the API key")

    def check(value: Any, done: dict[str, Any]) -> str:
        if done.get("secrets_config") is None:
            raise Invalid(
                "no longer passes the API key to the server: `--api-key ${NAME}` was expanded into its "
                "command line, which every local user can read in /proc/PID/cmdline. Put `api-key: 'KEY'` "
                "in a YAML file on the host (mode 0600, owned by the unit's User=) and name that file "
                "with secrets_config (the unit passes it as `--config FILE`); api_key_env then only names "
                "the variable in the operator's environment the health gate reads the same key from")
        return name_check(value, done)
    return check


def _state_dir(value: Any, done: dict[str, Any]) -> str:
    """A dedicated directory: absolute and normalised, at least two components deep; not a system
    directory (SYSTEM_DIRS) nor one containing one, not a home directory, not in any
    site-packages, and neither inside nor containing the host's site_packages or venv."""
    path = abs_path()(value, done)
    cut = path if len(path) <= 80 else path[:79] + "…"

    def refuse(what: str) -> Invalid:
        return Invalid(f"{cut} {what}; use a dedicated directory such as /var/lib/ddtree-ops")

    def under(p: str, d: str) -> bool:  # p is d or inside it
        return p == d or p.startswith(d.rstrip("/") + "/")

    if path in SYSTEM_DIRS:
        raise refuse("is a system directory")
    inside = next((d for d in SYSTEM_DIRS if under(d, path)), None)
    if inside:
        raise refuse(f"contains the system directory {inside}")
    parts = path.strip("/").split("/")
    if len(parts) < 2:
        raise refuse("is a top-level directory")
    if parts[0] == "home" and len(parts) == 2:
        raise refuse("is a home directory")
    if "site-packages" in parts or "dist-packages" in parts:
        raise refuse("is inside a Python site-packages")
    python_dir = posixpath.dirname(done.get("python") or "")
    venv = posixpath.dirname(python_dir) if posixpath.basename(python_dir) == "bin" else None
    for what, d in (("site_packages", done.get("site_packages")), ("venv", venv)):
        if d and d not in SYSTEM_DIRS:
            if under(d, path):
                raise refuse(f"contains the host's {what} {d}")
            if under(path, d):
                raise refuse(f"is inside the host's {what} {d}")
    return path


def _default_base_url(done: dict[str, Any]) -> str:
    address = done["address"]
    return f"http://{f'[{address}]' if ':' in address else address}:{done['port']}"


# An OpenSSH principal as allowed_signers names it (an e-mail address, a name); never an option.
_PRINCIPAL_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,254}$")
BUNDLE_SIGNER_FIELDS: tuple[Field, ...] = (
    Field("allowed_signers", abs_path(expand_user=True), required="an absolute path to an allowed_signers file"),
    Field("identity", matching(_PRINCIPAL_RE, "the signer's principal in allowed_signers ([A-Za-z0-9_.@+-])"),
          required="the signer's principal in allowed_signers"),
    Field("required", boolean(), True),
)

HEALTH_FIELDS: tuple[Field, ...] = (  # absent keys keep HealthSettings' defaults
    Field("load_deadline_s", number_range(1, 86400), OMIT),
    Field("poll_interval_s", number_range(0.05, 60), OMIT),
    Field("request_timeout_s", number_range(0.5, 600), OMIT),
    Field("consecutive_successes", int_range(1, 100), OMIT),
    Field("min_accept_length", optional(number_range(0, 1025)), OMIT),
    Field("generate_prompt", non_empty_string(), OMIT),
    Field("generate_max_new_tokens", int_range(1, 4096), OMIT),
    Field("drain_timeout_s", number_range(0, 86400), OMIT),
    Field("gpu_free_timeout_s", number_range(0, 86400), OMIT),
    Field("weights_deadline_s", optional(number_range(1, 86400)), OMIT),
    Field("cuda_graphs_deadline_s", optional(number_range(1, 86400)), OMIT),
    Field("warmup_deadline_s", optional(number_range(1, 86400)), OMIT),
    Field("min_healthy_s", number_range(0, 86400), OMIT),
    Field("soak_interval_s", number_range(0.05, 3600), OMIT),
)

HOST_FIELDS: tuple[Field, ...] = (
    Field("address", host_address(), required="an IP address or DNS name"),
    Field("ssh_port", int_range(1, 65535), 22),
    Field("ssh_user", user_name(), "root"),
    Field("identity_file", abs_path(expand_user=True), None),
    Field("known_hosts", abs_path(expand_user=True), "~/.ssh/known_hosts", required=_PATH),
    Field("connect_timeout", number_range(0.5, 300), 10, attr="connect_timeout_s"),
    Field("site_packages", abs_path(), required=_PATH),
    Field("python", abs_path(), required=_PATH),
    Field("agent_python", abs_path(), AGENT_PYTHON),
    Field("state_dir", _state_dir, "/var/lib/ddtree-ops", required=_PATH),
    Field("unit", unit_name(service=True), "sglang-k26-ddtree.service"),
    Field("conflicts", unit_list(not_field="unit"), ()),
    Field("port", int_range(1, 65535), 30000),
    Field("listen_host", ip_address(), "0.0.0.0"),
    Field("base_url", http_url(), _default_base_url),
    Field("launch_module", module_name(), "sglang.launch_server"),
    Field("model_path", launch_value(), required=_MODEL),
    Field("draft_model_path", launch_value(), required=_MODEL),
    Field("tp", int_range(1, 1024), 1),
    Field("budget", int_range(1, BUDGET_MAX), 16),
    Field("topk_cap", int_range(1, "budget"), 4),
    Field("extra_args", launch_args(_SECRET_HINT), ()),
    Field("environment", env_mapping(), {}),
    Field("service_user", user_name(), "root"),
    Field("template", template_name(), "sglang-ddtree.service.j2"),
    Field("keep_releases", int_range(1, 100), 5),
    Field("min_free_mb", int_range(0, 10**7), 64),
    Field("lock_renew_s", renew_interval(), LOCK_RENEW_S),
    Field("lock_lease_s", lease_duration("lock_renew_s"), LOCK_LEASE_S),
    Field("reconnect_window_s", number_range(0, 3600), RECONNECT_WINDOW_S),
    Field("environment_file", abs_path(), None),
    # A YAML file on the host holding `api-key: 'KEY'` (and other secret options), passed to SGLang
    # as `--config FILE`: the key never appears in the unit, its backups or the process list.
    Field("secrets_config", yaml_file(), None),
    Field("api_key_env", _api_key_env(), None),
    Field("health", table(HEALTH_FIELDS, HealthSettings), {}),
    Field("bundle_signers", table(BUNDLE_SIGNER_FIELDS, BundleSigners), None),
    # Other addresses of this host (another network's IP, a DNS name): router.worker may use them.
    Field("aliases", address_list(), ()),
    # The request router (smg) in front of the host: router_settings.py; its worker defaults to base_url.
    Field("router", router_field("base_url"), None),
    Field("max_unavailable", count_or_share(), None),  # a fleet setting: all or group vars (fleet/policy.py)
    Field("perf_gate", None),  # parse_perf_gate, after the table (it reads a file beside the inventory)
    Field("notify", notify_field(), ()),
    # A multi-node server: validated across its members by _resolve_servers.
    Field("multinode", None),
    Field("node_rank", None),
    Field("nnodes", None),
    Field("dist_init_addr", None),
)
_FIELD = {f.name: f for f in HOST_FIELDS}
_KNOWN_KEYS = known_keys(HOST_FIELDS)
_MULTINODE_KEYS = ("node_rank", "nnodes", "dist_init_addr")
# Mappings merged key by key across the layers (all → groups → host), not replaced whole: group
# vars set router.url and host vars router.worker. Absent everywhere: the row's default.
_MERGED = ("health", "router", "perf_gate")


def inventory_keys() -> frozenset[str]:
    """The keys an inventory may set (besides Ansible's `ansible_*`)."""
    return frozenset(_KNOWN_KEYS)


def load_inventory(path: str | os.PathLike) -> Inventory:
    """Read and validate an inventory file (YAML or INI) with the group_vars/ and host_vars/
    folders beside it. Raises InventoryError naming file/host/field."""
    graph = read_graph(Path(path))
    return build_inventory(graph, load_folder_vars(graph.fname, graph.groups, graph.host_vars))


def parse_inventory(doc: Any, fname: str = "<inventory>") -> Inventory:
    """An inventory from a YAML document already read (no vars folders)."""
    return build_inventory(graph_from_yaml(doc, fname), FolderVars())


@dataclass(frozen=True)
class _Layer:
    where: str  # as messages name it: "group gpu vars", "host vars", "group_vars/gpu.yml"
    vars: dict[str, Any]


def _layers(graph: InventoryGraph, folder: FolderVars, hname: str) -> list[_Layer]:
    """A host's vars, lowest precedence first, as Ansible orders them: inline group vars (all, then
    the host's groups by depth, priority, name), group_vars/all, group_vars of those groups, the
    host's inline vars, host_vars."""
    groups = graph.host_groups(hname)
    out = [_Layer(f"group {g} vars", graph.groups[g].vars) for g in (ALL, *groups)]
    out += [_Layer(f.label, f.vars) for g in (ALL, *groups) for f in folder.groups.get(g, ())]
    out.append(_Layer("host vars", graph.host_vars[hname]))
    out += [_Layer(f.label, f.vars) for f in folder.hosts.get(hname, ())]
    return out


def _merge(fname: str, hname: str, layers: list[_Layer]) -> tuple[dict[str, Any], dict[str, str]]:
    """The layers merged, a later one winning; the _MERGED mappings key by key. Also where each
    var was set."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    tables: dict[str, Any] = {}
    for layer in layers:
        _check_keys(fname, hname, layer.vars, layer.where)
        merged.update({k: v for k, v in layer.vars.items() if k not in _MERGED})
        origin.update(dict.fromkeys(layer.vars, layer.where))
        for key in _MERGED:
            t, sofar = layer.vars.get(key), tables.get(key, {})
            if isinstance(t, dict) and isinstance(sofar, dict):
                tables[key] = {**sofar, **t}
            elif t is not None and isinstance(sofar, dict):
                tables[key] = t  # not a mapping: kept for its row to refuse
    merged.update(tables)
    return merged, origin


def _host(fname: str, hname: str, layers: list[_Layer], member_of: tuple[str, ...]) -> Host:
    merged, origin = _merge(fname, hname, layers)
    folded = fold_ansible_vars(merged, origin, fname, hname)
    raw = folded.vars
    if raw.get("address") is None and _is_address(hname):
        raw["address"] = hname  # as Ansible: a host without ansible_host is reached at its name
    try:
        values = apply(HOST_FIELDS, raw)
    except Invalid as e:
        unnamed = e.field == "address" and "address" not in raw
        hint = " (nor is the host's name; set ansible_host or address)" if unnamed else ""
        raise InventoryError(fname, hname, folded.written.get(e.field, e.field), e.problem + hint) from None
    try:
        values["perf_gate"] = parse_perf_gate(raw.get("perf_gate"), "perf_gate",
                                              base_dir=os.path.dirname(os.path.abspath(fname)))
    except InputError as e:
        field, _, problem = str(e).partition(": ")
        raise InventoryError(fname, hname, field, problem) from None
    return Host(name=hname, groups=member_of, source=fname, **values)


def _is_address(name: str) -> bool:
    try:
        host_address()(name, {})
    except Invalid:
        return False
    return True


def build_inventory(graph: InventoryGraph, folder: FolderVars) -> Inventory:
    fname = graph.fname
    hosts: dict[str, Host] = {}
    host_chain: dict[str, list[tuple[str, dict]]] = {}  # for _resolve_servers: (group, its vars), all first
    host_vars: dict[str, dict] = {}
    for hname in graph.host_vars:
        groups = graph.host_groups(hname)
        member_of = tuple(g for g in graph.groups if g in groups)  # Ansible's group_names, inventory order
        hosts[hname] = _host(fname, hname, _layers(graph, folder, hname), member_of)
        host_chain[hname] = [(g, {**graph.groups[g].vars, **_folder_vars(folder.groups.get(g, ()))})
                             for g in (ALL, *groups)]
        host_vars[hname] = {**graph.host_vars[hname], **_folder_vars(folder.hosts.get(hname, ()))}
    hosts = _resolve_servers(fname, hosts, host_chain, host_vars)
    _check_workers_unique(fname, hosts)
    return Inventory(path=fname, hosts=hosts, groups={g: graph.members(g) for g in graph.groups})


def _folder_vars(files: tuple[VarsFile, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in files:
        out.update(f.vars)
    return out


def _check_workers_unique(fname: str, hosts: dict[str, Host]) -> None:
    """Two hosts with one router worker: deploying one would take the other out of the router."""
    seen: dict[str, str] = {}
    for h in hosts.values():
        if h.router is None:
            continue
        key = normalize_url(h.router.worker)
        if key in seen:
            raise InventoryError(fname, h.name, "router.worker",
                                 f"{shown(h.router.worker)} is also host {seen[key]}'s worker: each host's server is "
                                 f"its own worker (a worker set in group vars is every member's; set it per host)")
        seen[key] = h.name


def _check_keys(fname: str, hname: str, vars_: dict, where: str) -> None:
    """Our keys are checked for typos; Ansible's own (ansible_*) are its business (ansible_vars.py)."""
    unknown = sorted(str(k) for k in vars_ if not (k in _KNOWN_KEYS or str(k).startswith(ANSIBLE_PREFIX)))
    if unknown:
        raise InventoryError(fname, hname, unknown[0],
                             f"unknown key in {where}; allowed: {', '.join(sorted(_KNOWN_KEYS))} "
                             f"(and Ansible's ansible_* vars: ansible_host, ansible_port, ansible_user, "
                             f"ansible_ssh_private_key_file and ansible_python_interpreter are read, the rest "
                             f"ignored)")


_DIST_ADDR_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


def _resolve_servers(fname: str, hosts: dict[str, Host], host_chain: dict[str, list[tuple[str, dict]]],
                     host_vars: dict[str, dict]) -> dict[str, Host]:
    """Multi-node servers: a group with `multinode: true` in its vars is ONE SGLang server whose
    members are its nodes. Each member needs a distinct `node_rank` 0..n-1; `nnodes` (if given)
    must equal the member count; `dist_init_addr` defaults to the rank-0 node's address:20000."""
    server_of: dict[str, str] = {}
    node_vars: dict[str, dict[str, Any]] = {}  # host → node_rank/nnodes/dist_init_addr (host > group)
    for hname, chain in host_chain.items():
        for g, gv in chain:
            if "multinode" in gv and not isinstance(gv["multinode"], bool):
                raise InventoryError(fname, None, f"group {g}.vars.multinode",
                                     f"must be true or false, got {shown(gv['multinode'])}")
        if "multinode" in host_vars[hname]:
            raise InventoryError(fname, hname, "multinode", "is a group var: declare the multi-node server as a group")
        declared = [(g, gv["multinode"]) for g, gv in chain if gv.get("multinode") is not None]
        if declared and declared[-1][1]:  # the deepest group that says decides
            server_of[hname] = declared[-1][0]
        nv: dict[str, Any] = {}
        for layer in [gv for _, gv in chain] + [host_vars[hname]]:
            nv.update({k: layer[k] for k in _MULTINODE_KEYS if k in layer})
        node_vars[hname] = nv
        if hname not in server_of:
            for k in _MULTINODE_KEYS:
                if nv.get(k) is not None:
                    raise InventoryError(fname, hname, k, "only hosts of a multi-node server group (`multinode: true`) "
                                                          "take node_rank/nnodes/dist_init_addr")
    members: dict[str, list[str]] = {}
    for hname, g in server_of.items():
        members.setdefault(g, []).append(hname)
    out = dict(hosts)
    for g, names in members.items():
        n = len(names)
        if n < 2:
            raise InventoryError(fname, None, f"group {g}", "a multi-node server needs at least 2 hosts")
        ranks: dict[int, str] = {}
        for hname in names:
            nv = node_vars[hname]
            try:
                r = check_int(nv.get("node_rank"), 0, n - 1, note=f"server {g} has {n} hosts")
            except Invalid as e:
                raise InventoryError(fname, hname, "node_rank", e.problem) from None
            if r in ranks:
                raise InventoryError(fname, hname, "node_rank", f"rank {r} is also given to {ranks[r]} (server {g})")
            ranks[r] = hname
            nn = nv.get("nnodes")
            if nn is not None and (isinstance(nn, bool) or nn != n):
                raise InventoryError(fname, hname, "nnodes",
                                     f"must equal the number of hosts in server {g} ({n}), got {shown(nn)}")
        a = hosts[ranks[0]].address
        default_addr = f"[{a}]:{DIST_INIT_PORT}" if ":" in a else f"{a}:{DIST_INIT_PORT}"
        rank_of = {hname: r for r, hname in ranks.items()}
        for hname in names:
            h = hosts[hname]
            addr = node_vars[hname].get("dist_init_addr")
            addr = default_addr if addr is None else addr
            m = _DIST_ADDR_RE.match(addr) if isinstance(addr, str) else None
            if not m or not 1 <= int(m.group(2)) <= 65535:
                raise InventoryError(fname, hname, "dist_init_addr",
                                     f"must be HOST:PORT such as 10.0.0.5:20000, got {shown(addr)}")
            for other in names:
                if hosts[other].unit != h.unit:
                    raise InventoryError(fname, hname, "unit", f"all nodes of server {g} must run the same unit "
                                                               f"({h.unit} vs {hosts[other].unit} on {other})")
            out[hname] = replace(h, server=g, node_rank=rank_of[hname], nnodes=n, dist_init_addr=addr)
    return out


def check_host_fields(host: Host, names: Iterable[str]) -> None:
    """Check fields of an already built Host (one changed with dataclasses.replace) with the same
    validators as the inventory, in the order given (a bound such as budget comes first).
    Raises Invalid naming the field."""
    done: dict[str, Any] = {}
    for name in names:
        f = _FIELD[name]
        try:
            done[name] = f.check(getattr(host, f.attr or f.name), done)
        except Invalid as e:
            e.field = name
            raise


def with_overrides(host: Host, *, budget: int | None = None, topk_cap: int | None = None) -> Host:
    """The host with `--budget/--topk-cap` from the command line, validated like inventory values."""
    b = host.budget if budget is None else budget
    k = host.topk_cap if topk_cap is None else topk_cap
    checked = replace(host, budget=b, topk_cap=k)
    try:
        check_host_fields(checked, ("budget", "topk_cap"))
    except Invalid as e:
        flag = {"budget": "--budget", "topk_cap": "--topk-cap"}[e.field]
        raise InputError(f"{flag} {e.problem} (host {host.name})") from None
    return checked
