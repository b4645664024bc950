"""`run`: SGLang 0.5.23's start-up contract, phase by phase, with the fault knobs; SIGTERM ends it.

The log, in SGLang 0.5.23's order and words (port closed until the Uvicorn lines):

    server_args={...}
    [TP0] Load weight begin. avail mem=94.50 GB                     (srt/model_executor/model_runner.py)
    [TP0] Load weight end. elapsed=L s, type=..., avail mem=..., mem usage=61.20 GB.
    [TP0] Load weight begin. / Load weight end. ...                  (the draft model, when there is one)
    [TP0] Memory pool end. avail mem=... GB                          (srt/mem_cache/kv_cache_configurator.py)
    [TP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=N, avail mem=... GB
    [TP0] Capture target verify CUDA graph end. bs=[...], elapsed=C s, mem usage=... GB, avail mem=... GB.
          ("target decode" and num_tokens_per_req=1 without speculative decoding;
           model_runner_components/cuda_graph_setup.py capture_decode_graph)
    Engine startup timings (s): load_weight=L, kv_cache_allocation=..., scheduler_e2e=...,
          cuda_graph={prefill=..., decode=..., target_verify=C, ...}, tokenizer_e2e=...  (entrypoints/engine.py)
    INFO:     Started server process [PID] ... Uvicorn running on http://H:P (Press CTRL+C to quit)
    INFO:     127.0.0.1:... - "GET /model_info HTTP/1.1" 200      (the warm-up: /health 503 meanwhile)
    INFO:     127.0.0.1:... - "POST /generate HTTP/1.1" 200       (http_server.py _execute_server_warmup)
    The server is fired up and ready to roll!                       (http_server.py _wait_and_warmup)

L is --standin-load-seconds, C --standin-cuda-graph-seconds; the warm-up lasts --standin-warmup-seconds
(plus its 8-token generate). With --standin-fail-budget-above N and a DDTree budget above N the
capture fails after its begin line, as SGLang 0.5.23's did on sm_103 for budgets above 8: the log gets

    [TP0] Scheduler hit an exception: Traceback (most recent call last): ... RuntimeError: CUDA error:
          too many resources requested ... speculative_ddtree_budget=B ... During handling of the above
          exception, another exception occurred: ... Exception: Capture cuda graph failed: ... Possible solutions: ...

and the process exits 1 with the port never opened (a deploy's weight wait sees it die)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback

from .args import (
    ConfigError,
    build_parser,
    logged_server_args,
    masked,
    merge_config,
    record_unknown,
    sglang_flags,
    underscore_flags,
    unrecognized,
)
from .logs import log, log_raw
from .parse_probe import record_parse
from .payload import find_site_packages, list_ddtree_modules, prepare_parent_packages, sha256_short
from .server import WARMUP_HEADER, _Server, make_server
from .state import BASE_VERIFY_STEPS_PER_SECOND, GRAPH_PHASES, SGLANG_VERSION, State

# Upstream 0.5.23 choices of --speculative-algorithm (for the argparse-like error).
UPSTREAM_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")


class _Terminate(BaseException):
    pass


_STATE: State | None = None  # the running server's, for the SIGTERM handler


def _on_sigterm(signum, frame):  # noqa: ARG001
    """SGLang 0.5.23 (tokenizer_manager.py sigterm_watchdog): a healthy server turns /health 503
    and exits once its requests are done (the main loop waits); one still starting exits at once."""
    if _STATE is not None and _STATE.status == "Up":
        _STATE.gracefully_exiting = True
        return
    raise _Terminate()


# What a crashed or stopped server can leave behind: a process outside the unit (so stopping the
# unit neither waits for it nor ends it) that holds GPU memory for a while after the server is
# gone. It leaves the server's process tree at once (double fork), waits for the server to end,
# then registers its GPU memory for the given seconds.
_ORPHAN = """import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
gpu_dir, mib, parent, linger = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
def alive():
    try:
        return open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
# Registered at once, listed by nvidia-smi only once the server is gone: the memory is "held"
# from the instant the server's unit has stopped, however fast the stop returns.
path = os.path.join(gpu_dir, str(os.getpid()))
start = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
open(path, "w").write(f"{mib} {start} {parent}")
try:
    while alive():
        time.sleep(0.1)
    time.sleep(linger)
finally:
    os.unlink(path)
"""


def hold_gpu_memory(args) -> None:
    """Register this server's 'GPU memory' for the sandbox's nvidia-smi (it lists live PIDs only,
    so nothing needs removing), and start the lingering worker if asked."""
    d = args.standin_gpu_dir
    if not d or not os.path.isdir(d):
        return
    with open("/proc/self/stat") as fh:  # the start time tells this process from a later one with its PID
        start = fh.read().rsplit(")", 1)[1].split()[19]
    with open(os.path.join(d, str(os.getpid())), "w") as fh:
        fh.write(f"{args.standin_gpu_mib} {start}")
    if args.standin_orphan_gpu_seconds is not None:
        import subprocess

        argv = [sys.executable, "-c", _ORPHAN, d, "2000", str(os.getpid()), str(args.standin_orphan_gpu_seconds)]
        subprocess.run(_outside_the_unit(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        log(f"Stand-in: once this server ends, a leftover process holds GPU memory for "
            f"{args.standin_orphan_gpu_seconds:g} s (--standin-orphan-gpu-seconds)", "TP0")


def _outside_the_unit(argv: list[str]) -> list[str]:
    """Under systemd, a process the server forks stays in its unit's cgroup and is killed with it;
    what a stopped server really leaves behind holding GPU memory is outside that cgroup, so the
    leftover gets a scope of its own (`ddtree-sandbox-orphan-PID.scope`)."""
    import shutil

    if os.path.isdir("/run/systemd/system") and shutil.which("systemd-run"):
        return ["systemd-run", "--scope", "--quiet", f"--unit=ddtree-sandbox-orphan-{os.getpid()}", *argv]
    return argv


def _sleep(seconds: float) -> None:
    end = time.monotonic() + max(0.0, seconds)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def _crash_in_load() -> None:
    raise RuntimeError("Stand-in fault: crash during weight loading (--standin-crash-during-load)")


# SGLang 0.5.23's hint after a failed decode/verify graph capture
# (srt/model_executor/runner_backend_utils/__init__.py).
CUDA_GRAPH_CAPTURE_FAILED_MSG = (
    "Possible solutions:\n"
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n"
    "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled. "
    "(Not recommended. Huge performance loss)\n"
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n"
)


def _capture_verify_graph(args, state: State) -> None:
    """The verify graph's capture: it fails, with --standin-fail-budget-above N, for a DDTree budget
    above N, as SGLang 0.5.23's DDTree verify graph did on sm_103 for budgets above 8."""
    limit = args.standin_fail_budget_above
    if limit is None or (args.speculative_algorithm or "").upper() != "DDTREE" or state.budget() <= limit:
        return
    raise RuntimeError(
        f"CUDA error: too many resources requested for launch while capturing the DDTree target verify "
        f"graph: speculative_ddtree_budget={state.budget()} (num_tokens_per_req={state.num_draft_tokens()}) "
        f"is above {limit}, the largest budget this GPU captures (stand-in fault: "
        f"--standin-fail-budget-above {limit})")


def _capture_cuda_graph(args, state: State) -> None:
    """SGLang 0.5.23's DecodeCudaGraphRunner.__init__ (srt/model_executor/runner/decode_cuda_graph_runner.py):
    a RuntimeError while capturing becomes `Exception("Capture cuda graph failed: ...")`, raised
    inside the handler, so the log's traceback shows both."""
    try:
        _capture_verify_graph(args, state)
    except RuntimeError as e:
        raise Exception(f"Capture cuda graph failed: {e}\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}")  # noqa: B904 - as SGLang raises it


def _local_url(host: str, port: int) -> str:
    """Where the server reaches itself (its warm-up): the bound address, loopback for a wildcard."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def _warmup_request(args, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """One request of SGLang's warm-up (http_server.py `_execute_server_warmup`) to this server, with
    its API key; no proxy (loopback only). A non-200 answer raises."""
    import urllib.request

    headers = {WARMUP_HEADER: "1"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(_local_url(args.host, args.port) + path, data=data, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as resp:
        raw = resp.read()
        if resp.status != 200:
            raise AssertionError(f"res.status_code={resp.status}, res.text={raw[:200]!r}")
        return json.loads(raw or b"{}")


def _num_tokens_per_req(args, state: State) -> int:
    """What SGLang's decode graph capture logs (ModelRunner.decode_num_tokens_per_req): the draft
    tokens verified per request with speculative decoding (`State.num_draft_tokens`), else 1."""
    return state.num_draft_tokens() if args.speculative_algorithm else 1


# The stand-in stands for a GPU, whose pace does not depend on what else the host's CPUs run. Its
# steps are paced on its clock and a late step delays the ones after it, so on the test machine a
# stand-in that waits for a core decodes slower: the perf gate's two windows, minutes apart while
# the rest of the suite's load came and went, once read a release that is 1.6x faster at 0.49x of
# its DFlash baseline (441.9 -> 215.6 tok/s) and rolled it back. A higher CPU priority keeps its
# pace through load it shares the machine with (it needs little CPU); where it may not raise its
# priority (not root) it keeps the one it has and says so in its log.
STANDIN_NICE = -10


def _gpu_like_priority() -> str:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, STANDIN_NICE)
    except OSError as e:
        return f"CPU priority: nice {os.getpriority(os.PRIO_PROCESS, 0)} kept ({e.strerror})"
    return f"CPU priority: nice {os.getpriority(os.PRIO_PROCESS, 0)}"


def run(argv: list[str] | None = None) -> int:
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        pass
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--parse-only`: the launch check a deploy runs before anything stops (ddtree_ops/launch_check.py):
    # parse as the server would at start, exit 0 or 2 with argparse's message, start nothing.
    parse_only = "--parse-only" in argv
    if parse_only:
        argv.remove("--parse-only")
    try:
        argv = merge_config(argv)
    except (ConfigError, OSError) as exc:  # SGLang: the exception ends `launch_server` (exit 1)
        if isinstance(exc, OSError):
            log(f"Failed to read config file {argv[argv.index('--config') + 1]}: {exc}")
        log_raw(traceback.format_exc())
        return 1
    refused = underscore_flags(argv)
    if refused:  # SGLang's parser knows every option by its dashed name only
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{parser.prog}: error: unrecognized arguments: {' '.join(refused)}\n")
        sys.stderr.flush()
        return 2
    args, unknown = parser.parse_known_args(argv)
    if parse_only:
        refused = unrecognized(unknown, sglang_flags(find_site_packages(args.standin_site_packages)))
        record_parse(2 if refused else 0)
        if refused:
            parser.print_usage(sys.stderr)
            sys.stderr.write(f"{parser.prog}: error: unrecognized arguments: {' '.join(refused)}\n")
            return 2
        return 0
    extra = record_unknown(unknown)
    env_load = os.environ.get("DDTREE_STANDIN_LOAD_SECONDS")
    if env_load:
        try:
            args.standin_load_seconds = float(env_load)
        except ValueError:
            log(f"Ignoring DDTREE_STANDIN_LOAD_SECONDS={env_load!r}: not a number")
    load_s = max(0.0, args.standin_load_seconds)
    t_start = time.monotonic()
    priority = _gpu_like_priority()  # before any thread starts: threads inherit it

    signal.signal(signal.SIGTERM, _on_sigterm)
    httpd: _Server | None = None
    try:
        site_packages = find_site_packages(args.standin_site_packages)
        modules = list_ddtree_modules(site_packages)
        algo = (args.speculative_algorithm or "").upper()
        if algo == "DDTREE" and not modules:
            parser.print_usage(sys.stderr)
            choices = ", ".join(repr(c) for c in UPSTREAM_ALGORITHMS)
            sys.stderr.write(f"{parser.prog}: error: argument --speculative-algorithm: invalid choice: "
                             f"{args.speculative_algorithm!r} (choose from {choices})\n")
            sys.stderr.flush()
            return 2

        log(logged_server_args(args, extra))  # secrets in clear, as SGLang logs them
        if extra:
            log(f"Stand-in: recorded SGLang flags it does not model: {masked(extra)}")
        log(f"Stand-in SGLang {SGLANG_VERSION} server (no GPU); sglang found in "
            f"{site_packages if site_packages else '(nowhere)'}; pid {os.getpid()}; {priority}")

        mem = 94.50
        t_load = time.monotonic()
        log(f"Load weight begin. avail mem={mem:.2f} GB", "TP0")
        hold_gpu_memory(args)
        if args.standin_never_listen:
            log("Stand-in fault: weight loading never ends (--standin-never-listen)", "TP0")
            while True:
                time.sleep(1.0)
        if args.standin_crash_during_load:
            _sleep(load_s / 2)
            try:
                _crash_in_load()
            except RuntimeError:
                log(f"Scheduler hit an exception: {traceback.format_exc()}", "TP0")
                return 1

        # Import the DDTree modules as SGLang does when it creates a DDTree worker.
        imported: dict[str, str] = {}
        if modules and site_packages is not None:
            why = prepare_parent_packages(site_packages)
            if why:
                log(f"Stand-in: the sglang package itself does not import in this venv ({why}); "
                    "importing the DDTree modules under bare sglang/sglang.srt/"
                    "sglang.srt.speculative package stubs", "TP0")
        for path in modules:
            name = f"sglang.srt.speculative.{path.stem}"
            try:
                importlib.import_module(name)
            except _Terminate:
                raise
            except BaseException:  # noqa: BLE001 - SystemExit in a module is a crash too
                tb = traceback.format_exc()
                log(f"Scheduler hit an exception: {tb}", "TP0")
                log(f"Failed to import {name} from {path}", "TP0")
                return 1
            imported[name] = sha256_short(path)
        if modules:
            log("DDTree modules imported: " + ", ".join(f"{n} (sha256 {h})" for n, h in imported.items()), "TP0")
        else:
            log("DDTree modules imported: (none)", "TP0")

        _sleep(load_s - (time.monotonic() - t_load))
        elapsed = time.monotonic() - t_load
        log(f"Load weight end. elapsed={elapsed:.2f} s, type=StandinToyForCausalLM, "
            f"avail mem={mem - 61.2:.2f} GB, mem usage=61.20 GB.", "TP0")
        if args.speculative_draft_model_path:
            log(f"Load weight begin. avail mem={mem - 61.2:.2f} GB", "TP0")
            log("Load weight end. elapsed=0.01 s, type=StandinToyDraftModel, "
                f"avail mem={mem - 63.1:.2f} GB, mem usage=1.90 GB.", "TP0")
        load_elapsed = elapsed
        t_pool = time.monotonic()
        log(f"Memory pool end. avail mem={mem - 70.0:.2f} GB", "TP0")
        kv_elapsed = time.monotonic() - t_pool

        state = State(args, extra, imported, site_packages)
        global _STATE
        _STATE = state
        state.calibrate_payload()  # CPU-bound: done once here, with the port closed, never per request

        # SGLang 0.5.23 captures the decode graph (the verify graph with speculative decoding) after
        # the memory pools: model_runner_components/cuda_graph_setup.py capture_decode_graph.
        capture_name, graph_phase = ("target verify", "target_verify") if args.speculative_algorithm \
            else ("target decode", "decode")
        t_graph = time.monotonic()
        log(f"Capture {capture_name} CUDA graph begin. backend=full, "
            f"num_tokens_per_req={_num_tokens_per_req(args, state)}, avail mem={mem - 70.0:.2f} GB", "TP0")
        _sleep(max(0.0, args.standin_cuda_graph_seconds))
        try:
            _capture_cuda_graph(args, state)
        except Exception:  # noqa: BLE001 - SGLang: the scheduler logs it and the server exits 1
            log(f"Scheduler hit an exception: {traceback.format_exc()}", "TP0")
            return 1
        graph_elapsed = time.monotonic() - t_graph
        log(f"Capture {capture_name} CUDA graph end. bs=[1, 2, 4, 8, 12, 16, 24, 32], "
            f"elapsed={graph_elapsed:.2f} s, mem usage=0.85 GB, avail mem={mem - 70.85:.2f} GB.", "TP0")
        startup = {
            "load_weight": load_elapsed,
            "kv_cache_allocation": kv_elapsed,
            "scheduler_e2e": time.monotonic() - t_load,
            "cuda_graph": {p: (graph_elapsed if p == graph_phase else 0.0) for p in GRAPH_PHASES},
            "tokenizer_e2e": time.monotonic() - t_start,
        }
        state.set_startup_time(startup)
        graphs = ", ".join(f"{p}={v:.2f}" for p, v in startup["cuda_graph"].items())
        log(f"Engine startup timings (s): load_weight={startup['load_weight']:.2f}, "
            f"kv_cache_allocation={startup['kv_cache_allocation']:.2f}, "
            f"scheduler_e2e={startup['scheduler_e2e']:.2f}, cuda_graph={{{graphs}}}, "
            f"tokenizer_e2e={startup['tokenizer_e2e']:.2f}")
        if modules and state.ddtree_fns is None:
            log("DDTree functions not found in sglang.srt.speculative.ddtree_utils "
                "(build_ddtree_tree, compile_ddtree_retrieve, tree sampling): /generate is paced with "
                "the documented formula's accept length", "TP0")
        elif state.calibration is not None:
            log(f"DDTree payload measured at start-up (budget={state.budget()}, "
                f"topk_cap={state.topk_cap()}, sampler={state.ddtree_fns.sampling_name}): "
                f"{state.calibration.describe()}", "TP0")
        rate = args.standin_tokens_per_second
        steps = args.standin_verify_steps_per_second
        if not steps or steps <= 0:
            steps = BASE_VERIFY_STEPS_PER_SECOND
        log(f"Stand-in pacing: prefill {max(0.0, args.standin_ttft_seconds):.3f} s, accept length "
            f"{state.describe_accept_length()}, decode "
            f"{f'{rate:g} tokens/s' if rate and rate > 0 else f'{steps:g} verify steps/s'}"
            f" per request" + (f"; each generation takes {args.standin_generate_seconds:g} s"
                               if args.standin_generate_seconds > 0 else "")
            + f"; {state.describe_cost_model()}", "TP0")

        try:
            httpd = make_server(state)
        except OSError as exc:
            log_raw(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                    f"('{args.host}', {args.port}): {exc.strerror or exc}")
            log(f"Stand-in: cannot listen on {args.host}:{args.port}: {exc}. "
                f"Is another server already using the port?")
            return 1
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                         name="http", daemon=True).start()
        log_raw(f"INFO:     Started server process [{os.getpid()}]")
        log_raw("INFO:     Waiting for application startup.")
        log_raw("INFO:     Application startup complete.")
        log_raw(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")

        # SGLang's warm-up (http_server.py _wait_and_warmup / _execute_server_warmup): /model_info until
        # it answers, one 8-token greedy /generate, then Up and "fired up"; /health is 503 meanwhile.
        t_warm = time.monotonic()
        try:
            _warmup_request(args, "/model_info", timeout=5)
            if args.standin_warmup_never_completes:
                log("Stand-in fault: warm-up never completes (--standin-warmup-never-completes)", "TP0")
                while True:
                    time.sleep(1.0)
            _sleep(args.standin_warmup_seconds - (time.monotonic() - t_warm))
            warm = _warmup_request(args, "/generate", {
                "text": "The capital city of France is",
                "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        except _Terminate:
            raise
        except Exception:  # noqa: BLE001 - what SGLang does: log, kill the server
            log(f"Initialization failed. warmup error: {traceback.format_exc()}")
            return 1
        log(f"Warm-up generate: {warm['meta_info']['completion_tokens']} tokens, "
            f"accept len {warm['meta_info']['spec_accept_length']:.2f}", "TP0")
        state.status = "Up"
        log("The server is fired up and ready to roll!")

        die_at = None
        if args.standin_die_after_ready is not None:
            die_at = time.monotonic() + max(0.0, args.standin_die_after_ready)
        last_said = 0.0
        while True:
            if state.gracefully_exiting:
                # tokenizer_manager.py sigterm_watchdog: this line every 5 s, the last one with 0
                with state.lock:
                    remaining = state.running
                    rids = list(state.running_rids)
                if remaining == 0 or time.monotonic() - last_said >= 5:
                    last_said = time.monotonic()
                    log(f"Gracefully exiting... Remaining number of requests {remaining}. "
                        f"Remaining requests remaining_rids={rids!r}.")
                if remaining == 0:
                    raise _Terminate()
            if die_at is not None and time.monotonic() >= die_at:
                log("Stand-in fault: the server dies after it was declared healthy "
                    "(--standin-die-after-ready)", "TP0")
                log("Scheduler hit an exception: RuntimeError: stand-in fault", "TP0")
                os._exit(1)
            time.sleep(0.1)
    except _Terminate:
        log("Received sigterm with a graceful shutdown timeout of 0 seconds. Shutting down.")
        if httpd is not None:
            try:
                httpd.RequestHandlerClass.state.status = "Draining"  # type: ignore[attr-defined]
            except AttributeError:
                pass
            threading.Thread(target=httpd.shutdown, daemon=True).start()
            httpd.server_close()
        log("Stand-in server exited cleanly.")
        return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))

