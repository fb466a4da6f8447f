"""MLA glue that stays on the CPU: RoPE and attention over the cached latent.

Absorbed form: instead of expanding every cached latent into per-head keys and values each
step (what transformers does), the input stage pulls the query into latent space,
q_lat_h = W_kb_h^T q_nope_h, so a score is one 576-wide dot product against the cache row
[c_kv | k_rope]; the CPU returns ctx_h = sum_s p_s c_kv_s and the output stage applies
W_vb_h. The weight products are thus NPU work; the CPU only touches the cache, which it
reads in the fixed-size blocks it is stored in (see ``state.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from . import native

_QUERY_CHUNK = 64  # bounds the [T*H, context] score matrix of a long prefill piece
_GROUP_ROWS = 512  # cache rows scored together: 2 blocks, ~1.2 MB of cache, about one L2


def rope_angles(
    positions: np.ndarray, rope_dim: int, theta: float
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rope_dim / 2] for absolute ``positions`` (default RoPE, no scaling)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x_2i, x_2i+1) of ``x`` [T, ..., d_r] and keep the interleaved order.

    transformers writes the rotated pairs de-interleaved; q and k get the same permutation
    there, so scores are identical and the interleaved order is kept here.
    """
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = odd * c + even * s
    return out


# Below this many visible cache rows a decode query is not split across threads: the
# handoff (~50 us) would cost more than half the work.
SPLIT_MIN_ROWS = 2048


def mla_attention(
    q_latent: np.ndarray,
    q_rope: np.ndarray,
    blocks: Sequence[np.ndarray],
    length: int,
    scale: float,
    pool: Executor | None = None,
    parts: int = 1,
) -> np.ndarray:
    """Causal attention of the T newest tokens over a cache of ``length`` rows (them included).

    q_latent [T, H, r] (absorbed query), q_rope [T, H, d_r] (rotated); ``blocks`` hold cache
    rows [c_kv (r) | k_rope (d_r)] in order, the last one possibly partly filled. Returns the
    attention-weighted latent ctx [T, H, r]; the output stage applies W_vb.

    With a ``pool`` and ``parts`` > 1, a long cache is cut into ``parts`` ranges of rows
    scored at the same time (numpy's BLAS and ufuncs release the GIL) and the partial
    softmax states are merged, as in flash-decoding's split-K; same result up to float32
    rounding.
    """
    t_len, h, r = q_latent.shape
    q_cat = np.concatenate([q_latent, q_rope], axis=2)
    q_cat = (q_cat * np.float32(scale)).reshape(t_len * h, -1)  # rows: token-major, head-minor
    first_pos = length - t_len
    if t_len > 1:
        compiled = _prefill_compiled(q_cat, h, blocks, length, first_pos, r, pool, parts)
        if compiled is not None:
            return compiled.reshape(t_len, h, r)
    ctx = np.empty((t_len * h, r), dtype=np.float32)
    for start in range(0, t_len, _QUERY_CHUNK):
        end = min(start + _QUERY_CHUNK, t_len)
        rows = slice(start * h, end * h)
        visible = first_pos + end  # keys 0 .. visible-1 can be seen by this query chunk
        q = q_cat[rows]
        q_pos = first_pos + start + np.arange(end - start).repeat(h)
        ranges = _split(blocks, visible, first_pos + start,
                        parts if pool is not None else 1)
        if len(ranges) == 1:
            partial = _attend(q, blocks, 0, visible, q_pos, r)
        else:
            assert pool is not None
            futures = [pool.submit(_attend, q, part, key0, stop, q_pos, r)
                       for part, key0, stop in ranges[1:]]
            part, key0, stop = ranges[0]
            partial = _attend(q, part, key0, stop, q_pos, r)
            for f in futures:
                partial = _merge(partial, f.result())
        out, denom, _ = partial
        out /= denom
        ctx[rows] = out.T
    return ctx.reshape(t_len, h, r)


def _prefill_compiled(q_cat: np.ndarray, h: int, blocks: Sequence[np.ndarray], length: int,
                      first_pos: int, r: int, pool: Executor | None, parts: int
                      ) -> np.ndarray | None:
    """A prefill chunk's attention on the compiled kernel (``native.mla_prefill``), its
    16-column tiles shared out over ``pool``'s threads in equal runs (no merge: each tile
    sees all its keys); None when the kernel cannot take it (the numpy path then does)."""
    q_pos = first_pos + np.arange(len(q_cat) // h, dtype=np.int64).repeat(h)
    call = native.mla_prefill(q_cat, q_pos, blocks, length, first_pos + 1, r)
    if call is None:
        return None
    shares = min(parts if pool is not None else 1, call.tiles)
    bounds = [call.tiles * k // shares for k in range(shares + 1)]
    futures = [pool.submit(call.run, bounds[k], bounds[k + 1]) for k in range(1, shares)
               ] if pool is not None else []
    call.run(bounds[0], bounds[1])
    for f in futures:
        f.result()
    return None if call.failed else call.result()


def _split(blocks: Sequence[np.ndarray], visible: int, common: int, parts: int
           ) -> list[tuple[Sequence[np.ndarray], int, int]]:
    """Cut the first ``visible`` rows into at most ``parts`` ranges of whole blocks, as
    (blocks, first key position, end position). Every range but the last lies before
    ``common`` (keys every query of the chunk sees), so no range is fully masked for a
    query and each partial softmax has a finite max."""
    if parts < 2 or visible < SPLIT_MIN_ROWS:
        return [(blocks, 0, visible)]
    bounds = np.cumsum([0] + [len(b) for b in blocks])
    target = common // parts
    ranges: list[tuple[Sequence[np.ndarray], int, int]] = []
    first = 0
    for _ in range(parts - 1):
        # the last block boundary at or before the next equal share of the common rows
        cut = int(np.searchsorted(bounds, bounds[first] + target, side="right")) - 1
        if cut <= first or bounds[cut] > common:
            break
        ranges.append((blocks[first:cut], int(bounds[first]), int(bounds[cut])))
        first = cut
    ranges.append((blocks[first:], int(bounds[first]), visible))
    return ranges


def _merge(a: tuple[np.ndarray, np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray,
           np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two partial softmax states (ctx^T [r, n], denominator [n], max [n]) as one."""
    ctx_a, den_a, max_a = a
    ctx_b, den_b, max_b = b
    new_max = np.maximum(max_a, max_b)
    fa, fb = np.exp(max_a - new_max), np.exp(max_b - new_max)
    ctx_a *= fa
    ctx_a += ctx_b * fb
    return ctx_a, den_a * fa + den_b * fb, new_max


def _attend(
    q: np.ndarray, blocks: Sequence[np.ndarray], key0: int, visible: int, q_pos: np.ndarray,
    r: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Softmax attention state of query rows ``q`` [n*h, r+d_r] (at positions ``q_pos``)
    over the cache rows of ``blocks`` (key positions ``key0`` ..) up to position
    ``visible``, block by block (no copy of the cache). Returns the un-normalised context
    (transposed, [r, n*h]), the softmax denominator and the running max.

    One pass over the cache with a running max (the flash-attention form): each group of
    ~``_GROUP_ROWS`` rows gets its scores, exponentials and context contribution while it is
    still in the core's L2, instead of a scores pass and a second context pass that reads
    the whole cache from memory again. Measured A/B here: 3-4% less CPU at 4K and 32K
    tokens, about even at 512; the two skinny GEMMs per group are the rest (~20 GFLOP/s against
    ~36 for a square sgemm).

    Scores are kept key-major ([keys, queries]) so each block writes contiguous rows and
    both products run as (block @ q^T) and (block^T @ p): measured ~2x faster with
    OpenBLAS here than the query-major orientation for the 16-column decode case.
    """
    n_cols = q.shape[0]
    q_t = np.ascontiguousarray(q.T)
    last_pos = int(q_pos[-1])
    if last_pos == int(q_pos[0]):  # one token (decode): no mask, the compiled kernel's case
        compiled = native.mla_attend(q_t, blocks, key0, visible, r)
        if compiled is not None:
            return compiled
    ctx = np.zeros((r, n_cols), dtype=np.float32)
    part = np.empty_like(ctx)
    denom = np.zeros(n_cols, dtype=np.float32)
    run_max: np.ndarray | None = None
    count = visible - key0
    most = 3 * _GROUP_ROWS // 2 + max(len(b) for b in blocks)  # what a group can reach
    buf = np.empty((min(count, most), n_cols), dtype=np.float32)
    group: list[tuple[np.ndarray, int, int]] = []  # (rows, offset in buf, count)
    filled = 0
    pos = key0
    for i, block in enumerate(blocks):
        if pos >= visible:
            break
        n = min(block.shape[0], visible - pos)
        np.matmul(block[:n], q_t, out=buf[filled : filled + n])
        group.append((block[:n], filled, n))
        filled += n
        pos += n
        left = visible - pos if i + 1 < len(blocks) else 0
        if left and (filled < _GROUP_ROWS or left < _GROUP_ROWS // 2):
            continue  # a short remainder joins this group rather than forming its own
        scores = buf[:filled]
        if pos - 1 > int(q_pos[0]) and last_pos > int(q_pos[0]):  # future keys for some rows
            key_pos = np.arange(pos - filled, pos)
            scores[key_pos[:, None] > q_pos[None, :]] = -np.inf
        group_max = scores.max(axis=0)
        if run_max is None:  # the first group of a range: finite for every query (_split)
            run_max = group_max
        else:
            new_max = np.maximum(run_max, group_max)
            rescale = np.exp(run_max - new_max)
            ctx *= rescale
            denom *= rescale
            run_max = new_max
        scores -= run_max
        np.exp(scores, out=scores)
        denom += scores.sum(axis=0)
        for rows, off, cnt in group:
            np.matmul(rows[:, :r].T, scores[off : off + cnt], out=part)
            ctx += part
        group.clear()
        filled = 0
    assert run_max is not None
    return ctx, denom, run_max
