"""The agent's protocol: one dataclass per request the controller sends, and per reply it reads.

Both ends share it. The controller builds its requests from these classes, so a misspelt op or
field fails where it is written (an import or attribute error that ruff and the tests see), not
as a KeyError on the host; the agent decodes every request into its class before running it, and
refuses a field it does not know. On the wire a request is one JSON object, `{"op": OP, field:
value, ...}`, exactly as the fake host and the fault hooks read it; a field marked `optional` is
left out while it holds its default, and `wire` names a field whose JSON name is a Python keyword.

Stdlib only, and Python 3.8 syntax at run time (`typing.List`, not `list[...]`): this module is
joined into the agent's source and run by the host's own interpreter.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ProtocolError(ValueError):
    """A document that is not the request or reply it claims to be."""


def opt(default: Any = None, *, factory: Any = None, wire: Optional[str] = None) -> Any:
    """A field left off the wire while it holds its default (as today's requests leave it off)."""
    meta = {"optional": True, "wire": wire}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def message_list(cls: type) -> Any:
    """A list of nested messages (install's files, backup's paths): dicts on the wire."""
    return field(metadata={"items": cls})


def _wire_name(f: "dataclasses.Field") -> str:
    return f.metadata.get("wire") or f.name


def _default(f: "dataclasses.Field") -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _encode(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


class Message:
    """A request or reply: a dataclass that goes over the wire as a JSON object."""

    def to_wire(self) -> Dict[str, Any]:
        doc = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("optional") and value == _default(f):
                continue
            doc[_wire_name(f)] = _encode(value)
        return doc

    @classmethod
    def from_wire(cls, doc: Any) -> Any:
        if not isinstance(doc, dict):
            raise ProtocolError("%s: expected a JSON object, got %s" % (cls.__name__, type(doc).__name__))
        by_wire = {_wire_name(f): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(doc) - set(by_wire) - {"op"})
        if unknown:
            raise ProtocolError("%s: unknown field(s) %s" % (cls.__name__, ", ".join(unknown)))
        kwargs = {}
        for name, f in by_wire.items():
            if name in doc:
                nested = f.metadata.get("items")
                kwargs[f.name] = [nested.from_wire(v) for v in doc[name]] if nested else doc[name]
        try:
            return cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ProtocolError("%s: %s" % (cls.__name__, e)) from None


class Request(Message):
    OP = ""  # the op name on the wire (a class attribute, not a field)

    def to_wire(self) -> Dict[str, Any]:
        doc = {"op": self.OP}
        doc.update(super().to_wire())
        return doc


# ------------------------------------------------------------------------------------- requests

@dataclass
class Hello(Request):
    """The first request: `lease_s` is how long the agent keeps the deploy lock without hearing
    from its controller (see lease.py)."""

    OP = "hello"
    lease_s: Optional[float] = opt()


@dataclass
class Renew(Request):
    """The controller's heartbeat: nothing to do but renew the lease, as every request does."""

    OP = "renew"


@dataclass
class Facts(Request):
    """File facts, the unit, the release store's current release, journal and lock, free space.
    `secret_paths` get mode and owner only: nothing derived from a secret leaves the host."""

    OP = "facts"
    state_dir: str
    site_packages: str
    unit_path: str
    paths: List[str] = field(default_factory=list)
    secret_paths: List[str] = field(default_factory=list)
    python: str = opt("")  # the venv's interpreter: its version is read from its files, never run
    service_user: Optional[str] = opt()  # the unit's User=: its uid, or why the host has none


@dataclass
class Lock(Request):
    OP = "lock"
    state_dir: str
    holder: Dict[str, Any]
    wait_s: float = opt(0.0)  # grace for a holder that is just ending
    break_token: Optional[str] = opt(wire="break")  # the holder's token the operator chose to end
    break_wait_s: float = opt(15.0)
    resume_generation: Optional[int] = opt()  # re-taking after a reconnect: the generation held


@dataclass
class Unlock(Request):
    OP = "unlock"
    state_dir: str
    token: str


@dataclass
class Journal(Request):
    OP = "journal"
    state_dir: str
    journal: Optional[Dict[str, Any]] = opt()
    clear: bool = opt(False)


@dataclass
class Compile(Request):
    """Compile new modules (path → base64 source) with the venv's interpreter `python`, run as the
    unit's User=/Group= (its version decides the syntax; its code never runs as root)."""

    OP = "compile"
    files: Dict[str, str]
    python: str
    user: Optional[str] = opt()
    group: Optional[str] = opt()
    supplementary_groups: List[str] = opt(factory=list)
    timeout: float = opt(120.0)


@dataclass
class VerifyUnit(Request):
    """`argv` runs systemd-analyze verify; `@PATH@` stands for the unit written to a temp folder."""

    OP = "verify_unit"
    unit_name: str
    text: str
    argv: List[str]


@dataclass
class BackupPath(Message):
    """`expect_sha256`/`expect_absent`: what preflight read there; the backup refuses a path that
    changed since (left off the wire when unset, as an older controller sends it: no check)."""

    path: str
    kind: str = "file"
    expect_sha256: Optional[str] = opt()
    expect_absent: bool = opt(False)


@dataclass
class Backup(Request):
    """`site_packages`: the venv the release installs into; the SGLang version found there is
    recorded with the release (`sglang_version`), for the restore check (restore_check.py)."""

    OP = "backup"
    state_dir: str
    release_id: str
    paths: List[BackupPath] = message_list(BackupPath)
    site_packages: Optional[str] = opt()


@dataclass
class InstallFile(Message):
    path: str
    content_b64: str
    sha256: str
    mode: int = 0o644


@dataclass
class Install(Request):
    OP = "install"
    state_dir: str
    files: List[InstallFile] = message_list(InstallFile)
    test_pause: Optional[Dict[str, Any]] = opt()  # a test hook: pause after `after` files


@dataclass
class Restore(Request):
    OP = "restore"
    state_dir: str
    backup_dir: str


@dataclass
class VerifyBackup(Request):
    OP = "verify_backup"
    state_dir: str
    backup_dir: str


@dataclass
class RemovePartial(Request):
    OP = "remove_partial"
    state_dir: str
    release_id: str


@dataclass
class ReleaseWrite(Request):
    OP = "release_write"
    state_dir: str
    release_id: str
    fields: Dict[str, Any]


@dataclass
class TuneWrite(Request):
    """Keep a tune's record (`ddtree-ops tune`: its rows and winners) as tunes/<id>.json, beside the
    release records; `history` lists them."""

    OP = "tune_write"
    state_dir: str
    tune_id: str
    doc: Dict[str, Any]


@dataclass
class SetCurrent(Request):
    OP = "set_current"
    state_dir: str
    release_id: Optional[str]  # None: no current release


@dataclass
class History(Request):
    OP = "history"
    state_dir: str


@dataclass
class Prune(Request):
    OP = "prune"
    state_dir: str
    keep: int


@dataclass
class Run(Request):
    """One systemctl/journalctl/nvidia-smi argv, or several in one round trip (`argvs`). The
    values of secret-named keys in `scrub_files` are blanked out of what comes back."""

    OP = "run"
    argv: Optional[List[str]] = opt()
    argvs: Optional[List[List[str]]] = opt()
    timeout: float = 300.0
    scrub_files: List[str] = opt(factory=list)
    secret_words: List[str] = opt(factory=list)


@dataclass
class LaunchCheck(Request):
    OP = "launch_check"
    python: str
    module: str
    args: List[str]
    ports: List[int]
    sglang: bool = False
    scrub_files: List[str] = field(default_factory=list)
    secret_words: List[str] = field(default_factory=list)
    timeout: float = opt(180.0)
    # The parse runs as the unit's process would (host/agent/unit_identity.py): these are the
    # unit's [Service] settings as artifacts/unit_service.py reads them; site_packages is put on
    # the isolated interpreter's sys.path.
    site_packages: str = opt("")
    user: Optional[str] = opt()
    group: Optional[str] = opt()
    supplementary_groups: List[str] = opt(factory=list)
    environment: List[str] = opt(factory=list)
    environment_files: List[str] = opt(factory=list)
    working_directory: Optional[str] = opt()
    # `plan`: the new files (path relative to site-packages → base64), staged in a scratch folder
    # the parse imports them from ahead of site-packages; the scratch is removed afterwards.
    overlay: Dict[str, str] = opt(factory=dict)


@dataclass
class PathAccess(Request):
    """Whether the unit's User=/Group= can read each path (`execute`: run it), checked by a
    process that takes that identity; one answer per path, in order."""

    OP = "path_access"
    paths: List[str]
    execute: List[bool] = opt(factory=list)  # per path: also executable (the venv's interpreter)
    user: Optional[str] = opt()
    group: Optional[str] = opt()
    supplementary_groups: List[str] = opt(factory=list)


@dataclass
class ProcInfo(Request):
    OP = "proc_info"
    pids: List[int]


@dataclass
class WantedContent(Message):
    path: str
    sha256: str


@dataclass
class ReleaseContent(Request):
    """Read only: the text of each path as it was with the given sha256, looked up in the
    release store's backups (and the live file, for a path some backup lists); `diff` reads it."""

    OP = "release_content"
    state_dir: str
    paths: List[WantedContent] = message_list(WantedContent)
    max_bytes: int = 262144


@dataclass
class RestoreCheck(Request):
    """Read only: would restoring the backups of `releases` (newest first; then original/ with
    `to_original`) write over anything those releases did not leave there, or into an SGLang
    other than the one each was installed onto (restore_check.py)? `journal`: the releases the
    host's journal would restore (an interrupted deploy or rollback) instead. `as_installed`:
    `status`'s question: is each file exactly as the first of `releases` installed it."""

    OP = "restore_check"
    state_dir: str
    releases: List[str] = opt(factory=list)
    to_original: bool = opt(False)
    journal: bool = opt(False)
    as_installed: bool = opt(False)


REQUESTS = {cls.OP: cls for cls in (
    Hello, Renew, Facts, Lock, Unlock, Journal, Compile, VerifyUnit, Backup, Install, Restore, VerifyBackup,
    RemovePartial, ReleaseWrite, TuneWrite, SetCurrent, History, Prune, Run, LaunchCheck, PathAccess, ProcInfo,
    ReleaseContent, RestoreCheck)}


def decode_request(doc: Any) -> Request:
    """A wire request → its dataclass; ProtocolError for an unknown op or field."""
    op = doc.get("op") if isinstance(doc, dict) else None
    if op not in REQUESTS:
        raise ProtocolError("unknown op %r" % (op,))
    return REQUESTS[op].from_wire(doc)


# ------------------------------------------------------------------------------------- replies

@dataclass
class HelloReply(Message):
    pid: int
    python: str
    unit: Optional[str] = opt()  # the transient systemd unit the agent runs in (None: the SSH session)
    refused: Optional[str] = opt()  # why the agent will not run as root on this interpreter


@dataclass
class LockReply(Message):
    acquired: bool
    holder: Optional[Dict[str, Any]]
    break_failed: bool = opt(False)  # --break-lock: the lock changed hands or its holder did not end
    taken_meanwhile: bool = opt(False)  # re-taking: another run held it while the connection was down


@dataclass
class UnlockReply(Message):
    released: bool
    holder: Optional[Dict[str, Any]] = opt()


@dataclass
class CompileReply(Message):
    errors: List[str]
    failed: Optional[str] = opt()  # the compile could not run (no such user, interpreter, output)
    ran_as: Optional[Dict[str, Any]] = opt()  # {"user", "uid", "gid"} of the compiling process


@dataclass
class VerifyUnitReply(Message):
    available: bool  # False: the host has no systemd-analyze
    returncode: Optional[int] = opt()
    stdout: str = opt("")
    stderr: str = opt("")


@dataclass
class BackupChange(Message):
    """A path that changed since preflight: its index in the request and what is there now."""

    index: int
    found_sha256: Optional[str]  # None: the path is absent, or not a regular file


@dataclass
class BackupReply(Message):
    """`changed` non-empty: the backup refused and kept nothing (no backup, no partial one)."""

    manifest: Optional[Dict[str, Any]]
    changed: List[BackupChange] = message_list(BackupChange)


@dataclass
class RestoreReply(Message):
    restored: List[Dict[str, Any]]
    refused: bool  # the backup failed its check: nothing was restored
    problems: List[str]


@dataclass
class VerifyBackupReply(Message):
    problems: List[str]


@dataclass
class RemovePartialReply(Message):
    backup_complete: bool


@dataclass
class RunResult(Message):
    rc: int
    stdout: str
    stderr: str


@dataclass
class RunReply(Message):
    results: List[RunResult] = message_list(RunResult)


@dataclass
class PathFact(Message):
    """One path as the unit's process would meet it: `problem` None when it can use it."""

    path: str
    exists: bool
    kind: str = opt("")  # file | dir | other
    problem: Optional[str] = opt()


@dataclass
class PathAccessReply(Message):
    facts: List[PathFact] = message_list(PathFact)
    failed: Optional[str] = opt()  # the check could not run as the unit's identity (why)


@dataclass
class ContentItem(Message):
    """One wanted path: `found` where a copy with its sha256 exists; `text` only for UTF-8 text
    up to the request's max_bytes (`binary`/`size` say why not)."""

    found: bool
    source: Optional[str] = opt()  # "backup" or "live"
    text: Optional[str] = opt()
    binary: bool = opt(False)
    size: Optional[int] = opt()


@dataclass
class ReleaseContentReply(Message):
    items: List[ContentItem] = message_list(ContentItem)


@dataclass
class FileDrift(Message):
    """A file not as the release that should own it left it: a restore would write over it."""

    path: str
    release: str  # whose install it should be ("original": as it was before any release)
    expected_sha256: Optional[str]  # None: absent
    found_sha256: Optional[str]  # None: absent, or not a regular file


@dataclass
class VersionDrift(Message):
    """The SGLang in a release's site-packages is not the version the release was installed onto."""

    release: str
    recorded: str
    found: Optional[str]  # None: no sglang dist-info there; "A, B": two of them


@dataclass
class RestoreCheckReply(Message):
    """`files` and `versions` empty: nothing drifted (of what could be checked; `unchecked` says
    what could not, and why)."""

    releases: List[str]  # what was checked, newest first
    files: List[FileDrift] = message_list(FileDrift)
    versions: List[VersionDrift] = message_list(VersionDrift)
    unchecked: List[str] = opt(factory=list)
    sglang_version: Optional[str] = opt()  # what the releases' site-packages holds now
    to_original: bool = opt(False)
    forced: bool = opt(False)  # `journal`: the run that wrote it was given --force
    journal_kind: Optional[str] = opt()  # `journal`: "deploy" or "rollback" (None: no journal)

    @property
    def drifted(self) -> bool:
        return bool(self.files or self.versions)
