"""The plan for one host: what a deploy would change there, as a plain value.

`read_host` reads the host (no change); `compute_plan` turns what it read into a `HostPlan`: what
each file would become, the unit diff (secrets redacted), the units to stop and restart, and every
reason to refuse. `compute_plan` is pure, so every case is tested from data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..artifacts.patchset import PatchSet, check_sglang_version
from ..artifacts.units import render_unit, unit_diff
from ..config.inventory import Host
from ..config.redaction import redact
from ..host.agent.protocol import PathAccess
from ..host.journal import journal_problem
from ..host.release_store import ReleaseStore
from ..host.services import UnitState


class _Units(Protocol):
    def states(self, units: tuple[str, ...]) -> dict[str, UnitState]: ...


class HostReader(Protocol):
    """What reading a host needs of a session: the release store and the unit states."""

    host: Host
    store: ReleaseStore
    services: _Units


@dataclass(frozen=True)
class FileChange:
    path: str  # absolute on the host
    rel: str  # relative to site-packages
    action: str  # add | replace
    old_sha256: str | None
    new_sha256: str
    status: str  # new | change | same | drift
    note: str = ""


@dataclass(frozen=True)
class HostPlan:
    host: str
    patchset: str
    patchset_digest: str
    budget: int
    topk_cap: int
    sglang_version: str | None
    current_release: str | None
    files: tuple[FileChange, ...]
    unit_path: str
    unit_old: str | None
    unit_new: str
    unit_diff: str
    stop_units: tuple[str, ...]  # conflicting units that are active now
    restart_unit: str
    refusals: tuple[str, ...]  # preflight problems that stop the deploy (nothing changed)
    interrupted: dict | None  # the journal of an interrupted deploy, repaired first
    lock: dict | None
    # `plan`'s dry run (dry_run.py): the checks that passed, one line each, and the lock message
    # deploy would stop with (exit 5) when another run holds the host.
    checked: tuple[str, ...] = ()
    locked: str | None = None

    @property
    def changes(self) -> bool:
        return any(f.status != "same" for f in self.files) or bool(self.unit_diff)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("unit_old")
        d.pop("unit_new")
        return d


def target_path(host: Host, rel: str) -> str:
    return f"{host.site_packages}/{rel}"


def compute_plan(host: Host, ps: PatchSet, facts: dict[str, Any], unit_new: str, *, force: bool = False) -> HostPlan:
    """Pure: the plan for `host` from what `facts` (the remote agent's answer) says is there."""
    refusals: list[str] = []
    version = facts.get("sglang_version")
    if not facts.get("site_packages_exists"):
        refusals.append(f"site-packages {host.site_packages} does not exist")
    elif version is None:
        refusals.append(f"no sglang dist-info in {host.site_packages}: is SGLang installed there?")
    elif not check_sglang_version(ps, version):
        refusals.append(f"SGLang {version} on the host does not satisfy the patch set's sglang{ps.sglang_spec}")
    installed_now = ((facts.get("current_release") or {}).get("installed") or {})
    files = []
    for pf in ps.files:
        path = target_path(host, pf.path)
        f = facts["files"].get(path, {"exists": False})
        old = f.get("sha256") if f.get("exists") else None
        if old == pf.sha256:
            status, note = "same", ""
        elif pf.action == "replace":
            if old is None:
                status, note = "drift", "upstream file missing"
            elif old == pf.base_sha256:
                status, note = "change", "upstream"
            elif installed_now.get(path) == old:
                status, note = "change", f"from release {facts.get('current')}"
            else:
                status, note = "drift", "neither the upstream file nor what the current release installed"
        else:  # add
            if old is None:
                status, note = "new", ""
            elif installed_now.get(path) == old:
                status, note = "change", f"from release {facts.get('current')}"
            else:
                status, note = "drift", "a file of unknown origin is in the way"
        files.append(FileChange(path, pf.path, pf.action, old, pf.sha256, status, note))
        if status == "drift" and not force:
            refusals.append(f"drift: {path} has sha256 {str(old)[:12]} ({note}); --force overrides")
    if facts.get("service_user_problem"):  # the server could not start as its User= either
        refusals.append(str(facts["service_user_problem"]))
    refusals += secrets_config_refusals(host, facts)
    refusals += path_refusals(host, facts)
    refusals += unwritable_refusals(host, facts)
    journal_bad = facts.get("journal_error") or journal_problem(facts.get("journal"))
    if journal_bad:
        refusals.append(f"corrupt journal: {journal_bad}; see docs/guarantees.md, 'corrupt journal'")
    need_mb = sum(pf.source.stat().st_size for pf in ps.files) * 2 // (1024 * 1024) + 1
    for where, free in (facts.get("free_mb") or {}).items():
        if free < need_mb + host.min_free_mb:
            refusals.append(f"not enough disk for {where}: {free} MB free, need {need_mb + host.min_free_mb} MB")
    unit_old = facts.get("unit_text")
    return HostPlan(
        host=host.name, patchset=ps.label, patchset_digest=ps.digest(), budget=host.budget,
        topk_cap=host.topk_cap, sglang_version=version, current_release=facts.get("current"),
        files=tuple(files), unit_path=host.unit_path, unit_old=unit_old, unit_new=unit_new,
        unit_diff=redact(unit_diff(unit_old, unit_new, host.unit_path)),
        stop_units=tuple(u for u in host.conflicts if (facts.get("units") or {}).get(u) == "active"),
        restart_unit=host.unit, refusals=tuple(refusals), interrupted=facts.get("journal"),
        lock=facts.get("lock"),
    )


def unwritable_refusals(host: Host, facts: dict[str, Any]) -> list[str]:
    """A target directory the install could not write (read-only mount, immutable): refused before
    anything changes, since the install would fail half-way and its rollback could not write
    there either."""
    found = facts.get("unwritable")
    if not isinstance(found, dict):
        return []
    inside = host.site_packages.rstrip("/") + "/"
    return [f"{'site-packages is read-only' if (str(d) + '/').startswith(inside) else 'read-only target'}: "
            f"{d} cannot be written on {host.name} ({why}); the install would fail there"
            for d, why in sorted(found.items())]


def secrets_config_refusals(host: Host, facts: dict[str, Any]) -> list[str]:
    """Why the host's secrets_config (the YAML file SGLang reads the API key from, `--config`)
    cannot be used, from its file facts: it must exist, be a regular file (not a symlink, whose
    target is not what was checked), be readable by its owner only, and be owned by the unit's
    User= -- root for a root unit; a non-root User= cannot read a 0600 file root owns, and when the
    facts carry that user's uid (`service_user_uid`) the owner must be it. Nothing of its content
    is read here."""
    path = host.secrets_config
    if not path:
        return []
    f = (facts.get("files") or {}).get(path) or {"exists": False}
    what = f"secrets_config {path}"
    fix = f"(chown {host.service_user} {path}; chmod 600 {path})"
    if not f.get("exists"):
        return [f"{what} does not exist on the host: create it with `api-key: 'KEY'`, mode 0600, owned by "
                f"{host.service_user} (the unit's User=), before deploying; SGLang would exit at start without it"]
    if not f.get("is_file"):
        return [f"{what} is not a regular file (a symlink, a folder or a device): make it a plain file {fix}"]
    refusals = []
    mode, uid = f.get("mode"), f.get("uid")
    if not isinstance(mode, int) or mode & 0o077:
        shown = f"{mode:04o}" if isinstance(mode, int) else "unknown"
        refusals.append(f"{what} has mode {shown}: group and others must have no access, it holds the API key "
                        f"(chmod 600 {path})")
    if host.service_user == "root":
        if uid != 0:
            refusals.append(f"{what} is owned by uid {uid}, not root (the unit's User=root): its owner can "
                            f"rewrite the server's configuration (chown root {path})")
    elif uid == 0:
        refusals.append(f"{what} is owned by root, but the server runs as User={host.service_user}, which "
                        f"cannot read a 0600 file it does not own {fix}")
    elif facts.get("service_user_uid") is not None and uid != facts["service_user_uid"]:
        refusals.append(f"{what} is owned by uid {uid}, not by {host.service_user} (uid "
                        f"{facts['service_user_uid']}), the unit's User= {fix}")
    elif isinstance(mode, int) and not mode & 0o400:
        refusals.append(f"{what} has mode {mode:04o}: its owner {host.service_user} cannot read it {fix}")
    return refusals


# The paths the launch line names that the unit's process must be able to use: (field, execute).
LAUNCH_PATHS = (("python", True), ("model_path", False), ("draft_model_path", False))
PATH_CONSEQUENCE = {
    "python": "the unit's ExecStart runs it (python: the venv's interpreter)",
    "model_path": "the new server would fail to load it after the old one stopped",
    "draft_model_path": "the new server would fail to load the draft model after the old one stopped",
}


def launch_paths(host: Host) -> list[tuple[str, str, bool]]:
    """(field, path, execute) for each launch path that is a local path (a hub id such as
    moonshotai/Kimi-K2.6 is fetched by the server, not checked here)."""
    return [(name, getattr(host, name), execute) for name, execute in LAUNCH_PATHS
            if getattr(host, name).startswith("/")]


def path_access_request(host: Host) -> PathAccess:
    paths = launch_paths(host)
    return PathAccess([p for _, p, _ in paths], [x for _, _, x in paths], user=host.service_user)


def path_refusals(host: Host, facts: dict[str, Any]) -> list[str]:
    """A launch path that is missing or that the unit's User= cannot use: the server would fail
    only after the old one stopped. Facts without the check (an older reader) refuse nothing."""
    found = facts.get("launch_paths")
    if not isinstance(found, dict):
        return []
    if found.get("failed"):
        if facts.get("service_user_problem"):
            return []  # refused already, for the same cause
        return [f"the launch paths ({', '.join(n for n, _, _ in launch_paths(host))}) could not be checked as "
                f"User={host.service_user}: {found['failed']}"]
    return [f"{f['field']} {f['path']} {f['problem']} on {host.name}: {PATH_CONSEQUENCE[f['field']]}; fix "
            f"{f['field']} in the inventory or provision it on the host"
            for f in found.get("paths", []) if f.get("problem")]


def read_launch_paths(store: ReleaseStore, host: Host) -> dict[str, Any]:
    """The launch paths as the unit's User= meets them (one round trip; none without a local path)."""
    names = launch_paths(host)
    if not names:
        return {"paths": []}
    reply = store.path_access(path_access_request(host))
    if reply.failed:
        return {"failed": reply.failed}
    return {"paths": [{"field": name, "path": path, "exists": f.exists, "kind": f.kind, "problem": f.problem}
                      for (name, path, _), f in zip(names, reply.facts, strict=True)]}


def read_host(session: HostReader, ps: PatchSet) -> dict[str, Any]:
    """Everything the plan needs, read in three round trips. `unit_states` keeps the whole state of
    each unit (the deploy records it as what to restore); the plan reads only `units`. The
    secrets_config file is asked for with the patch set's files, as a secret path: the agent
    reports its mode and owner only, and no hash of it leaves the host."""
    host = session.host
    paths = [target_path(host, pf.path) for pf in ps.files]
    facts = session.store.facts(paths, [host.secrets_config] if host.secrets_config else [])
    facts["unit_states"] = session.services.states((host.unit, *host.conflicts))
    facts["units"] = {u: s.active for u, s in facts["unit_states"].items()}
    facts["launch_paths"] = read_launch_paths(session.store, host)
    return facts


def plan_host(session: HostReader, ps: PatchSet, *, force: bool = False,
              templates_dir: str | None = None) -> HostPlan:
    """Read the host and compute its plan; changes nothing."""
    facts = read_host(session, ps)
    return compute_plan(session.host, ps, facts, render_unit(session.host, templates_dir), force=force)
