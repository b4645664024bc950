"""The host heals itself: the controller's lease ran out (stopped, killed or cut off) while a deploy
or a rollback it ran had changed the host, so the agent finishes the job as the controller's repair
would (runbook/phases.py `repair_interrupted`): an interrupted deploy is rolled back, an interrupted
rollback is finished. Then the outcome is written where the controller finds it: the release
record, and <state_dir>/host-heal.json, which the `facts` op returns as `host_heal`.

Health is not waited for here (no HTTP, nobody to tell): a restarted unit is checked to be running
with `systemctl is-active`, and the next status/deploy/rollback gates it and reports the heal.

A journal this tool did not write is never acted on, and one left on purpose (--no-rollback) is
left as it is. A heal that fails at a step keeps the journal, so the next run repairs from it as
it would have without the heal; the failure is recorded, never raised.

Before restoring anything the heal makes the controller's restore check (restore_check.py): a file
it would write over that is not as the undone release left it, or an SGLang version other than
the one the release was installed onto (a venv upgraded meanwhile), and it restores nothing: the
host is left as it is, the journal stays, and the record says why (`refused`, `restore_check`).
A rollback run with --force wrote `force` into its journal: its heal restores regardless.
"""

import os
import re
import time

from .backup import op_restore
from .files import atomic_json, read_json
from .protocol import Journal, ReleaseWrite, RemovePartial, Restore, SetCurrent
from .restore_check import journal_restore_check, restore_drift_summary
from .store import op_journal, op_release_write, op_remove_partial, op_set_current
from .systemd import run_program

HEAL_RECORD = "host-heal.json"
HEAL_LEFT_STEP = "failed (--no-rollback)"  # the operator asked to leave the host as it failed
HEAL_RUNNING = ("active", "activating")
# Before "stop conflicts" nothing was stopped, restarted, enabled or disabled: a unit that still
# runs is the old server serving, and is left alone.
HEAL_UNTOUCHED_STEPS = ("backup", "install")
HEAL_SYSTEMCTL_TIMEOUT_S = 300.0
# Units conflict on the port and the GPUs: the old one starts once the new one's memory is free,
# or after this long (then its start fails, and the next run's health gate says so).
HEAL_GPU_WAIT_S = 60.0
# The same rule as config/schema.py `is_valid_unit_name`: nothing else reaches systemctl.
_HEAL_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.(service|socket|target|device|mount|"
                           r"automount|swap|path|timer|slice|scope)$")


class HealFailed(Exception):
    """A step of the heal did not do what it must; the journal stays for the next run."""


def heal_journal_problem(journal):
    """Why a journal is not one this tool wrote (None: it is, or there is none). The same rules,
    word for word: the controller's host/journal.py `journal_problem` is this function."""
    if journal is None:
        return None
    if not isinstance(journal, dict):
        return "journal.json holds a %s, not an object" % type(journal).__name__
    rid = journal.get("release")
    if not _heal_release_id(rid):
        return "journal.json names no valid release (%r)" % str(rid)[:40]
    if not isinstance(journal.get("step"), str):
        return "journal.json names no step"
    for key in ("active_before", "enabled_before"):
        v = journal.get(key, {})
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            return "journal.json field %r is not a map of unit → state" % key
    if journal.get("kind", "deploy") not in ("deploy", "rollback"):
        return "journal.json is of an unknown kind %r" % str(journal.get("kind"))[:40]
    if journal.get("kind") == "rollback":
        undo = journal.get("undo")
        if not isinstance(undo, list) or not undo or not all(_heal_release_id(r) for r in undo):
            return "journal.json (rollback) has no valid list of releases to undo"
        if journal.get("to") is not None and not isinstance(journal.get("to"), str):
            return "journal.json (rollback) field 'to' is not a release id"
    prev = journal.get("previous")
    if prev is not None and not isinstance(prev, str):
        return "journal.json field 'previous' is not a release id"
    return None


def _heal_release_id(rid):
    return isinstance(rid, str) and bool(rid) and "/" not in rid and not rid.startswith(".")


def heal_record_facts(state):
    """The last heal's record for `facts`, with `reported` (a deploy or rollback has shown it: it
    wrote the heal's `at` as `host_heal_reported` into the healed release's record) or None. An
    unreadable record is reported as such."""
    try:
        record = read_json(os.path.join(state, HEAL_RECORD))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return {"ok": False, "error": "%s cannot be read: %s" % (HEAL_RECORD, e), "reported": False}
    if not isinstance(record, dict):
        return None
    rid = record.get("release")
    release = None
    if _heal_release_id(rid):
        try:
            release = read_json(os.path.join(state, "releases", rid, "release.json"))
        except (OSError, ValueError, UnicodeDecodeError):
            release = None
    # A healed release pruned since is long past; nothing is left to report about it. The mark
    # names the heal shown (its `at`): a later heal of the same release is news again.
    reported = not isinstance(release, dict) or release.get("host_heal_reported") == record.get("at")
    return dict(record, reported=reported)


class _HealRun:
    """One heal: the journal it acts on, and what it did, in order."""

    def __init__(self, state, journal, gpu_wait_s):
        self.state, self.journal, self.gpu_wait_s = state, journal, gpu_wait_s
        self.actions = []

    def note(self, text):
        self.actions.append(text)

    def systemctl(self, *args, checked=False):
        """`systemctl ARGS` (an argv, no shell); its answer. `checked`: a failure ends the heal."""
        argv = ["systemctl"] + list(args)
        r = run_program(argv, HEAL_SYSTEMCTL_TIMEOUT_S)
        self.note("%s: rc %d" % (" ".join(argv), r["rc"]))
        if checked and r["rc"] != 0:
            said = (r["stderr"] or r["stdout"]).strip()[-400:]
            raise HealFailed("`%s` exited %d: %s" % (" ".join(argv), r["rc"], said))
        return r

    def restore(self, rid):
        bdir = os.path.join(self.state, "original") if rid == "original" else os.path.join(
            self.state, "releases", rid, "backup")
        res = op_restore(Restore(self.state, bdir))
        if res.refused:
            raise HealFailed("the %s is corrupted, refusing to restore it: %s"
                             % ("original backup" if rid == "original" else "backup of " + rid,
                                "; ".join(res.problems)))
        done = {}
        for r in res.restored:
            done[r["action"]] = done.get(r["action"], 0) + 1
        self.note("restore %s: %s" % ("original files" if rid == "original" else "backup of " + rid,
                                      ", ".join("%d %s" % (n, a) for a, n in sorted(done.items())) or "nothing"))

    def states(self, units):
        """ActiveState and UnitFileState of each unit, in one `systemctl show`."""
        r = run_program(["systemctl", "show", "-p", "Id", "-p", "ActiveState", "-p", "UnitFileState"] + list(units),
                        HEAL_SYSTEMCTL_TIMEOUT_S)
        if r["rc"] != 0:
            raise HealFailed("`systemctl show` exited %d: %s" % (r["rc"], r["stderr"].strip()[-400:]))
        return heal_parse_states(r["stdout"], units)

    def gpus_free(self, wait_s):
        """Wait (at most `wait_s`) until no process holds GPU memory; no nvidia-smi: no wait."""
        t0 = time.monotonic()
        while True:
            r = run_program(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                            60)
            held = [ln.strip() for ln in r["stdout"].splitlines() if ln.strip()] if r["rc"] == 0 else []
            waited = time.monotonic() - t0
            if not held or waited >= wait_s:
                break
            time.sleep(min(1.0, max(wait_s - waited, 0.01)))
        if r["rc"] == 127:
            return
        self.note("gpus free after %.1f s" % waited if not held
                  else "GPU memory still held after %.1f s (%s); starting anyway" % (waited, ", ".join(held[:4])))

    def restore_services(self, active_before, enabled_before, untouched):
        """As runbook/phases.py `restore_services`, without the drain and the health gate: units
        enabled as recorded, what was not running stopped first (they conflict on the port), then
        what was running restarted, unless `untouched` and it still runs."""
        recorded = list(dict.fromkeys(list(active_before) + list(enabled_before)))
        bad = [u for u in recorded if not (isinstance(u, str) and len(u) <= 255 and _HEAL_UNIT_RE.fullmatch(u))]
        if bad:
            raise HealFailed("the record names %r, not a valid unit name; refusing to pass it to systemctl"
                             % str(bad[0])[:80])
        if not recorded:
            return
        now = self.states(recorded)
        for u, e in enabled_before.items():
            if e == "enabled" and now[u]["enabled"] != "enabled":
                self.systemctl("enable", u)
            elif e != "enabled" and now[u]["enabled"] == "enabled":
                self.systemctl("disable", u)
        was_active = [u for u, s in active_before.items() if s in HEAL_RUNNING]
        stopped = False
        for u in recorded:
            if u not in was_active and now[u]["active"] in HEAL_RUNNING + ("failed",):
                self.systemctl("stop", u, checked=True)
                stopped = True
        keep = [u for u in was_active if untouched and now[u]["active"] == "active"]
        if stopped and any(u not in keep for u in was_active):
            self.gpus_free(self.gpu_wait_s)
        not_running = []
        for u in was_active:
            if u in keep:
                self.note("%s was never stopped: left running" % u)
                continue
            self.systemctl("restart", u)
            state = (self.systemctl("is-active", u)["stdout"].strip().splitlines() or ["unknown"])[0]
            if state not in HEAL_RUNNING:
                not_running.append("%s is %s" % (u, state))
        if not_running:
            raise HealFailed("after the restart " + ", ".join(not_running))


def heal_parse_states(text, units):
    """`systemctl show -p Id -p ActiveState -p UnitFileState U...`: a block per unit (blank line
    between blocks, matched by Id); a unit without a block or a value is 'unknown'."""
    blocks, cur = [], {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if cur:
                blocks.append(cur)
            cur = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            cur[key.strip()] = value.strip()
    by_id = dict((b.get("Id"), b) for b in blocks if b.get("Id"))
    return dict((u, {"active": by_id.get(u, {}).get("ActiveState") or "unknown",
                     "enabled": by_id.get(u, {}).get("UnitFileState") or "unknown"}) for u in units)


def _heal_deploy(run, at):
    """runbook/phases.py `roll_back`: the release's backup back in place, the services as before."""
    j, rid = run.journal, run.journal["release"]
    if op_remove_partial(RemovePartial(run.state, rid)).backup_complete:
        run.restore(rid)
    else:
        run.note("no complete backup of %s: nothing was installed" % rid)
    run.systemctl("daemon-reload", checked=True)
    run.restore_services(j.get("active_before") or {}, j.get("enabled_before") or {},
                         j.get("step") in HEAL_UNTOUCHED_STEPS)
    op_release_write(ReleaseWrite(run.state, rid, {
        "outcome": "rolled back by the host: controller lost at %s" % j.get("step"), "rolled_back_at": at,
        "host_heal_at": at}))
    op_set_current(SetCurrent(run.state, j.get("previous")))
    return j.get("previous")


def _heal_rollback(run, at):
    """runbook/phases.py `finish_rollback`: undo the releases newest first, the original files if
    asked, then the services, then `current`."""
    j = run.journal
    for rid in j["undo"]:
        run.restore(rid)
        op_release_write(ReleaseWrite(run.state, rid, {
            "outcome": "rolled back (finished by the host: controller lost at %s)" % j.get("step"),
            "rolled_back_at": at, "host_heal_at": at, "rollback_rollout": j.get("rollout")}))
    if j.get("to_original"):
        run.restore("original")
    op_journal(Journal(run.state, journal=dict(j, step="services")))
    run.systemctl("daemon-reload", checked=True)
    run.restore_services(j.get("active_before") or {}, j.get("enabled_before") or {}, False)
    op_set_current(SetCurrent(run.state, j.get("to")))
    return j.get("to")


def _heal_refused(run, record):
    """The restore check (restore_check.py) before the heal restores anything: True, with the
    record saying why, when the host changed under the release since (nothing is touched)."""
    check = journal_restore_check(run.state, run.journal)
    if check.forced:
        run.note("checked before restoring: skipped, the rollback was run with --force")
        return False
    if not check.drifted:
        run.note("checked before restoring: nothing changed under the release" + (
            " (%s)" % "; ".join(check.unchecked) if check.unchecked else ""))
        return False
    record.update(refused=True, restore_check=check.to_wire(), error=(
        "restored nothing: %s. Restoring the backups over them could mix two SGLang releases, so the host "
        "is left as it is and the journal stays; `ddtree-ops rollback --force` restores them anyway"
        % restore_drift_summary(check)))
    run.note("checked before restoring: the host changed under the release; nothing restored, the journal stays")
    return True


def heal(state_dir, why, gpu_wait_s=HEAL_GPU_WAIT_S):
    """Finish what the journal says a lost controller left half done; the record of it, or None
    when there is no journal. Never raises: a failure is in the record (`ok` false, `error`)."""
    path = os.path.join(state_dir, "journal.json")
    try:
        journal = read_json(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return {"healed": False, "ok": False, "why": why, "error": "corrupt journal: %s cannot be read: %s" % (path, e)}
    if journal is None:
        return None
    problem = heal_journal_problem(journal)
    if problem:
        return {"healed": False, "ok": False, "why": why, "error": "corrupt journal: %s; left as it is" % problem}
    if journal.get("step") == HEAL_LEFT_STEP:
        return {"healed": False, "ok": True, "why": why, "step": journal["step"], "release": journal["release"],
                "error": None, "actions": ["left as it failed: the operator asked for --no-rollback"]}
    return _heal_journal(state_dir, journal, why, gpu_wait_s)


def _heal_journal(state, journal, why, gpu_wait_s):
    at = time.time()
    run = _HealRun(state, journal, gpu_wait_s)
    kind = journal.get("kind", "deploy")
    record = {"at": at, "why": why, "kind": kind, "step": journal.get("step"), "release": journal["release"],
              "previous": journal.get("to") if kind == "rollback" else journal.get("previous"),
              "actions": run.actions, "ok": False, "error": None, "healed": False}
    try:
        if not _heal_refused(run, record):
            record["previous"] = (_heal_rollback if kind == "rollback" else _heal_deploy)(run, at)
            op_journal(Journal(state, clear=True))
            run.note("journal cleared")
            record.update(ok=True, healed=True)
    except Exception as e:  # recorded for the next run, which repairs from the journal left in place
        record["error"] = "%s: %s" % (type(e).__name__, e) if not isinstance(e, HealFailed) else str(e)
        run.note("stopped: %s; the journal stays for the next run" % record["error"])
    record["finished_at"] = time.time()
    try:
        atomic_json(os.path.join(state, HEAL_RECORD), record)
    except Exception as e:  # a full disk: the caller still gets what happened
        record["record_error"] = "%s: %s" % (type(e).__name__, e)
    return record
