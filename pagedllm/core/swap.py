"""Swap preemption (``preemption_mode="swap"``): a victim's KV goes to CPU blocks and
comes back to fresh GPU blocks before it runs again (torch-free bookkeeping).

```
 preempt ──► park(victim): computed GPU blocks ──copy──► CPU blocks   (swap_out pairs)
             victim.status = SWAPPED, appended to ``swapped``
 schedule ─► resume(req, n): CPU blocks ──copy──► new GPU blocks      (swap_in pairs)
             (the scheduler tries swapped requests before waiting ones)
```

The manager owns the swapped queue, the free CPU block ids and the step's copy lists;
the runner performs the copies (``SchedulerOutput.swap_out`` / ``swap_in``).  At most
``max_swap_blocks_per_step`` blocks move per step, but one request always may (however
large: it would otherwise never move).  When swapping is off, or a victim does not fit
the swap space or this step's budget, ``park`` returns False and the scheduler
recomputes the victim instead.
"""

from __future__ import annotations

from collections import deque

from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


class SwapManager:
    """The swapped requests, the CPU swap space and the block copies of one step.

    ``num_cpu_blocks`` is the size of the swap space; its block ids index the runner's
    CPU KV tensors.  ``begin_step`` starts a step's copy lists; ``swap_out`` and
    ``swap_in`` are that step's (GPU block, CPU block) and (CPU block, GPU block) pairs.
    """

    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, num_cpu_blocks: int,
                 enabled: bool, max_blocks_per_step: int) -> None:
        self.kv = kv
        self.enabled = enabled  # preemption_mode == "swap"
        self.max_blocks_per_step = max_blocks_per_step
        self.swapped: deque[Request] = deque()
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self._used = 0  # blocks moved this step (both directions)
        self.total_swaps = 0

    def __len__(self) -> int:
        """The number of swapped-out requests."""
        return len(self.swapped)

    def begin_step(self) -> None:
        """Fresh copy lists and budget for a new step."""
        self.swap_out, self.swap_in, self._used = [], [], 0

    def _budget_allows(self, num_blocks: int) -> bool:
        # One request may always move, however large: it would otherwise never move.
        return self._used == 0 or (
            self._used + num_blocks <= self.max_blocks_per_step)

    def park(self, victim: Request) -> bool:
        """Park ``victim``'s computed KV in CPU blocks; False (nothing changed) if swapping
        is off or the swap space or this step's swap budget cannot take it -- recompute
        then."""
        if not self.enabled:
            return False
        n = self.kv.num_swap_blocks(victim)
        if n == 0 or n > len(self.cpu_free) or not self._budget_allows(n):
            return False
        gpu = self.kv.swap_out(victim)
        cpu = [self.cpu_free.pop() for _ in range(n)]
        self.swap_out.extend(zip(gpu, cpu))
        self._used += n
        victim.cpu_block_ids = cpu
        victim.status = RequestStatus.SWAPPED
        self.swapped.append(victim)
        self.total_swaps += 1
        return True

    def resume(self, req: Request, num_new_tokens: int) -> bool:
        """Bring swapped ``req`` back to new GPU blocks with room for ``num_new_tokens``
        more; False (nothing changed) if this step's swap budget or the free GPU blocks
        cannot take it.  On success ``req`` has left ``swapped``; the caller admits it."""
        m = len(req.cpu_block_ids or ())
        if not self._budget_allows(m):
            return False
        blocks = self.kv.swap_in(req, num_new_tokens)
        if blocks is None:
            return False
        self.swap_in.extend(zip(req.cpu_block_ids or (), (b.block_id for b in blocks)))
        self._used += m
        self._free_cpu(req)
        self.swapped.remove(req)
        return True

    def remove(self, req: Request) -> None:
        """Forget swapped ``req`` (finished or aborted) and free its CPU blocks."""
        self.swapped.remove(req)
        self._free_cpu(req)

    def _free_cpu(self, req: Request) -> None:
        if req.cpu_block_ids:
            self.cpu_free.extend(req.cpu_block_ids)
        req.cpu_block_ids = None
