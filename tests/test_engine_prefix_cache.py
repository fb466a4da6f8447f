"""Prefix cache: trie lookups, byte-bounded eviction, persistence and its failure modes.

The snapshots here are small array holders with the model's snapshot interface
(``nbytes``, ``to_arrays``/``from_arrays``); the real model's snapshots go through the
same cache in tests/test_engine_agent_loop.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from engine_doubles import SharesNothing
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from ling3_rknn.engine.cache.prefix_cache import PrefixCache
from ling3_rknn.engine.cache.snapshot_store import SnapshotStore, model_fingerprint
from ling3_rknn.model.snapshot_arrays import RowBlocks, joined

VOCAB = 16


@dataclass
class Snap(SharesNothing):
    value: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.value.nbytes


def snap(tag: float, size: int = 100) -> Snap:
    return Snap(np.full(size, tag, np.float32))


def row(tag: float) -> np.ndarray:
    return np.full(VOCAB, tag, np.float32)


def entry_bytes(size: int = 100) -> int:
    return size * 4 + VOCAB * 4


def to_arrays(s: Snap) -> dict[str, np.ndarray]:
    return {"value": s.value}


def from_arrays(arrays) -> Snap:
    value = arrays["value"]
    if value.dtype != np.float32:
        raise ValueError("wrong dtype")
    return Snap(value)


def make(tmp_path=None, *, max_bytes=10**6, fingerprint="fp-a", **kw) -> PrefixCache:
    store = SnapshotStore(tmp_path, fingerprint) if tmp_path is not None else None
    return PrefixCache(
        max_bytes, store=store, to_arrays=to_arrays, from_arrays=from_arrays, **kw
    )


def test_deepest_prefix_wins_and_partial_edges_do_not_match():
    c = make()
    c.insert([1, 2, 3], snap(1), row(1))
    c.insert([1, 2, 3, 4, 5], snap(2), row(2))
    c.insert([1, 2, 9], snap(3), row(3))
    hit = c.lookup([1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.depth == 5 and hit.snapshot.value[0] == 2
    hit = c.lookup([1, 2, 3, 4, 7])  # diverges inside the 4,5 edge
    assert hit.depth == 3 and hit.logits[0] == 1
    assert c.lookup([1, 2, 9]).depth == 3
    assert c.lookup([1, 2]) is None
    assert c.lookup([7]) is None
    assert c.lookup([]) is None
    counters = c.counters()
    assert (counters.lookups, counters.hits, counters.entries) == (6, 3, 3)


def test_exact_prompt_hit_returns_stored_logits():
    c = make()
    logits = np.arange(VOCAB, dtype=np.float32)
    c.insert([5, 6], snap(1), logits)
    logits[:] = -1  # the cache keeps its own copy
    hit = c.lookup([5, 6])
    assert hit.depth == 2
    np.testing.assert_array_equal(hit.logits, np.arange(VOCAB))


def test_byte_budget_evicts_lru_leaves_before_shared_prefixes():
    c = make(max_bytes=3 * entry_bytes())
    c.insert([1, 2], snap(0), row(0))  # shared header
    c.insert([1, 2, 3], snap(1), row(1))
    c.insert([1, 2, 4], snap(2), row(2))
    c.lookup([1, 2, 3])  # [1,2,4] is now the least recently used leaf
    c.lookup([1, 2])  # header used most recently, but [1,2,3] must still go before it
    c.insert([9], snap(3), row(3))
    assert c.paths() == [(1, 2), (1, 2, 3), (9,)]
    c.insert([8], snap(4), row(4))  # oldest leaf now [1,2,3]; header still kept
    assert c.paths() == [(1, 2), (8,), (9,)]
    assert c.counters().bytes_held == 3 * entry_bytes()


def test_trie_is_pruned_after_eviction():
    c = make(max_bytes=2 * entry_bytes())
    c.insert([1, 2, 3, 4], snap(1), row(1))
    c.insert([1, 2, 5, 6], snap(2), row(2))
    c.insert([7], snap(3), row(3))  # evicts [1,2,3,4]; branch node 1,2 must merge away
    assert c.paths() == [(1, 2, 5, 6), (7,)]
    assert c.lookup([1, 2, 5, 6, 0]).depth == 4
    assert c.lookup([1, 2, 3, 4]) is None


def test_snapshot_larger_than_budget_is_refused():
    c = make(max_bytes=10)
    assert not c.insert([1], snap(1), row(1))
    assert c.counters().entries == 0


def test_persisted_snapshots_reload_lazily_in_a_new_cache(tmp_path):
    c = make(tmp_path)
    c.insert([1, 2, 3], snap(1.5), row(1.5))
    c.insert([1, 2, 3, 4], snap(2.5), row(2.5))
    c.close()
    assert len(list(tmp_path.iterdir())) == 2

    fresh = make(tmp_path)
    counters = fresh.counters()
    assert (counters.entries, counters.resident_entries, counters.bytes_held) == (2, 0, 0)
    hit = fresh.lookup([1, 2, 3, 4, 5])
    assert hit.depth == 4 and hit.snapshot.value[0] == 2.5 and hit.logits[0] == 2.5
    assert fresh.counters().resident_entries == 1
    fresh.close()


def test_memory_eviction_keeps_the_disk_copy(tmp_path):
    c = make(tmp_path, max_bytes=entry_bytes(), background_writes=False)
    c.insert([1], snap(1), row(1))
    c.insert([2], snap(2), row(2))  # evicts [1] from memory; its file stays
    assert c.counters().resident_entries == 1 and c.counters().entries == 2
    hit = c.lookup([1, 5])
    assert hit.depth == 1 and hit.snapshot.value[0] == 1


def test_disk_budget_deletes_oldest_files(tmp_path):
    c = make(tmp_path, background_writes=False, max_disk_bytes=1)
    c.insert([1], snap(1), row(1))
    c.insert([2], snap(2), row(2))
    assert len(list(tmp_path.glob("*.l3snap"))) == 0  # each file alone exceeds 1 byte
    assert c.counters().entries == 2  # still served from memory


def _write_two(tmp_path) -> list:
    c = make(tmp_path, background_writes=False)
    c.insert([1, 2], snap(1), row(1))
    c.insert([1, 2, 3], snap(2), row(2))
    return sorted(tmp_path.glob("*.l3snap"), key=lambda p: p.stat().st_size)


def test_corrupt_file_is_ignored_deleted_and_falls_back(tmp_path):
    c = make(tmp_path, background_writes=False)
    c.insert([1, 2], snap(1), row(1))
    c.insert([1, 2, 3], snap(2), row(2))
    deep = SnapshotStore(tmp_path, "fp-a").path_for((1, 2, 3))
    data = bytearray(deep.read_bytes())
    data[-5] ^= 0xFF  # flip a byte inside the state array
    deep.write_bytes(bytes(data))

    fresh = make(tmp_path)
    hit = fresh.lookup([1, 2, 3, 4])
    assert hit.depth == 2 and hit.snapshot.value[0] == 1  # fell back to the shallower one
    assert not deep.exists()
    assert fresh.counters().disk_errors == 1
    assert fresh.paths() == [(1, 2)]


def test_truncated_file_is_deleted_at_start_up(tmp_path):
    _write_two(tmp_path)
    victim = SnapshotStore(tmp_path, "fp-a").path_for((1, 2, 3))
    victim.write_bytes(victim.read_bytes()[:40])
    fresh = make(tmp_path)
    assert not victim.exists()
    assert fresh.paths() == [(1, 2)]


def test_truncated_data_section_is_caught_on_first_use(tmp_path):
    _write_two(tmp_path)
    victim = SnapshotStore(tmp_path, "fp-a").path_for((1, 2, 3))
    victim.write_bytes(victim.read_bytes()[:-8])  # header intact, arrays cut short
    fresh = make(tmp_path)
    hit = fresh.lookup([1, 2, 3])
    assert hit is None or hit.depth == 2
    assert not victim.exists()


def test_foreign_fingerprint_files_are_deleted(tmp_path):
    _write_two(tmp_path)
    fresh = make(tmp_path, fingerprint="fp-other-bundle")
    assert fresh.counters().entries == 0
    assert list(tmp_path.glob("*.l3snap")) == []


def test_junk_files_and_crash_leftovers(tmp_path):
    (tmp_path / "garbage.l3snap").write_bytes(b"\x00" * 100)
    (tmp_path / "x.l3snap.123.tmp").write_bytes(b"partial")
    (tmp_path / "README.txt").write_text("not ours")
    # A well-formed safetensors file under a name that does not match its token path.
    save_file(
        {"tokens": np.array([1], np.int64), "logits": row(0)},
        str(tmp_path / "renamed.l3snap"),
        metadata={"format": "ling3-rknn-prefix-snapshot/1", "fingerprint": "fp-a",
                  "checksum": "0"},
    )
    fresh = make(tmp_path)
    assert fresh.counters().entries == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.txt"]


def test_model_rejecting_arrays_counts_as_corrupt(tmp_path):
    c = make(tmp_path, background_writes=False)
    c.insert([4], Snap(np.zeros(3, np.float64)), row(0))  # from_arrays refuses float64
    fresh = make(tmp_path)
    assert fresh.lookup([4, 4]) is None
    assert fresh.counters().disk_errors == 1
    assert list(tmp_path.glob("*.l3snap")) == []


def test_write_is_atomic_no_tmp_files_remain(tmp_path):
    c = make(tmp_path)
    for i in range(6):
        c.insert([i, i + 1], snap(i), row(i))
    c.close()
    names = os.listdir(tmp_path)
    assert all(n.endswith(".l3snap") for n in names)


def test_fingerprint_depends_on_config_and_weights():
    a = model_fingerprint({"vocab_size": 10}, "w1")
    assert a == model_fingerprint({"vocab_size": 10}, "w1")
    assert a != model_fingerprint({"vocab_size": 11}, "w1")
    assert a != model_fingerprint({"vocab_size": 10}, "w2")


def test_store_refuses_missing_store_callbacks(tmp_path):
    with pytest.raises(ValueError):
        PrefixCache(100, store=SnapshotStore(tmp_path, "x"))


def test_notes_survive_a_restart_and_a_tampered_note_drops_the_file(tmp_path):
    c = make(tmp_path, background_writes=False)
    c.insert([1, 2], snap(1), row(1), note='{"x": 1}')
    c.insert([3], snap(2), row(2))
    assert make(tmp_path).notes() == [((1, 2), '{"x": 1}')]

    path = SnapshotStore(tmp_path, "fp-a").path_for((1, 2))
    data = path.read_bytes()
    path.write_bytes(data.replace(b'{\\"x\\": 1}', b'{\\"x\\": 2}'))
    fresh = make(tmp_path)
    assert fresh.notes() == [] and fresh.paths() == [(3,)]
    assert not path.exists()


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "lookup"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=7),
        ),
        max_size=40,
    ),
    capacity=st.integers(1, 6),
)
def test_trie_agrees_with_a_brute_force_model(ops, capacity):
    """Random inserts and lookups (with evictions and trie splits/merges) against a plain
    dict of token tuples: every lookup returns the deepest held prefix."""
    c = make(max_bytes=capacity * entry_bytes())
    for op, tokens in ops:
        key = tuple(tokens)
        if op == "insert":
            c.insert(tokens, snap(len(key)), row(len(key)))
        else:
            held = set(c.paths())
            prefixes = [key[:n] for n in range(len(key), 0, -1) if key[:n] in held]
            hit = c.lookup(tokens)
            if prefixes:
                assert hit is not None and hit.depth == len(prefixes[0])
                assert hit.snapshot.value[0] == len(prefixes[0])
            else:
                assert hit is None
        assert len(c.paths()) <= capacity
        assert c.counters().bytes_held == len(c.paths()) * entry_bytes()
        assert_compact(c._root)


def assert_compact(node, depth=0):
    """Internal invariant: no empty leaves, no pass-through nodes, edges keyed correctly."""
    for first, child in node.children.items():
        assert child.edge and child.edge[0] == first and child.parent is node
        assert child.depth == depth + len(child.edge)
        assert child.entry is not None or len(child.children) >= 2
        assert_compact(child, child.depth)


@dataclass
class SharingSnap:
    """Like the model's snapshots: a private part plus latent blocks shared with others."""

    private: np.ndarray
    blocks: tuple[np.ndarray, ...]

    @property
    def private_nbytes(self) -> int:
        return self.private.nbytes

    @property
    def nbytes(self) -> int:
        return self.private.nbytes + sum(b.nbytes for b in self.blocks)

    def shared_blocks(self) -> tuple[np.ndarray, ...]:
        return self.blocks


def test_shared_blocks_are_charged_once():
    block_a = np.zeros(1000, np.float32)
    block_b = np.zeros(1000, np.float32)
    own = 100 * 4 + VOCAB * 4
    c = make(max_bytes=10**6)
    c.insert([1], SharingSnap(np.zeros(100, np.float32), (block_a,)), row(1))
    c.insert([1, 2], SharingSnap(np.zeros(100, np.float32), (block_a, block_b)), row(2))
    assert c.counters().bytes_held == 2 * own + 8000
    c2 = make(max_bytes=2 * own + 8000)  # exactly enough for both thanks to sharing
    c2.insert([1], SharingSnap(np.zeros(100, np.float32), (block_a,)), row(1))
    c2.insert([1, 2], SharingSnap(np.zeros(100, np.float32), (block_a, block_b)), row(2))
    assert c2.paths() == [(1,), (1, 2)]
    c2.insert([7], SharingSnap(np.zeros(100, np.float32), ()), row(3))  # evicts the leaf
    assert c2.paths() == [(1,), (7,)]
    assert c2.counters().bytes_held == 2 * own + 4000  # block_b freed, block_a still held


@dataclass
class LatentSnap(SharesNothing):
    """A snapshot exporting an append-only per-token array, like the model's MLA latent."""

    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    @staticmethod
    def to_arrays(s) -> dict[str, np.ndarray | RowBlocks]:
        return {"mla.3.latent": RowBlocks.from_rows(s.rows),
                "length": np.array(len(s.rows), np.int64)}

    @staticmethod
    def from_arrays(arrays) -> LatentSnap:
        latent = joined(arrays)["mla.3.latent"]
        assert int(arrays["length"]) == len(latent)
        return LatentSnap(latent)


def latent_cache(tmp_path, **kw) -> PrefixCache:
    return PrefixCache(
        10**8,
        store=SnapshotStore(tmp_path, "fp-a"),
        to_arrays=LatentSnap.to_arrays,
        from_arrays=LatentSnap.from_arrays,
        background_writes=False,
        **kw,
    )


def latent_rows(n: int) -> np.ndarray:
    return np.arange(n * 6, dtype=np.float32).reshape(n, 6)  # row k is the same for all n


def test_latent_prefix_blocks_are_stored_once_and_reassembled(tmp_path):
    c = latent_cache(tmp_path)
    c.insert([1], LatentSnap(latent_rows(600)), row(1))
    c.insert([1, 2], LatentSnap(latent_rows(700)), row(2))
    blocks = sorted((tmp_path / "blocks").iterdir())
    assert len(blocks) == 2  # rows 0-255 and 256-511, shared by both snapshots
    files = sum(p.stat().st_size for p in tmp_path.glob("*.l3snap"))
    assert c.counters().disk_bytes == files + sum(p.stat().st_size for p in blocks)

    fresh = latent_cache(tmp_path)
    np.testing.assert_array_equal(fresh.lookup([1, 2, 3]).snapshot.rows, latent_rows(700))
    np.testing.assert_array_equal(fresh.lookup([1, 5]).snapshot.rows, latent_rows(600))


def test_corrupt_or_missing_block_fails_verification(tmp_path):
    c = latent_cache(tmp_path)
    c.insert([1], LatentSnap(latent_rows(300)), row(1))
    (shared,) = (tmp_path / "blocks").iterdir()
    c.insert([1, 2], LatentSnap(latent_rows(600)), row(2))
    # not by mtime: two writes within one coarse kernel clock tick share an mtime
    (own,) = set((tmp_path / "blocks").iterdir()) - {shared}
    data = bytearray(own.read_bytes())
    data[10] ^= 0x01
    own.write_bytes(bytes(data))
    fresh = latent_cache(tmp_path)
    hit = fresh.lookup([1, 2])
    assert hit is not None and hit.depth == 1  # fell back to the intact shallower one
    assert fresh.counters().disk_errors == 1 and not own.exists() and shared.exists()
    shared.unlink()
    again = latent_cache(tmp_path)
    assert again.lookup([1]) is None
    assert list(tmp_path.glob("*.l3snap")) == []


def test_orphan_blocks_are_collected_and_dropped_files_release_blocks(tmp_path):
    c = latent_cache(tmp_path, max_disk_bytes=10**9)
    c.insert([1], LatentSnap(latent_rows(300)), row(1))
    orphan = tmp_path / "blocks" / ("0" * 64 + ".blk")
    orphan.write_bytes(b"junk")
    (tmp_path / "blocks" / "x.blk.1.tmp").write_bytes(b"partial")
    fresh = latent_cache(tmp_path, max_disk_bytes=1)  # over budget: everything goes
    assert fresh.counters().entries == 0 and fresh.counters().disk_bytes == 0
    assert list((tmp_path / "blocks").iterdir()) == []


def test_latent_of_exactly_whole_blocks_leaves_an_empty_tail(tmp_path):
    c = latent_cache(tmp_path)
    c.insert([4], LatentSnap(latent_rows(512)), row(4))
    np.testing.assert_array_equal(
        latent_cache(tmp_path).lookup([4]).snapshot.rows, latent_rows(512)
    )
