"""A tiny seeded toy model, and decoding with it: autoregressive, or one DDTree step at a time
with the payload's functions (so the reported accept length is real)."""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any, Iterator

from .payload import DDTreeFunctions, PayloadError

TOY_VOCAB = 64
MAX_NEW_TOKENS_CAP = 4096


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "replace")).digest()[:8], "big")


def _prompt_tokens(text: str) -> list[int]:
    words = text.split() or [""]
    return [_seed_of(w) % TOY_VOCAB for w in words]


class ToyModel:
    """A Markov model over TOY_VOCAB tokens: logits of the next token depend on the last."""

    def __init__(self, seed: int, vocab: int = TOY_VOCAB):
        rng = random.Random(seed)
        self.vocab = vocab
        self.logits = [[rng.gauss(0.0, 2.5) for _ in range(vocab)] for _ in range(vocab)]
        self._probs: dict[tuple[int, float, int, float], list[float]] = {}

    def probs(self, token: int, temperature: float, top_k: int, top_p: float) -> list[float]:
        """Target distribution after temperature, top-k, top-p (as eagle_sample does);
        greedy (temperature ~0) is a one-hot at the argmax. Cached: do not modify the list."""
        key = (min(max(int(token), 0), self.vocab - 1), temperature, top_k, top_p)
        p = self._probs.get(key)
        if p is None:
            p = self._probs[key] = self._compute_probs(*key)
        return p

    def _compute_probs(self, token: int, temperature: float, top_k: int, top_p: float) -> list[float]:
        row = self.logits[token]
        if temperature <= 1e-5:
            best = max(range(self.vocab), key=row.__getitem__)
            return [1.0 if i == best else 0.0 for i in range(self.vocab)]
        m = max(row)
        p = [math.exp((x - m) / temperature) for x in row]
        order = sorted(range(self.vocab), key=p.__getitem__, reverse=True)
        if 0 < top_k < self.vocab:
            for i in order[top_k:]:
                p[i] = 0.0
        s = sum(p)
        p = [x / s for x in p]
        if 0.0 < top_p < 1.0:
            acc, keep = 0.0, set()
            for i in order:
                if p[i] <= 0.0:
                    break
                keep.add(i)
                acc += p[i]
                if acc >= top_p:
                    break
            p = [x if i in keep else 0.0 for i, x in enumerate(p)]
            s = sum(p)
            p = [x / s for x in p]
        return p

    def greedy_next(self, token: int) -> int:
        row = self.logits[token]
        return max(range(self.vocab), key=row.__getitem__)


def _sample(p: list[float], coin: float) -> int:
    acc = 0.0
    total = sum(p)
    last_pos = len(p) - 1
    for i, x in enumerate(p):
        if x <= 0.0:
            continue
        last_pos = i
        acc += x
        if acc > coin * total:
            return i
    return last_pos


def _params(sp: dict[str, Any]) -> tuple[float, int, float, int]:
    temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
    top_k = int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1)
    top_p = float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0)
    mnt = sp.get("max_new_tokens", 128)
    mnt = 128 if mnt is None else int(mnt)
    return temperature, top_k, top_p, max(0, min(mnt, MAX_NEW_TOKENS_CAP))


def generate_autoregressive(model: ToyModel, last: int, n: int, params, rng: random.Random) -> list[int]:
    temperature, top_k, top_p, _ = params
    out = []
    for _ in range(n):
        last = _sample(model.probs(last, temperature, top_k, top_p), rng.random())
        out.append(last)
    return out


def iter_autoregressive(model: ToyModel, last: int, params, rng: random.Random) -> Iterator[int]:
    """`generate_autoregressive` one token at a time, without end (the caller stops)."""
    temperature, top_k, top_p, _ = params
    while True:
        last = _sample(model.probs(last, temperature, top_k, top_p), rng.random())
        yield last


def detokenize(tokens: list[int]) -> str:
    """The toy tokenizer's text: "tok12 tok7 ...", so a prefix of tokens gives a prefix of text."""
    return " ".join(f"tok{t}" for t in tokens)


def ddtree_step(fns: DDTreeFunctions, torch, model: ToyModel, last: int, params,
                budget: int, topk_cap: int, gen) -> tuple[list[int], int, int]:
    """One draft-tree + verify step. Returns (committed tokens, accepted drafts, max depth)."""
    temperature, top_k, top_p, _ = params
    V = model.vocab
    L = max(1, min(15, budget))
    # Toy drafter: marginals near the target's greedy chain, plus noise.
    chain, t = [], last
    for _ in range(L):
        chain.append(t)
        t = model.greedy_next(t)
    draft_logits = torch.tensor([model.logits[c] for c in chain], dtype=torch.float32)
    draft_logits = draft_logits + torch.randn(draft_logits.shape, generator=gen) * 1.5
    draft_logprobs = torch.log_softmax(draft_logits, dim=-1).unsqueeze(0)  # [1, L, V]

    try:
        tokens, parents, depths, scores = fns.build(draft_logprobs, budget, topk_cap)
        N = budget + 1
        for name, ten in (("tokens", tokens), ("parents", parents), ("depths", depths), ("scores", scores)):
            if tuple(ten.shape) != (1, N):
                raise PayloadError(f"build_ddtree_tree returned {name} of shape {tuple(ten.shape)}, "
                                   f"expected (1, {N})")
        retrive_index, retrive_next_token, retrive_next_sibling = fns.compile_retrieve(parents, scores)
        for name, ten in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                          ("retrive_next_sibling", retrive_next_sibling)):
            if tuple(ten.shape) != (1, N):
                raise PayloadError(f"compile_ddtree_retrieve returned {name} of shape "
                                   f"{tuple(ten.shape)}, expected (1, {N})")
        candidates = tokens.to(torch.int64).clone()
        candidates[0, 0] = last
        cand = candidates[0].tolist()
        target = torch.tensor(
            [model.probs(c if 0 <= c < V else 0, temperature, top_k, top_p) for c in cand],
            dtype=torch.float32,
        ).unsqueeze(0)  # [1, N, V]
        max_depth = int(depths.max().item())
        S = max_depth + 1
        predicts = torch.zeros(N, dtype=torch.int32)
        accept_index = torch.full((1, S), -1, dtype=torch.int32)
        accept_token_num = torch.zeros(1, dtype=torch.int32)
        hi = 1.0 - 2.0 ** -24
        coins = torch.rand((1, N), generator=gen, dtype=torch.float32).clamp_(max=hi)
        final_coin = torch.rand((1,), generator=gen, dtype=torch.float32).clamp_(max=hi)
        draft_probs = torch.zeros((1, N, V), dtype=torch.float32)
        fns.sampling(
            predicts, accept_index, accept_token_num, candidates,
            retrive_index.to(torch.int64), retrive_next_token.to(torch.int64),
            retrive_next_sibling.to(torch.int64), coins, final_coin, target, draft_probs,
            threshold_single=1.0, threshold_acc=1.0,
        )
        n = int(accept_token_num[0].item())
        if not 0 <= n <= S - 1:
            raise PayloadError(f"accept_token_num={n} outside [0, {S - 1}]")
        idx = accept_index[0, : n + 1].tolist()
        if any(i < 0 or i >= N for i in idx):
            raise PayloadError(f"accept_index {idx} has entries outside [0, {N})")
        committed = [int(predicts[i].item()) for i in idx]
        if any(not 0 <= tok < V for tok in committed):
            raise PayloadError(f"committed tokens {committed} outside the vocabulary")
        return committed, n, max_depth
    except PayloadError:
        raise
    except Exception as exc:  # a payload function raised
        raise PayloadError(f"{type(exc).__name__}: {exc}") from exc
