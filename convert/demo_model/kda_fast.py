"""A faster drop-in for transformers' pure-torch chunked KDA, for CPU training only.

transformers 5.24 falls back to ``chunk_kimi_delta_attention`` (a reference port of fla's
kernel) when ``flash-linear-attention`` is absent. Its backward pass is what makes CPU
training slow: the in-place row loop of the triangular solve and the per-chunk indexing
(``x[:, :, i]``) each record a ``SelectBackward`` that fills a zero tensor of the *whole*
input shape, so a backward pass writes O(chunks^2) memory (measured: 25 % of a training
step in ``fill_`` alone). This version computes the same math with the chunk-independent
parts batched (the solve by ``torch.linalg.solve_triangular``, the intra-chunk scores,
the decayed queries/keys) and the inter-chunk recurrence over ``unbind`` views, whose
backward is one ``stack``. ``python -m convert.demo_model.kda_fast`` checks it against
the reference (outputs, final state and all input gradients; torch is not in the test
venv, so this check is not part of ``make test``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, chunk_size: int = 16,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, **_kwargs: object
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same signature and result as transformers' ``chunk_kimi_delta_attention``."""
    dtype = query.dtype
    q, k, v, b, g = (x.transpose(1, 2).contiguous().float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    bsz, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q = F.pad(q, (0, 0, 0, pad)) * dk ** -0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    b = F.pad(b, (0, pad))
    n = (length + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(bsz, heads, n, chunk_size, x.shape[-1])

    k_beta = chunks(k * b.unsqueeze(-1))
    v_beta = chunks(v * b.unsqueeze(-1))
    q, k, g = chunks(q), chunks(k), chunks(g).cumsum(dim=-2)

    eye = torch.eye(chunk_size, dtype=q.dtype)
    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=1)
    diff = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf"))
    decay = diff.exp()  # [b, h, n, C, C, dk]
    lower = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    lower = lower.masked_fill(~torch.tril(torch.ones_like(upper), diagonal=-1), 0.0)
    # (I + L)^-1: the row loop of the reference, as one batched unit-triangular solve.
    solve = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False,
                                          unitriangular=True)
    u = solve @ v_beta
    w = solve @ (k_beta * g.exp())
    intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(upper, 0.0)
    q_decayed = q * g.exp()
    g_last = g[:, :, :, -1:, :]
    k_decayed = k * (g_last - g).exp()
    state_decay = g_last.squeeze(-2).exp().unsqueeze(-1)  # [b, h, n, dk, 1]

    state = (torch.zeros(bsz, heads, dk, dv, dtype=q.dtype) if initial_state is None
             else initial_state.to(q))
    outs = []
    for qd, kd, ui, wi, ai, sd in zip(
        q_decayed.unbind(2), k_decayed.unbind(2), u.unbind(2), w.unbind(2), intra.unbind(2),
        state_decay.unbind(2), strict=True,
    ):
        v_new = ui - wi @ state
        outs.append(qd @ state + ai @ v_new)
        state = state * sd + kd.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(bsz, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def check(seed: int = 0) -> float:
    """Largest relative difference to transformers' reference over the output, the final
    state and the gradients of every input (the initial state included)."""
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as reference

    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = 2, 77, 4, 16

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.requires_grad_()

    inputs = [leaf(torch.randn(b, t, h, d, generator=gen)) for _ in range(3)]
    inputs.append(leaf(-5 * torch.sigmoid(torch.randn(b, t, h, d, generator=gen))))
    inputs.append(leaf(torch.sigmoid(torch.randn(b, t, h, generator=gen))))
    state = leaf(torch.randn(b, h, d, d, generator=gen))
    weight = torch.randn(b, t, h, d, generator=gen)
    worst = 0.0
    results = []
    kernels: list[tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], int]] = [
        (reference.chunk_kimi_delta_attention, 64), (chunk_kda, 8)]
    for fn, chunk in kernels:
        out, final = fn(*inputs, chunk_size=chunk, initial_state=state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((out * weight).sum() + final.sum(), [*inputs, state])
        results.append([out, final, *grads])
    for ref, got in zip(*results, strict=True):
        worst = max(worst, ((ref - got).abs().max() / ref.abs().max()).item())
    return worst


if __name__ == "__main__":
    error = check()
    print(f"kda_fast vs transformers chunk_kimi_delta_attention: max relative error {error:.2e}")
    raise SystemExit(0 if error < 1e-4 else 1)
