"""Stand-in SGLang 0.5.23 server for test hosts without a GPU.

Run by the unit's ExecStart with the SGLang venv's interpreter::

    python -m ddtree_ops.testing.standin --model-path M --host H --port P --tp 8 \
        --speculative-algorithm DDTREE --speculative-draft-model-path D \
        --speculative-ddtree-budget 16 --speculative-ddtree-topk-cap 4 [other SGLang flags]

It follows the start-up contract of ``sglang.launch_server`` 0.5.23 (see
``sglang/srt/entrypoints/http_server.py`` upstream; ``timeline.run``):

1. "loading": ``Load weight begin`` is logged, the port stays closed, every
   ``sglang/srt/speculative/ddtree*.py`` found beside the installed ``sglang`` package is
   imported (an exception ends the process with status 1 and the traceback in the log),
   ``Load weight end`` and the CUDA graph lines are logged;
2. warm-up: the port is bound; ``/health``, ``/health_generate`` and ``/ready`` answer 503;
3. ready: they answer 200 and ``The server is fired up and ready to roll!`` is logged.

Endpoints: ``/health``, ``/health_generate``, ``/ready``, ``/model_info``
(``/get_model_info``), ``/server_info`` (``/get_server_info``), ``/v1/models`` and
``POST /generate``. With ``--api-key`` every endpoint except ``/health*`` and ``/ready``
needs ``Authorization: Bearer KEY``.

``/generate`` runs a tiny seeded toy model (vocabulary of 64 tokens, Markov in the last
token), paced by a clock with the release's accept length (``state``'s docstring). Where the
payload module ``sglang.srt.speculative.ddtree_utils`` provides ``build_ddtree_tree``,
``compile_ddtree_retrieve`` and a tree sampling function, that accept length is measured once at
start-up by building DDTrees from toy draft log-probs and verifying them with that sampling
function (``calibration``), so it is the payload's own; a payload function that raises there is
logged with its traceback and the server decodes with accept length 1.0. With
``--speculative-algorithm DDTREE`` and no payload functions, the accept length is the documented
formula's (``state.default_accept_length``). No payload maths runs per request: a busy machine
slows every release alike.

A verify step's time follows a GPU's roofline (``costmodel``, which says why and what it ignores):
with ``--standin-verify-steps-per-second N`` and ``--standin-verify-knee-tokens K`` (default 256) a
step takes (1/N) x max(1, batch x width / K), width the tokens each request verifies (a DDTree's
budget + 1, DFlash's 16) and batch the requests generating then. A wide tree is free at batch 1 and
costly at batch 16, so the best budget / top-k cap shrinks as the concurrency grows, which is what
``ddtree-ops tune`` has to find; ``costmodel.expected_output_tps`` is the same model for a test to
rank configs with. K <= 0 or inf turns it off; ``--standin-tokens-per-second`` and
``--standin-generate-seconds`` do not use it. ``/server_info`` shows ``standin_verify_knee_tokens``
(None when the model does not pace) and ``standin_verify_width``; the start-up "Stand-in pacing"
line says the model in effect.

``--standin-fail-budget-above N`` stands for a GPU whose CUDA graphs do not fit a bigger tree (SGLang
on sm_103 for budgets above 8): with ``--speculative-algorithm DDTREE`` and a budget above N,
start-up logs SGLang's ``Capture cuda graph failed`` traceback after the capture's begin line and
exits 1 before the port opens, so a deploy's weight-loading wait sees the server die and rolls back;
a budget at or under N, or a DFlash server, starts as usual.

Fault and timing knobs (passed through the inventory's ``extra_args``) are the
``--standin-*`` flags (``args.build_parser``); ``DDTREE_STANDIN_LOAD_SECONDS`` in the
environment overrides ``--standin-load-seconds``.

Secrets, as SGLang 0.5.23 handles them: ``--config FILE`` merges a YAML file of options into the
command line the way SGLang does (``args.merge_config``: ``api-key: K`` works, ``api_key: K``
ends in "unrecognized arguments: --api_key K"), and the first log line is SGLang's
``server_args={...}`` with every value in clear, the API key included (``args.logged_server_args``;
SGLang hides only its watermark keys), so tests can prove that the controller hides it. The
stand-in's own lines (recorded flags) and ``/server_info`` mask secret-named values
(``ddtree_ops.config.redaction``).

Needs only the standard library and ``ddtree_ops.config.redaction`` (PyYAML with ``--config``, as
SGLang); torch is imported lazily, to measure a DDTree payload only.

Modules, by concern:

    args       the launch flags: --config merged, parsed, unknown ones recorded, secrets masked
    payload    the DDTree modules: found beside sglang, imported, their functions looked up
    calibration  the payload's accept length, measured once at start-up
    costmodel  a verify step's time for a batch and a tree width (pure; tests rank configs with it)
    toymodel   the toy model, sampling, autoregressive and DDTree decoding
    state      what the server answers: info documents, /generate, counters
    server     HTTP: the handler and the threading server
    timeline   `run`: loading (no listener), warm-up (503), ready (200), SIGTERM
    logs       SGLang-style log lines
"""

from __future__ import annotations

from .args import build_parser, masked, record_unknown
from .calibration import Calibration, calibrate
from .payload import find_site_packages, list_ddtree_modules, lookup_ddtree_functions, prepare_parent_packages
from .state import SGLANG_VERSION, State
from .timeline import main, run
from .toymodel import ToyModel, ddtree_step, generate_autoregressive

__all__ = [
    "SGLANG_VERSION", "Calibration", "State", "ToyModel", "build_parser", "calibrate", "ddtree_step",
    "find_site_packages",
    "generate_autoregressive", "list_ddtree_modules", "lookup_ddtree_functions", "main", "masked",
    "prepare_parent_packages", "record_unknown", "run",
]
