"""The ``eagle`` / ``eagle3`` proposer: an EAGLE head (``worker/spec_decode/eagle.py``) drafts
``k`` greedy tokens per request from the target's hidden states of the step that just ran.

The head's KV lives in the target's blocks plus per-request scratch blocks, exactly as a
draft model's does (``DraftModelProposer``, whose block tables, slots and metadata this
reuses).  What differs is the input: the head's entry at position ``p`` reads the
token at ``p + 1`` and the target's state at ``p``, so it can only be computed once the
target has run position ``p`` and the token after it is known.  One round, after a target
step whose rows for a request started at position ``p0`` (``n`` known tokens now)::

 step 1:  positions [p0, n - 1): ids t_{p+1}, hidden = target rows of the step (the
          verified drafts and the row before the bonus token; a whole prompt chunk)
          -> g (the head's state) and d1 at the last row (position n - 2)
 step j:  position n + j - 3: id d_{j-1}, hidden = g of step j - 1  -> d_j, j <= k

Step ``j >= 2`` writes speculative KV at positions ``>= n - 1``; the next step of the
target starts at ``n - 1`` (it rolls back to there), so the next round's step 1
rewrites them from real states.  Requests that get no drafts from a step still get
step 1 for its rows (``observe``): a prompt chunk before the last (at launch: its next
tokens are prompt tokens), a step over ``disable_by_batch_size``, a request that cannot
speculate.  Positions the target never ran (prefix-cache hits) keep the head KV their
block holds, written by the request that filled it; a block copied on write, or swapped
out and back (``BlockOps`` moves the target's KV only), holds none.  Such positions can
lower acceptance, never change the output (verification is lossless).  No state is
kept per request, so preemption needs nothing.

The target's states of the step are handed over on the device (``TargetStates``); the
round's one device->host transfer is the ``[R, k]`` drafts at its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.worker.spec_decode.draft_model import H2D, DraftModelProposer


@dataclass
class TargetStates:
    """What a target step leaves for the head: ``hidden`` [T, D] per token row of the
    step (EAGLE-1: the model output; EAGLE-3: its 3 aux states side by side), and per
    request id ``(first row in hidden, its position, number of rows)``."""

    hidden: torch.Tensor
    first: dict[str, tuple[int, int, int]]


class EagleProposer(DraftModelProposer):
    """``model``: an ``EagleHead`` or a DeepSeek MTP layer (``models/deepseek_mtp.py``:
    the same interface -- ``target_hidden``, ``forward(ids, positions, hidden, meta) ->
    (for_logits, next_hidden)``, ``draft_tokens``, ``bind_kv_caches``); otherwise as
    ``DraftModelProposer``."""

    @torch.inference_mode()
    def propose(self, batch: Any, rows: Sequence[int], req_ids: Sequence[str],
                max_drafts: Sequence[int], h2d: H2D,
                target: TargetStates | None = None) -> list[list[int]]:
        """Drafts for each of ``rows`` of ``batch`` (an ``InputBatch`` whose rows hold
        the step's emitted tokens), at most ``max_drafts[i]``.  Every request with rows
        in ``target`` gets its head KV written for them (step 1), even with no drafts
        (``max_drafts[i] == 0``: see ``observe``)."""
        out: list[list[int]] = [[] for _ in rows]
        if target is None:
            return out
        rows_a = np.asarray(rows, dtype=np.int64)
        n_all = batch.num_tokens[rows_a].astype(np.int64)
        first = np.asarray([target.first.get(r, (-1, -1, 0)) for r in req_ids],
                           dtype=np.int64).reshape(-1, 3)
        # Step 1 covers the step's rows whose next token is known.
        q_all = np.minimum(n_all - 1, first[:, 1] + first[:, 2]) - first[:, 1]
        pick = np.flatnonzero((first[:, 1] >= 0) & (q_all > 0))
        if not len(pick):
            return out
        r, n, q = rows_a[pick], n_all[pick], q_all[pick]
        row0, p0 = first[pick, 0], first[pick, 1]
        # Step j writes position n + j - 3: within the own and scratch blocks.  Drafts
        # need the step's last row (at n - 2) and a scratch slot (max_rows of them).
        room = (batch.num_blocks[r].astype(np.int64) + self.scratch) * self.block_size \
            - n + 2
        caps = np.minimum(np.minimum(np.asarray(max_drafts, dtype=np.int64)[pick], room),
                          self.k)
        caps[p0 + q != n - 1] = 0
        caps[np.cumsum(caps > 0) > self.max_rows] = 0
        slot = np.where(caps > 0, np.cumsum(caps > 0) - 1, -1)
        tbl = self.block_tables(batch.block_table, batch.num_blocks, r, slot)
        num_req = len(r)
        model = self.model

        # Step 1: positions [p0, p0 + q) from the target's rows of the step.
        qsl = np.zeros(num_req + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        req_of_tok = np.repeat(np.arange(num_req), q)
        off = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], q)
        pos = np.repeat(p0, q) + off
        ids = batch.token_ids[r[req_of_tok], pos + 1]
        src = np.repeat(row0, q) + off
        meta = self._meta(h2d, "0", qsl, (p0 + q).astype(np.int32), tbl,
                          self._slots(tbl, req_of_tok, pos))
        hidden = model.target_hidden(target.hidden[h2d("eagle_src", src)])
        for_logits, nxt = model(h2d("draft_ids0", ids), h2d("draft_pos0", pos), hidden, meta)
        m = int(caps.max())
        if m == 0:  # head KV only (observe): no drafts, no transfer
            return out
        last = h2d("eagle_last", qsl[1:].astype(np.int64) - 1)
        tok = model.draft_tokens(for_logits[last])
        g = nxt[last]
        drafts = [tok]

        # Steps 2..m: one token per request at position n + j - 3.  A request past its
        # cap rides along (its rows are discarded) without writing KV.
        if m > 1:
            pos_all, slots_all, qsl1 = self._later_steps(n - 3, caps, tbl, m)
            for step in range(m - 1):  # over the k draft positions, not over tokens
                p = pos_all[step]
                meta = self._meta(h2d, str(step + 1), qsl1, (p + 1).astype(np.int32), tbl,
                                  slots_all[step])
                for_logits, g = model(tok, h2d(f"draft_pos{step + 1}", p), g, meta)
                tok = model.draft_tokens(for_logits)
                drafts.append(tok)
        host = torch.stack(drafts, dim=1).tolist()  # the round's one device->host copy
        for idx, i in enumerate(pick.tolist()):
            out[i] = host[idx][:int(caps[idx])]
        return out

    def observe(self, batch: Any, rows: Sequence[int], req_ids: Sequence[str], h2d: H2D,
                target: TargetStates) -> None:
        """Write the head KV of ``target``'s rows of requests that get no drafts from
        this step (a prompt chunk before the last; a step over
        ``disable_by_batch_size``), so a later round finds it (device work only)."""
        self.propose(batch, rows, req_ids, [0] * len(rows), h2d, target)
