"""The Triton kernels behind ``triton_exact``: block attention that reads bf16/fp16 q, k, v and writes
fp32 results, so nothing the ring merges or sums is rounded to 16 bits.

    _forward   grid (q tiles, B * Hq):  online softmax over k tiles in fp32 (running max, denominator,
               unnormalised accumulator); writes out = acc / l in fp32 and the LSE (natural log).
    _dkdv      grid (k tiles, B * Hkv): for one k tile, loops over the q heads of its GQA group and
               over q tiles; writes dk, dv in fp32. K/V are read through the kv head index (no copy).
    _dq        grid (q tiles, B * Hq):  for one q tile, loops over k tiles; writes dq in fp32.

The masks (``kernels/base.py``): q row i sees k row j iff j <= i + ``offset`` when CAUSAL, with
offset 0 for "causal" and Sk - Sq for "causal_bottom_right". Tiles past Sq, Sk or the head dim
(d = 80 runs in 128-wide tiles) are masked on load, so any length and head dim <= 128 works.
As in FlashAttention, the probabilities and dS are rounded to the input dtype for the tensor-core
products (the single-device kernels do the same); all sums are fp32.

``UPCAST``: under ``TRITON_INTERPRET=1`` bf16 ``tl.dot`` is wrong (Triton 3.9 interpreter), so both
operands are cast to fp32 first. A bf16 x bf16 product is exact in fp32, so the result is the same
as the tensor-core path up to summation order.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host side: the wrapper passes scale * LOG2E
_LN2 = tl.constexpr(0.6931471805599453)  # kernels may read only constexpr globals
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def _forward(Q, K, V, Out, Lse,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
             sob, soh, som, sod, slb, slh, slm,
             q_heads, groups, seq_q, seq_k, head_dim, offset, scale_log2,
             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // groups
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < head_dim
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = seq_k
    if CAUSAL:
        end = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + offset)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        k_t = tl.load(k_base + cols[None, :] * skn + dims[:, None] * skd,
                      mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        s = _dot(q, k_t, UPCAST) * scale_log2
        allowed = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn + dims[None, :] * svd,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    tl.store(Out + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, out,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(Lse + b * slb + h * slh + rows * slm, lse, mask=row_ok)


@triton.jit
def _dkdv(Q, K, V, DO, Lse, Delta, DK, DV,
          sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
          sdb, sdh, sdm, sdd, slb, slh, slm, sgb, sgh, sgn, sgd,
          kv_heads, groups, seq_q, seq_k, head_dim, offset, scale, scale_log2,
          CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """dk, dv of one k tile; ``Lse`` and ``Delta`` (fp32, [B, Hq, Sq]) share the strides sl*;
    DK and DV (fp32) share sg*."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_k
    dim_ok = dims < head_dim
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd,
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd,
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = 0
    if CAUSAL:
        first = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for g in range(0, groups):
        h = hk * groups + g
        for start in range(first, seq_q, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < seq_q
            tile = row_ok[None, :] & dim_ok[:, None]
            q_t = tl.load(Q + b * sqb + h * sqh + rows[None, :] * sqm + dims[:, None] * sqd,
                          mask=tile, other=0.0)
            do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + dims[None, :] * sdd,
                         mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            lse = tl.load(Lse + b * slb + h * slh + rows * slm, mask=row_ok, other=0.0)
            delta = tl.load(Delta + b * slb + h * slh + rows * slm, mask=row_ok, other=0.0)
            s_t = _dot(k, q_t, UPCAST) * scale_log2  # [N, M]
            allowed = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                allowed = allowed & (cols[:, None] <= rows[None, :] + offset)
            p_t = tl.where(allowed, tl.exp2(s_t - lse[None, :] * _LOG2E), 0.0)
            dv += _dot(p_t.to(do.dtype), do, UPCAST)
            dp_t = _dot(v, tl.trans(do), UPCAST)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), UPCAST)
    out_tile = col_ok[:, None] & dim_ok[None, :]
    offsets = b * sgb + hk * sgh + cols[:, None] * sgn + dims[None, :] * sgd
    tl.store(DK + offsets, dk * scale, mask=out_tile)
    tl.store(DV + offsets, dv, mask=out_tile)


@triton.jit
def _dq(Q, K, V, DO, Lse, Delta, DQ,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sdb, sdh, sdm, sdd, slb, slh, slm, sgb, sgh, sgm, sgd,
        q_heads, groups, seq_q, seq_k, head_dim, offset, scale, scale_log2,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """dq of one q tile (fp32 DQ with strides sg*)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // groups
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < head_dim
    tile = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + dims[None, :] * sdd,
                 mask=tile, other=0.0)
    lse = tl.load(Lse + b * slb + h * slh + rows * slm, mask=row_ok, other=0.0)
    delta = tl.load(Delta + b * slb + h * slh + rows * slm, mask=row_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = seq_k
    if CAUSAL:
        end = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + offset)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        k_t = tl.load(k_base + cols[None, :] * skn + dims[:, None] * skd,
                      mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        v_t = tl.load(v_base + cols[None, :] * svn + dims[:, None] * svd,
                      mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        s = _dot(q, k_t, UPCAST) * scale_log2
        allowed = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(allowed, tl.exp2(s - lse[:, None] * _LOG2E), 0.0)
        dp = _dot(do, v_t, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k_t.dtype), tl.trans(k_t), UPCAST)
    tl.store(DQ + b * sgb + h * sgh + rows[:, None] * sgm + dims[None, :] * sgd, dq * scale,
             mask=tile)
