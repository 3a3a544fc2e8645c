"""The Triton source of the CUDA paged decode kernel (model/triton_paged_attention.py calls it).

Left undecorated: the caller applies `triton.jit` on first use, so that Triton's interpreter
(TRITON_INTERPRET=1, how the tests run it on CPU) is chosen by the setting at that time.
No `from __future__ import annotations` here: Triton reads `tl.constexpr` off the real
annotation objects.
"""

import triton.language as tl


def paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                  stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
                  stride_table, stride_o_seq, stride_o_head, scale, window,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    start = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    t = tl.arange(0, BLOCK_SIZE)
    for b in range(start // BLOCK_SIZE, tl.cdiv(context, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_table + b).to(tl.int64)
        pos = b * BLOCK_SIZE + t
        tok_ok = (pos < context) & (pos >= start)
        offs = block * stride_k_block + t[:, None] * stride_k_token + kv_head * stride_k_head + d[None, :]
        both_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offs, mask=both_ok, other=0.0).to(tl.float32)            # [BLOCK, DIM]
        v = tl.load(v_ptr + offs, mask=both_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                     # [GROUP, BLOCK]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, axis=1))
        p = tl.exp(s - new_best[:, None])
        alpha = tl.exp(best - new_best)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
