"""Persistent per-request rows on the host, and the vectorised step-input builder.

```
 row:  0        1        2   ...  (dense: rows [0, num_reqs) are live)
 token_ids   [max_num_seqs, max_model_len]   prompt + generated, appended in place
 block_table [max_num_seqs, max_blocks]      appended from the scheduler's diffs
```

A request keeps its row while it runs; removal moves the last row into the hole, so
rows stay dense and nothing is rebuilt from scratch per step.  ``fork`` copies a row (a
new sequence sharing the parent's blocks); forks are applied before the step's removals,
so the arrays grow (rarely, once) when a step forks and drops sequences at the same time.
With hybrid KV cache groups (``core/kv_cache_groups.py``) groups 1.. have their own
tables, ``group_table [groups - 1, max_num_seqs, max_blocks]``, moved with the row.
``prepare`` turns a step's ``(row, num_new_tokens)`` list into flattened token ids,
positions, slot mapping, query offsets and sequence lengths with numpy array ops -- no
Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepInputs:
    """Host arrays for one step, in scheduled order."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks_used] int32
    max_query_len: int
    max_seq_len: int
    # Hybrid KV cache groups 1..: [G - 1, B, max_blocks_used] and [G - 1, T] (else None).
    group_block_tables: np.ndarray | None = None
    group_slot_mapping: np.ndarray | None = None


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 num_kv_groups: int = 1) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        g = num_kv_groups - 1
        self.group_table = np.zeros((g, max_num_seqs, max_blocks), dtype=np.int32) \
            if g else None
        self.group_num_blocks = np.zeros((g, max_num_seqs), dtype=np.int64)
        self.req_ids: list[str] = []  # row -> request id
        self.row_of: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def _new_row(self) -> int:
        row = len(self.req_ids)
        if row >= len(self.token_ids):
            if row >= 2 * self.max_num_seqs:
                raise RuntimeError("input batch is full (more than max_num_seqs requests)")
            def grown(a: np.ndarray) -> np.ndarray:
                return np.concatenate([a, np.zeros_like(a[:self.max_num_seqs])])

            self.token_ids, self.num_tokens = grown(self.token_ids), grown(self.num_tokens)
            self.block_table, self.num_blocks = grown(self.block_table), grown(self.num_blocks)
            if self.group_table is not None:
                self.group_table = np.concatenate(
                    [self.group_table, np.zeros_like(self.group_table[:, :self.max_num_seqs])],
                    axis=1)
                self.group_num_blocks = np.concatenate(
                    [self.group_num_blocks,
                     np.zeros_like(self.group_num_blocks[:, :self.max_num_seqs])], axis=1)
        return row

    def add(self, req_id: str, token_ids: list[int], block_ids: list[int],
            group_block_ids: list[list[int]] | None = None) -> int:
        row = self._new_row()
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        self.group_num_blocks[:, row] = 0
        self.req_ids.append(req_id)
        self.row_of[req_id] = row
        self.append_blocks(row, block_ids)
        if group_block_ids:
            self.append_group_blocks(row, group_block_ids)
        return row

    def append_group_blocks(self, row: int, group_block_ids: list[list[int]]) -> None:
        """Hybrid KV cache groups: ``group_block_ids[g - 1]`` appended to group g."""
        assert self.group_table is not None
        for g, ids in enumerate(group_block_ids):
            if ids:
                start = int(self.group_num_blocks[g, row])
                self.group_table[g, row, start:start + len(ids)] = ids
                self.group_num_blocks[g, row] = start + len(ids)

    def replace_group_blocks(self, row: int, replaced: list[tuple[int, int, int]]) -> None:
        """Copy-on-write in groups 1..: ``(group, index, block id)``."""
        assert self.group_table is not None
        for g, i, b in replaced:
            self.group_table[g - 1, row, i] = b

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def fork(self, parent_id: str, child_id: str) -> int:
        """A new row for ``child_id`` holding a copy of the parent's tokens and block table."""
        src = self.row_of[parent_id]
        row = self._new_row()
        n, nb = int(self.num_tokens[src]), int(self.num_blocks[src])
        self.token_ids[row, :n] = self.token_ids[src, :n]
        self.block_table[row, :nb] = self.block_table[src, :nb]
        self.num_tokens[row] = n
        self.num_blocks[row] = nb
        self._copy_group_row(src, row)
        self.req_ids.append(child_id)
        self.row_of[child_id] = row
        return row

    def replace_blocks(self, row: int, replaced: list[tuple[int, int]]) -> None:
        """Point table entries at new blocks (copy-on-write): ``(index, block id)``."""
        for i, b in replaced:
            self.block_table[row, i] = b

    def _copy_group_row(self, src: int, dst: int) -> None:
        if self.group_table is not None:
            nb = int(self.group_num_blocks[:, src].max())
            self.group_table[:, dst, :nb] = self.group_table[:, src, :nb]
            self.group_num_blocks[:, dst] = self.group_num_blocks[:, src]

    def set_last_token(self, row: int, token_id: int) -> None:
        """Overwrite the row's last token (beam search chose another one)."""
        self.token_ids[row, self.num_tokens[row] - 1] = token_id

    def remove(self, req_id: str) -> None:
        """Drop a request's row, moving the last row into its place (O(row width))."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            n, nb = int(self.num_tokens[last]), int(self.num_blocks[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_tokens[row] = n
            self.num_blocks[row] = nb
            self._copy_group_row(last, row)
            self.req_ids[row] = moved
            self.row_of[moved] = row
        self.req_ids.pop()

    def append_token(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def prepare(self, rows: np.ndarray, num_computed: np.ndarray,
                num_new: np.ndarray) -> StepInputs:
        """Flatten the step: request ``rows[i]`` computes tokens
        ``[num_computed[i], num_computed[i] + num_new[i])``."""
        bs = self.block_size
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=qsl[1:])
        total = int(qsl[-1])
        # Position of every token: its request's start plus its offset in the chunk.
        req_of_tok = np.repeat(np.arange(len(rows)), num_new)
        offsets = np.arange(total) - np.repeat(qsl[:-1], num_new)
        positions = np.repeat(num_computed, num_new) + offsets
        tok_rows = rows[req_of_tok]
        input_ids = self.token_ids[tok_rows, positions]
        slots = (self.block_table[tok_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        seq_lens = (num_computed + num_new).astype(np.int32)
        max_seq = int(seq_lens.max()) if len(rows) else 0
        nblk = -(-max_seq // bs)
        group_tables = group_slots = None
        if self.group_table is not None:  # the same gathers on every other group's table
            group_slots = (self.group_table[:, tok_rows, positions // bs].astype(np.int64)
                           * bs + positions % bs)
            group_tables = self.group_table[:, rows, :max(nblk, 1)]
        return StepInputs(
            input_ids=input_ids, positions=positions.astype(np.int64), slot_mapping=slots,
            query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max(nblk, 1)],
            max_query_len=int(num_new.max()) if len(rows) else 0, max_seq_len=max_seq,
            group_block_tables=group_tables, group_slot_mapping=group_slots)
