"""Tests of the stand-in SGLang server: real subprocesses on 127.0.0.1, free ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The test rig's own tests: each starts stand-in server processes.
pytestmark = pytest.mark.sandbox

# A fake payload implementing the agreed API (tree of the B best prefixes with a per-depth
# cap, retrieve arrays, and the walk of tree_speculative_sampling_target_only).
FAKE_DDTREE_UTILS = textwrap.dedent('''
    import heapq
    import torch

    def build_ddtree_tree(draft_logprobs, budget, topk_cap):
        bs, L, V = draft_logprobs.shape
        K = min(topk_cap, V)
        vals, idx = draft_logprobs[0].topk(K, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        tokens, parents, depths, scores = [0], [-1], [0], [0.0]
        heap = [(-vals[0][0], 1, 0, 0, 0.0)]  # (-score, depth, rank, parent, parent score)
        while heap and len(tokens) < budget + 1:
            neg, d, r, par, pscore = heapq.heappop(heap)
            me = len(tokens)
            tokens.append(idx[d - 1][r]); parents.append(par); depths.append(d); scores.append(-neg)
            if r + 1 < K:
                heapq.heappush(heap, (-(pscore + vals[d - 1][r + 1]), d, r + 1, par, pscore))
            if d < L:
                heapq.heappush(heap, (-(-neg + vals[d][0]), d + 1, 0, me, -neg))
        t = lambda x, dt: torch.tensor([x], dtype=dt)
        return (t(tokens, torch.int64), t(parents, torch.int64), t(depths, torch.int64),
                t(scores, torch.float32))

    def compile_ddtree_retrieve(parents, scores):
        bs, N = parents.shape
        nxt = [-1] * N; sib = [-1] * N; last_child = {}
        for i, p in enumerate(parents[0].tolist()):
            if p < 0:
                continue
            if p in last_child:
                sib[last_child[p]] = i
            else:
                nxt[p] = i
            last_child[p] = i
        t = lambda x: torch.tensor([x], dtype=torch.int64)
        return t(list(range(N))), t(nxt), t(sib)

    def tree_speculative_sampling_reference(predicts, accept_index, accept_token_num, candidates,
                                            retrive_index, retrive_next_token, retrive_next_sibling,
                                            uniform_samples, uniform_samples_for_final_sampling,
                                            target_probs, draft_probs, threshold_single=1.0,
                                            threshold_acc=1.0):
        B, N = candidates.shape
        S = accept_index.shape[1]
        for b in range(B):
            row = 0; coin = float(uniform_samples[b, 0]); n = 0
            accept_index[b, 0] = int(retrive_index[b, 0])
            while n < S - 1:
                child = int(retrive_next_token[b, row]); acc = 0.0; took = -1
                while child != -1:
                    tok = int(candidates[b, child]); p = float(target_probs[b, row, tok]); acc += p
                    if p > 0 and (coin < acc / threshold_acc or p >= threshold_single):
                        took = child; break
                    draft_probs[b, row, tok] = target_probs[b, row, tok]
                    child = int(retrive_next_sibling[b, child])
                if took < 0:
                    break
                predicts[int(retrive_index[b, row])] = int(candidates[b, took])
                n += 1; accept_index[b, n] = int(retrive_index[b, took])
                row = took; coin = float(uniform_samples[b, took])
            accept_token_num[b] = n
            q = target_probs[b, row] if n == S - 1 else torch.relu(target_probs[b, row] - draft_probs[b, row])
            cum = torch.cumsum(q, 0); tot = float(cum[-1]); u = float(uniform_samples_for_final_sampling[b])
            pos = [i for i in range(q.numel()) if q[i] > 0]
            pick = next((i for i in pos if float(cum[i]) > u * tot), pos[-1] if pos else q.numel() - 1)
            predicts[int(retrive_index[b, row])] = pick
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_site_packages(root: Path, modules: dict[str, str] | None = None) -> Path:
    sp = root / "site-packages"
    spec = sp / "sglang" / "srt" / "speculative"
    spec.mkdir(parents=True)
    for d in (sp / "sglang", sp / "sglang" / "srt", spec):
        (d / "__init__.py").write_text("")
    for name, src in (modules or {}).items():
        (spec / name).write_text(src)
    return sp


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log_path = proc, port, log

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, headers: dict | None = None, timeout: float = 5.0):
        """(status, parsed body) or (None, None) when the connection is refused."""
        return _request(urllib.request.Request(self.url(path), headers=headers or {}), timeout)

    def post(self, path: str, body: dict, headers: dict | None = None, timeout: float = 30.0):
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return _request(req, timeout)

    def wait_status(self, path: str, want: int, timeout: float = 15.0, headers=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log}"
            if self.get(path, headers)[0] == want:
                return
            time.sleep(0.02)
        raise AssertionError(f"{path} never answered {want}:\n{self.log}")

    def wait_exit(self, timeout: float = 15.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout}s:\n{self.log}") from None


def _request(req, timeout):
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw) if raw else None
        except ValueError:
            return e.code, raw
    except (ConnectionRefusedError, ConnectionResetError):
        return None, None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (ConnectionRefusedError, ConnectionResetError)):
            return None, None
        raise


@pytest.fixture
def spawn(tmp_path):
    procs: list[subprocess.Popen] = []

    def _spawn(*flags: str, site_packages: Path | None = None, port: int | None = None,
               env: dict | None = None, load: float = 0.1, warmup: float = 0.05) -> Server:
        port = port or free_port()
        sp = site_packages or make_site_packages(tmp_path / f"sp{len(procs)}")
        e = dict(os.environ)
        e.pop("DDTREE_STANDIN_LOAD_SECONDS", None)
        e["PYTHONPATH"] = os.pathsep.join([str(sp), str(REPO)])
        e.update(env or {})
        log = tmp_path / f"server{len(procs)}.log"
        cmd = [sys.executable, "-m", "ddtree_ops.testing.standin", "--host", "127.0.0.1",
               "--port", str(port), "--model-path", "/models/toy",
               "--standin-load-seconds", str(load), "--standin-warmup-seconds", str(warmup), *flags]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=e)
        procs.append(proc)
        return Server(proc, port, log)

    try:
        yield _spawn
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def test_readiness_timeline_refused_then_503_then_200(spawn):
    s = spawn(load=0.6, warmup=0.6)
    seen: list[object] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert s.proc.poll() is None, s.log
        code = s.get("/health")[0]
        if not seen or seen[-1] != code:
            seen.append(code)
        if code == 200:
            break
        time.sleep(0.02)
    assert seen == [None, 503, 200], seen
    # /server_info and /model_info answer; /ready agrees with health
    assert s.get("/ready")[0] == 200
    code, info = s.get("/model_info")
    assert code == 200 and info["model_path"] == "/models/toy" and "weight_version" in info
    log = s.log
    order = ["Load weight begin. avail mem=", "Load weight end. elapsed=", "Capture target decode CUDA graph begin",
             "Capture target decode CUDA graph end", "Uvicorn running on", "The server is fired up and ready to roll!"]
    positions = [log.index(x) for x in order]
    assert positions == sorted(positions), log
    # SIGTERM: clean exit within a second
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(2) == 0
    assert "Received sigterm" in s.log


def test_crash_during_load_exits_nonzero_with_traceback(spawn):
    s = spawn("--standin-crash-during-load", load=0.4)
    assert s.wait_exit() != 0
    log = s.log
    assert "Load weight begin" in log and "Traceback (most recent call last)" in log
    assert "Load weight end" not in log


def test_ddtree_module_failing_import_ends_process(spawn, tmp_path):
    sp = make_site_packages(tmp_path / "bad", {
        "ddtree_bad.py": "raise ImportError('cannot import name ddtree_kernel from sgl_kernel')\n"})
    s = spawn("--speculative-algorithm", "DDTREE", site_packages=sp)
    assert s.wait_exit() == 1
    log = s.log
    assert "Traceback (most recent call last)" in log
    assert "cannot import name ddtree_kernel" in log and "ddtree_bad" in log
    assert "fired up" not in log


def test_ddtree_algorithm_without_modules_exits_2(spawn):
    s = spawn("--speculative-algorithm", "DDTREE")
    assert s.wait_exit() == 2
    assert "invalid choice: 'DDTREE'" in s.log


def test_never_listen_and_warmup_never_completes(spawn):
    a = spawn("--standin-never-listen", load=0.05)
    b = spawn("--standin-warmup-never-completes", load=0.05)
    b.wait_status("/server_info", 200)
    time.sleep(0.5)
    assert a.proc.poll() is None and a.get("/health")[0] is None
    assert b.get("/health")[0] == 503 and b.get("/ready")[0] == 503
    assert b.get("/health_generate")[0] == 503
    for s in (a, b):  # SIGTERM ends even a server stuck loading or warming up
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_exit(2) == 0


def test_unknown_flags_are_recorded():
    from ddtree_ops.testing.standin import build_parser, record_unknown

    args, unknown = build_parser().parse_known_args([
        "--tp", "8", "--trust-remote-code", "--mem-fraction-static=0.88", "--context-length",
        "4096", "--speculative-ddtree-budget", "16", "--offset", "-1", "--enable-metrics"])
    assert args.tp_size == 8 and args.speculative_ddtree_budget == 16
    assert record_unknown(unknown) == {"trust_remote_code": True, "mem_fraction_static": "0.88",
                                       "context_length": "4096", "offset": "-1",
                                       "enable_metrics": True}


def test_recorded_flags_are_masked_with_the_projects_secret_list():
    from ddtree_ops.config.redaction import MASK
    from ddtree_ops.testing.standin import masked, record_unknown

    extra = record_unknown(["--hf-token", "t0k", "--admin-api-key=k3y", "--db-password", "pw", "--some-secret",
                            "--mem-fraction-static=0.88", "--trust-remote-code"])
    assert masked(extra) == {"hf_token": MASK, "admin_api_key": MASK, "db_password": MASK,
                             "some_secret": True,  # a bare switch hides nothing
                             "mem_fraction_static": "0.88", "trust_remote_code": True}


def test_health_flaps_after_ready(spawn):
    s = spawn("--standin-health-flaps")
    s.wait_status("/ready", 200)
    codes = [s.get("/health")[0] for _ in range(6)]
    assert codes in ([200, 503] * 3, [503, 200] * 3), codes


def test_generate_fails_500_but_health_ok(spawn):
    s = spawn("--standin-generate-fails")
    s.wait_status("/health", 200)
    code, _ = s.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert code == 500


def test_server_info_reports_args_and_accept_length(spawn):
    s = spawn("--tp", "8", "--speculative-algorithm", "DFLASH",
              "--speculative-draft-model-path", "/models/draft",
              "--speculative-ddtree-budget", "24", "--speculative-ddtree-topk-cap=6",
              "--trust-remote-code", "--mem-fraction-static=0.88", "--cuda-graph-max-bs", "8",
              "--hf-token", "hf-s3cret", "--db-password=pw-s3cret",
              env={"DDTREE_STANDIN_LOAD_SECONDS": "0.05"}, load=30)
    s.wait_status("/health", 200, timeout=10)  # the env override beats --standin-load-seconds 30
    code, info = s.get("/server_info")
    assert code == 200
    assert info["speculative_ddtree_budget"] == 24 and info["speculative_ddtree_topk_cap"] == 6
    assert info["speculative_draft_model_path"] == "/models/draft"
    assert info["speculative_algorithm"] == "DFLASH" and info["tp_size"] == 8
    assert info["version"] == "0.5.23" and info["standin"] is True
    assert info["trust_remote_code"] is True and info["mem_fraction_static"] == "0.88"
    # secret-named flags the stand-in does not model: masked in /server_info and in its own log
    # lines; SGLang's `server_args={...}` line has every value in clear, as SGLang logs it
    assert info["hf_token"] == "***" and info["db_password"] == "***"
    assert info["standin_extra_args"]["hf_token"] == "***"
    assert "s3cret" not in json.dumps(info)
    assert "'hf_token': 'hf-s3cret'" in s.log
    assert not [ln for ln in s.log.splitlines() if "s3cret" in ln and "server_args={" not in ln], s.log
    assert "avg_spec_accept_length" not in info["internal_states"][0]
    code, out = s.post("/generate", {"text": "hello there", "sampling_params": {
        "temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 12}})
    assert code == 200 and out["text"].startswith("tok")
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 12 and meta["spec_accept_length"] == 1.0
    for k in ("id", "prompt_tokens", "spec_accept_rate", "spec_verify_ct", "finish_reason"):
        assert k in meta
    assert s.get("/get_server_info")[1]["internal_states"][0]["avg_spec_accept_length"] == 1.0


def test_api_key_enforced_except_health(spawn):
    s = spawn("--api-key", "s3cret-key")
    s.wait_status("/health", 200)
    assert s.get("/ready")[0] == 200
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    assert s.post("/generate", body)[0] == 401
    assert s.post("/generate", body, {"Authorization": "Bearer wrong"})[0] == 401
    assert s.get("/server_info")[0] == 401 and s.get("/model_info")[0] == 401
    ok = {"Authorization": "Bearer s3cret-key"}
    assert s.post("/generate", body, ok)[0] == 200
    code, info = s.get("/server_info", ok)
    assert code == 200 and "s3cret-key" not in json.dumps(info)
    # SGLang 0.5.23 logs it at start-up (engine.py `server_args={...}`), the stand-in too: the
    # controller scrubs what it shows (tests/test_secrets.py)
    assert [ln for ln in s.log.splitlines() if "s3cret-key" in ln] == [
        ln for ln in s.log.splitlines() if "server_args={" in ln and "'api_key': 's3cret-key'" in ln]


def test_config_file_gives_the_api_key_as_sglang_does(spawn, tmp_path):
    cfg = tmp_path / "secrets.yaml"
    cfg.write_text("api-key: 'cfg-s3cret'\n")
    cfg.chmod(0o600)
    s = spawn("--config", str(cfg))
    s.wait_status("/health", 200)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    assert s.post("/generate", body)[0] == 401
    assert s.post("/generate", body, {"Authorization": "Bearer cfg-s3cret"})[0] == 200
    assert "'api_key': 'cfg-s3cret'" in s.log
    # `api_key:` is not an SGLang option name: "unrecognized arguments: --api_key VALUE", exit 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("api_key: 'cfg-s3cret'\n")
    b = spawn("--config", str(bad))
    assert b.wait_exit() == 2
    assert "error: unrecognized arguments: --api_key cfg-s3cret" in b.log


def test_port_already_taken_exits_quickly(spawn):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = spawn(port=port, load=0.05)
        t0 = time.monotonic()
        assert s.wait_exit(10) != 0
        assert time.monotonic() - t0 < 5
    assert "address already in use" in s.log.lower() and str(port) in s.log


def test_die_after_ready(spawn):
    s = spawn("--standin-die-after-ready", "0.3")
    s.wait_status("/health", 200)
    assert s.wait_exit(5) == 1
    assert "fired up" in s.log


def test_generate_exercises_ddtree_payload(spawn, tmp_path):
    good = make_site_packages(tmp_path / "good", {"ddtree_utils.py": FAKE_DDTREE_UTILS,
                                                  "ddtree_info.py": "X = 1\n"})
    broken_src = FAKE_DDTREE_UTILS + "\ndef build_ddtree_tree(*a, **k):\n    raise ValueError('boom in build')\n"
    broken = make_site_packages(tmp_path / "broken", {"ddtree_utils.py": broken_src})
    flags = ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "12",
             "--speculative-ddtree-topk-cap", "3")
    g = spawn(*flags, site_packages=good)
    b = spawn(*flags, site_packages=broken)
    plain = spawn()  # no payload: autoregressive toy generation
    for s in (g, b, plain):
        s.wait_status("/health", 200, timeout=30)
    assert "DDTree modules imported: sglang.srt.speculative.ddtree_info" in g.log
    # Measured once, at start-up, before the server was ready; each request is paced with it.
    import re

    m = re.search(r"DDTree payload measured at start-up \(budget=12, topk_cap=3, "
                  r"sampler=tree_speculative_sampling_reference\): accept length ([0-9.]+) greedy, ([0-9.]+) at "
                  r"temperature 1 \(128 verify steps each", g.log)
    assert m and g.log.index(m.group(0)) < g.log.index("fired up"), g.log
    at_0, at_1 = float(m.group(1)), float(m.group(2))
    prompt = "Explain speculative decoding"
    greedy = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
    code, out = g.post("/generate", greedy)
    assert code == 200 and out["meta_info"]["spec_ddtree"] is True
    assert at_0 > 1.5 and out["meta_info"]["spec_accept_length"] == pytest.approx(at_0, rel=0.1)  # greedy chain
    assert out["meta_info"]["completion_tokens"] == 40
    # lossless at temperature 0: the same tokens as plain greedy decoding
    assert out["text"] == plain.post("/generate", greedy)[1]["text"]
    code, out2 = g.post("/generate", {"text": "other", "sampling_params": {
        "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 30}})
    assert code == 200 and out2["meta_info"]["spec_ddtree"] is True
    assert out2["meta_info"]["spec_accept_length"] == pytest.approx(at_1, rel=0.1) and at_1 < at_0
    avg = g.get("/server_info")[1]["internal_states"][0]["avg_spec_accept_length"]
    m1, m2 = out["meta_info"], out2["meta_info"]
    expected = (m1["completion_tokens"] + m2["completion_tokens"]) / (m1["spec_verify_ct"] + m2["spec_verify_ct"])
    assert avg == pytest.approx(expected, rel=1e-6) and avg > 1.0
    # a payload function that raises: logged with its traceback, /generate still answers
    code, out3 = b.post("/generate", greedy)
    assert code == 200 and out3["meta_info"]["spec_accept_length"] == 1.0
    assert out3["text"] == out["text"]
    assert "DDTree payload error at start-up" in b.log and "boom in build" in b.log and "Traceback" in b.log
    assert "DDTree payload measured" not in b.log and b.get("/server_info")[1]["standin_payload_errors"] == 1


def _real_sglang_tree() -> Path:
    """The real 0.5.23 files, downloaded (pip, once) and extracted into the cache if needed."""
    from ddtree_ops.testing.sandbox import sglang_site_tree

    return sglang_site_tree() / "sglang"


@pytest.mark.sglang
def test_ddtree_modules_beside_real_sglang_files_without_its_dependencies(spawn, tmp_path):
    """As on the test hosts: the real 0.5.23 files, none of SGLang's dependencies
    (sglang/__init__.py needs orjson, transformers, ...), plus the payload's modules."""
    real = _real_sglang_tree()
    sp = tmp_path / "site-packages"
    # a tree of symlinks to the real files, with the payload added to srt/speculative
    for src_dir, dst_dir, keep in ((real, sp / "sglang", "srt"), (real / "srt", sp / "sglang" / "srt", "speculative"),
                                   (real / "srt" / "speculative", sp / "sglang" / "srt" / "speculative", None)):
        dst_dir.mkdir(parents=True)
        for entry in src_dir.iterdir():
            if entry.name != keep:
                (dst_dir / entry.name).symlink_to(entry)
    (sp / "sglang" / "srt" / "speculative" / "ddtree_utils.py").write_text(FAKE_DDTREE_UTILS)
    s = spawn("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8",
              "--speculative-ddtree-topk-cap", "2", site_packages=sp)
    s.wait_status("/health", 200, timeout=30)
    assert "DDTree modules imported: sglang.srt.speculative.ddtree_utils" in s.log
    code, out = s.post("/generate", {"text": "x y", "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert code == 200 and out["meta_info"]["spec_ddtree"] is True


def test_sigterm_lets_in_flight_generations_finish_as_sglang_does(spawn):
    """SGLang 0.5.23's SIGTERM drain: /health 503 at once, requests in flight finish (answered
    200), `Gracefully exiting... Remaining number of requests N`, then exit. /v1/loads counts them."""
    import threading

    s = spawn("--standin-generate-seconds", "2")
    s.wait_status("/health", 200)
    got: list = []
    t = threading.Thread(target=lambda: got.append(s.post("/generate", {"text": "hi"})))
    t.start()
    deadline = time.monotonic() + 10
    while s.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] != 1:
        assert time.monotonic() < deadline, s.log
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGTERM)
    s.wait_status("/health", 503, timeout=2)
    t.join(10)
    assert got and got[0][0] == 200, got
    assert s.wait_exit(5) == 0
    assert "Gracefully exiting... Remaining number of requests 1" in s.log
    # SGLang 0.5.23's words: the request ids still in flight, and a last line with none left
    log = s.log
    rid = got[0][1]["meta_info"]["id"]
    assert f"Gracefully exiting... Remaining number of requests 1. Remaining requests remaining_rids=['{rid}']." in log
    assert log.index("remaining_rids=[].") > log.index(f"remaining_rids=['{rid}']")


# -- pacing, streaming, /metrics, start-up phases ------------------------------------------------

def _stream(s: Server, body: dict, timeout: float = 30.0) -> tuple[str, list[tuple[float, bytes]], float]:
    """POST /generate with "stream": true; (content type, [(arrival time, raw event)], start time)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=timeout)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events: list[tuple[float, bytes]] = []
        buf = b""
        while True:
            line = resp.readline()
            if not line:
                break
            buf += line
            if line == b"\n":  # an event ends with a blank line
                events.append((time.monotonic(), buf))
                buf = b""
        assert buf == b"", buf
        return resp.getheader("Content-Type"), events, t0
    finally:
        conn.close()


def _chunks(events: list[tuple[float, bytes]]) -> list[tuple[float, dict]]:
    assert events and events[-1][1] == b"data: [DONE]\n\n", events[-1:]
    out = []
    for t, raw in events[:-1]:
        assert raw.startswith(b"data: {") and raw.endswith(b"}\n\n"), raw
        out.append((t, json.loads(raw[len(b"data: "):])))
    return out


def _get_text(s: Server, path: str) -> tuple[int, str, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def _prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a Prometheus text page; every family with HELP and TYPE."""
    import re

    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out: dict[tuple[str, frozenset], float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            m = sample.match(line)
            assert m, line
            name = m.group(1)
            assert name in typed or re.sub(r"_(bucket|count|sum)$", "", name) in typed, line
            out[(name, frozenset(label.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def _sample(metrics: dict, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _ddtree_formula_site(tmp_path: Path, name: str) -> Path:
    """A DDTree module without the payload's functions: /generate is paced with the formula's
    accept length for the budget and top-k cap."""
    return make_site_packages(tmp_path / name, {"ddtree_info.py": "X = 1\n"})


def test_streaming_generate_answers_sglangs_events_with_cumulative_text_and_counts(spawn, tmp_path):
    flags = ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16",
             "--speculative-ddtree-topk-cap", "4")
    s = spawn(*flags, site_packages=_ddtree_formula_site(tmp_path, "a"))
    inc = spawn(*flags, "--incremental-streaming-output", site_packages=_ddtree_formula_site(tmp_path, "b"))
    for srv in (s, inc):
        srv.wait_status("/health", 200)
    body = {"text": "Explain speculative decoding", "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
    ctype, events, _ = _stream(s, body)
    assert ctype.startswith("text/event-stream")
    chunks = [c for _, c in _chunks(events)]
    assert len(chunks) >= 5
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    steps = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert counts[-1] == 40 and all(n >= 1 for n in steps) and max(steps) >= 3, counts  # several tokens a step
    for c in chunks:  # SGLang's default (non-incremental) stream: text and output_ids cumulative
        assert len(c["output_ids"]) == c["meta_info"]["completion_tokens"]
        assert c["text"] == " ".join(f"tok{t}" for t in c["output_ids"])
        assert c["meta_info"]["id"] == chunks[0]["meta_info"]["id"]
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None and "spec_accept_length" not in c["meta_info"]
               for c in chunks[:-1])
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 40}
    assert last["spec_verify_ct"] == len(chunks) and last["spec_accept_length"] == pytest.approx(40 / len(chunks))
    assert last["e2e_latency"] > 0 and last["prompt_tokens"] == 3
    # the same tokens as the answer without streaming
    code, whole = s.post("/generate", body)
    assert code == 200 and whole["text"] == chunks[-1]["text"]
    # --incremental-streaming-output: each event carries its own tokens, the counts stay cumulative
    deltas = [c for _, c in _chunks(_stream(inc, body)[1])]
    assert [c["meta_info"]["completion_tokens"] for c in deltas] == counts
    assert [t for c in deltas for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in deltas) == whole["text"]
    # /metrics exists only with --enable-metrics, as in SGLang
    assert _get_text(s, "/metrics")[0] == 404


def _server_rate(s: Server) -> float:
    """The decode rate of the server's one counted request on its own clock (`sglang:gen_throughput`:
    tokens after the first chunk over the time from the first chunk to the last, as it sent them)."""
    return _sample(_prometheus(_get_text(s, "/metrics")[2]), "sglang:gen_throughput")


def test_release_with_budget16_topk4_decodes_faster_than_7_1_and_tokens_per_second_slows_it(spawn, tmp_path):
    """The three streams side by side, each rate read on its server. They were once measured by the
    client from its first chunk to its last, and a loaded machine made the wide release's 1970
    tokens/s out of a paced 1628: its first chunk came late and the stand-in then caught up on an
    absolute clock, sending the missed steps back to back (the window started late, its end did
    not). Steps are now at least a step time apart on the server's clock (see the test below), so no
    rate on that clock can exceed the release's pacing: the upper bounds are exact. The lower bounds
    and the ratios are read on the pacing's schedule (`standin_paced_gen_throughput`, the rate of
    the GPU the stand-in models), never above the process's clock's rate: on the process's clock a
    stand-in starved of CPU for a while is slower by however long it was not scheduled (a stress run
    with two busy loops read the wide release at 720 tokens/s there, against a floor of 900)."""
    import threading

    def release(budget: int, topk: int, *more: str) -> Server:
        return spawn("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(budget),
                     "--speculative-ddtree-topk-cap", str(topk), "--enable-metrics", *more,
                     site_packages=_ddtree_formula_site(tmp_path, f"r{budget}-{topk}-{len(more)}"))

    wide, narrow = release(16, 4), release(7, 1)
    slow = release(16, 4, "--standin-tokens-per-second", "300", "--standin-ttft-seconds", "0.2")
    servers = {"wide": wide, "narrow": narrow, "slow": slow}
    for srv in servers.values():
        srv.wait_status("/health", 200)
    body = {"text": "Write a Python function", "sampling_params": {"temperature": 0.7, "max_new_tokens": 120}}
    streams: dict[str, tuple[list[tuple[float, dict]], float]] = {}

    def one(name: str) -> None:
        _, events, t0 = _stream(servers[name], body)
        streams[name] = (_chunks(events), t0)

    threads = [threading.Thread(target=one, args=(name,)) for name in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(streams) == set(servers), streams
    runs = {}
    for name, (chunks, t0) in streams.items():
        first, meta = chunks[0][1]["meta_info"], chunks[-1][1]["meta_info"]
        runs[name] = {"ttft": chunks[0][0] - t0, "rate": _server_rate(servers[name]), "meta": meta,
                      "paced": servers[name].get("/server_info")[1]["standin_paced_gen_throughput"],
                      "after_first": meta["completion_tokens"] - first["completion_tokens"]}
    w, n, sl = runs["wide"], runs["narrow"], runs["slow"]
    # accept length 1 + log2(1 + B/4) + (min(K, B) - 1)/4 at 400 verify steps/s: 4.07 and 2.46
    assert w["meta"]["spec_accept_length"] == pytest.approx(4.0, abs=0.15)
    assert n["meta"]["spec_accept_length"] == pytest.approx(2.46, abs=0.15)
    # Never above the pacing: the tokens after the first chunk over (steps after the first) / 400,
    # and 300 tokens/s with --standin-tokens-per-second (wide: at most 116 / (29 / 400) = 1600).
    for r in (w, n):
        assert r["rate"] <= r["after_first"] * 400 / (r["meta"]["spec_verify_ct"] - 1), runs
        assert r["paced"] == pytest.approx(r["after_first"] * 400 / (r["meta"]["spec_verify_ct"] - 1)), runs
    assert sl["rate"] <= 300, runs
    assert all(r["rate"] <= r["paced"] * 1.0001 for r in runs.values()), runs
    assert w["paced"] > 1.3 * n["paced"] and w["paced"] > 900, runs
    # --standin-tokens-per-second: the decode rate whatever the accept length; the prefill delay first
    assert 200 < sl["paced"] and sl["paced"] < n["paced"] / 2, runs
    assert sl["meta"]["spec_accept_length"] == pytest.approx(w["meta"]["spec_accept_length"])
    assert 0.03 <= w["ttft"] < 0.2 <= sl["ttft"], runs


def test_a_starved_server_goes_on_at_its_step_time_and_never_bursts_the_steps_it_missed(spawn):
    """A GPU server's forward that starts late ends late: a stand-in given no CPU for 0.3 s in the
    middle of a stream (SIGSTOP, then SIGCONT) goes on one chunk per step. It used to catch up on an
    absolute clock instead, sending the ~30 steps it had missed 0.1 ms apart: a gate's DFlash
    baseline so starved showed an ITL p50 of 0.3 ms (10 ms paced) and a DDTree release "failed"
    against it (tests/test_perfgate_standin.py). Read on the server's own clock: its inter-token
    histogram, whatever the client's scheduling."""
    import http.client

    s = spawn("--standin-verify-steps-per-second", "100", "--enable-metrics")  # accept length 1: 10 ms a token
    s.wait_status("/health", 200)
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    try:
        # 200 steps: 2 s of decoding, of which the first chunk's arrival starts the stall
        conn.request("POST", "/generate", json.dumps({"text": "x", "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 200}}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        stalled, last = False, None
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            last = json.loads(line[len(b"data: "):])
            if not stalled:
                stalled = True
                os.kill(s.proc.pid, signal.SIGSTOP)
                try:  # stopped (the kernel says so), then 0.3 s without CPU
                    deadline = time.monotonic() + 10
                    while Path(f"/proc/{s.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                        assert time.monotonic() < deadline, "the stand-in never stopped"
                        time.sleep(0.001)
                    time.sleep(0.3)
                finally:
                    os.kill(s.proc.pid, signal.SIGCONT)
    finally:
        conn.close()
    meta = last["meta_info"]
    assert meta["completion_tokens"] == 200 and meta["spec_verify_ct"] == 200
    m = _prometheus(_get_text(s, "/metrics")[2])
    itl = "sglang:inter_token_latency_seconds"
    assert _sample(m, f"{itl}_count") == 199
    # the stall is one gap between two chunks (so it fell inside the stream) ...
    assert _sample(m, f"{itl}_count") - _sample(m, f"{itl}_bucket", le="0.2") >= 1
    # ... and no gap is shorter than a step (the next bucket bound under 10 ms is 8 ms)
    assert _sample(m, f"{itl}_bucket", le="0.008") == 0
    # the steps after the stall shifted by it: the prefill, 198 more steps and the stall at least
    assert meta["e2e_latency"] >= 0.03 + 198 * 0.01 + 0.3


def test_accept_length_knob_shows_in_server_info_and_metrics(spawn):
    s = spawn("--standin-accept-length", "2.5", "--enable-metrics")
    s.wait_status("/health", 200)
    code, out = s.post("/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 100}})
    assert code == 200
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 100 and meta["spec_verify_ct"] == 40 and meta["spec_accept_length"] == 2.5
    assert s.get("/server_info")[1]["internal_states"][0]["avg_spec_accept_length"] == 2.5
    code, ctype, text = _get_text(s, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    m = _prometheus(text)
    assert _sample(m, "sglang:spec_accept_length", model_name="/models/toy", engine_type="unified",
                   tp_rank="0") == 2.5
    assert _sample(m, "sglang:spec_verify_calls_total") == 40
    assert "accept len: 2.50, accept rate: " in s.log


def test_metrics_histograms_count_served_requests(spawn):
    import threading

    s = spawn("--enable-metrics", "--max-running-requests", "1", "--standin-accept-length", "2")
    s.wait_status("/health", 200)
    base = {"temperature": 0}
    for n in (10, 6):
        assert s.post("/generate", {"text": f"p{n}", "sampling_params": {**base, "max_new_tokens": n}})[0] == 200
    streamed = _chunks(_stream(s, {"text": "s", "sampling_params": {**base, "max_new_tokens": 9}})[1])
    assert streamed[-1][1]["meta_info"]["completion_tokens"] == 9
    # real gauges: one long request running, one waiting for the only slot
    long_body = {"text": "long", "sampling_params": {**base, "max_new_tokens": 320}}  # 0.4 s at 800 tokens/s
    threads = [threading.Thread(target=s.post, args=("/generate", long_body)) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while True:
        m = _prometheus(_get_text(s, "/metrics")[2])
        if _sample(m, "sglang:num_queue_reqs") == 1:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert _sample(m, "sglang:num_running_reqs") == 1
    assert s.get("/v1/loads")[1]["loads"][0] == {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 1}
    for t in threads:
        t.join(10)
    m = _prometheus(_get_text(s, "/metrics")[2])
    assert _sample(m, "sglang:num_running_reqs") == 0 and _sample(m, "sglang:num_queue_reqs") == 0
    # four plain requests (10, 6, 320 and 320 tokens) and one streamed (9); the warm-up is not counted
    ttft = "sglang:time_to_first_token_seconds"
    assert _sample(m, f"{ttft}_count", is_streaming="false") == 4
    assert _sample(m, f"{ttft}_count", is_streaming="true") == 1
    assert _sample(m, f"{ttft}_sum", is_streaming="true") >= 0.03
    assert _sample(m, "sglang:e2e_request_latency_seconds_count", is_streaming="false") == 4
    assert _sample(m, "sglang:e2e_request_latency_seconds_count", is_streaming="true") == 1
    assert _sample(m, "sglang:generation_tokens_total", is_streaming="false") == 656
    assert _sample(m, "sglang:generation_tokens_total", is_streaming="true") == 9
    assert _sample(m, "sglang:prompt_tokens_total", is_streaming="false") == 4
    assert _sample(m, "sglang:num_requests_total", is_streaming="false") == 4
    assert _sample(m, "sglang:spec_verify_calls_total") == 5 + 3 + 160 + 160 + 5
    # accept length 2: the first step's 2 tokens come with the prefill; each later step's tokens count one
    # inter-token latency each, of the step's interval over its tokens. So the latencies add up to each
    # request's time from its first chunk to its last (e2e - TTFT, the same clock), at least a step
    # (1/400 s) per step after the first. Both exact on the server's clock: this test once asked most
    # latencies to be under 2 ms, which a loaded machine kept only while the stand-in caught up on an
    # absolute clock with bursts of steps; a late step now shifts the ones after it.
    itl, e2e = "sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds"
    assert _sample(m, f"{itl}_count") == 8 + 4 + 318 + 318 + 7
    decoding = sum(_sample(m, f"{e2e}_sum", is_streaming=x) - _sample(m, f"{ttft}_sum", is_streaming=x)
                   for x in ("false", "true"))
    assert _sample(m, f"{itl}_sum") == pytest.approx(decoding, rel=1e-9)
    assert _sample(m, f"{itl}_sum") >= (4 + 2 + 159 + 159 + 4) / 400  # steps after the first, 1/400 s each
    # cumulative buckets ending in +Inf == _count (SGLang's default bounds)
    buckets = sorted(((float(dict(ls)["le"]), v) for (n, ls), v in m.items()
                      if n == f"{ttft}_bucket" and ("is_streaming", "false") in ls))
    assert buckets[0][0] == 0.1 and buckets[-1] == (float("inf"), 4)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    # The request that waited for the slot counts its time in the queue too: at least the other's
    # 159 steps after its first, 1/400 s each on the server's clock (a late step only delays the
    # next), so its first token came after 0.2 s however loaded the machine. This once asked the
    # three that did not wait to be under 0.1 s (a 0.03 s prefill), which one missed at a load of 9
    # on 2 cores: a bound on wall time that no server clock gives.
    assert _sample(m, f"{ttft}_bucket", is_streaming="false", le="0.2") <= 3
    assert _sample(m, f"{ttft}_sum", is_streaming="false") >= 4 * 0.03 + 159 / 400  # so above 0.35 too


def test_startup_phase_lines_in_sglang_order_with_cuda_graph_knob(spawn, tmp_path):
    t0 = time.monotonic()
    s = spawn("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16", "--enable-metrics",
              "--standin-cuda-graph-seconds", "0.6", site_packages=_ddtree_formula_site(tmp_path, "sp"), load=0.1)
    while s.get("/health")[0] is None:  # the port stays closed while loading and capturing
        assert s.proc.poll() is None and time.monotonic() - t0 < 15, s.log
        time.sleep(0.02)
    assert time.monotonic() - t0 >= 0.7
    s.wait_status("/health", 200)
    log = s.log
    order = ["Load weight begin. avail mem=", "Load weight end. elapsed=0.1", "Memory pool end. avail mem=",
             "Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=17, avail mem=",
             "Capture target verify CUDA graph end. bs=[", "Engine startup timings (s): load_weight=0.1",
             "Uvicorn running on", '"GET /model_info HTTP/1.1" 200', '"POST /generate HTTP/1.1" 200',
             "The server is fired up and ready to roll!"]
    positions = [log.find(x) for x in order]
    assert -1 not in positions and positions == sorted(positions), log
    import re

    capture = float(re.search(r"CUDA graph end\. bs=\[[^]]*\], elapsed=([0-9.]+) s", log).group(1))
    assert 0.55 <= capture < 1.5, log
    timings = re.search(r"cuda_graph=\{prefill=0\.00, decode=0\.00, target_verify=([0-9.]+), draft_prefill", log)
    assert timings and float(timings.group(1)) == capture, log
    m = _prometheus(_get_text(s, "/metrics")[2])
    assert _sample(m, "sglang:startup_cuda_graph_time_seconds", phase="target_verify") >= 0.55
    assert _sample(m, "sglang:startup_time_seconds", phase="load_weight") >= 0.1
