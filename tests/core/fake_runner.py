"""A fake model runner for scheduler tests: deterministic tokens, no torch.

It mirrors the real runner's contract: it learns requests from ``new_reqs`` and ``forks``
(copying the parent's row), forgets them on ``finished_req_ids`` (keeping preempted
ones), checks that every scheduled chunk starts where the last one ended, applies
copy-on-write replacements, beam-search token overrides and block moves (swap out,
the disk tier's saves and loads, offloads to the host tier, swap in, copies) in the real
runner's order -- loads from the host tier land after the step's forward, which must not
touch their blocks, as the real runner overlaps them with it -- and samples only when a
request's known tokens are all computed.  The "model" emits
``(last token + position + 7 * seed) % 1000 + 10``; beam rows also report ``K``
candidates with fixed, decreasing log probabilities.

It also simulates the KV cache, one token per slot: every computed position is written
into its block, and after each step every request re-reads *all* its positions through
its block table -- a block shared with, freed to or overwritten by someone else shows up
as a wrong token.  With ``pool`` set it also asserts that nothing writes a slot of a
block that another request has already computed and reads (registered prefix-cache
blocks excepted: their owner fills them with exactly the tokens their hash names).
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput


def fake_token(tokens: list[int], seed: int | None) -> int:
    return (tokens[-1] + len(tokens) + 7 * (seed or 0)) % 1000 + 10


def fake_candidates(tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """Beam candidates: k distinct tokens, log probs strictly decreasing."""
    base = tokens[-1] + len(tokens)
    ids = [(base + 13 * j) % 1000 + 10 for j in range(k)]
    lps = [-0.3 * (j + 1) - 0.01 * ((base + j) % 7) for j in range(k)]
    return ids, lps


class FakeRunner:
    def __init__(self, block_size: int = 4, pool: BlockPool | None = None) -> None:
        self.block_size = block_size
        self.pool = pool
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.seeds: dict[str, int | None] = {}
        self.num_logprobs: dict[str, int | None] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}  # the prefix cache's host tier
        self.disk: dict[int, list[int | None]] = {}  # ... and its disk tier
        self.steps: list[SchedulerOutput] = []

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        return self.blocks[rid][pos // self.block_size], pos % self.block_size

    def _check_no_reader(self, writer: str, block: int, off: int) -> None:
        """No other request has already computed (and so reads) this slot."""
        for other, table in self.blocks.items():
            if other == writer or block not in table:
                continue
            pos = table.index(block) * self.block_size + off
            assert pos >= self.computed[other], \
                f"{writer} overwrites block {block} that {other} still reads"

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        for f in sched.forks:
            p, c = f.parent_req_id, f.child_req_id
            self.tokens[c] = list(self.tokens[p])
            self.computed[c] = self.computed[p]
            self.blocks[c] = list(self.blocks[p])
            params = f.sampling_params
            self.seeds[c] = params.seed if params is not None else self.seeds[p]
            self.num_logprobs[c] = self.num_logprobs[p]
        for rid in sched.finished_req_ids:
            self.blocks.pop(rid, None)
            if rid not in sched.preempted_req_ids:
                self.tokens.pop(rid, None)
        for nr in sched.new_reqs:
            self.tokens[nr.req_id] = nr.prompt_token_ids + nr.output_token_ids
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.blocks[nr.req_id] = list(nr.block_ids)
            self.seeds[nr.req_id] = nr.sampling_params.seed
            self.num_logprobs[nr.req_id] = nr.sampling_params.logprobs
        for c in sched.cached_reqs:
            assert self.computed[c.req_id] == c.num_computed_tokens, "chunk gap"
            for i, b in c.replaced_block_ids:
                self.blocks[c.req_id][i] = b
            self.blocks[c.req_id].extend(c.new_block_ids)
            if c.last_token_id is not None:
                self.tokens[c.req_id][-1] = c.last_token_id
        # Block moves, in the real runner's order.
        for g, cpu in sched.swap_out:
            self.cpu[cpu] = list(self.kv.get(g, [None] * self.block_size))
        for slot, d in sched.kv_disk_save:  # the disk tier: saves, then loads
            self.disk[d] = list(self.host[slot])
        for d, slot in sched.kv_disk_load:
            self.host[slot] = list(self.disk[d])
        for g, slot in sched.kv_offload:  # the prefix cache's host tier
            self.host[slot] = list(self.kv.get(g, [None] * self.block_size))
        for cpu, g in sched.swap_in:
            self.kv[g] = list(self.cpu[cpu])
        # Loads from the host tier land before this step's attention reads them (the
        # real runner overlaps them with the forward, layer by layer); nothing of this
        # step may write a block being loaded.
        loading = {g for _, g in sched.kv_load}
        assert len(loading) == len(sched.kv_load), "two loads, one block"
        for slot, g in sched.kv_load:
            self.kv[g] = list(self.host[slot])
        copies = [(d, list(self.kv.get(s, [None] * self.block_size)))
                  for s, d in sched.block_copies]
        assert len({d for d, _ in copies}) == len(copies), "two copies into one block"
        assert not loading & {d for d, _ in copies}, "a copy into a block being loaded"
        for d, content in copies:
            self.kv[d] = content

        out = ModelRunnerOutput(list(sched.num_scheduled_tokens), [])
        for rid, n in sched.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            start = self.computed[rid]
            end = start + n
            assert end <= len(toks), "scheduled beyond known tokens"
            for pos in range(start, end):
                b, off = self._slot(rid, pos)
                assert b not in loading, f"{rid} writes block {b}, which is being loaded"
                if self.pool is not None and self.pool.blocks[b].block_hash is None:
                    self._check_no_reader(rid, b, off)
                self.kv.setdefault(b, [None] * self.block_size)[off] = toks[pos]
            self.computed[rid] = end
            if end == len(toks):
                t = fake_token(toks, self.seeds[rid])
                k = self.num_logprobs[rid]
                if k:
                    ids, lps = fake_candidates(toks, k)
                    out.logprobs[rid] = ([t, *ids], [lps[0], *lps], 1)
                toks.append(t)
                out.sampled_token_ids.append([t])
            else:
                out.sampled_token_ids.append([])
        # Every scheduled request re-reads its whole history through its block table.
        for rid in sched.num_scheduled_tokens:
            toks = self.tokens[rid]
            for pos in range(self.computed[rid]):
                b, off = self._slot(rid, pos)
                assert self.kv[b][off] == toks[pos], f"{rid}: KV of position {pos} lost"
        return out
