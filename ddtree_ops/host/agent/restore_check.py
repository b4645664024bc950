"""The restore check: before backups are put back, is the host still as the releases being undone
left it? A venv upgraded under a deployed release (`pip install -U sglang`: server_args.py and
spec_info.py rewritten, the dist-info now 0.5.24) must not get the 0.5.23 backups written over it:
that is a mix of two SGLang releases, reported as healthy. One check, read only, for the three
that restore (the controller's `rollback` and its repair of an interrupted run, and the host's
own heal, heal.py) and for `status` (`as_installed`).

The rule, per path a restore of `releases` (newest first, then original/ with `to_original`)
would write or remove: what is there now (sha256; absent, or not a regular file) must be one of
  * what the newest of those releases that touched it installed (the record's `installed`),
  * what one of their backups holds for it (the state after that part of the restore: a file
    already put back, or a rollback cut off half way and finished now; an added file: absent),
  * with `to_original`, what original/ holds for it (a path only releases since undone touched).
A file a release added that is gone is therefore fine (the restore would remove it anyway); one
with other content is not (the restore would delete somebody else's file). And the SGLang
version in each release's site-packages must be the one recorded when the release was backed up
(`sglang_version`, written by the backup: backup.py).

A release recorded without these (by an older ddtree-ops, or a deploy that never committed:
`installed` is written at commit) cannot be checked for what it lacks: its paths are skipped, or
its version, and `unchecked` says so. Only what was recorded is compared.
"""

import os

from .files import file_facts, read_json
from .protocol import FileDrift, RestoreCheck, RestoreCheckReply, VersionDrift
from .venv_version import sglang_version_in

ORIGINAL_RELEASE = "original"


def op_restore_check(req: RestoreCheck):
    if req.journal:
        return journal_restore_check(req.state_dir)
    return restore_check(req.state_dir, list(req.releases), req.to_original, req.as_installed)


def journal_restore_check(state, journal=None):
    """The check for what the journal's repair (or the host's heal) would restore: an interrupted
    deploy undoes its release, an interrupted rollback the releases it names. No journal (or one
    that is not readable: the controller refuses that on its own): nothing to check."""
    if journal is None:
        try:
            journal = read_json(os.path.join(state, "journal.json"))
        except (OSError, ValueError, UnicodeDecodeError):
            journal = None
    if not isinstance(journal, dict) or not isinstance(journal.get("release"), str):
        return RestoreCheckReply([], [], [])
    kind = journal.get("kind", "deploy")
    if kind == "rollback" and isinstance(journal.get("undo"), list):
        releases, to_original = [r for r in journal["undo"] if isinstance(r, str)], bool(journal.get("to_original"))
    else:
        releases, to_original = [journal["release"]], False
    reply = restore_check(state, releases, to_original)
    reply.forced, reply.journal_kind = bool(journal.get("force")), kind
    return reply


def _rc_json(path):
    """A record (release.json, a backup's manifest.json) as a dict; None when missing or unreadable."""
    try:
        doc = read_json(path)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _rc_release_dir(state, rid):
    if not isinstance(rid, str) or not rid or "/" in rid or rid.startswith("."):
        return None
    return os.path.join(state, "releases", rid)


def _rc_entries(manifest):
    entries = (manifest or {}).get("entries")
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str)]


def _rc_left(entry):
    """What a backup entry puts back: its sha256, or None for a path it removes."""
    return entry.get("sha256") if entry.get("existed") else None


NOT_A_FILE = "not a regular file"  # what FileDrift.found_sha256 says of a folder, a link, a device


def restore_check(state, releases, to_original=False, as_installed=False):
    """RestoreCheckReply for restoring `releases` (newest first); see the module's rule.
    `as_installed`: only the first release's `installed`, each exactly (what status reports)."""
    if as_installed:
        releases = releases[:1]
    dirs = dict((rid, _rc_release_dir(state, rid)) for rid in releases)
    records = dict((rid, (_rc_json(os.path.join(d, "release.json")) if d else None) or {}) for rid, d in dirs.items())
    accepted = {}  # path -> what may be there now
    owner = {}  # path -> (release, what it left there)
    unknown = set()  # paths whose newest undone release recorded nothing of what it installed
    unchecked = []
    for rid in releases:
        installed = records[rid].get("installed")
        if not isinstance(installed, dict):
            installed = None
            unchecked.append("release %s records no sha256 of what it installed (%s): its files were not checked"
                             % (rid, records[rid].get("outcome") or "no record"))
        entries = [] if as_installed or not dirs[rid] else _rc_entries(
            _rc_json(os.path.join(dirs[rid], "backup", "manifest.json")))
        for path in list(installed or {}) + [e["path"] for e in entries]:
            if path in owner or path in unknown:
                continue
            if installed is not None and path in installed:
                owner[path] = (rid, installed[path])
                accepted.setdefault(path, set()).add(installed[path])
            else:
                unknown.add(path)
        for e in entries:
            accepted.setdefault(e["path"], set()).add(_rc_left(e))
    if to_original and not as_installed:
        for e in _rc_entries(_rc_json(os.path.join(state, "original", "manifest.json"))):
            accepted.setdefault(e["path"], set()).add(_rc_left(e))
            if e["path"] not in owner and e["path"] not in unknown:
                owner[e["path"]] = (ORIGINAL_RELEASE, _rc_left(e))
    files = []
    for path in sorted(owner):
        f = file_facts(path)
        found = (f.get("sha256") if f.get("is_file") else NOT_A_FILE) if f["exists"] else None
        if found not in accepted[path]:
            rid, expected = owner[path]
            files.append(FileDrift(path, rid, expected, found))
    versions, now = [], None
    for rid in releases:
        want, sp = records[rid].get("sglang_version"), records[rid].get("site_packages")
        if not (isinstance(want, str) and isinstance(sp, str)):
            unchecked.append("release %s records no SGLang version: not compared" % rid)
            continue
        found = sglang_version_in(sp)
        now = now or found
        if found != want:
            versions.append(VersionDrift(rid, want, found))
    return RestoreCheckReply(list(releases), files, versions, unchecked, now, bool(to_original))


def _rc_short(sha):
    if sha is None:
        return "absent"
    return sha if sha == NOT_A_FILE else sha[:12]


def restore_drift_lines(reply, site_packages=None):
    """One phrase per drifted file and per changed version, paths under `site_packages` shortened."""
    out = []
    several = len(reply.releases) > 1
    for d in reply.files:
        path = d.path
        if site_packages and path.startswith(site_packages.rstrip("/") + "/"):
            path = path[len(site_packages.rstrip("/")) + 1:]
        if d.release == ORIGINAL_RELEASE:
            whose = "as before any release "
        else:
            whose = "as %s installed it " % d.release if several else ""
        out.append("%s (%sexpected %s, found %s)" % (path, whose, _rc_short(d.expected_sha256),
                                                     _rc_short(d.found_sha256)))
    for v in reply.versions:
        out.append("SGLang %s installed, %s was installed onto %s"
                   % (v.found or "missing (no sglang dist-info)", v.release, v.recorded))
    return out


def restore_drift_summary(reply, site_packages=None):
    """What drifted, in one sentence (the host's heal record, the controller's refusal)."""
    n = len(reply.files)
    what = (["%d file%s" % (n, "" if n == 1 else "s")] if n else []) + (["the SGLang version"] if reply.versions
                                                                       else [])
    return "%s changed since %s installed %s: %s" % (
        " and ".join(what), ("release " if len(reply.releases) == 1 else "releases ") + ", ".join(reply.releases),
        "it" if len(reply.releases) == 1 else "them", "; ".join(restore_drift_lines(reply, site_packages)))
