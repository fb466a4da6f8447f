"""The disk tier with the real model's snapshots: frozen latent blocks are handed to the
store as they are, hashed once per process, shared again when read back, and the files
keep format ``ling3-rknn-prefix-snapshot/1`` (a cache directory written before the disk
tier had its own class still loads). The cache's own failure modes are in
tests/test_engine_prefix_cache.py."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ling3_rknn.engine.cache import snapshot_store
from ling3_rknn.engine.cache.prefix_cache import PrefixCache
from ling3_rknn.engine.cache.snapshot_store import SnapshotStore, arrays_checksum
from ling3_rknn.model import Model
from ling3_rknn.model.snapshot_arrays import BLOCK_TOKENS, RowBlocks

IDS = [int(t) for t in np.random.default_rng(3).integers(0, 256, size=2 * BLOCK_TOKENS + 150)]
SHORT = BLOCK_TOKENS + 100  # a: one frozen block per MLA layer; b (all of IDS): two


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Model:
    return Model.from_hf(tiny_model_dir)


@pytest.fixture(scope="module")
def two_turns(model):
    """Snapshots after SHORT tokens and after all of IDS, of one state (so they share the
    first frozen block of every latent cache), with their last logits rows."""
    state = model.new_state()
    first = model.forward(IDS[:SHORT], state, last_only=True)[-1]
    a = state.snapshot()
    second = model.forward(IDS[SHORT:], state, last_only=True)[-1]
    return (a, first), (state.snapshot(), second)


def cache(model, directory, **kw) -> PrefixCache:
    return PrefixCache(
        10**9,
        store=SnapshotStore(directory, "fp"),
        to_arrays=lambda s: s.blocked_arrays(),
        from_arrays=model.snapshot_from_arrays,
        background_writes=False,
        **kw,
    )


def test_blocks_are_hashed_once_and_read_back_as_the_same_arrays(model, two_turns, tmp_path,
                                                                 monkeypatch):
    (a, first), (b, second) = two_turns
    hashed = []
    block_hash = snapshot_store.block_hash

    def counting(block):
        hashed.append(len(block))
        return block_hash(block)

    monkeypatch.setattr(snapshot_store, "block_hash", counting)
    store = SnapshotStore(tmp_path, "fp")
    layers = len(model.config.mla_layers)
    store.write(tuple(IDS[:SHORT]), first, a.blocked_arrays())
    store.write(tuple(IDS), second, b.blocked_arrays())
    # b's first block in each layer is a's, handed over as the same object: hashed once
    assert hashed == [BLOCK_TOKENS] * (2 * layers)
    assert len(list((tmp_path / "blocks").iterdir())) == 2 * layers

    (index_a, index_b) = sorted(store.scan(), key=lambda e: len(e.tokens))
    for loaded, snap in ((store.load(index_a), a), (store.load(index_b), b)):
        for name, value in snap.blocked_arrays().items():
            got = loaded.state[name]
            if isinstance(value, RowBlocks):  # the live blocks themselves, not copies
                assert isinstance(got, RowBlocks)
                assert all(x is y for x, y in zip(got.frozen, value.frozen, strict=True))
                np.testing.assert_array_equal(got.partial, value.partial)
            else:
                np.testing.assert_array_equal(got, value)

    # Another process (a fresh store) reads and verifies every block from its file, once:
    # the snapshot it loads second shares the blocks of the first.
    hashed.clear()
    fresh = SnapshotStore(tmp_path, "fp")
    loaded_a, loaded_b = (fresh.load(e) for e in (index_a, index_b))
    assert hashed == [BLOCK_TOKENS] * (2 * layers)
    for name, value in loaded_b.state.items():
        if isinstance(value, RowBlocks):
            assert value.frozen[0] is loaded_a.state[name].frozen[0]


def test_restored_snapshots_equal_the_originals_and_share_their_blocks(model, two_turns,
                                                                       tmp_path):
    (a, first), (b, second) = two_turns
    c = cache(model, tmp_path)
    c.insert(IDS[:SHORT], a, first)
    c.insert(IDS, b, second)
    c.close()

    fresh = cache(model, tmp_path)
    hit_b, hit_a = fresh.lookup(IDS), fresh.lookup(IDS[:SHORT])
    assert (hit_b.depth, hit_a.depth) == (len(IDS), SHORT)
    for hit, snap, row in ((hit_a, a, first), (hit_b, b, second)):
        got, want = hit.snapshot.to_arrays(), snap.to_arrays()
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        np.testing.assert_array_equal(hit.logits, row)
    shared = {id(x): x.nbytes for s in (hit_a.snapshot, hit_b.snapshot)
              for x in s.shared_blocks()}
    assert len(shared) == 2 * len(model.config.mla_layers)  # a's blocks are b's first ones
    want_bytes = (a.private_nbytes + b.private_nbytes + sum(shared.values())
                  + first.nbytes + second.nbytes)
    assert fresh.counters().bytes_held == want_bytes


# -- format /1, spelled out independently of the store's own code ----------------------


def write_v1(directory, fingerprint: str, tokens: tuple[int, ...], logits: np.ndarray,
             state: dict[str, np.ndarray]) -> None:
    """A snapshot file as format /1 lays it out: every ``*.latent`` array of 256 rows or
    more cut into 256-row blocks under ``blocks/<sha256>.blk``, the remaining rows in the
    file under ``state.<name>``; checksum over the arrays plus the block list."""
    arrays = {"tokens": np.asarray(tokens, np.int64), "logits": logits}
    blocks = {}
    (directory / "blocks").mkdir(exist_ok=True)
    for name, a in state.items():
        if name.endswith(".latent") and len(a) >= 256:
            full = len(a) // 256 * 256
            hashes = []
            for i in range(0, full, 256):
                rows = np.ascontiguousarray(a[i : i + 256])
                h = hashlib.sha256(f"{rows.dtype.str}|{rows.shape}|".encode())
                h.update(rows.tobytes())
                hashes.append(h.hexdigest())
                (directory / "blocks" / f"{h.hexdigest()}.blk").write_bytes(rows.tobytes())
            blocks[name] = {"dtype": a.dtype.str, "cols": a.shape[1], "hashes": hashes}
            a = a[full:]
        arrays[f"state.{name}"] = np.asarray(a, order="C")
    blocks_json = json.dumps(blocks, sort_keys=True)
    checksum = hashlib.sha256((arrays_checksum(arrays) + blocks_json).encode()).hexdigest()
    name = hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:40]
    save_file(arrays, str(directory / f"{name}.l3snap"), metadata={
        "format": "ling3-rknn-prefix-snapshot/1", "fingerprint": fingerprint,
        "checksum": checksum, "blocks": blocks_json,
    })


def file_contents(directory) -> dict[str, object]:
    """Every file's tensors and metadata, and every block's bytes, by name."""
    found: dict[str, object] = {}
    for path in sorted(directory.glob("*.l3snap")):
        with safe_open(str(path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            found[path.name] = (f.metadata(), tensors)
    for path in sorted((directory / "blocks").iterdir()):
        found[path.name] = path.read_bytes()
    return found


def test_files_keep_format_1_both_ways(model, two_turns, tmp_path):
    (a, first), (b, second) = two_turns
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    for key, snap, row in ((IDS[:SHORT], a, first), (IDS, b, second)):
        write_v1(old, "fp", tuple(int(t) for t in key), row, snap.to_arrays())
    c = cache(model, new)
    c.insert(IDS[:SHORT], a, first)
    c.insert(IDS, b, second)
    want, got = file_contents(old), file_contents(new)
    assert want.keys() == got.keys()
    for name, value in want.items():
        if isinstance(value, bytes):
            assert got[name] == value
        else:
            (meta, tensors), (got_meta, got_tensors) = value, got[name]
            assert got_tensors.keys() == tensors.keys()
            for k in tensors:
                assert got_tensors[k].dtype == tensors[k].dtype, k
                np.testing.assert_array_equal(got_tensors[k], tensors[k], err_msg=k)
            assert got_meta == meta

    from_old = cache(model, old)  # a directory written in format /1 loads as it was
    assert from_old.counters().entries == 2
    hit = from_old.lookup(IDS)
    assert hit is not None and hit.depth == len(IDS)
    for name, value in b.to_arrays().items():
        np.testing.assert_array_equal(hit.snapshot.to_arrays()[name], value)
    assert from_old.counters().disk_errors == 0


def test_a_block_of_the_wrong_shape_is_refused_by_the_model(model, two_turns, tmp_path):
    """A file whose blocks are not the model's block size (another writer's): the store's
    checks pass, the model refuses it, the file is dropped and counted as an error."""
    (_, _), (b, second) = two_turns
    flat = b.to_arrays()
    latent = next(k for k in flat if k.endswith(".latent"))
    rows = flat[latent]
    halves = {**b.blocked_arrays(),
              latent: RowBlocks(tuple(rows[i : i + 128] for i in range(0, 512, 128)),
                                rows[512:])}
    SnapshotStore(tmp_path, "fp").write(tuple(IDS), second, halves)
    fresh = cache(model, tmp_path)
    assert fresh.lookup(IDS) is None
    assert fresh.counters().disk_errors == 1
    assert list(tmp_path.glob("*.l3snap")) == []
