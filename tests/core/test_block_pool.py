from __future__ import annotations

import pytest

from pagedllm.core.block_pool import BlockPool


def test_lru_order_and_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    pool.free_blocks(reversed(a))  # tail first -> 3, 2, 1 appended
    b = pool.get_new_blocks(3)
    # 4 and 5 were never used: they are at the head, then the freed ones in order.
    assert [x.block_id for x in b] == [4, 5, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(10)


def test_double_free_is_an_error_not_corruption():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.null_block])


def test_touch_revives_cached_block_from_middle_of_free_list():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[1], 1234)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(1234) is blocks[1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.num_free_blocks == 3
    # Eviction on reuse drops the hash.
    pool.free_blocks([blocks[1]])
    got = pool.get_new_blocks(4)
    assert blocks[1] in got and pool.get_cached_block(1234) is None
