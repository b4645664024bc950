"""systemd unit rendering, verification, diffing and read-back.

The unit is rendered from a Jinja2 template (``templates/<host.template>``, found through
`resources.templates_dir()` unless a bundle's folder is given) with every
`Host` field in the context and three filters:

* ``systemd_quote`` — one argument of an ``ExecStart=`` command line, quoted per
  systemd.service(5) "Command lines": ``%`` → ``%%`` (specifiers), ``$`` → ``$$``
  (environment variable substitution), and double quotes with C-style escapes when the
  value is empty or holds whitespace, quotes, backslashes or control characters.
* ``systemd_env`` — one ``NAME=value`` assignment of an ``Environment=`` line, always
  double-quoted (``%`` → ``%%``; ``$`` is not expanded in ``Environment=``, so it is kept).
* ``systemd_value`` — the value of a one-word setting (``User=``, ``EnvironmentFile=``): ``%`` → ``%%``.

`verify_unit` runs ``systemd-analyze verify`` on the text; `verify_command` builds the same
argv for running on the target host, and `verify_problems` classifies its output, so that a
remote check and the local one agree on what counts as an error.
"""

from __future__ import annotations

import difflib
import functools
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..config.inventory import Host, check_host_fields
from ..config.redaction import is_secret_flag
from ..config.schema import Invalid, is_valid_unit_name
from ..errors import InputError
from .resources import templates_dir as default_templates_dir

SYSTEMD_ANALYZE = "systemd-analyze"
# What ExecStart's program is replaced with when the real one only exists on the remote host.
STAND_IN_EXECUTABLE = "/bin/true"


class UnitVerifyError(InputError):
    """`systemd-analyze verify` rejected a rendered unit (or could not be run)."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        self.problems = list(problems)
        if self.problems:
            message += ":\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(message)


# --------------------------------------------------------------------------- quoting

_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\a": "\\a",
              "\b": "\\b", "\f": "\\f", "\v": "\\v"}


def _c_escape(s: str) -> str:
    out = []
    for ch in s:
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    return "".join(out)


def _needs_quotes(s: str) -> bool:
    return s == "" or any(ch.isspace() or ch in "\"'\\;" or ord(ch) < 32 or ord(ch) == 127 for ch in s)


def systemd_quote(value: Any) -> str:
    """Quote one argument for an ExecStart= line (systemd.service(5), "Command lines").

    ``%`` becomes ``%%`` and ``$`` becomes ``$$`` always (systemd expands both, also inside
    quotes). Values that are empty or contain whitespace, quotes, backslash, ';' or control
    characters are wrapped in double quotes with C-style escapes for ``\\``, ``"`` and control
    characters, so a value can never split into two arguments or break the line.
    """
    s = str(value).replace("%", "%%").replace("$", "$$")
    if not _needs_quotes(s):
        return s
    return '"' + _c_escape(s) + '"'


def systemd_value(value: Any) -> str:
    """One value of a setting that takes a single word (``User=``, ``EnvironmentFile=``,
    ``WorkingDirectory=``): ``%`` → ``%%``, since systemd expands specifiers there too (a path
    with ``%H`` would name a file per host name). The inventory refuses whitespace and control
    characters in these values."""
    return str(value).replace("%", "%%")


def systemd_env(assignment: Any) -> str:
    """Quote one ``NAME=value`` for an Environment= line: always double quotes, C escapes, %%."""
    s = str(assignment).replace("%", "%%")
    return '"' + _c_escape(s) + '"'


# --------------------------------------------------------------------------- rendering

def _has_control(value: Any) -> bool:
    if isinstance(value, str):
        return any(ord(c) < 32 or ord(c) == 127 for c in value)
    if isinstance(value, (tuple, list)):
        return any(_has_control(v) for v in value)
    return False


def _check_host(host: Host) -> None:
    """Defence in depth: the Host may have been built with dataclasses.replace(). The numbers and
    unit names go through the inventory's own validators; no field may hold a control character."""

    def fail(fieldname: str, problem: str) -> None:
        raise InputError(f"host {host.name!r}: field {fieldname!r}: {problem} (refusing to render the unit)")

    try:
        check_host_fields(host, ("budget", "topk_cap", "port", "tp", "unit", "conflicts"))
    except Invalid as e:
        fail(e.field or "?", e.problem)
    for f in fields(host):
        if _has_control(getattr(host, f.name)):
            fail(f.name, "must not contain control characters (newline, tab, ...)")


@functools.lru_cache(maxsize=16)
def _jinja_env(templates_dir: Path) -> jinja2.Environment:
    # One per folder, kept: a fleet's hosts share it and each template is compiled once (Jinja
    # reloads one whose file changed). Sandboxed: a template may come from a bundle someone else
    # built, and rendering runs on the operator's machine (also under `plan`); it may read the
    # host's values, never call into Python.
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["systemd_quote"] = systemd_quote
    env.filters["systemd_env"] = systemd_env
    env.filters["systemd_value"] = systemd_value
    return env


def render_unit(host: Host, templates_dir: str | Path | None = None) -> str:
    """Render `host.template` for `host`. Raises InputError on bad values or a broken template."""
    _check_host(host)
    tdir = Path(templates_dir) if templates_dir is not None else default_templates_dir()
    context: dict[str, Any] = {f.name: getattr(host, f.name) for f in fields(host)}
    context["unit_path"] = host.unit_path
    try:
        template = _jinja_env(tdir).get_template(host.template)
        text = template.render(**context)
    except jinja2.TemplateNotFound:
        raise InputError(f"host {host.name!r}: unit template {host.template!r} not found in {tdir}") from None
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{tdir / host.template}:{e.lineno}: template syntax error: {e.message}") from None
    except jinja2.UndefinedError as e:
        raise InputError(f"{tdir / host.template}: host {host.name!r}: {e.message}") from None
    except SecurityError as e:
        raise InputError(f"{tdir / host.template}: refused: the template reaches outside the values a unit "
                         f"template may use ({e})") from None
    flags = secret_flags_in_exec(text)
    if flags:  # e.g. a template from an older bundle that still renders `--api-key ${NAME}`
        raise InputError(f"{tdir / host.template}: host {host.name!r}: refused: the rendered unit passes "
                         f"{', '.join(sorted(set(flags)))} on the command line, readable by every local user "
                         f"in /proc/PID/cmdline; the API key goes in the YAML file named by secrets_config")
    return text


_EXEC_LINE_RE = re.compile(r"^[ \t]*Exec[A-Za-z]*=(.*)$", re.M)


def secret_flags_in_exec(text: str) -> list[str]:
    """The secret flags (redaction.is_secret_flag) on the Exec*= command lines of a unit text."""
    joined = re.sub(r"\\\n", " ", text)  # systemd's line continuation
    return [tok.split("=", 1)[0] for m in _EXEC_LINE_RE.finditer(joined)
            for tok in m.group(1).replace('"', " ").replace("'", " ").split() if is_secret_flag(tok)]


# --------------------------------------------------------------------------- verification

# systemd-analyze prints most configuration problems as warnings and may still exit 0
# (older versions do for unknown keys), so its stderr is classified too.
_PROBLEM_RE = re.compile(
    r"Unknown key|Unknown section|Unknown lvalue|Failed to|Invalid|invalid|is not executable|"
    r"Missing|missing|not found|ignoring|Ignoring|bad-setting|outside of section|"
    r"[Nn]eeds? to be|is not absolute|Neither a valid|has no ExecStart",
)


def verify_command(path: str, unit_name: str) -> list[str]:
    """argv that verifies the unit file at `path` (whose file name must be `unit_name`)."""
    if not is_valid_unit_name(unit_name) or not unit_name.endswith(".service"):
        raise InputError(f"{unit_name!r} is not a valid systemd .service unit name")
    if PurePosixPath(path).name != unit_name:
        raise InputError(f"systemd-analyze verify needs the file named as the unit: {path!r} is not {unit_name!r}")
    return [SYSTEMD_ANALYZE, "verify", "--man=no", "--recursive-errors=no", path]


def verify_problems(returncode: int, stdout: str, stderr: str, unit_name: str | None = None) -> list[str]:
    """The problems in one `verify_command` run; an empty list means the unit passed.

    With `unit_name`, warnings about *other* units (systemd loads dependencies such as
    network-online.target, whose files on a real host may draw their own warnings) are not
    held against ours; a non-zero exit status always fails.
    """
    lines = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines() if ln.strip()]
    problems = [ln for ln in lines if _PROBLEM_RE.search(ln)]
    if unit_name:
        ours = [ln for ln in problems if unit_name in ln]
        if ours or returncode == 0:
            problems = ours
    if returncode != 0 and not problems:
        problems = lines or [f"systemd-analyze verify exited with status {returncode} and printed nothing"]
    return problems


_EXEC_PROGRAM_RE = re.compile(r'^(Exec[A-Za-z]*=[ \t]*[@\-:+!|]*)("(?:[^"\\\n]|\\.)*"|[^\s"]+)', re.M)


def substitute_executables(text: str, stand_in: str = STAND_IN_EXECUTABLE) -> str:
    """`text` with the program of every Exec*= line replaced by `stand_in`, the rest identical."""
    return _EXEC_PROGRAM_RE.sub(lambda m: m.group(1) + stand_in, text)


def verify_unit(
    text: str,
    unit_name: str,
    *,
    check_executables: bool = True,
    runner: Callable[[list[str]], Any] | None = None,
) -> None:
    """Check `text` with `systemd-analyze verify` on this machine; raise UnitVerifyError if bad.

    systemd-analyze also checks that ExecStart's program exists and is executable *on the
    machine where it runs*. The unit's program is the host's venv Python, which usually does
    not exist here: pass ``check_executables=False`` to verify a copy whose Exec*= programs are
    replaced by /bin/true (everything else byte-identical), and run `verify_command` on the
    target host for the full check.

    `runner(argv)` returns an object with returncode/stdout/stderr (subprocess.run by default).
    """
    if not is_valid_unit_name(unit_name) or not unit_name.endswith(".service"):
        raise UnitVerifyError(f"{unit_name!r} is not a valid systemd .service unit name")
    if runner is None:
        if shutil.which(SYSTEMD_ANALYZE) is None:
            raise UnitVerifyError(
                "systemd-analyze is not installed on this machine, so the rendered unit cannot be "
                "verified; install it (Debian/Ubuntu: apt-get install systemd)"
            )

        def runner(argv: list[str]) -> Any:
            return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    checked = text if check_executables else substitute_executables(text)
    with tempfile.TemporaryDirectory(prefix="ddtree-ops-verify-") as tmp:
        path = Path(tmp) / unit_name
        path.write_text(checked)
        try:
            result = runner(verify_command(str(path), unit_name))
        except FileNotFoundError:
            raise UnitVerifyError(
                "systemd-analyze is not installed on this machine; install it (apt-get install systemd)"
            ) from None
        except subprocess.TimeoutExpired:
            raise UnitVerifyError("systemd-analyze verify timed out") from None
        problems = verify_problems(result.returncode, result.stdout or "", result.stderr or "", unit_name)
    if problems:
        # Name the unit, not the throw-away temp path.
        problems = [p.replace(str(path), unit_name) for p in problems]
        raise UnitVerifyError(f"systemd-analyze verify rejected {unit_name}", problems)


# --------------------------------------------------------------------------- diff and read-back

def unit_diff(old: str | None, new: str, path: str) -> str:
    """Unified diff old → new labelled a/<path> b/<path> (/dev/null when there is no old); '' if equal."""
    if old == new:
        return ""
    rel = path.lstrip("/")

    def lines(s: str) -> list[str]:
        out = s.splitlines(keepends=True)
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n\\ No newline at end of file\n"
        return out

    fromfile = "/dev/null" if old is None else f"a/{rel}"
    return "".join(difflib.unified_diff(lines(old or ""), lines(new), fromfile=fromfile, tofile=f"b/{rel}"))


def _logical_lines(text: str) -> list[str]:
    """Unit file lines with backslash continuations joined (as systemd reads them)."""
    out: list[str] = []
    cur: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if cur is not None and line.lstrip().startswith(("#", ";")):
            continue  # comment lines inside a continuation are skipped by systemd
        cont = line.endswith("\\") and (len(line) - len(line.rstrip("\\"))) % 2 == 1
        piece = line[:-1] if cont else line
        cur = piece if cur is None else cur + " " + piece.strip()
        if not cont:
            out.append(cur)
            cur = None
    if cur is not None:
        out.append(cur)
    return out


_FLAGS = {
    "--speculative-ddtree-budget": ("budget", int),
    "--speculative-ddtree-topk-cap": ("topk_cap", int),
    "--speculative-algorithm": ("algorithm", str),
}


def exec_start_words(unit_text: str) -> list[str] | None:
    """The last ExecStart= command line of a unit as argv (continuations joined, systemd's `%%`
    and `$$` unescaped); None when there is none."""
    exec_line = None
    for line in _logical_lines(unit_text):
        s = line.strip()
        if s.startswith("ExecStart="):
            value = s[len("ExecStart="):].strip()
            exec_line = value or None  # an empty ExecStart= resets the list
    if not exec_line:
        return None
    try:
        words = shlex.split(exec_line, comments=False, posix=True)
    except ValueError:
        words = exec_line.split()
    return [w.replace("%%", "%").replace("$$", "$") for w in words]


def parse_exec_flags(unit_text: str) -> dict[str, Any]:
    """DDTree flags from a unit's ExecStart: {'budget': int, 'topk_cap': int, 'algorithm': str}.

    Only keys found (with a readable value) are returned; {} when the unit has none. Handles
    line continuations and both ``--flag value`` and ``--flag=value``.
    """
    words = exec_start_words(unit_text)
    if not words:
        return {}
    found: dict[str, Any] = {}
    for i, w in enumerate(words):
        flag, eq, val = w.partition("=")
        if flag not in _FLAGS:
            continue
        if not eq:
            if i + 1 >= len(words):
                continue
            val = words[i + 1]
        key, conv = _FLAGS[flag]
        try:
            found[key] = conv(val)
        except ValueError:
            continue
    return found
