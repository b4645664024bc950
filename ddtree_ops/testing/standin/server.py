"""HTTP: SGLang's endpoints on a threading server, answered from a `State`.

`POST /generate` with `"stream": true` answers as SGLang 0.5.23's `generate_request` does
(srt/entrypoints/http_server.py): `text/event-stream`, one `data: {json}\n\n` event per verify step
(see `state.Generation`), then `data: [DONE]\n\n`. `GET /metrics` (only with `--enable-metrics`, else
404 as SGLang) is the Prometheus text of `state.Metrics`."""

from __future__ import annotations

import json
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .logs import log, log_raw
from .state import Generation, State

NO_KEY_PREFIXES = ("/health", "/ready", "/metrics")
# The stand-in's own warm-up request (timeline.run, as SGLang's _execute_server_warmup sends one): kept
# out of the counters, /metrics and the fault knobs.
WARMUP_HEADER = "X-Standin-Warmup"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _dumps(obj: Any) -> bytes:
    """Compact JSON, as SGLang's orjson-based dumps_json writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    state: State  # set on the subclass

    def log_message(self, fmt: str, *args: Any) -> None:  # uvicorn-like access log
        log_raw(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
                f"{args[1] if len(args) > 1 else ''}")

    def _send(self, code: int, body: Any = None, content_type: str | None = None) -> None:
        if body is None:
            data = b""
            ctype = "text/plain"
        elif isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
            ctype = content_type or "text/plain; charset=utf-8"
        else:
            data = json.dumps(body).encode()
            ctype = "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _authorised(self, path: str) -> bool:
        key = self.state.args.api_key
        if not key or path.startswith(NO_KEY_PREFIXES):
            return True
        return self.headers.get("Authorization", "") == f"Bearer {key}"

    def _health(self) -> None:
        st = self.state
        if st.args.node_rank >= 1:
            self._send(200)
            return
        if st.status != "Up" or st.gracefully_exiting:
            self._send(503)
            return
        if st.args.standin_health_flaps:
            with st.lock:
                n = st.health_counter
                st.health_counter += 1
            self._send(200 if n % 2 == 0 else 503)
            return
        self._send(200)

    def do_GET(self) -> None:  # noqa: N802
        path = self._path()
        if not self._authorised(path):
            self._send(401, {"error": "Unauthorized"})
            return
        st = self.state
        if path in ("/health", "/health_generate"):
            self._health()
        elif path == "/ready":
            self._send(200 if st.status == "Up" else 503)
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, st.model_info())
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, st.server_info())
        elif path == "/v1/loads":  # SGLang 0.5.23 srt/entrypoints/v1_loads.py, the "core" fields
            with st.lock:
                running = st.running
                queued = st.queued
            self._send(200, {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "version": "0.5.23", "accelerator": None, "num_accelerators": 0,
                             "loads": [{"dp_rank": 0, "num_running_reqs": running - queued,
                                        "num_waiting_reqs": queued}]})
        elif path == "/metrics" and st.metrics_enabled:
            self._send(200, st.metrics_text(), PROMETHEUS_CONTENT_TYPE)
        elif path == "/v1/models":
            name = st.args.served_model_name or st.args.model_path
            self._send(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": int(st.start_time), "owned_by": "sglang",
                 "root": name}]})
        else:
            self._send(404, {"detail": "Not Found"})

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        path = self._path()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorised(path):
            self._send(401, {"error": "Unauthorized"})
            return
        if path not in ("/generate",):
            self._send(404, {"detail": "Not Found"})
            return
        st = self.state
        warmup = self.headers.get(WARMUP_HEADER) == "1"
        if st.args.standin_generate_fails and not warmup:
            log("Stand-in fault: /generate fails (--standin-generate-fails)", "TP0")
            self._send(500, {"error": {"message": "Internal server error (stand-in fault)"}})
            return
        try:
            req = json.loads(raw or b"{}")
            if not isinstance(req, dict):
                raise ValueError("request body must be a JSON object")
            text = req.get("text", "")
            sp = req.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise ValueError("sampling_params must be an object")
            stream = bool(req.get("stream", False))
            if stream and isinstance(text, list):
                raise ValueError("the stand-in streams one prompt at a time, not a batch")
            texts = [str(t) for t in text] if isinstance(text, list) else [str(text)]
            gens = [Generation(st, t, sp, stream=stream, warmup=warmup) for t in texts]
        except (ValueError, TypeError) as exc:
            self._send(400, {"error": {"message": str(exc)}})
            return
        try:
            if stream:
                self._stream(gens[0])
            else:
                outs = self._run_all(gens)
                self._send(200, outs if isinstance(text, list) else outs[0])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left
        except Exception as exc:  # noqa: BLE001
            log(f"/generate failed: {exc}\n{traceback.format_exc()}", "TP0")
            self._send(500, {"error": {"message": str(exc)}})
        finally:
            for g in gens:
                g.release()  # answered: no longer in flight (the SIGTERM drain waits for this)

    def _run_all(self, gens: list[Generation]) -> list[dict[str, Any]]:
        """Generate a batch side by side, as SGLang schedules its requests together."""
        outs: list[Any] = [None] * len(gens)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                gens[i].start()
                outs[i] = gens[i].run()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        if len(gens) == 1:
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(gens))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return outs

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, gen: Generation) -> None:
        """SGLang's StreamingResponse: `data: {json}` per chunk, `data: [DONE]` at the end; an error
        after the first byte is one more `data: {"error": ...}` event."""
        gen.start()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks = gen.chunks()
        try:
            for out in chunks:
                self._write_chunk(b"data: " + _dumps(out) + b"\n\n")
        except (BrokenPipeError, ConnectionResetError):
            chunks.close()  # counted as aborted
            raise
        except Exception as exc:  # noqa: BLE001
            log(f"/generate failed: {exc}\n{traceback.format_exc()}", "TP0")
            err = {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400,
                             "retryable": False}}
            self._write_chunk(b"data: " + _dumps(err) + b"\n\n")
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


def make_server(state: State) -> _Server:
    """Bind state.args.host:port (OSError when taken); serving is the caller's to start."""
    handler = type("StandinHandler", (Handler,), {"state": state})
    return _Server((state.args.host, state.args.port), handler)
