"""The ``draft_model`` proposer: a smaller model with the target's vocabulary proposes
its greedy continuation, ``k`` tokens per request, all requests batched per draft step.

KV bookkeeping -- the draft's KV lives in the target's blocks::

 target KV, layer l:  [2, num_blocks, block_size, H_t, D_t]    (worker.kv_caches)
 draft  KV, layer l:  [2, num_blocks + scratch, block_size, H_d, D_d]
                        ^ the same block ids: block b of a request holds its target KV
                          in the target tensors and its draft KV in the draft tensors

so the draft's blocks are allocated and freed with the request's (the KV manager's
``allocate_slots`` / ``free``: nothing here can leak a block), preemption drops them with
the request's, and the memory plan counts the draft's bytes per block
(``draft_kv_bytes_per_token``).  Rejected drafts are rolled back by a count, as for the
target: ``computed[req]`` is how many of the request's *known* tokens have draft KV.

One proposal round, after the target's step appended its emitted tokens (``n`` known)::

 step 1:   query = tokens [computed, n)   (the accepted drafts + the bonus token; a whole
           prompt the first time)  -> d1 = argmax at the last row;  computed := n
 step j:   query = d_{j-1} at position n + j - 2 (one token per request) -> d_j, j <= k

Steps 2..k write KV at positions past ``n - 1``.  Those may lie past the blocks the
scheduler allocated (it allocates for the verify step's tokens only), so each proposing
request gets ``cdiv(k, block_size)`` private *scratch* blocks after the pool's blocks,
appended to its block table for the round only; the next round's step 1 recomputes
whichever of those positions became known tokens (at most ``k + 1`` per request), so
nothing speculative is ever read as if it were known; a known position whose KV went to
scratch (past the request's blocks) is not counted as computed either.  A request's
computed count is forgotten when it leaves the batch (finished or preempted), or when a
block of it is copied on write (the copy holds target KV only): it then recomputes its
draft KV from 0.

Positions and slots of every draft step are known on the host before step 1, so the
round has one device->host transfer (the ``[R, k]`` drafts at the end); the draft steps'
input ids stay on the device.  The draft runs eagerly (no CUDA graphs yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata

H2D = Callable[[str, np.ndarray], torch.Tensor]


def draft_kv_bytes_per_token(draft_config: Any, cache_dtype: str = "auto") -> int:
    """The draft's KV bytes per token (its layers and KV heads): added to each block's
    size in the memory plan, since every block holds draft KV too."""
    return int(draft_config.kv_bytes_per_token(cache_dtype))


def scratch_blocks_per_request(k: int, block_size: int) -> int:
    """Blocks a proposing request writes past its own during a round (see module doc):
    positions up to ``n + k - 2`` with ``n - 1`` at most the end of its blocks."""
    return -(-k // block_size)


class DraftModelProposer:
    """Proposals from ``model`` (a pagedllm model, e.g. ``LlamaForCausalLM``) whose
    per-layer KV tensors ``kv_caches`` have ``num_blocks`` pool blocks followed by
    ``max_rows * scratch_blocks_per_request(k, block_size)`` scratch blocks."""

    def __init__(self, model: nn.Module, k: int, block_size: int, num_blocks: int,
                 max_rows: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.k = k
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.device = device
        self.scratch = scratch_blocks_per_request(k, block_size)
        self.kv_caches: list[torch.Tensor] = []  # per draft layer (attach_draft)
        # Request id -> how many of its known tokens have draft KV (see module doc).
        self.computed: dict[str, int] = {}

    @property
    def num_cache_blocks(self) -> int:
        """Blocks each draft KV tensor needs: the pool's, then the scratch ones."""
        return self.num_blocks + self.max_rows * self.scratch

    def forget(self, req_id: str) -> None:
        """The request's draft KV is gone or stale (finished, preempted, copy-on-write)."""
        self.computed.pop(req_id, None)

    # -- host-side inputs -----------------------------------------------------------
    def block_tables(self, block_table: np.ndarray, num_blocks: np.ndarray,
                     rows: np.ndarray, slot: np.ndarray | None = None) -> np.ndarray:
        """Each proposing request's block table for the round: its blocks, then its
        scratch blocks (request ``i`` of the round owns scratch ``i``, or ``slot[i]``;
        none where that is negative), then zeros."""
        width = block_table.shape[1] + self.scratch
        nb = num_blocks[rows].astype(np.int64)
        tbl = np.zeros((len(rows), width), dtype=np.int32)
        tbl[:, :block_table.shape[1]] = block_table[rows]
        col = np.arange(width)[None, :] - nb[:, None]  # offset past the own blocks
        if slot is None:
            slot = np.arange(len(rows))
        own_scratch = self.num_blocks + slot[:, None] * self.scratch + col
        is_scratch = (col >= 0) & (col < self.scratch) & (slot[:, None] >= 0)
        tbl[is_scratch] = own_scratch[is_scratch]
        tbl[(col >= 0) & ~is_scratch] = 0
        return tbl

    def _meta(self, h2d: H2D, tag: str, qsl: np.ndarray, seq_lens: np.ndarray,
              tbl: np.ndarray, slots: np.ndarray) -> AttentionMetadata:
        max_seq = int(seq_lens.max())
        nblk = -(-max_seq // self.block_size)
        return AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), num_reqs=len(seq_lens),
            max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=max_seq,
            query_start_loc=h2d(f"draft_qsl{tag}", qsl),
            seq_lens=h2d(f"draft_seq{tag}", seq_lens),
            block_tables=h2d(f"draft_bt{tag}", np.ascontiguousarray(tbl[:, :nblk])),
            slot_mapping=h2d(f"draft_slots{tag}", slots),
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens_cpu=torch.from_numpy(seq_lens), block_size=self.block_size)

    def _later_steps(self, base: np.ndarray, caps: np.ndarray, tbl: np.ndarray,
                     m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draft steps 2..m, one token per request at position ``base + j``: positions
        and KV slots ``[m - 1, R]`` and the one-token query starts.  A request past its
        cap rides along at a clamped position with slot -1 (no KV written)."""
        num_req = len(base)
        j = np.arange(2, m + 1)[:, None]  # [m - 1, 1]
        pos_all = base[None, :] + j
        live = j <= caps[None, :]
        pos_all = np.where(live, pos_all, np.minimum(pos_all, self.max_model_len - 1))
        reqs = np.broadcast_to(np.arange(num_req), pos_all.shape)
        slots_all = np.where(live, self._slots(tbl, reqs, pos_all), -1)
        return pos_all, slots_all, np.arange(num_req + 1, dtype=np.int32)

    def _slots(self, tbl: np.ndarray, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return tbl[req, pos // bs].astype(np.int64) * bs + pos % bs

    # -- the round --------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: Any, rows: Sequence[int], req_ids: Sequence[str],
                max_drafts: Sequence[int], h2d: H2D, target: Any = None) -> list[list[int]]:
        """Drafts for each of ``rows`` of ``batch`` (a ``worker.input_batch.InputBatch``:
        token ids, counts and block tables), at most ``max_drafts[i]`` (0: none).
        ``target``: the target step's states, unused (a draft model reads tokens only)."""
        out: list[list[int]] = [[] for _ in rows]
        # Step m writes position n + m - 2, which must lie in the request's blocks or
        # its scratch: at most ``room`` drafts (the scheduler's allocation makes this
        # >= k; the cap is a guard, never a silent write elsewhere).
        rows_a = np.asarray(rows, dtype=np.int64)
        room = (batch.num_blocks[rows_a].astype(np.int64) + self.scratch) * self.block_size \
            - batch.num_tokens[rows_a].astype(np.int64) + 1
        all_caps = np.minimum(np.minimum(np.asarray(max_drafts, dtype=np.int64), room),
                              self.k)
        pick = np.flatnonzero(all_caps > 0)[:self.max_rows].tolist()
        if not pick:
            return out
        r = rows_a[pick]
        caps = all_caps[pick]
        n = batch.num_tokens[r].astype(np.int64)
        start = np.asarray([self.computed.get(req_ids[i], 0) for i in pick], dtype=np.int64)
        start = np.minimum(start, n - 1)  # at least the last token is fed
        tbl = self.block_tables(batch.block_table, batch.num_blocks, r)
        num_req = len(r)

        # Step 1: the known tokens without draft KV, each request's last one predicting.
        q = n - start
        qsl = np.zeros(num_req + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        req_of_tok = np.repeat(np.arange(num_req), q)
        pos = np.repeat(start, q) + np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], q)
        ids = batch.token_ids[r[req_of_tok], pos]
        meta = self._meta(h2d, "0", qsl, n.astype(np.int32), tbl,
                          self._slots(tbl, req_of_tok, pos))
        hidden = self.model(h2d("draft_ids0", ids), h2d("draft_pos0", pos), meta, True)
        tok = self.model.compute_logits(hidden).argmax(dim=-1)
        drafts = [tok]

        # Steps 2..m: one token per request at position n + j - 2.  A request past its
        # cap rides along (its rows are discarded) without writing KV.
        m = int(caps.max())
        if m > 1:
            pos_all, slots_all, qsl1 = self._later_steps(n - 2, caps, tbl, m)
            for step in range(m - 1):  # over the k draft positions, not over tokens
                p = pos_all[step]
                meta = self._meta(h2d, str(step + 1), qsl1, (p + 1).astype(np.int32), tbl,
                                  slots_all[step])
                hidden = self.model(tok, h2d(f"draft_pos{step + 1}", p), meta, True)
                tok = self.model.compute_logits(hidden).argmax(dim=-1)
                drafts.append(tok)
        host = torch.stack(drafts, dim=1).tolist()  # the round's one device->host copy
        # Known positions whose draft KV landed in the request's own blocks (position
        # n - 1 may have gone to scratch: it is recomputed next round).
        own = batch.num_blocks[r].astype(np.int64) * self.block_size
        for idx, i in enumerate(pick):
            self.computed[req_ids[i]] = int(min(n[idx], own[idx]))
            out[i] = host[idx][:int(caps[idx])]
        return out


def attach_draft(runner: Any, model: nn.Module, config: Any, kv_dtype: torch.dtype,
                 proposer_cls: type[DraftModelProposer] = DraftModelProposer) -> None:
    """Give ``runner`` (a ``ModelRunner`` with a ``draft_model``, ``eagle`` or ``eagle3``
    speculative config) its proposer, a ``proposer_cls``: allocate the draft's KV tensors
    (the pool's block count from ``config``, an ``EngineConfig`` whose memory plan
    already counted the draft's bytes per block, plus the scratch blocks) and bind them
    to ``model``."""
    spec = config.scheduler_config.speculative_config
    dc = spec.draft_model_config
    cc, sc = config.cache_config, config.scheduler_config
    proposer = proposer_cls(
        model, spec.num_speculative_tokens, cc.block_size, cc.num_blocks,
        max_rows=min(sc.max_num_seqs, spec.disable_by_batch_size or sc.max_num_seqs),
        max_model_len=sc.max_model_len, device=runner.device)
    shape = (dc.kv_entries_per_token, proposer.num_cache_blocks, cc.block_size,
             dc.num_kv_heads, dc.head_dim)
    # Zeroed, like the target's: attention gathers whole blocks and masks the tail.
    caches = [torch.zeros(shape, dtype=kv_dtype, device=runner.device)
              for _ in range(dc.num_layers)]
    model.bind_kv_caches(caches)
    proposer.kv_caches = caches
    runner.spec.draft = proposer
