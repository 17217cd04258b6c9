"""FreeBlockQueue: every operation, ordering, batches, sentinels, edge cases and errors."""

from __future__ import annotations

import pytest

from kvcore.errors import BlockStateError, InvalidArgumentError, NoFreeBlocksError, NullBlockError
from kvcore.eviction import FreeBlockQueue
from kvcore.types import KVCacheBlock, NullBlock
from tests.factories import ids


def make_blocks(n: int, start: int = 1) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(start, start + n)]


def assert_consistent(q: FreeBlockQueue) -> None:
    """Walk forward and backward; both must agree with len() and with each other."""
    fwd = list(q)
    back = []
    node = q.tail.prev_free
    while node is not q.head:
        back.append(node)
        node = node.prev_free
    assert fwd == back[::-1]
    assert len(q) == len(fwd)
    assert q.head.prev_free is None and q.tail.next_free is None


def test_construction_links_in_order() -> None:
    blocks = make_blocks(5)
    q = FreeBlockQueue(blocks)
    assert ids(q) == [1, 2, 3, 4, 5]
    assert len(q) == 5
    assert blocks[0].prev_free is q.head and blocks[-1].next_free is q.tail
    assert_consistent(q)


def test_empty_queue_sentinels_point_at_each_other() -> None:
    q = FreeBlockQueue()
    assert len(q) == 0 and list(q) == []
    assert q.head.next_free is q.tail and q.tail.prev_free is q.head
    assert q.first() is None


def test_popleft_returns_head_and_unlinks() -> None:
    blocks = make_blocks(3)
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free is None and b.next_free is None
    assert ids(q) == [2, 3] and len(q) == 2
    assert blocks[1].prev_free is q.head
    assert_consistent(q)


def test_popleft_empty_raises_value_error_subclass() -> None:
    q = FreeBlockQueue()
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
    assert issubclass(NoFreeBlocksError, ValueError)
    q = FreeBlockQueue(make_blocks(1))
    q.popleft()
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
    assert_consistent(q)


def test_one_element_queue_every_operation() -> None:
    (b,) = blocks = make_blocks(1)
    q = FreeBlockQueue(blocks)
    q.remove(b)
    assert len(q) == 0 and q.head.next_free is q.tail
    q.append(b)
    assert ids(q) == [1]
    assert q.popleft_n(1) == [b]
    q.prepend_n([b])
    assert ids(q) == [1] and q.first() is b
    assert_consistent(q)


def test_popleft_n_order_count_and_links() -> None:
    blocks = make_blocks(6)
    q = FreeBlockQueue(blocks)
    out = q.popleft_n(4)
    assert ids(out) == [1, 2, 3, 4]
    assert all(b.prev_free is None and b.next_free is None for b in out)
    assert ids(q) == [5, 6] and len(q) == 2
    assert q.popleft_n(0) == []
    assert ids(q.popleft_n(2)) == [5, 6]
    assert len(q) == 0 and q.head.next_free is q.tail
    assert_consistent(q)


def test_popleft_n_errors_leave_queue_unchanged() -> None:
    q = FreeBlockQueue(make_blocks(3))
    with pytest.raises(NoFreeBlocksError):
        q.popleft_n(4)
    with pytest.raises(InvalidArgumentError):
        q.popleft_n(-1)
    assert ids(q) == [1, 2, 3]
    assert_consistent(q)


def test_remove_middle_head_tail() -> None:
    blocks = make_blocks(5)
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [1, 2, 4, 5]
    q.remove(blocks[0])
    assert ids(q) == [2, 4, 5]
    q.remove(blocks[4])
    assert ids(q) == [2, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert_consistent(q)


def test_remove_unlinked_raises_without_corruption() -> None:
    blocks = make_blocks(3)
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    with pytest.raises(BlockStateError, match="block 2 is not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(BlockStateError):
        q.remove(KVCacheBlock(99))
    assert ids(q) == [1, 3] and len(q) == 2
    assert_consistent(q)


def test_append_goes_to_tail() -> None:
    blocks = make_blocks(3)
    q = FreeBlockQueue(blocks[:2])
    q.append(blocks[2])
    assert ids(q) == [1, 2, 3]
    assert blocks[2].next_free is q.tail
    assert_consistent(q)


def test_append_n_and_prepend_n_keep_batch_order() -> None:
    blocks = make_blocks(7)
    q = FreeBlockQueue(blocks[:2])  # 1 2
    q.append_n(blocks[2:4])  # 1 2 3 4
    q.prepend_n(blocks[4:6])  # 5 6 1 2 3 4
    q.append_n([blocks[6]])
    assert ids(q) == [5, 6, 1, 2, 3, 4, 7]
    assert len(q) == 7
    q.append_n([])
    q.prepend_n([])
    assert len(q) == 7
    assert_consistent(q)


def test_batch_ops_into_empty_queue() -> None:
    blocks = make_blocks(4)
    q = FreeBlockQueue()
    q.prepend_n(blocks[:2])
    assert ids(q) == [1, 2]
    q2 = FreeBlockQueue()
    q2.append_n(blocks[2:])
    assert ids(q2) == [3, 4]
    assert_consistent(q)
    assert_consistent(q2)


def test_fifo_order_after_mixed_operations() -> None:
    blocks = make_blocks(5)
    q = FreeBlockQueue(blocks)
    a, b = q.popleft(), q.popleft()
    q.remove(blocks[3])
    q.append(a)
    q.prepend_n([blocks[3]])
    q.append_n([b])
    assert ids(q) == [4, 3, 5, 1, 2]
    assert_consistent(q)


@pytest.mark.parametrize("op", ["append", "append_n", "prepend_n"])
def test_inserting_a_linked_block_raises_and_changes_nothing(op: str) -> None:
    blocks = make_blocks(4)
    q = FreeBlockQueue(blocks[:3])
    extra = blocks[3]
    with pytest.raises(BlockStateError, match="block 2"):
        if op == "append":
            q.append(blocks[1])
        elif op == "append_n":
            q.append_n([extra, blocks[1]])
        else:
            q.prepend_n([extra, blocks[1]])
    assert ids(q) == [1, 2, 3]
    assert extra.prev_free is None and extra.next_free is None
    assert_consistent(q)


@pytest.mark.parametrize("op", ["append_n", "prepend_n"])
def test_repeated_block_in_a_batch_raises_and_changes_nothing(op: str) -> None:
    blocks = make_blocks(4)
    q = FreeBlockQueue(blocks[:2])
    batch = [blocks[2], blocks[3], blocks[2]]
    with pytest.raises(BlockStateError, match="repeated"):
        getattr(q, op)(batch)
    assert ids(q) == [1, 2]
    assert all(b.prev_free is None and b.next_free is None for b in blocks[2:])
    assert_consistent(q)


def test_null_block_never_enters_a_queue() -> None:
    q = FreeBlockQueue(make_blocks(2))
    null = NullBlock(0)
    with pytest.raises(NullBlockError):
        q.append(null)
    with pytest.raises(NullBlockError):
        q.append_n([null])
    with pytest.raises(NullBlockError):
        FreeBlockQueue([null])
    assert ids(q) == [1, 2]


def test_null_block_ref_count_is_read_only() -> None:
    null = NullBlock(0)
    assert null.ref_cnt == 0 and null.is_null
    with pytest.raises(NullBlockError):
        null.ref_cnt = 1
    with pytest.raises(NullBlockError):
        null.ref_cnt += 1
    assert null.ref_cnt == 0


def test_block_slots_prevent_stray_attributes() -> None:
    b = KVCacheBlock(3)
    with pytest.raises(AttributeError):
        b.some_field = 1  # type: ignore[attr-defined]
    assert (b.block_id, b.ref_cnt, b.block_hash, b.prev_free, b.next_free, b.is_null) == (
        3, 0, None, None, None, False)
    assert "id=3" in repr(b)
