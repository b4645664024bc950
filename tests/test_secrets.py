"""Secrets stay secret: the API key reaches SGLang through a 0600 YAML file
passed with `--config` (inventory `secrets_config`), never through the unit or the command line;
what the controller shows or returns of a server's log is scrubbed (redaction.scrub); the
stand-in merges `--config` and logs its arguments as SGLang 0.5.23 does.

The SGLang 0.5.23 behaviour these tests pin down was read in the wheel's code:
sglang/srt/server_args.py (`--config` registered ~402, merged in `prepare_server_args` ~683 only
for the exact token `--config`), sglang/srt/utils/server_args_config_parser.py (each YAML key
becomes `--KEY` as written, the config's options go before the command line's, .yaml/.yml only,
one file) and sglang/srt/entrypoints/engine.py ~1185 (`server_args={...}`: the dict of every field,
secrets in clear). All fast tier (fake hosts, stubs) except the last test, which runs it all on
a real sandbox host.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest

from ddtree_ops.artifacts.units import render_unit, secret_flags_in_exec
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.redaction import MASK, SECRET_NAME_WORDS, is_secret_name, redact, scrub, scrub_lines
from ddtree_ops.errors import DeployFailed, InputError, InventoryError, PreflightError
from ddtree_ops.gates.health import wait_until_serving
from ddtree_ops.host.services import UnitProbe
from ddtree_ops.runbook.deploy import deploy_host, describe_failure
from ddtree_ops.runbook.phases import DeployOptions, StepFailed
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.testing.fake_host import FAKE_CRASH, fake_hosts, fake_inventory
from ddtree_ops.testing.standin.args import (
    ConfigError,
    build_parser,
    logged_server_args,
    merge_config,
    record_unknown,
    underscore_flags,
)
from kit import DFLASH_INFO, make_patchset, run_cli, upstream_file

KEY = "sk-issue11-" + "7f3a9c"
SECRETS = "/etc/sglang/ddtree-secrets.yaml"
ENV = "DDTREE_TEST_SECRETS_API_KEY"


# --------------------------------------------------------------------------- scrub: what is hidden

@pytest.mark.parametrize("line, expected", [
    # SGLang 0.5.23's start-up line: the repr of a dict of every field (engine.py ~1185)
    ("[2026-01-01 10:00:00] server_args={'model_path': '/m', 'api_key': 'sk-1', 'admin_api_key': None, "
     "'port': 30000}",
     "[2026-01-01 10:00:00] server_args={'model_path': '/m', 'api_key': '***', 'admin_api_key': None, "
     "'port': 30000}"),
    # ServerArgs.__repr__ (server_args.py ~307), in tracebacks and error messages
    ("ServerArgs(model_path='/m', api_key='sk-2', ssl_keyfile_password=\"it's\", tp_size=8)",
     "ServerArgs(model_path='/m', api_key='***', ssl_keyfile_password=\"***\", tp_size=8)"),
    ("ServerArgs(api_key='a\\'b', port=1)", "ServerArgs(api_key='***', port=1)"),
    # YAML, as in the secrets file, and JSON
    ("api-key: sk-yaml with spaces", "api-key: ***"),
    ("api-key: 'sk-quoted'", "api-key: '***'"),
    ('  hf_token: "hf_abc"', '  hf_token: "***"'),
    ('{"api_key": "sk-j", "port": 1}', '{"api_key": "***", "port": 1}'),
    # key=value
    ("token=abc hf_token=hf_x password=pw x=1", "token=*** hf_token=*** password=*** x=1"),
    ('Environment="HF_TOKEN=hf_x" "A=1"', 'Environment="HF_TOKEN=***" "A=1"'),
    ("GET /x?token=abc&page=2", "GET /x?token=***&page=2"),
    # flags, also the `--api_key` SGLang's parser refuses when the YAML key is written api_key
    ("launch_server.py: error: unrecognized arguments: --api_key sk-B", "launch_server.py: error: "
     "unrecognized arguments: --api_key ***"),
    ("--api-key sk-1 --port 1", "--api-key *** --port 1"),
    ("--db-password=pw --port 1", "--db-password=*** --port 1"),
    ("Authorization: Bearer sk-bear", "Authorization: Bearer ***"),
])
def test_scrub_masks_secret_fields_in_every_form_a_log_prints_them(line, expected):
    assert scrub(line) == expected
    assert scrub(expected) == expected  # idempotent


@pytest.mark.parametrize("line", [
    "Prefill batch. #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: 0.00",
    "server_args={'api_key': None, 'tbo_token_distribution_threshold': 0.48, 'max_total_tokens': 4096}",
    "ServerArgs(api_key=None, tokenizer_path='/m', speculative_num_draft_tokens=8)",
    "--api-key ${SGLANG_KEY} --port 1", "TOKENIZERS_PARALLELISM=false KEYBOARD=us",
    "Load weight end. elapsed=3.21 s, type=KimiK2ForCausalLM, avail mem=33.30 GB",
])
def test_scrub_keeps_what_holds_no_secret(line):
    assert scrub(line) == line


def test_scrub_removes_every_known_value_wherever_it_is():
    lines = [f"Traceback: ValueError: bad key {KEY}!", f"x={KEY}{KEY}", "nothing here", f"{KEY[:-1]}"]
    got = scrub_lines(lines, [KEY, None, ""])
    assert got == [f"Traceback: ValueError: bad key {MASK}!", f"x={MASK}{MASK}", "nothing here", KEY[:-1]]
    assert scrub_lines(lines) == lines  # no secret-named field: only a known value gives these away


def test_one_list_of_secret_names_decides_what_scrub_masks():
    for word in SECRET_NAME_WORDS:
        name = f"my_{word.lower()}"
        assert is_secret_name(name) and scrub(f"{name}='v'") == f"{name}='***'"
    assert scrub("tokenizer_mode='auto'") == "tokenizer_mode='auto'"
    assert redact("server_args={'api_key': 'x'}") == scrub("server_args={'api_key': 'x'}")


# --------------------------------------------------------------------------- inventory and unit

def host(**vars_):
    return parse_inventory(fake_inventory(1, **vars_), "inv.yaml").hosts["fh1"]


def test_secrets_config_is_rendered_as_config_and_no_key_is_in_the_unit():
    h = host(secrets_config=SECRETS, api_key_env=ENV, environment_file="/etc/sglang/env")
    unit = render_unit(h)
    assert f"    --config {SECRETS}" in unit and unit.count("--config") == 1
    assert "--config=" not in unit  # SGLang merges only the exact token `--config`
    assert "--api-key" not in unit and ENV not in unit and secret_flags_in_exec(unit) == []
    assert "EnvironmentFile=/etc/sglang/env" in unit
    assert "--config" not in render_unit(host())


def test_api_key_env_without_secrets_config_is_refused_and_says_where_the_key_goes():
    with pytest.raises(InventoryError) as e:
        host(api_key_env=ENV, environment_file="/etc/sglang/env")
    assert e.value.field == "api_key_env"
    msg = str(e.value)
    assert "/proc/PID/cmdline" in msg and "api-key: 'KEY'" in msg and "mode 0600" in msg
    assert "secrets_config" in msg and "--config FILE" in msg
    assert host(api_key_env=ENV, secrets_config=SECRETS).api_key_env == ENV


@pytest.mark.parametrize("value, fragment", [
    ("/etc/sglang/secrets.env", "ending in .yaml or .yml"),
    ("secrets.yaml", "must be an absolute path"),
    ("/etc/sglang/../x.yaml", "'..'"),
])
def test_secrets_config_must_be_an_absolute_yaml_path(value, fragment):
    with pytest.raises(InventoryError, match="secrets_config") as e:
        host(secrets_config=value)
    assert fragment in str(e.value)
    assert host(secrets_config="/etc/sglang/s.YML").secrets_config == "/etc/sglang/s.YML"


@pytest.mark.parametrize("arg", ["--config", "--config=/etc/x.yaml", "--conf=/etc/x.yaml", "--api-key=sk"])
def test_config_and_secret_flags_are_refused_in_extra_args(arg):
    with pytest.raises(InventoryError, match="must not be in extra_args.*secrets_config"):
        host(extra_args=[arg, "/etc/x.yaml"] if "=" not in arg else [arg])
    assert host(extra_args=["--context-length=4096"]).extra_args == ("--context-length=4096",)


def test_a_template_that_puts_a_secret_flag_in_execstart_is_refused(tmp_path):
    """A template from an older bundle rendered `--api-key ${NAME}`: refused at render time."""
    (tmp_path / "old.service.j2").write_text(
        "[Service]\nExecStart=/usr/bin/python -m sglang.launch_server \\\n"
        "    --port {{ port }} \\\n    --api-key ${SGLANG_API_KEY}\n")
    with pytest.raises(InputError, match="--api-key on the command line.*secrets_config"):
        render_unit(host(template="old.service.j2"), tmp_path)
    assert secret_flags_in_exec('ExecStart=/x "--api-ke=1"\n# --api-key in a comment\n') == ["--api-ke"]


# --------------------------------------------------------------------------- the stand-in's --config

def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_standin_merges_config_as_sglang_does(tmp_path):
    cfg = write(tmp_path, "s.yaml", f"api-key: '{KEY}'\nmem-fraction-static: 0.88\ntrust-remote-code: true\n"
                                    "enable-metrics: false\ncuda-graph-bs: [1, 2]\n")
    argv = merge_config(["--port", "1", "--config", cfg, "--tp", "8"])
    assert argv == ["--api-key", KEY, "--mem-fraction-static", "0.88", "--trust-remote-code",
                    "--cuda-graph-bs", "1", "2", "--port", "1", "--tp", "8"]
    args, unknown = build_parser().parse_known_args(argv)
    assert args.api_key == KEY and args.port == 1 and args.tp_size == 8
    # the command line wins over the file (the file's options go first)
    args, _ = build_parser().parse_known_args(merge_config(["--config", cfg, "--api-key", "cli"]))
    assert args.api_key == "cli"
    # `--config=FILE` is an option SGLang parses and never merges
    args, _ = build_parser().parse_known_args(merge_config([f"--config={cfg}"]))
    assert args.api_key is None and args.config == cfg


def test_standin_config_errors_are_sglangs(tmp_path):
    cfg = write(tmp_path, "s.yaml", "api-key: 'x'\n")
    for argv, message in [
        (["--config", write(tmp_path, "s.conf", "api-key: x\n")], "Config file must be YAML format, got: .conf"),
        (["--config", str(tmp_path / "none.yaml")], "Config file not found"),
        (["--config", cfg, "--config", cfg], "Multiple config files specified! Only one allowed."),
        (["--config"], "No config file specified after --config flag!"),
        (["--config", write(tmp_path, "l.yaml", "- a\n")], "Config file must contain a dictionary at root level"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("!", "!")):
            merge_config(argv)
    # `api_key:` (underscore) becomes `--api_key`, which SGLang's parser refuses, value and all
    merged = merge_config(["--config", write(tmp_path, "u.yaml", f"api_key: '{KEY}'\n")])
    assert underscore_flags(merged) == ["--api_key", KEY]
    # an unquoted number is YAML's: 0123 is 83 (so the sandbox and the docs quote the key)
    assert merge_config(["--config", write(tmp_path, "n.yaml", "api-key: 0123\n")]) == ["--api-key", "83"]


def test_standin_logs_server_args_as_sglang_does_and_scrub_hides_it():
    argv = ["--model-path", "/m", "--api-key", KEY, "--admin-api-key", "adm-1", "--standin-load-seconds", "1"]
    args, unknown = build_parser().parse_known_args(argv)
    line = logged_server_args(args, record_unknown(unknown))
    assert line.startswith("server_args={'model_path': '/m', ")
    assert f"'api_key': '{KEY}'" in line and "'admin_api_key': 'adm-1'" in line  # in clear, as SGLang
    assert "standin" not in line and "'config'" not in line
    hidden = scrub(line)
    assert KEY not in hidden and "adm-1" not in hidden and "'api_key': '***'" in hidden
    assert "'model_path': '/m'" in hidden


# --------------------------------------------------------------------------- what the controller returns

def test_describe_failure_scrubs_the_log_tail_and_the_message(monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    rb = SimpleNamespace(host=host(secrets_config=SECRETS, api_key_env=ENV), last_step="restart")
    exc = StepFailed("wait for weights", f"server exited; it said {KEY}", [
        f"[2026-01-01 10:00:00] server_args={{'model_path': '/m', 'api_key': '{KEY}', 'port': 30000}}",
        f"ValueError: the key {KEY} is wrong", "Load weight begin. avail mem=94.50 GB"])
    step, message, log = describe_failure(rb, exc)
    assert step == "wait for weights" and KEY not in message and MASK in message
    assert KEY not in "\n".join(log) and "'api_key': '***'" in log[0] and log[2].startswith("Load weight begin")
    _, message, _ = describe_failure(rb, RuntimeError(f"boom {KEY}"))
    assert message == f"RuntimeError: boom {MASK}"


def test_results_and_the_summary_table_mask_secret_fields_again(capsys):
    from ddtree_ops.cli.tables import print_rollout
    from ddtree_ops.fleet.rollout import RolloutResult

    r = HostResult("h", Outcome.ROLLED_BACK, 3, log=["server_args={'api_key': 'sk-raw'}", "api-key: sk-yaml"])
    assert r.to_dict()["log"] == ["server_args={'api_key': '***'}", "api-key: ***"]
    res = RolloutResult("deploy", [r], [["h"]])
    assert "sk-raw" not in repr(res.to_dict())
    print_rollout(res)
    out = capsys.readouterr().out
    assert "sk-raw" not in out and "sk-yaml" not in out and "'api_key': '***'" in out


def test_health_progress_lines_are_scrubbed(monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    h = host(secrets_config=SECRETS, api_key_env=ENV)
    # The milestone is cut to its last 160 characters: scrubbed before, so no half name survives.
    lines = [f"server_args={{'api_key': '{KEY}', " + "'x': 1, " * 30 + "}", f"Error: key {KEY}",
             "Load weight begin " + "x" * 150 + f" api_key='{KEY}'"]
    seen: list[str] = []
    session = SimpleNamespace(
        host=h, sleep=lambda s: None, monotonic=lambda: 0.0,
        services=SimpleNamespace(probe=lambda unit, lines_=30: UnitProbe("active", 7, list(lines))),
        http=lambda: httpx.Client(base_url="http://x", transport=httpx.MockTransport(
            lambda req: httpx.Response(503 if len(seen) < 2 else 200))))
    wait_until_serving(session, h.unit, expected_pid=7, deadline_s=30, progress=lambda t, m: seen.append(m))
    assert seen and all(KEY not in m for m in seen), seen
    assert any("api_key='***'" in m for m in seen), seen


def test_a_loose_or_missing_secrets_file_refuses_the_deploy_before_any_change(tmp_path, patchset):
    user = "root" if os.getuid() == 0 else "sglang"
    fake = fake_hosts(tmp_path / "h", secrets_config=SECRETS, service_user=user)[0]
    before = fake.tree(fake.host.site_packages, "/etc/systemd/system")
    with pytest.raises(PreflightError, match="does not exist on the host"):
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    fake.write(SECRETS, f"api-key: '{KEY}'\n".encode(), mode=0o644)
    with pytest.raises(PreflightError, match="has mode 0644: group and others must have no access") as e:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    assert KEY not in str(e.value)
    assert fake.tree(fake.host.site_packages, "/etc/systemd/system") == before


def test_a_failed_deploy_on_a_fake_host_returns_and_records_no_key(tmp_path, monkeypatch, versioned_patchset):
    """The whole path on a fake host (the real agent in a folder): the server crashes while
    loading, its log tail holds SGLang's server_args line with the key; the result, the progress
    lines and everything the deploy wrote on the host are free of it."""
    monkeypatch.setenv(ENV, KEY)
    user = "root" if os.getuid() == 0 else "sglang"  # the file is owned by whoever runs the tests
    fake = fake_hosts(tmp_path / "h", secrets_config=SECRETS, api_key_env=ENV, service_user=user)[0]
    fake.write(SECRETS, f"api-key: '{KEY}'\n".encode(), mode=0o600)
    session = fake.session()
    probe = session.services.probe

    def probe_with_sglang_log(unit, lines=30):
        p = probe(unit, lines)
        return UnitProbe(p.active, p.main_pid, [f"[2026-01-01 10:00:00] server_args={{'api_key': '{KEY}'}}",
                                                *p.log])

    session.services.probe = probe_with_sglang_log
    reported: list[str] = []
    with pytest.raises(DeployFailed) as ei:
        deploy_host(session, versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), DeployOptions(reconnect_s=5),
                    lambda event: reported.append(event.text))
    r = ei.value.result
    assert r.outcome == Outcome.ROLLED_BACK and r.failed_step == "wait for weights"
    assert "'api_key': '***'" in r.log[0]
    assert KEY not in repr(r.to_dict()) and KEY not in "\n".join(reported)
    # On the host: the key is in the secrets file only (the unit says --config; backups, journal
    # and releases under state_dir never held it).
    holders = [p for p, data in fake.tree("/").items() if KEY.encode() in data]
    assert holders == [SECRETS], holders


# --------------------------------------------------------------------------- on a real test host (sandbox)

def _holders(root: str, needle: bytes) -> list[str]:
    """Files under `root` (this machine's view of a sandbox host's folders) that contain `needle`."""
    out = []
    for d, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    if needle in fh.read():
                        out.append(os.path.relpath(p, root))
    return sorted(out)


def test_the_api_key_lives_in_the_secrets_file_only_on_a_real_host(fresh_host, tmp_path, good_patchset):
    """A sandbox host (sshd, systemctl, the stand-in SGLang, which logs `server_args={...}` with
    the key in clear, as SGLang 0.5.23 does). Deploy with the key provisioned in secrets_config,
    then two failed deploys (the server crashes while loading: its log tail, with the server_args
    line, goes into the JSON, and into the table without --json). The key is in none of: the unit file, anything under
    the state dir (backups, journal, releases), /proc/<server pid>/cmdline and environ, the CLI's
    stdout/stderr and --json output. On the host it is in the secrets file -- and in the server's
    own log (the journal under /var/log), which is SGLang's doing, not the tool's: operators
    restrict who reads /var/log; the tool scrubs what it shows."""
    from ddtree_ops.testing.sandbox import write_secrets_config

    key = "sk-ddtree-sandbox-" + os.urandom(8).hex()
    sb = next(h for h in fresh_host.sandbox.hosts() if h.name == fresh_host.name)
    path = write_secrets_config(sb, {"api-key": key})
    th = fresh_host.with_vars(tmp_path, secrets_config=path, api_key_env=ENV)
    h = th.host
    outputs: list[str] = []

    def cli(*args: str, code: int):
        r = run_cli(*args, env={ENV: key})
        outputs.append(r.stdout + r.stderr)
        assert r.code == code, r.stdout + r.stderr
        return r

    inv = str(th.inventory)
    plan = cli("plan", "-i", inv, "-l", th.name, "-p", str(good_patchset), "--json", code=0).json()["plans"][0]
    assert f"+    --config {path}" in plan["unit_diff"] and plan["refusals"] == []
    cli("deploy", "-i", inv, "-l", th.name, "-p", str(good_patchset), "--yes", code=0)
    # The server took the key from the file: without it 401, with it 200.
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(h.base_url + "/generate", json=body, timeout=10).status_code == 401
    assert httpx.post(h.base_url + "/generate", json=body, timeout=10,
                      headers={"Authorization": f"Bearer {key}"}).status_code == 200
    pid = th.main_pid(h.unit)
    proc = th.ssh(["sh", "-c", 'tr "\\0" " " < /proc/$1/cmdline; echo; tr "\\0" " " < /proc/$1/environ',
                   "sh", str(pid)]).stdout
    assert f"--config {path}" in proc and key not in proc, proc
    log = th.ssh(["journalctl", "-u", h.unit, "-n", "200", "--no-pager"]).stdout
    assert f"'api_key': '{key}'" in log  # the stand-in logs it as SGLang does: the reason for scrubbing

    # A failed deploy: a DDTree module that raises while the server loads; rolled back (exit 3).
    crash = make_patchset(tmp_path, {
        "sglang/srt/speculative/ddtree_raises.py": b"raise RuntimeError('boom at import')\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# crash\n",
    }, name="crash")
    r = cli("deploy", "-i", inv, "-l", th.name, "-p", str(crash), "--yes", "--json", code=3)
    res = r.json()["hosts"][0]
    assert res["outcome"] == "rolled_back" and any("boom at import" in ln for ln in res["log"]), res
    assert any("'api_key': '***'" in ln for ln in res["log"]), res["log"]  # the line was there, scrubbed
    # Without --json: the table and the last 15 log lines, so a crash with a short traceback.
    t2 = th.with_vars(tmp_path, secrets_config=path, api_key_env=ENV,
                      extra_args=th.base_extra_args() + ["--standin-crash-during-load"])
    r = cli("deploy", "-i", str(t2.inventory), "-l", th.name, "-p", str(good_patchset), "--yes", code=3)
    assert "--- last log lines of" in r.stdout and "'api_key': '***'" in r.stdout, r.stdout
    cli("history", "--host", th.name, "-i", inv, "--json", code=0)
    cli("status", "-i", inv, "-l", th.name, "--json", code=0)

    for out in outputs:
        assert key not in out
    unit = th.read(h.unit_path).decode()
    assert f"--config {path}" in unit and key not in unit
    # Every file of the host (units, state dir with its backups and journal, site-packages,
    # /var/log) read on this machine, and the host's own /run: the secrets file and the server's
    # journal hold the key, nothing else.
    held = _holders(sb.dir, key.encode())
    assert "var-lib/sglang-secrets/ddtree-secrets.yaml" in held, held
    # Besides, only the server's own log: journald's files under var-log (which may compress the
    # long server_args line beyond a byte scan; the journal read above holds it in clear).
    others = [p for p in held if p != "var-lib/sglang-secrets/ddtree-secrets.yaml"]
    assert all(p.startswith("var-log/") for p in others), held
    assert th.ssh(["sh", "-c", 'grep -rlsF -- "$1" /run /etc/systemd/system /var/lib/ddtree-ops || true',
                   "sh", key]).stdout.split() == []
    # Leave the host as the next test expects it (no release that wants a key): a deployable host
    # on a release is kept by fixtures that do not reset it.
    cli("rollback", "-i", inv, "-l", th.name, "--to", "original", "--yes", code=0)
