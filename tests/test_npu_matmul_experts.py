"""Routed experts of a prefill piece as int8 NPU matmuls (``ling3_rknn.npu.matmul_experts``).

Run on two runtimes: the numpy test double (``npu_matmul_double``: exact int32, records every
run) and the real binding over the host stand-in library (``ling3_rknn.npu.matmul``, the
product path: native B layout, ctypes, threads per core).

The accuracy bound is derived from the int8 arithmetic, not measured. Each of x and a
weight column is rounded to a multiple of its scale s = max|.| / 127, an error of at most
s / 2 = max|.| / 254. The int32 sums are exact. So one product's error is
|x^w^ - xw| <= max|x| max|w| (2 / 254 + 1 / 254^2), about 2 x 2^-8 of the two maxima, and a
K-term dot product's at most K times that (``_matmul_bound``). Through SwiGLU (silu is
1.1-Lipschitz) and the down projection, whose input is requantized per row, the bounds
chain element by element (``_expert_bound``); float32 dequantization adds ~2^-24 relative
per operation (a 1e-5 relative slack).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from npu_matmul_double import DoubleRuntime

from convert.experts_quant import (
    dequantize_matmul_experts,
    pack_matmul_experts,
    quantize_experts,
)
from convert.qmoe_graph import build_qmoe_model
from ling3_rknn.model import FloatExperts
from ling3_rknn.npu import ExpertError, QMoeExperts, matmul_abi
from ling3_rknn.npu.matmul_experts import (
    Int8MatmulExperts,
    MatmulExpertStore,
    NpuLayerExperts,
    bucket_rows,
    padded_sizes,
    plan_slots,
    quantize_rows,
)
from ling3_rknn.npu.matmul_plan import MatmulError

E, INTER, D, K = 8, 48, 64, 2  # INTER pads to 64: the padding is exercised
E_QMOE, INTER_QMOE = 16, 64  # QMoE needs the width a multiple of its block (32)
Q = 1 / 254  # half an int8 step relative to the row's / column's max
E2 = 2 * Q + Q * Q
SILU_LIPSCHITZ = 1.1  # max |d/dx x sigmoid(x)| = 1.0998
F32_SLACK = 1e-5


def _float_weights(rng, e=E, inter=INTER, d=D):
    gate = rng.normal(0, 0.05, (e, inter, d)).astype(np.float32)
    up = rng.normal(0, 0.05, (e, inter, d)).astype(np.float32)
    down = rng.normal(0, 0.05, (e, d, inter)).astype(np.float32)
    return gate, up, down


def _pack(gate, up, down) -> Int8MatmulExperts:
    e, inter, d = gate.shape
    return pack_matmul_experts(e, inter, d, lambda x: (gate[x], up[x], down[x]))


def _routing(rng, t, e=E, k=K):
    ids = np.array([rng.choice(e, k, replace=False) for _ in range(t)], np.int64).reshape(t, k)
    w = rng.random((t, k)).astype(np.float32)
    return ids, (2.5 * w / w.sum(1, keepdims=True)).astype(np.float32)


def _silu(x):
    return x / (1 + np.exp(-x))


def _matmul_bound(x, w):
    """Per (row, column) bound on |q(x) q(w) - x w| for x [n, K], w [K, m] (see above)."""
    mx = np.abs(x).max(axis=1, keepdims=True)
    mw = np.abs(w).max(axis=0, keepdims=True)
    return x.shape[1] * mx * mw * E2


def _expert_bound(x, gate, up, down):
    """(float64 output, its error bound) of one expert for rows x [n, D]."""
    x = x.astype(np.float64)
    g, u = x @ gate.T.astype(np.float64), x @ up.T.astype(np.float64)
    eg, eu = _matmul_bound(x, gate.T), _matmul_bound(x, up.T)
    act = _silu(g) * u
    e_act = SILU_LIPSCHITZ * eg * (np.abs(u) + eu) + np.abs(_silu(g)) * eu
    # the down projection sees the computed act (within e_act), requantized per row
    seen = np.abs(act) + e_act
    y = act @ down.T.astype(np.float64)
    dt = down.T.astype(np.float64)
    e_y = (seen.shape[1] * seen.max(axis=1, keepdims=True) * np.abs(dt).max(axis=0) * E2
           + e_act @ np.abs(dt))
    return y, e_y


def _reference_and_bound(x, ids, w, gate, up, down):
    out = np.zeros((len(x), x.shape[1]))
    bound = np.zeros_like(out)
    scale = np.zeros_like(out)
    for t in range(len(x)):
        for e, wt in zip(ids[t], w[t], strict=True):
            y, ey = _expert_bound(x[t:t + 1], gate[e], up[e], down[e])
            out[t] += wt * y[0]
            bound[t] += abs(wt) * ey[0]
            scale[t] += abs(wt) * np.abs(y[0])
    return out, bound + F32_SLACK * (scale + scale.max())


def _exact_int8_reference(x, ids, w, packed: Int8MatmulExperts):
    """The executor's arithmetic in float64 with exact integer products: tight."""
    d, i = packed.hidden, packed.intermediate
    dp, ip = padded_sizes(d, i)
    xq, xs = quantize_rows(x, dp)
    out = np.zeros((len(x), d))
    for t in range(len(x)):
        for e, wt in zip(ids[t], w[t], strict=True):
            c1 = xq[t].astype(np.int64) @ packed.gate_up[e].astype(np.int64)
            h = c1 * float(xs[t]) * packed.gate_up_scales[e].astype(np.float64)
            act = (_silu(h[:i]) * h[ip:ip + i]).astype(np.float32)
            aq, as_ = quantize_rows(act[None], ip)
            c2 = aq[0].astype(np.int64) @ packed.down[e].astype(np.int64)
            out[t] += wt * (c2[:d] * float(as_[0]) * packed.down_scales[e, :d])
    return out


@pytest.fixture(scope="module")
def weights():
    return _float_weights(np.random.default_rng(0))


@pytest.fixture(scope="module")
def packed(weights):
    return _pack(*weights)


def _standin_runtime():
    from ling3_rknn.npu import matmul

    try:
        return matmul.open_runtime("mock")
    except MatmulError as exc:  # no C compiler: conftest could not build the stand-in
        pytest.skip(f"the matmul stand-in is not built: {exc}")


@pytest.fixture(params=["double", "standin"])
def runtime(request):
    rt = DoubleRuntime() if request.param == "double" else _standin_runtime()
    yield rt
    rt.close()


def _executor(runtime, packed, buckets=(4, 8, 16), layers=(3,), activations=None, **kw):
    store = MatmulExpertStore(runtime, list(layers), lambda i: packed, hidden=packed.hidden,
                              intermediate=packed.intermediate,
                              num_experts=packed.num_experts, buckets=buckets, **kw)
    return store, {i: NpuLayerExperts(store, i, packed.num_experts, K,
                                      activations=activations) for i in layers}


def test_packing_is_b_per_output_channel_with_padding(weights, packed):
    gate, up, down = weights
    dp, ip = padded_sizes(D, INTER)
    assert (dp, ip) == (64, 64)
    assert packed.gate_up.shape == (E, dp, 2 * ip) and packed.down.shape == (E, ip, dp)
    # column j of B is gate row j: its scale is that row's max / 127
    np.testing.assert_allclose(packed.gate_up_scales[2, 5], np.abs(gate[2, 5]).max() / 127,
                               rtol=1e-6)
    np.testing.assert_allclose(packed.gate_up_scales[2, ip + 5], np.abs(up[2, 5]).max() / 127,
                               rtol=1e-6)
    assert not packed.gate_up[:, :, INTER:ip].any() and not packed.down[:, INTER:].any()
    g, u, dn = dequantize_matmul_experts(packed)
    for got, want in ((g, gate), (u, up), (dn, down)):  # half a step per channel
        step = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert (np.abs(got - want) <= step / 2 * (1 + 1e-5)).all()


def test_quantize_rows_is_symmetric_absmax_and_pads():
    x = np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], np.float32)
    q, s = quantize_rows(x, 32)
    assert q.shape == (2, 32) and not q[:, 3:].any()
    assert q[0, :3].tolist() == [64, -127, 32] and s[0] == pytest.approx(2 / 127)
    assert not q[1].any() and s[1] == 0


def test_bucket_rows():
    assert bucket_rows(0, (16, 32)) == []
    assert bucket_rows(5, (16, 32)) == [(0, 5, 16)]
    assert bucket_rows(17, (16, 32)) == [(0, 17, 32)]
    assert bucket_rows(70, (16, 32)) == [(0, 32, 32), (32, 32, 32), (64, 6, 16)]


@pytest.mark.parametrize("t", [1, 5, 40])
def test_executor_is_the_int8_arithmetic_exactly(runtime, weights, packed, t):
    """Grouping, buckets, padding, scales and scatter against the same arithmetic done
    token by token in float64 (only float32 rounding between them)."""
    rng = np.random.default_rng(t)
    _, layers = _executor(runtime, packed)
    x = rng.normal(size=(t, D)).astype(np.float32)
    ids, w = _routing(rng, t)
    got = layers[3].run(x, ids, w)
    want = _exact_int8_reference(x, ids, w, packed)
    assert got.shape == (t, D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("t", [3, 64])
def test_executor_within_the_int8_bound_of_the_float_experts(runtime, weights, packed, t,
                                                             capsys):
    rng = np.random.default_rng(100 + t)
    _, layers = _executor(runtime, packed)
    x = rng.normal(size=(t, D)).astype(np.float32)
    ids, w = _routing(rng, t)
    got = layers[3].run(x, ids, w)
    want, bound = _reference_and_bound(x, ids, w, *weights)
    assert (np.abs(got - want) <= bound).all(), float(np.max(np.abs(got - want) / bound))
    flt = FloatExperts(*weights, top_k=K).run(x, ids, w)
    err = float(np.linalg.norm(got - flt) / np.linalg.norm(flt))
    # typical error: four roundings in series (x, the gate/up weights, the intermediate, the
    # down weights), each uniform within +-s/2, rms s / sqrt(12) = max / (127 sqrt 12), ~0.7 %
    # of a Gaussian operand's rms at max ~ 3 sigma: ~1.4 % combined; allowed twice that
    assert err < 0.03
    with capsys.disabled():
        print(f"\n[npu experts] int8 per-channel x per-token vs float: relative L2 {err:.4f}, "
              f"worst element at {float(np.max(np.abs(got - want) / bound)):.3f} of its bound")


@pytest.mark.parametrize("t", [3, 64])
def test_compiled_activation_steps_hold_the_same_bound(runtime, weights, packed, t):
    """The model's compiled steps (moe_int8.c: one pass each, per expert's rows) in place of
    the numpy ones: the same int8 arithmetic up to where a half rounds, within the same
    derived bound of the float experts, and next to the numpy path's result."""
    from ling3_rknn.model import moe_int8, native

    if not native.available():
        pytest.skip("the compiled kernels are not built here")
    rng = np.random.default_rng(200 + t)
    _, compiled = _executor(runtime, packed, activations=moe_int8)
    _, plain = _executor(runtime, packed)
    x = rng.normal(size=(t, D)).astype(np.float32)
    ids, w = _routing(rng, t)
    got = compiled[3].run(x, ids, w)
    want, bound = _reference_and_bound(x, ids, w, *weights)
    assert (np.abs(got - want) <= bound).all(), float(np.max(np.abs(got - want) / bound))
    other = plain[3].run(x, ids, w)
    assert (np.abs(got - other) <= 2 * bound).all()


def test_executor_closer_to_float_than_the_int4_cpu_copy(runtime):
    """The CPU's int4 g32 QMoE (the decode path) is ~0.16 relative off the float experts
    (docs/performance.md); the NPU's int8 copy must be closer than that, and the two paths
    must agree within the sum of their errors."""
    rng = np.random.default_rng(5)
    gate, up, down = _float_weights(rng, E_QMOE, INTER_QMOE)
    packed = _pack(gate, up, down)
    store = MatmulExpertStore(runtime, [0], lambda i: packed, hidden=D,
                              intermediate=INTER_QMOE, num_experts=E_QMOE)
    npu = NpuLayerExperts(store, 0, E_QMOE, 4)
    qmoe = QMoeExperts(build_qmoe_model(quantize_experts(gate, up, down, 4, 32), 4)
                       .SerializeToString(), hidden_size=D, num_experts=E_QMOE, top_k=4)
    x = rng.normal(size=(64, D)).astype(np.float32)
    ids, w = _routing(rng, 64, E_QMOE, 4)
    flt = FloatExperts(gate, up, down, top_k=4).run(x, ids, w)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    got, cpu = npu.run(x, ids, w), qmoe.run(x, ids, w)
    assert rel(got, flt) < 0.03 < rel(cpu, flt)
    assert rel(got, cpu) <= rel(got, flt) + rel(cpu, flt)


def test_grouping_edge_cases(weights, packed):
    """An expert with no tokens, one past the largest bucket, all tokens on one expert."""
    rt = DoubleRuntime()
    _, layers = _executor(rt, packed, buckets=(4, 8))
    rng = np.random.default_rng(9)
    t = 19
    x = rng.normal(size=(t, D)).astype(np.float32)
    ids = np.stack([np.zeros(t, np.int64), 1 + (np.arange(t) % 3)], axis=1)  # 4..7 idle
    w = rng.random((t, K)).astype(np.float32)
    got = layers[3].run(x, ids, w)
    np.testing.assert_allclose(got, _exact_int8_reference(x, ids, w, packed), rtol=1e-4,
                               atol=1e-5)
    # expert 0 has 19 rows: runs of 8, 8 and 3 padded to 4; experts 1-3 have 6 or 7 rows
    gate_up_rows = sorted(r for r, _, n, *_ in rt.runs if n == packed.gate_up.shape[2])
    assert gate_up_rows == [4, 8, 8, 8, 8, 8]
    assert len(rt.runs) == 2 * 6  # every run has its down projection, idle experts none
    single = np.stack([np.full(t, 5), np.full(t, 6)], axis=1)  # two experts take all
    np.testing.assert_allclose(layers[3].run(x, single, w),
                               _exact_int8_reference(x, single, w, packed), rtol=1e-4,
                               atol=1e-5)
    assert layers[3].run(x[:0], ids[:0], w[:0]).shape == (0, D)


def test_a_small_group_costs_the_npu_its_bucket_not_the_largest(packed):
    """Five tokens on experts 0 and 1 with the product's buckets (16 ... 256): each of the
    four runs (two experts, two projections) computes M = 16 rows on the stand-in library
    (its own count), not 256, and the result is still the int8 arithmetic's."""
    from ling3_rknn.npu.matmul_experts import ROW_BUCKETS

    rng = np.random.default_rng(11)
    x = rng.normal(size=(5, D)).astype(np.float32)
    ids = np.tile(np.array([[0, 1]]), (5, 1))
    w = rng.random((5, K)).astype(np.float32)
    want = _exact_int8_reference(x, ids, w, packed)
    rt = _standin_runtime()
    try:
        store, layers = _executor(rt, packed, buckets=ROW_BUCKETS)
        np.testing.assert_allclose(layers[3].run(x, ids, w), want, rtol=1e-4, atol=1e-5)
        counter = rt.lib.ling3_standin_rows_run
        counter.restype, counter.argtypes = ctypes.c_int64, [matmul_abi.Context]
        computed = sum(counter(ctx.handle) for ctx in store._contexts.values())
        assert computed == 4 * ROW_BUCKETS[0]
        store.close()
    finally:
        rt.close()
    double = DoubleRuntime()
    _, layers = _executor(double, packed, buckets=ROW_BUCKETS)
    np.testing.assert_allclose(layers[3].run(x, ids, w), want, rtol=1e-4, atol=1e-5)
    assert [r[0] for r in double.runs] == [16] * 4


def test_routing_inputs_are_checked(packed):
    _, layers = _executor(DoubleRuntime(), packed)
    x = np.zeros((2, D), np.float32)
    with pytest.raises(ExpertError, match="expert ids must lie"):
        layers[3].run(x, np.array([[0, E], [1, 2]]), np.ones((2, K), np.float32))
    with pytest.raises(ExpertError, match="selected twice"):
        layers[3].run(x, np.array([[1, 1], [1, 2]]), np.ones((2, K), np.float32))


def test_experts_spread_over_cores_and_domains(packed):
    """Every layer's experts share the three cores; no domain holds more than its size."""
    each = packed.gate_up[0].nbytes + packed.down[0].nbytes
    limit = 5 * each + 16 * (64 + 128 * 4 + 64 + 64 * 4)  # 5 experts and the A and C
    rt = DoubleRuntime(domain_limit=limit)
    store, layers = _executor(rt, packed, layers=(1, 3), domain_bytes=limit)
    cores = {(i, s.core) for (i, _), s in store.slots.items()}
    assert cores == {(i, c) for i in (1, 3) for c in range(3)}
    assert max(rt.domain_bytes.values()) <= limit
    assert len(rt.domain_bytes) >= -(-2 * E * each // limit)
    assert store.domains == rt.domain_bytes
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, D)).astype(np.float32)
    ids, w = _routing(rng, 30)
    np.testing.assert_allclose(layers[1].run(x, ids, w),
                               _exact_int8_reference(x, ids, w, packed), rtol=1e-4, atol=1e-5)
    assert {r[3] for r in rt.runs} == {0, 1, 2}


def test_full_size_plan_needs_two_domains_at_least():
    """Ling-3.0-tiny: 23 layers x 128 experts, hidden 1536, width 512: ~6.9 GB of int8."""
    each = 1536 * 1024 + 512 * 1536
    slots = plan_slots([(i, e) for i in range(23) for e in range(128)], each, 2 << 20)
    per: dict[int, int] = {}
    for s in slots.values():
        per[s.domain] = per.get(s.domain, 0) + each
    assert sum(per.values()) == 23 * 128 * each > 4 << 30
    assert len(per) >= 2 and max(per.values()) + (2 << 20) <= 4 << 30
    assert {s.core for s in slots.values()} == {0, 1, 2}


def test_bad_copies_are_typed_errors(packed):
    t = packed.tensors()
    with pytest.raises(ExpertError, match="lack tensors"):
        Int8MatmulExperts.from_tensors({k: v for k, v in t.items() if k != "down"}, D, INTER)
    with pytest.raises(ExpertError, match="gate_up is"):
        Int8MatmulExperts.from_tensors({**t, "gate_up": t["gate_up"][:, :-1]}, D, INTER)
    with pytest.raises(ExpertError, match="down is int16"):
        Int8MatmulExperts.from_tensors({**t, "down": t["down"].astype(np.int16)}, D, INTER)
    with pytest.raises(ExpertError, match="finite and positive"):
        Int8MatmulExperts.from_tensors({**t, "down_scales": -t["down_scales"]}, D, INTER)
    with pytest.raises(ExpertError, match="the model's"):
        MatmulExpertStore(DoubleRuntime(), [0], lambda i: packed, hidden=D,
                          intermediate=INTER, num_experts=E + 1)
