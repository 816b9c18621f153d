"""A fake model runner for scheduler tests: deterministic tokens, no torch.

It mirrors the real runner's contract: it learns requests from ``new_reqs``, forgets them
on ``finished_req_ids`` (keeping preempted ones), checks that every scheduled chunk starts
where the last one ended, and samples only when a request's known tokens are all
computed.  The "model" emits ``(sum of the last token and the position) % 1000 + 10``.
"""

from __future__ import annotations

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput


class FakeRunner:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        for rid in sched.finished_req_ids:
            self.blocks.pop(rid, None)
            if rid not in sched.preempted_req_ids:
                self.tokens.pop(rid, None)
        for nr in sched.new_reqs:
            self.tokens[nr.req_id] = nr.prompt_token_ids + nr.output_token_ids
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.blocks[nr.req_id] = list(nr.block_ids)
        for c in sched.cached_reqs:
            assert self.computed[c.req_id] == c.num_computed_tokens, "chunk gap"
            self.blocks[c.req_id].extend(c.new_block_ids)
        out = ModelRunnerOutput(list(sched.num_scheduled_tokens), [])
        for rid, n in sched.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            end = self.computed[rid] + n
            assert end <= len(toks), "scheduled beyond known tokens"
            self.computed[rid] = end
            if end == len(toks):
                t = (toks[-1] + len(toks)) % 1000 + 10
                toks.append(t)
                out.sampled_token_ids.append([t])
            else:
                out.sampled_token_ids.append([])
        return out
