"""Who a unit's process runs as, and with what environment, resolved on this host as systemd
resolves it: User= (root when absent), Group= (the user's own group when absent), supplementary
groups as initgroups gives them plus SupplementaryGroups=, HOME/USER/LOGNAME/SHELL, the unit's
Environment= and then its EnvironmentFile= files (read here as PID 1 reads them, parsed by
systemd's env-file rules), and WorkingDirectory= (/ when absent). A check the agent runs on the
unit's behalf (the launch check) takes this identity, so that nothing from the venv runs with
more rights than the unit's own server."""

import grp
import os
import pwd
from dataclasses import dataclass
from typing import Dict, List, Optional

# The environment the system manager starts every service with, before the unit's own settings.
SERVICE_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The exit status of a child that could not take the identity (systemd: 217/USER); its stderr
# starts with SETUP_FAILED_PREFIX.
SETUP_FAILED_RC = 217
SETUP_FAILED_PREFIX = "cannot start as the unit's User= in its WorkingDirectory=: "


class UnitRefusal(Exception):
    """The unit's identity or environment cannot be set up on this host (systemd could not start
    its server either): the message names the setting and the cause."""


@dataclass
class RunAs:
    name: str
    uid: int
    gid: int
    groups: Optional[List[int]]  # None: keep the agent's (a root unit without User=)
    switch: bool  # False: run as the agent itself
    env: Dict[str, str]
    cwd: str

    def enter(self):
        """In the child, before exec (preexec_fn): the groups, then the gid, then the uid (no way
        back), umask as systemd's default, the working directory as the user. Nothing here may
        raise into subprocess (its message would be lost): a failure exits SETUP_FAILED_RC."""
        try:
            if self.switch:
                os.setgroups(self.groups or [])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
            os.umask(0o022)
            os.chdir(self.cwd)
        except OSError as e:
            os.write(2, ("%sUser=%s WorkingDirectory=%s: %s\n" % (SETUP_FAILED_PREFIX, self.name, self.cwd,
                                                                   e.strerror or e)).encode())
            os._exit(SETUP_FAILED_RC)


def _passwd_entry(user):
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError, OverflowError):
        raise UnitRefusal("the unit's User=%s does not exist on this host (no passwd entry); systemd could not "
                          "start the server as it either: create the user or fix service_user" % user) from None


def _group_id(group, setting):
    try:
        return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
    except (KeyError, ValueError, OverflowError):
        raise UnitRefusal("the unit's %s=%s does not exist on this host (no group entry)" % (setting, group)) from None


def resolve_identity(user, group, supplementary):
    """(name, uid, gid, groups, passwd entry or None) of the unit's process."""
    if not user:
        pw = None
        name, uid, gid = "root", 0, 0
    else:
        pw = _passwd_entry(user)
        name, uid, gid = pw.pw_name, pw.pw_uid, pw.pw_gid
    if group:
        gid = _group_id(group, "Group")
    extra = [_group_id(g, "SupplementaryGroups") for g in supplementary]
    if pw is None and not group and not extra:
        return name, uid, gid, None, pw
    # systemd: initgroups(user, gid) for a user whose gid is not 0, then SupplementaryGroups=.
    base = os.getgrouplist(name, gid) if pw is not None and gid != 0 else [gid]
    groups = sorted(set(base + extra))
    return name, uid, gid, groups, pw


def parse_environment_file(text):
    """(name, value) pairs of an EnvironmentFile=, by systemd's rules (env-file.c, v252): `#`/`;`
    comments, whitespace around the name and an unquoted value trimmed, single quotes literal,
    double quotes with \\ before " \\ ` $ and newline, a backslash-newline continues the line.
    Invalid names are skipped, as systemd skips them."""
    pairs = []
    state, key, value, trail = "pre_key", [], [], None

    def push():
        v = "".join(value if trail is None else value[:trail])
        k = "".join(key).rstrip(" \t")
        if k and (k[0].isalpha() or k[0] == "_") and all(c.isalnum() or c == "_" for c in k) and k.isascii():
            pairs.append((k, v))

    for c in text + "\n":
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in " \t\n\r":
                state, key, value, trail = "key", [c], [], None
        elif state == "key":
            if c in "\n\r":
                state = "pre_key"
            elif c == "=":
                state = "pre_value"
            else:
                key.append(c)
        elif state == "pre_value" or state == "value":
            if c in "\n\r":
                push()
                state = "pre_key"
            elif c == "\\":
                state, trail = "value_escape", None
            elif state == "pre_value" and c in "'\"":
                state = "single" if c == "'" else "double"
            elif state == "pre_value" and c in " \t":
                pass
            else:
                if c not in " \t":
                    trail = None
                elif trail is None:
                    trail = len(value)
                value.append(c)
                state = "value"
        elif state == "value_escape":
            state = "value"
            if c not in "\n\r":
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in "\"\\`$":
                value.append(c)
            elif c != "\n":
                value.extend(["\\", c])
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in "\n\r":
                state = "pre_key"
        elif state == "comment_escape":
            state = "comment"
    return pairs


def _environment_file_pairs(spec):
    optional = spec.startswith("-")
    path = spec[1:] if optional else spec
    try:
        with open(path, "rb") as fh:
            return parse_environment_file(fh.read().decode("utf-8", "replace"))
    except OSError as e:
        if optional:
            return []
        raise UnitRefusal("the unit's EnvironmentFile=%s cannot be read (%s); systemd could not start the server "
                          "either" % (path, e.strerror or e)) from None


def service_environment(pw, environment, environment_files):
    """The environment systemd gives the unit's process: the manager's PATH, the user's login
    variables when User= is set, Environment= in order, then the EnvironmentFile= files in order
    (which override Environment=)."""
    env = {"PATH": SERVICE_BASE_PATH}
    if pw is not None:
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell or "/bin/sh")
    for assignment in environment:
        name, _, value = assignment.partition("=")
        env[name] = value
    for spec in environment_files:
        env.update(_environment_file_pairs(spec))
    return env


def working_directory(spec, pw):
    """WorkingDirectory=: `~` is the user's home, a leading `-` makes a missing folder fall back
    to / (systemd's default for a system service)."""
    if not spec:
        return "/"
    optional = spec.startswith("-")
    path = spec[1:] if optional else spec
    if path == "~":
        path = pw.pw_dir if pw is not None else "/root"
    if optional and not os.path.isdir(path):
        return "/"
    return path


def unit_run_as(user, group, supplementary, environment, environment_files, cwd_spec):
    """The unit's identity and environment on this host; UnitRefusal when it has none here.

    An agent that is not root (the tests' local agent) cannot switch: it runs a root unit's check
    as itself (never more than root), and refuses another user's."""
    name, uid, gid, groups, pw = resolve_identity(user or "", group or "", list(supplementary))
    env = service_environment(pw, environment, environment_files)
    cwd = working_directory(cwd_spec, pw)
    me = os.geteuid()
    if me != 0:
        if uid not in (0, me):
            raise UnitRefusal("the agent runs as uid %d, not root: it cannot run the check as the unit's User=%s"
                              % (me, user))
        try:
            myself = pwd.getpwuid(me).pw_name
        except KeyError:
            myself = str(me)
        return RunAs(myself, me, os.getegid(), None, False, env, cwd)
    switch = groups is not None
    return RunAs(name, uid, gid, groups, switch, env, cwd)
