"""KV reservation sizes for DDTree decode steps (ddtree-temp patch set).

Standard library only: this module imports without SGLang's dependencies, so
the sizes can be checked (and documented) anywhere.

What a DDTree decode step writes
--------------------------------
Let ``prefix`` be a request's committed KV length as the *GPU* sees it (the
``seq_lens`` the worker gets). In one step the worker writes, for every request:

* the DFlash draft block: ``req_to_token[prefix : prefix + block_size]``;
* the target tree verify: ``req_to_token[prefix : prefix + budget + 1]``
  (DFlash's own chain verify: ``[prefix, prefix + block_size)``);
* the accepted path's draft KV: ``req_to_token[prefix : prefix + commit]``,
  ``commit = accepted drafts + 1 <= min(budget, block_size - 1) + 1``
  (DFlash's chain verify: ``<= block_size``), so always ``commit <= block_size``.

So the widest window from ``prefix`` is ``max(block_size, budget + 1)``.

The overlap lag
---------------
``DFlashDraftInputV2.prepare_for_decode`` reserves from the *CPU*
``req.kv.kv_committed_len``. In the overlap scheduler
(``Scheduler.event_loop_overlap``) step N is prepared
(``get_next_batch_to_run`` -> ``update_running_batch`` ->
``prepare_for_decode``) and launched *before* the result of step N - 1 is
popped and processed (``pop_and_process`` -> ``_resolve_spec_v2_tokens``,
which does ``kv_committed_len += len(accepted run)``). The result queue never
holds more than one batch (``_reqs_finishing_inflight`` asserts it), so at
preparation time ``kv_committed_len`` lags the GPU's ``seq_lens`` by exactly
the one unprocessed step's commit of that request, or by nothing when the
request was not in that batch (a prefill batch ran in between, or overlap was
disabled for the step). A request retracted or finished while its step is in
flight commits nothing more. One step's commit is at most ``block_size``
(the tree path commits at most ``min(budget + 1, block_size)``, a step DFlash's
own forward serves at most ``block_size``), hence

    prefix <= kv_committed_len + block_size

and every slot the step writes lies below

    kv_committed_len + block_size + max(block_size, budget + 1).

Upstream DFlash (no budget) is the special case ``2 * block_size``: lag
``block_size`` plus a ``block_size`` verify block, which is what 0.5.23 uses.
For ``budget >= block_size - 1`` the bound is tight; below it a tree-only worker
lags at most ``budget + 1``, and the reserve keeps ``block_size - budget - 1``
slots per request of slack so that it holds whichever forward served the step.
Page alignment of the reservation stays ``page_aligned_decode_alloc_lens``'s
job (it rounds ``kv_committed_len + reserve`` up to a page).

The req_to_token row
--------------------
``assign_req_to_token_pool`` writes ``req_to_token[row, cur : nxt]`` with no
bound on the row width: a reservation past the row end lands in the next
request's row. ``nxt <= kv_committed_len + reserve + page_size - 1`` and the
scheduler keeps a live request's ``kv_committed_len`` below the model context
length (``max_new_tokens <= max_req_len - input_len - 1`` with
``max_req_len = context_len - 1``), so a row of
``context_len + reserve + page_size - 1`` entries holds every reservation.
0.5.23 sizes the row ``context_len + 4 + max_speculative_num_draft_tokens``
at page size 1, i.e. ``context_len + 69`` under DDTREE budget 64, which does
not hold the 81-slot reservation: :func:`ddtree_req_to_token_extra` gives the
headroom ``get_req_to_token_extra_context_len`` uses when a budget is set.
(A live request reaches ``kv_committed_len = context_len - 4``; plain DFLASH's
page-size-1 row, ``context_len + 4 + block_size``, is then ``2 * block_size - 8
- block_size`` = 8 entries short at block 16: 0.5.23's own limit, left as it is
outside DDTREE.)
"""

from __future__ import annotations


def ddtree_verify_width(block_size: int, budget: int | None) -> int:
    """Widest KV window one decode step writes from the GPU prefix.

    ``block_size`` (DFlash: draft block and chain verify) without a budget,
    else ``max(block_size, budget + 1)`` (the tree verify is budget + 1 wide).
    """
    block_size = int(block_size)
    if budget is None:
        return block_size
    return max(block_size, int(budget) + 1)


def ddtree_max_commit(block_size: int, budget: int | None) -> int:
    """Most tokens one decode step commits for a request (the overlap lag).

    Tree path: ``min(budget, block_size - 1) + 1``; DFlash's chain verify (plain
    DFLASH, or a step the DDTree worker leaves to ``DFlashWorkerV2``) commits up
    to ``block_size``. The reserve covers both, so this is ``block_size``
    whether or not a budget is set.
    """
    del budget  # DFlash's chain verify bounds the lag at block_size in every mode
    return int(block_size)


def ddtree_decode_reserve(block_size: int, budget: int | None) -> int:
    """KV length to reserve past ``kv_committed_len`` for one DFlash/DDTree step.

    ``2 * block_size`` when ``budget`` is None (upstream DFlash, unchanged);
    else ``block_size + max(budget + 1, block_size)``: the overlap lag (one
    unprocessed step's commit, at most ``block_size``; see the module
    docstring for why it is exactly one step) plus the widest window the step
    writes from the GPU prefix (tree verify ``budget + 1``, draft block
    ``block_size``). Page alignment is applied by the caller
    (``page_aligned_decode_alloc_lens``).
    """
    block_size = int(block_size)
    if block_size <= 0:
        raise ValueError(f"invalid block_size={block_size}")
    if budget is None:
        return 2 * block_size
    budget = int(budget)
    if budget < 1:
        raise ValueError(f"invalid DDTree budget={budget}")
    lag = ddtree_max_commit(block_size, budget)
    return lag + ddtree_verify_width(block_size, budget)


def ddtree_req_to_token_extra(block_size: int, budget: int, page_size: int) -> int:
    """req_to_token row headroom past the context length a DDTree budget needs.

    ``ddtree_decode_reserve(block_size, budget) + page_size - 1``: the
    page-aligned reservation of a request whose ``kv_committed_len`` is at the
    context length still fits its own row (see the module docstring).
    """
    return ddtree_decode_reserve(block_size, budget) + int(page_size) - 1
