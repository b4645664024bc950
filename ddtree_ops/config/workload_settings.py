"""The perf gate's workload as the inventory describes it: what is sent (prompts, concurrency,
sampling, duration) and the prompts file it may name.

  Workload            one case: what is sent, for how long; `label` names it in messages
  DEFAULT_WORKLOADS   the cases a `perf_gate:` without `workloads` (nor concurrency/temperature) gets
  load_prompts(path)  a prompts file, validated

Settings only: sending the workload and measuring it is gates/workload.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InputError, shown

# --------------------------------------------------------------------------- defaults

# Varied on purpose: code, arithmetic, prose, translation, lists, structured output and dialogue
# draft differently (code and lists are easy for a drafter, free prose is hard), so the accept
# length and the speed of the mix move when any one kind regresses.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "A train leaves at 09:40 and travels 312 km at 78 km/h. When does it arrive? Explain step by step.",
    "Write a short story, about 150 words, about a lighthouse keeper who finds a message in a bottle.",
    "Translate into French and German: 'The meeting is moved to Thursday afternoon because of the strike.'",
    "List ten countries in Africa with their capitals, one per line, in the form 'Country: Capital'.",
    "Explain to a new engineer why a database index speeds up reads but slows down writes.",
    "Return a JSON object describing a book with the keys title, author, year, genres (a list) and isbn.",
    "You are a support agent. A customer says their order arrived damaged. Reply politely and offer options.",
)

DEFAULT_CONCURRENCY = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TEMPERATURE = 0.7  # what the DDTree modules are tuned for (temperature-aware drafting)
DEFAULT_TOP_P = 0.9
DEFAULT_DURATION_S = 20.0
DEFAULT_MIN_REQUESTS = 8  # percentiles of fewer requests say little
DEFAULT_REQUEST_TIMEOUT_S = 60.0  # per request, and per read while streaming

# Prompts files: bounds that keep a wrong path (a model file, a log) from being read whole.
PROMPTS_FILE_MAX_BYTES = 8 * 1024 * 1024
PROMPTS_MAX = 10_000
PROMPT_MAX_CHARS = 65_536

CONCURRENCY_MAX = 64  # under httpx's default pool of 100 connections, so no request waits for one


# --------------------------------------------------------------------------- workload

@dataclass(frozen=True)
class Workload:
    """What the gate sends. Request i uses prompts[i % len(prompts)], so baseline and canary see
    the same mix. The run starts requests until `duration_s` has passed *and* at least
    `min_requests` were started; each started request finishes (or times out), so at least
    `min_requests` are counted unless the run is stopped."""

    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    concurrency: int = DEFAULT_CONCURRENCY
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    duration_s: float = DEFAULT_DURATION_S
    min_requests: int = DEFAULT_MIN_REQUESTS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    prompts_file: str | None = None  # where the prompts came from (None: the built-in list)
    name: str | None = None  # the inventory's name for the case (None: `label` is made from it)

    def __post_init__(self) -> None:
        # A list from a caller becomes a tuple: the dataclass is frozen and hashable.
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.prompts:
            raise ValueError("a workload needs at least one prompt")
        if self.concurrency < 1 or self.min_requests < 0:
            raise ValueError("concurrency must be ≥ 1 and min_requests ≥ 0")

    @property
    def case(self) -> tuple[int, int, float, float]:
        """What makes two workloads different cases: what each request asks and how many at once
        (the same case measured twice, with another duration, says nothing new)."""
        return (self.concurrency, self.max_new_tokens, self.temperature, self.top_p)

    @property
    def label(self) -> str:
        """A short name for messages: the inventory's `name`, else "c4 T0.7" (concurrency and
        temperature), with the token count and top_p when they are not the defaults ("c1 T0
        256 tok", "c4 T0.7 p0.95"; top_p only when sampling, greedy ignores it)."""
        if self.name:
            return self.name
        parts = [f"c{self.concurrency}", f"T{self.temperature:g}"]
        if self.max_new_tokens != DEFAULT_MAX_NEW_TOKENS:
            parts.append(f"{self.max_new_tokens} tok")
        if self.top_p != DEFAULT_TOP_P and self.temperature > 0:
            parts.append(f"p{self.top_p:g}")
        return " ".join(parts)

    def request_body(self, index: int) -> dict[str, Any]:
        """The JSON body of request `index`: SGLang's native /generate, streaming."""
        return {
            "text": self.prompts[index % len(self.prompts)],
            "sampling_params": {"temperature": self.temperature, "top_p": self.top_p,
                                "max_new_tokens": self.max_new_tokens},
            "stream": True,
        }


# Without `workloads`: today's case (batch 4, sampled: what the DDTree modules are tuned for)
# first, so the gate's record and its figures read as before when both pass, and beside it the
# batch-1 greedy case, where a tree is the most likely to lose to the flat chain (an independent
# vLLM implementation measured a tree 31.6 % slower at batch 1 with CUDA graphs).
DEFAULT_WORKLOADS: tuple[Workload, ...] = (Workload(), Workload(concurrency=1, temperature=0.0))


def load_prompts(path: str) -> tuple[str, ...]:
    """Prompts from a file: `*.jsonl` holds one JSON object per line with a non-empty string
    "text" (other keys ignored); any other file holds one prompt per line. Blank lines are
    skipped. The format follows the name, never the content: a plain prompt may start with "{".
    Raises InputError naming the file and line."""
    try:
        with open(path, "rb") as f:
            data = f.read(PROMPTS_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) > PROMPTS_FILE_MAX_BYTES:
        raise InputError(f"{path}: larger than {PROMPTS_FILE_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 (byte {e.start})") from None
    jsonl = path.endswith(".jsonl")
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path} line {n}: not JSON ({e})") from None
            prompt = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise InputError(f"{path} line {n}: needs a JSON object with a non-empty string \"text\", "
                                 f"got {shown(obj)}")
        else:
            prompt = line
        if len(prompt) > PROMPT_MAX_CHARS:
            raise InputError(f"{path} line {n}: prompt longer than {PROMPT_MAX_CHARS} characters")
        prompts.append(prompt)
        if len(prompts) > PROMPTS_MAX:
            raise InputError(f"{path}: more than {PROMPTS_MAX} prompts")
    if not prompts:
        shape = 'one JSON object with "text" per line' if jsonl else "one prompt per line"
        raise InputError(f"{path}: no prompts ({shape})")
    return tuple(prompts)
