"""FreeBlockQueue: order, O(1) middle removal, membership."""

import pytest

from pagedllm.kv.free_queue import FreeBlockQueue


def test_fresh_queue_is_in_id_order():
    queue = FreeBlockQueue(4)
    assert list(queue) == [0, 1, 2, 3]
    assert len(queue) == 4


def test_pop_from_head_append_to_tail_remove_from_middle():
    queue = FreeBlockQueue(5)
    assert [queue.popleft(), queue.popleft()] == [0, 1]
    queue.append(0)
    queue.remove(3)
    assert list(queue) == [2, 4, 0]
    assert 3 not in queue and 0 in queue
    queue.remove(0)
    queue.remove(2)
    assert list(queue) == [4]
    assert queue.popleft() == 4
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(3)
    assert list(queue) == [3]


def test_queueing_twice_or_removing_absent_block_raises():
    queue = FreeBlockQueue(2)
    with pytest.raises(ValueError):
        queue.append(1)
    queue.remove(1)
    with pytest.raises(ValueError):
        queue.remove(1)
