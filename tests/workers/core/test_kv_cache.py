"""KVCache: slot bookkeeping, rollback by pointer, compaction of an accepted tree path, writes/reads."""

from __future__ import annotations

import pytest
import torch

from specd.workers.core.kv_cache import CacheFullError, KVCache

LAYERS, SLOTS, MAX_LEN, HEADS, DIM = 2, 3, 8, 2, 4


def _cache() -> KVCache:
    return KVCache(LAYERS, SLOTS, MAX_LEN, HEADS, DIM, torch.float32, "cpu")


def _kv(b: int, n: int, base: float) -> torch.Tensor:
    """[b, heads, n, dim] whose value at (row, head, j, :) is base + 100*row + 10*head + j."""
    row = torch.arange(b)[:, None, None, None] * 100.0
    head = torch.arange(HEADS)[None, :, None, None] * 10.0
    pos = torch.arange(n)[None, None, :, None] * 1.0
    return (base + row + head + pos).expand(b, HEADS, n, DIM).contiguous()


def test_shapes_and_fresh_state():
    cache = _cache()
    assert cache.k.shape == (LAYERS, SLOTS, HEADS, MAX_LEN, DIM)
    assert cache.v.shape == cache.k.shape
    assert cache.lengths.tolist() == [0, 0, 0]
    assert cache.num_free == SLOTS


def test_allocate_until_full_then_free_and_reuse():
    cache = _cache()
    slots = [cache.allocate() for _ in range(SLOTS)]
    assert sorted(slots) == [0, 1, 2]
    assert cache.num_free == 0
    with pytest.raises(CacheFullError, match="in use"):
        cache.allocate()
    cache.lengths[slots[1]] = 5
    cache.free(slots[1])
    assert cache.lengths[slots[1]] == 0  # freeing resets the length
    assert cache.num_free == 1
    assert cache.allocate() == slots[1]  # the freed slot is handed out again
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(7)


def test_free_twice_is_refused():
    cache = _cache()
    slot = cache.allocate()
    cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(slot)


def test_rollback_moves_the_pointer_only():
    cache = _cache()
    slot = cache.allocate()
    cache.write_runs(0, [slot], [0], _kv(1, 5, 1.0), _kv(1, 5, 2.0))
    cache.lengths[slot] = 5
    before = cache.k.clone()
    cache.rollback(slot, 2)
    assert int(cache.lengths[slot]) == 2
    assert torch.equal(cache.k, before)  # data untouched; positions >= 2 are simply no longer committed
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(slot, 3)  # cannot roll forward
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(slot, -1)


def test_rollback_many_is_rollback_of_each_slot():
    cache = _cache()
    slots = [cache.allocate() for _ in range(2)]
    cache.lengths[slots] = torch.tensor([5, 3])
    before = cache.k.clone()
    cache.rollback_many(slots, [2, 3])
    assert cache.lengths[slots].tolist() == [2, 3] and torch.equal(cache.k, before)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback_many(slots, [1, 4])       # cannot roll forward
    assert cache.lengths[slots].tolist() == [2, 3]            # nothing written on a refusal
    cache.free(slots[1])
    with pytest.raises(ValueError, match="not allocated"):
        cache.rollback_many(slots, [1, 1])


def test_write_runs_matches_general_write():
    a, b = _cache(), _cache()
    for cache in (a, b):
        cache.allocate(), cache.allocate()
    k, v = _kv(2, 3, 1.0), _kv(2, 3, 5.0)
    a.write_runs(1, [1, 0], [2, 4], k, v)
    b.write(1, torch.tensor([1, 0]), torch.tensor([[2, 3, 4], [4, 5, 6]]), k, v)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert torch.equal(a.k[1, 1, :, 2:5], k[0])
    assert torch.equal(a.v[1, 0, :, 4:7], v[1])
    assert a.k[0].abs().sum() == 0  # other layers untouched


def test_write_past_capacity_is_refused():
    cache = _cache()
    cache.allocate()
    with pytest.raises(CacheFullError):
        cache.check_capacity([MAX_LEN - 2], 3)
    with pytest.raises(CacheFullError):
        cache.write(0, torch.tensor([0]), torch.tensor([[MAX_LEN]]), _kv(1, 1, 0.0), _kv(1, 1, 0.0))
    cache.check_capacity([MAX_LEN - 3], 3)  # exactly full is fine


def test_read_is_a_view_for_consecutive_slots_and_a_gather_otherwise():
    cache = _cache()
    for _ in range(SLOTS):
        cache.allocate()
    for slot in range(SLOTS):
        cache.write_runs(0, [slot], [0], _kv(1, 4, 10.0 * slot), _kv(1, 4, -10.0 * slot))
    k, v = cache.read(0, [1, 2], 3)
    assert k.shape == (2, HEADS, 3, DIM)
    assert k.data_ptr() == cache.k[0, 1].data_ptr()  # consecutive slots: no copy
    assert torch.equal(k[1], cache.k[0, 2, :, :3])
    k, v = cache.read(0, [2, 0], 3)
    assert torch.equal(k[0], cache.k[0, 2, :, :3]) and torch.equal(k[1], cache.k[0, 0, :, :3])
    assert torch.equal(v[1], cache.v[0, 0, :, :3])


def test_compact_keeps_the_accepted_tree_path():
    cache = _cache()
    slot = cache.allocate()
    # prefix of 2 committed positions, then a tree of 5 nodes written at 2..6
    cache.write_runs(0, [slot], [0], _kv(1, 7, 0.0), _kv(1, 7, 50.0))
    cache.write_runs(1, [slot], [0], _kv(1, 7, 1000.0), _kv(1, 7, 2000.0))
    cache.lengths[slot] = 7
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.compact(slot, start=2, keep=[0, 2, 4])  # root, node 2, node 4
    assert int(cache.lengths[slot]) == 5
    for layer in range(LAYERS):
        assert torch.equal(cache.k[layer, slot, :, :2], before_k[layer, slot, :, :2])  # prefix untouched
        for j, node in enumerate([0, 2, 4]):
            assert torch.equal(cache.k[layer, slot, :, 2 + j], before_k[layer, slot, :, 2 + node])
            assert torch.equal(cache.v[layer, slot, :, 2 + j], before_v[layer, slot, :, 2 + node])


def test_compact_identity_and_empty_path():
    cache = _cache()
    slot = cache.allocate()
    cache.write_runs(0, [slot], [0], _kv(1, 4, 3.0), _kv(1, 4, 4.0))
    cache.lengths[slot] = 4
    before = cache.k.clone()
    cache.compact(slot, 1, torch.tensor([0, 1]))  # already a chain: nothing moves
    assert torch.equal(cache.k, before) and int(cache.lengths[slot]) == 3
    cache.compact(slot, 1, [])
    assert int(cache.lengths[slot]) == 1


def test_compact_out_of_range_is_refused():
    cache = _cache()
    slot = cache.allocate()
    with pytest.raises(ValueError, match="out of range"):
        cache.compact(slot, MAX_LEN - 1, [0, 1])


def test_compact_many_is_compact_of_each_slot():
    """Several slots' paths at once (overlapping moves within a slot, a chain that moves nothing, an empty
    path) leave the cache as one compact() per slot does."""
    one, many = _cache(), _cache()
    for cache in (one, many):
        slots = [cache.allocate() for _ in range(SLOTS)]
        for layer in range(LAYERS):
            cache.write_runs(layer, slots, [0] * SLOTS, _kv(SLOTS, 7, 10.0 * layer),
                             _kv(SLOTS, 7, 5.0 + layer))
        cache.lengths[slots] = 7
    starts, keeps = [1, 2, 3], [[0, 1, 3, 5], [0, 1, 2], []]
    for slot, start, keep in zip(slots, starts, keeps, strict=True):
        one.compact(slot, start, keep)
    many.compact_many(slots, starts, keeps)
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)
    assert one.lengths.tolist() == many.lengths.tolist() == [5, 5, 3]
    with pytest.raises(ValueError, match="out of range"):
        many.compact_many([slots[0]], [MAX_LEN - 1], [[0, 1]])
