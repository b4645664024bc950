"""HTTP: SGLang's endpoints on a threading server, answered from a `State`."""

from __future__ import annotations

import json
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .logs import log, log_raw
from .state import State

NO_KEY_PREFIXES = ("/health", "/ready", "/metrics")


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    state: State  # set on the subclass

    def log_message(self, fmt: str, *args: Any) -> None:  # uvicorn-like access log
        log_raw(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
                f"{args[1] if len(args) > 1 else ''}")

    def _send(self, code: int, body: Any = None) -> None:
        if body is None:
            data = b""
            ctype = "text/plain"
        elif isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
            ctype = "text/plain; charset=utf-8"
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
            self._send(200, {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "version": "0.5.23", "accelerator": None, "num_accelerators": 0,
                             "loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0}]})
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
        if st.args.standin_generate_fails:
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
            with st.lock:
                st.running += 1
            try:
                if st.args.standin_generate_seconds > 0:
                    time.sleep(st.args.standin_generate_seconds)
                out = [st.generate_one(str(t), sp) for t in text] if isinstance(text, list) else \
                    st.generate_one(str(text), sp)
            finally:
                with st.lock:
                    st.running -= 1
            self._send(200, out)
        except (ValueError, TypeError) as exc:
            self._send(400, {"error": {"message": str(exc)}})
        except Exception as exc:  # noqa: BLE001
            log(f"/generate failed: {exc}\n{traceback.format_exc()}", "TP0")
            self._send(500, {"error": {"message": str(exc)}})


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


def make_server(state: State) -> _Server:
    """Bind state.args.host:port (OSError when taken); serving is the caller's to start."""
    handler = type("StandinHandler", (Handler,), {"state": state})
    return _Server((state.args.host, state.args.port), handler)
