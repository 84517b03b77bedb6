"""The Triton kernels behind ``triton_exact``: block attention that reads bf16/fp16 q, k, v and writes
fp32 results, so nothing the ring merges or sums is rounded to 16 bits.

    _forward   grid (q tiles, B * Hq):  online softmax over k tiles in fp32 (running max, denominator,
               unnormalised accumulator); writes out = acc / l in fp32 and the LSE (natural log),
               or merges them into the schedule's running (out, lse) in place.
    _dkdv      grid (k tiles, B * Hkv): for one k tile, loops over the q heads of its GQA group and
               over q tiles; writes dk, dv in fp32. K/V are read through the kv head index (no copy).
    _dq        grid (q tiles, B * Hq):  for one q tile, loops over k tiles; writes dq in fp32, and
               D = rowsum(dO * O) of its rows for _dkdv, which runs after it.

The backward kernels write their fp32 gradients into the caller's tensors (any strides: the
schedules' accumulator views) or, with ADD, add them to what those hold: no separate pass.

The masks (``kernels/base.py``): q row i sees k row j iff j <= i + ``offset`` when CAUSAL, with
offset 0 for "causal" and Sk - Sq for "causal_bottom_right". A sliding window's band
(``layouts/windows.py``) is CAUSAL with offset hi and, with WINDOW = 1, j >= i + ``win_lo``
(trimmed blocks: win_lo <= 0 <= hi). Each program walks its tiles in two kinds of loop: tiles
every row of which sees every column of (no mask, no bounds checks: most of the work), and the
others (the band's two edges, the ragged ends past Sq or Sk), masked:

    k tiles:      start ..... first_full ...... full_end ...... end     (forward, dq: a q tile)
    unseen (window) | masked edge | unmasked  | masked band  |  unseen (causal)

With packed documents and a window (WINDOW = 2) the window is given by global positions (PosQ,
PosK: row i sees column j iff PosK[j] >= PosQ[i] - win_left and PosK[j] <= PosQ[i] + win_right),
checked in the documents' masked tiles.

Head dims below the tile width (d = 80 runs in 128-wide tiles) mask the loads' columns.

fp16 products. FlashAttention and cuDNN round P and dS to bf16 for the tensor-core products; that
rounding is most of their gradients' error. These kernels round them to fp16 (3 more mantissa
bits) instead. fp16's 5-bit exponent needs scales, all powers of two (so every scaling is exact):
* the products' other operands are fp16 copies made by ``_to_fp16`` (one launch per call): per
  (batch, head), x * 2^e with e putting amax(|x|) in [2^14, 2^15). The forward copies V (S = QK^T
  stays bf16 x bf16); the backward copies q, k, v, dO. The copies are exact except for values
  below 2^-24 of their head's largest (fp16 subnormals).
* P is scaled by 2^15 (P <= 1), so P >= 2^-29 keeps fp16's full precision.
* dS = P (dP - D) is scaled from a bound: |dS| <= P (|dP| + |D|) <= 2 |dO|_1 max|V|. dq's rows use
  their own |dO_i|_1; dK's rows use the bound d * max|dO| (they sum over every q row), which puts
  typical dS of a row spread over n keys near 2^15 / (2^10 n): fp16 normal up to n ~ 2^20, and
  still at least bf16's precision up to n ~ 2^23.
The scales fold into multiplies the kernels do anyway (the softmax scale, the exp2's shift, the
subtraction of D, the final scale), so the loops do no extra work per element.

``UPCAST``: under ``TRITON_INTERPRET=1`` bf16 ``tl.dot`` is wrong (Triton 3.9 interpreter), so the
operands of every product (bf16 or fp16) are cast to fp32 first. A product of two 16-bit numbers
is exact in fp32, so the result is the same as the tensor-core path up to summation order.
"""
import triton
import triton.language as tl

from ..merge.fused import merge_rows

LOG2E = 1.4426950408889634  # host side: the wrapper passes scale * LOG2E
_LN2 = tl.constexpr(0.6931471805599453)  # kernels may read only constexpr globals
_LOG2E = tl.constexpr(LOG2E)
_P_SHIFT = tl.constexpr(15)  # P is rounded as P * 2^15 (P <= 1)
# dK's dS bound: |dS| 2^(e_dO + e_V) <= 2 |dO_i|_1 2^15 <= 2 * 128 * 2^15 * 2^15 = 2^38 (d <= 128)
_DK_DS_BOUND = tl.constexpr(38)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def _dot_add(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b, accumulated in the tensor-core instruction itself (no separate add)."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        result = tl.dot(a, b, acc)
    return result


@triton.jit
def _pow2(e):
    """2^e as fp32, exactly, for integer e (int32) in [-252, 254]: two factors built from their
    exponent bits, each in fp32's normal range."""
    half = e // 2
    return (((half + 127) << 23).to(tl.float32, bitcast=True)
            * ((e - half + 127) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _exponent(x):
    """The integer E with x < 2^E and x >= 2^(E-1) (x >= 0, fp32; 0 and subnormals give -126)."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126


@triton.jit
def _fp16_exponent(amax_ptr):
    """e such that amax * 2^e lies in [2^14, 2^15): the scale of ``_to_fp16``'s copy."""
    amax = tl.load(amax_ptr).to(tl.float32)
    return tl.minimum(tl.maximum(15 - _exponent(amax), -126), 126)


@triton.jit
def _pick(t, a0, a1, a2, a3):
    """The t-th (0..3) of four values of one type."""
    result = a0
    if t == 1:
        result = a1
    if t == 2:
        result = a2
    if t == 3:
        result = a3
    return result


@triton.jit
def _to_fp16(X0, X1, X2, X3, Amax, Y, batch, heads_max,
             b0, h0, m0, d0, H0, S0, o0, b1, h1, m1, d1, H1, S1, o1,
             b2, h2, m2, d2, H2, S2, o2, b3, h3, m3, d3, H3, S3, o3,
             ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Up to four [B, H_t, S_t, D] tensors X_t (one dtype; strides b_t, h_t, m_t, d_t) into the
    flat fp16 Y from element o_t (contiguous), times 2^e per (batch, head), e = ``_fp16_exponent``
    of that head's amax (``Amax``: fp32, X_t's contiguous [B, H_t] from t * batch * heads_max).
    Grid (row tiles, batch * heads_max, tensors): one launch for all of a call's copies."""
    t = tl.program_id(2)
    bh = tl.program_id(1)
    heads = _pick(t, H0, H1, H2, H3)
    seq = tl.where(bh < batch * heads, _pick(t, S0, S1, S2, S3), 0)  # past H_t: no rows
    b = bh // heads
    h = bh % heads
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    base = _pick(t, X0, X1, X2, X3) + b * _pick(t, b0, b1, b2, b3) + h * _pick(t, h0, h1, h2, h3)
    x = _load(base, rows, _pick(t, m0, m1, m2, m3), seq, dims, _pick(t, d0, d1, d2, d3), True,
              HEAD_DIM, BLOCK_D)
    y = (x.to(tl.float32) * _pow2(_fp16_exponent(Amax + t * batch * heads_max + bh))).to(tl.float16)
    _store(Y + _pick(t, o0, o1, o2, o3) + bh.to(tl.int64) * seq * HEAD_DIM, rows, HEAD_DIM, seq,
           dims, 1, y, False, HEAD_DIM, BLOCK_D)


@triton.jit
def _load(base, idx, stride, n, dims, stride_d, CHECK: tl.constexpr, HEAD_DIM: tl.constexpr,
          BLOCK_D: tl.constexpr):
    """Rows ``idx`` of a [n, HEAD_DIM] matrix as a [len(idx), BLOCK_D] tile; rows past n (when
    CHECK) and columns past HEAD_DIM read as 0."""
    ptrs = base + idx[:, None] * stride + dims[None, :] * stride_d
    if CHECK:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=idx[:, None] < n, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(idx[:, None] < n) & (dims[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store(base, idx, stride, n, dims, stride_d, value, ADD: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """``value`` into rows ``idx`` of a [n, HEAD_DIM] matrix; with ADD, added to what they hold.
    One program owns its rows (no other program of the launch touches them)."""
    ptrs = base + idx[:, None] * stride + dims[None, :] * stride_d
    if HEAD_DIM == BLOCK_D:
        inside = idx[:, None] < n
    else:
        inside = (idx[:, None] < n) & (dims[None, :] < HEAD_DIM)
    if ADD:
        value += tl.load(ptrs, mask=inside, other=0.0)
        tl.debug_barrier()  # in place: every thread has loaded before any stores (merge/fused.py)
    tl.store(ptrs, value, mask=inside)


@triton.jit
def _visible(rows, cols, seq_q, seq_k, offset, win_lo, CAUSAL: tl.constexpr,
             WINDOW: tl.constexpr):
    """True where q row sees k col, both in range (``rows``, ``cols``: broadcastable index
    grids)."""
    seen = (rows < seq_q) & (cols < seq_k)
    if CAUSAL:
        seen = seen & (cols <= rows + offset)
    if WINDOW == 1:
        seen = seen & (cols >= rows + win_lo)
    return seen


@triton.jit
def _in_window(PosQ, PosK, rows, cols, seq_q, seq_k, win_left, win_right):
    """WINDOW = 2: where the global positions of ``rows`` and ``cols`` (broadcastable index grids)
    lie within the window."""
    pos_q = tl.load(PosQ + rows, mask=rows < seq_q, other=0)
    pos_k = tl.load(PosK + cols, mask=cols < seq_k, other=0)
    return (pos_k >= pos_q - win_left) & (pos_k <= pos_q + win_right)


@triton.jit
def _visible_in_documents(row_seg, row_lim, col_seg, cols, CAUSAL: tl.constexpr):
    """Packed documents: q rows see k cols of their own segment (``row_seg`` == ``col_seg``) up
    to ``row_lim`` (causal; the row's last visible col). Rows and cols out of range carry
    segment -1 and -2. Broadcastable index grids, as in ``_visible``."""
    seen = row_seg == col_seg
    if CAUSAL:
        seen = seen & (cols <= row_lim)
    return seen


@triton.jit
def _seen_by_q_tile(rows, cols, seq_q, seq_k, offset, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
                    SegK, row_seg, row_lim, win_lo, PosQ, PosK, win_left, win_right,
                    WINDOW: tl.constexpr):
    """[M, N]: which of a q tile's ``rows`` see which k ``cols`` (the forward's and dq's tiles)."""
    if DOCS:
        col_seg = tl.load(SegK + cols, mask=cols < seq_k, other=-2)
        seen = _visible_in_documents(row_seg[:, None], row_lim[:, None], col_seg[None, :],
                                     cols[None, :], CAUSAL)
        if WINDOW == 2:
            seen = seen & _in_window(PosQ, PosK, rows[:, None], cols[None, :], seq_q, seq_k,
                                     win_left, win_right)
    else:
        seen = _visible(rows[:, None], cols[None, :], seq_q, seq_k, offset, win_lo, CAUSAL,
                        WINDOW)
    return seen


@triton.jit
def _documents_q_tile(SegQ, LimQ, CuK, rows, m0, seq_q, BLOCK_M: tl.constexpr,
                      CAUSAL: tl.constexpr):
    """With documents, for the q tile at row m0: each row's segment and causal limit, and the k
    cols [lo, hi) the tile may see: from its first row's segment's first key to its last row's
    segment's last key (causal: no further than its rows' largest limit; rows of different
    segments have unrelated limits)."""
    row_seg, row_lim = _row_segments(SegQ, LimQ, rows, seq_q)
    last = tl.minimum(m0 + BLOCK_M, seq_q) - 1
    lo = tl.load(CuK + tl.load(SegQ + m0))
    hi = tl.load(CuK + tl.load(SegQ + last) + 1)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(row_lim, 0) + 1)
    return row_seg, row_lim, lo, hi


@triton.jit
def _row_segments(SegQ, LimQ, rows, seq_q):
    """Each row's segment and causal limit (out of range: segment -1)."""
    inside = rows < seq_q
    return (tl.load(SegQ + rows, mask=inside, other=-1),
            tl.load(LimQ + rows, mask=inside, other=-1))


@triton.jit
def _q_tile_bounds(m0, seq_k, offset, win_lo, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the q tile starting at row m0: (start, first_full, full_end, end). k tiles in
    [first_full, full_end) are seen whole by every row; [start, first_full) is the window's
    masked edge, [full_end, end) the masked band and ragged end (each may be empty)."""
    full_end = seq_k // BLOCK_N * BLOCK_N
    end = seq_k
    if CAUSAL:
        full_end = tl.minimum(full_end, (m0 + offset + 1) // BLOCK_N * BLOCK_N)
        end = tl.minimum(seq_k, m0 + BLOCK_M + offset)
    start = 0
    first_full = 0
    if WINDOW == 1:  # win_lo <= 0: the tile's first row sees from column m0 + win_lo on
        start = tl.maximum(m0 + win_lo, 0) // BLOCK_N * BLOCK_N
        first_full = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + win_lo, 0), BLOCK_N) * BLOCK_N
        first_full = tl.minimum(first_full, tl.cdiv(end, BLOCK_N) * BLOCK_N)
        full_end = tl.maximum(first_full, full_end)
    return start, first_full, full_end, end


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, rows, dims, lo, hi,
                   seq_q, seq_k, offset, scale_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   UPCAST: tl.constexpr, DOCS: tl.constexpr, SegK, row_seg, row_lim, win_lo,
                   PosQ, PosK, win_left, win_right, WINDOW: tl.constexpr):
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load(k_base, cols, skn, seq_k, dims, skd, MASKED, HEAD_DIM, BLOCK_D)
        s = _dot(q, tl.trans(k), UPCAST)  # unscaled; the running max m_i is in log2 units
        if MASKED:
            seen = _seen_by_q_tile(rows, cols, seq_q, seq_k, offset, CAUSAL, DOCS, SegK, row_seg,
                                   row_lim, win_lo, PosQ, PosK, win_left, win_right, WINDOW)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # scale > 0 (validation.check_options)
        m_use = m_new  # an unmasked tile is seen whole by every row: m_new is finite
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * scale_log2 - (m_use - _P_SHIFT)[:, None])  # P * 2^15: one FMA per score
        l_i = l_i * alpha + tl.sum(p, 1)  # l and acc carry P's 2^15: out = acc / l cancels it
        v = _load(v_base, cols, svn, seq_k, dims, svd, MASKED, HEAD_DIM, BLOCK_D)  # fp16 copy
        acc = _dot_add(p.to(tl.float16), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _forward(Q, K, V, VAmax, Out, Lse, SegQ, LimQ, SegK, CuQ, CuK, PosQ, PosK,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
             sob, soh, som, sod, slb, slh, slm,
             q_heads, groups, seq_q, seq_k, offset, scale_log2, win_lo, win_left, win_right,
             CAUSAL: tl.constexpr, MERGE: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             UPCAST: tl.constexpr, DOCS: tl.constexpr, WINDOW: tl.constexpr):
    """out and LSE of one q tile, written into the fp32 Out / Lse, or with MERGE merged into the
    (out, lse) those rows hold (the schedules' running accumulator). V is ``_to_fp16``'s copy,
    with its heads' amax in ``VAmax``; q and k are the inputs. With DOCS (packed documents), the
    tile walks only the keys of its rows' segments, every tile masked (SegQ, LimQ, SegK: see
    ``triton_exact._document_rows``)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // groups
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load(Q + b * sqb + h * sqh, rows, sqm, seq_q, dims, sqd, True, HEAD_DIM, BLOCK_D)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if DOCS:
        row_seg, row_lim, lo, hi = _documents_q_tile(SegQ, LimQ, CuK, rows, m0, seq_q, BLOCK_M,
                                                     CAUSAL)
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd,
                                       rows, dims, lo, hi, seq_q, seq_k, offset, scale_log2,
                                       True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, True,
                                       SegK, row_seg, row_lim, win_lo, PosQ, PosK, win_left,
                                       win_right, WINDOW)
    else:
        start, first_full, full_end, end = _q_tile_bounds(m0, seq_k, offset, win_lo, CAUSAL,
                                                          WINDOW, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd,
                                       rows, dims, start, first_full, seq_q, seq_k, offset,
                                       scale_log2, True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D,
                                       UPCAST, False, SegK, rows, rows, win_lo, PosQ, PosK,
                                       win_left, win_right, WINDOW)
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd,
                                       rows, dims, first_full, full_end, seq_q, seq_k, offset,
                                       scale_log2, False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D,
                                       UPCAST, False, SegK, rows, rows, win_lo, PosQ, PosK,
                                       win_left, win_right, WINDOW)
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd,
                                       rows, dims, full_end, end, seq_q, seq_k, offset,
                                       scale_log2, True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D,
                                       UPCAST, False, SegK, rows, rows, win_lo, PosQ, PosK,
                                       win_left, win_right, WINDOW)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (_pow2(-_fp16_exponent(VAmax + b * (q_heads // groups) + hk)) / l_safe)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i - _P_SHIFT + tl.log2(l_safe)) * _LN2)
    out_base = Out + b * sob + h * soh
    lse_ptrs = Lse + b * slb + h * slh + rows * slm
    if MERGE:
        held = _load(out_base, rows, som, seq_q, dims, sod, True, HEAD_DIM, BLOCK_D)
        held_lse = tl.load(lse_ptrs, mask=rows < seq_q, other=0.0)
        tl.debug_barrier()  # in place: every thread has loaded before any stores (merge/fused.py)
        out, lse = merge_rows(held, held_lse, out, lse)
    _store(out_base, rows, som, seq_q, dims, sod, out, False, HEAD_DIM, BLOCK_D)
    tl.store(lse_ptrs, lse, mask=rows < seq_q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm, sdd, slm,
                cols, dims, lo, hi, seq_q, seq_k, offset, scale_log2, p_shift, dp_scale,
                delta_scale, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr, SegQ, LimQ,
                col_seg, win_lo, PosQ, PosK, win_left, win_right, WINDOW: tl.constexpr):
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load(q_base, rows, sqm, seq_q, dims, sqd, MASKED, HEAD_DIM, BLOCK_D)
        do = _load(do_base, rows, sdm, seq_q, dims, sdd, MASKED, HEAD_DIM, BLOCK_D)
        if MASKED:
            lse = tl.load(lse_base + rows * slm, mask=rows < seq_q, other=0.0)
            delta = tl.load(delta_base + rows * slm, mask=rows < seq_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows * slm)
            delta = tl.load(delta_base + rows * slm)
        lse2 = lse * _LOG2E - p_shift
        p_t = tl.exp2(_dot(k, tl.trans(q), UPCAST) * scale_log2 - lse2[None, :])  # [N, M], scaled
        if MASKED:
            if DOCS:
                row_seg, row_lim = _row_segments(SegQ, LimQ, rows, seq_q)
                seen_t = _visible_in_documents(row_seg[None, :], row_lim[None, :],
                                               col_seg[:, None], cols[:, None], CAUSAL)
                if WINDOW == 2:
                    seen_t = seen_t & _in_window(PosQ, PosK, rows[None, :], cols[:, None], seq_q,
                                                 seq_k, win_left, win_right)
            else:
                seen_t = _visible(rows[None, :], cols[:, None], seq_q, seq_k, offset, win_lo,
                                  CAUSAL, WINDOW)
            p_t = tl.where(seen_t, p_t, 0.0)
        dv = _dot_add(p_t.to(tl.float16), do, dv, UPCAST)
        ds_t = p_t * (_dot(v, tl.trans(do), UPCAST) * dp_scale - (delta * delta_scale)[None, :])
        dk = _dot_add(ds_t.to(tl.float16), q, dk, UPCAST)
    return dk, dv


@triton.jit
def _dkdv(Q, K, V, DO, QAmax, KAmax, VAmax, DOAmax, Lse, Delta, DK, DV, SegQ, LimQ, SegK, CuQ,
          CuK, PosQ, PosK, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
          sdb, sdh, sdm, sdd, slb, slh, slm, sgb, sgh, sgn, sgd, sub, suh, sun, sud,
          kv_heads, groups, seq_q, seq_k, offset, scale, scale_log2, win_lo, win_left, win_right,
          CAUSAL: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
          DOCS: tl.constexpr, WINDOW: tl.constexpr):
    """dk, dv of one k tile, written (or with ADD added) into the fp32 DK (strides sg*) and DV
    (su*); ``Lse`` and ``Delta`` (fp32, [B, Hq, Sq]) share the strides sl*.

    Q, K, V, DO are ``_to_fp16``'s copies (their heads' amax in *Amax). For head h of the GQA
    group, P is rounded as P 2^(15 + E0 - e_dO(h)) with E0 the group's least e_dO, so dv's
    products are 2^(15 + E0) dv for every head. dS is rounded as dS 2^(U - e_q(h)), where
    U = min over the group of e_dO + e_V - 23 + e_q bounds it below 2^15 (``_DK_DS_BOUND``), so
    dk's products are 2^U dk.

    dq has its own kernel, which recomputes S and dP (7 products per tile pair instead of 5).
    Adding dq here instead, by per-element fp32 atomics or by TMA reduce-add, was measured no
    faster (docs/design.md, "Measurements behind design choices"), and its sums would change from
    run to run.

    q tiles:  first ...... full_start ...... full_end ...... rows_end   (this k tile's view)
              masked band  |  unmasked        | masked: the window's edge (WINDOW = 1), the
                                                ragged end
    """
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _load(K + b * skb + hk * skh, cols, skn, seq_k, dims, skd, True, HEAD_DIM, BLOCK_D)
    v = _load(V + b * svb + hk * svh, cols, svn, seq_k, dims, svd, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = 0
    full_start = 0
    if CAUSAL:  # row r sees all of the tile iff r >= n0 + BLOCK_N - 1 - offset
        first = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
    rows_end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > seq_k:  # the ragged last k tile: every q tile masked
        full_start = rows_end
    full_start = tl.minimum(full_start, rows_end)
    full_end = tl.maximum(full_start, seq_q // BLOCK_M * BLOCK_M)
    if WINDOW == 1:  # row r sees column c only if r <= c - win_lo
        rows_end = tl.minimum(rows_end, tl.cdiv(n0 + BLOCK_N - win_lo, BLOCK_M) * BLOCK_M)
        full_start = tl.minimum(full_start, rows_end)
        full_end = tl.minimum(full_end, (n0 - win_lo + 1) // BLOCK_M * BLOCK_M)
        full_end = tl.maximum(full_start, full_end)
    col_seg = cols
    if DOCS:  # only the rows of this tile's segments, every tile masked
        col_seg = tl.load(SegK + cols, mask=cols < seq_k, other=-2)
        last = tl.minimum(n0 + BLOCK_N, seq_k) - 1
        first = tl.load(CuQ + tl.load(SegK + n0))
        rows_end = tl.load(CuQ + tl.load(SegK + last) + 1)
        full_start = rows_end
        full_end = rows_end
    e_k = _fp16_exponent(KAmax + bh)
    e_v = _fp16_exponent(VAmax + bh)
    first_head = b * kv_heads * groups + hk * groups  # the group's first q head, as b * Hq + h
    e0 = _fp16_exponent(DOAmax + first_head)
    u = e0 + _fp16_exponent(QAmax + first_head)
    for g in range(1, groups):
        e0 = tl.minimum(e0, _fp16_exponent(DOAmax + first_head + g))
        u = tl.minimum(u, _fp16_exponent(DOAmax + first_head + g)
                       + _fp16_exponent(QAmax + first_head + g))
    u = u + e_v + 15 - _DK_DS_BOUND
    for g in range(0, groups):
        h = hk * groups + g
        e_q = _fp16_exponent(QAmax + first_head + g)
        e_do = _fp16_exponent(DOAmax + first_head + g)
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        lse_base = Lse + b * slb + h * slh
        delta_base = Delta + b * slb + h * slh
        head_log2 = scale_log2 * _pow2(-e_k - e_q)
        p_shift = (e0 - e_do).to(tl.float32) + _P_SHIFT
        # ds_t = P 2^(15 + E0 - e_dO) (dP 2^(e_dO + e_V) * dp_scale - D * delta_scale)
        dp_scale = _pow2(u - e_q - _P_SHIFT - e0 - e_v)
        delta_scale = _pow2(u - e_q - _P_SHIFT - e0) * _pow2(e_do)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm,
                             sdd, slm, cols, dims, first, full_start, seq_q, seq_k, offset,
                             head_log2, p_shift, dp_scale, delta_scale, True, CAUSAL, BLOCK_M,
                             HEAD_DIM, BLOCK_D, UPCAST, DOCS, SegQ, LimQ, col_seg, win_lo, PosQ,
                             PosK, win_left, win_right, WINDOW)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm,
                             sdd, slm, cols, dims, full_start, full_end, seq_q, seq_k, offset,
                             head_log2, p_shift, dp_scale, delta_scale, False, CAUSAL, BLOCK_M,
                             HEAD_DIM, BLOCK_D, UPCAST, DOCS, SegQ, LimQ, col_seg, win_lo, PosQ,
                             PosK, win_left, win_right, WINDOW)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm,
                             sdd, slm, cols, dims, full_end, rows_end, seq_q, seq_k, offset,
                             head_log2, p_shift, dp_scale, delta_scale, True, CAUSAL, BLOCK_M,
                             HEAD_DIM, BLOCK_D, UPCAST, DOCS, SegQ, LimQ, col_seg, win_lo, PosQ,
                             PosK, win_left, win_right, WINDOW)
    _store(DK + b * sgb + hk * sgh, cols, sgn, seq_k, dims, sgd, dk * (_pow2(-u) * scale), ADD,
           HEAD_DIM, BLOCK_D)
    _store(DV + b * sub + hk * suh, cols, sun, seq_k, dims, sud, dv * _pow2(-e0 - _P_SHIFT), ADD,
           HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_tiles(dq, q, do, lse2, dp_scale, delta, k_base, v_base, skn, skd, svn, svd, rows, dims, lo,
              hi, seq_q, seq_k, offset, scale_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              UPCAST: tl.constexpr, DOCS: tl.constexpr, SegK, row_seg, row_lim, win_lo, PosQ,
              PosK, win_left, win_right, WINDOW: tl.constexpr):
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load(k_base, cols, skn, seq_k, dims, skd, MASKED, HEAD_DIM, BLOCK_D)
        v = _load(v_base, cols, svn, seq_k, dims, svd, MASKED, HEAD_DIM, BLOCK_D)
        p = tl.exp2(_dot(q, tl.trans(k), UPCAST) * scale_log2 - lse2[:, None])
        if MASKED:
            seen = _seen_by_q_tile(rows, cols, seq_q, seq_k, offset, CAUSAL, DOCS, SegK, row_seg,
                                   row_lim, win_lo, PosQ, PosK, win_left, win_right, WINDOW)
            p = tl.where(seen, p, 0.0)
        ds = p * (_dot(do, tl.trans(v), UPCAST) * dp_scale[:, None] - delta[:, None])  # scaled
        dq = _dot_add(ds.to(tl.float16), k, dq, UPCAST)
    return dq


@triton.jit
def _dq(Q, K, V, DO, QAmax, KAmax, VAmax, DOAmax, Lse, Delta, DQ, Out, SegQ, LimQ, SegK, CuQ, CuK,
        PosQ, PosK, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sdb, sdh, sdm, sdd, slb, slh, slm, sgb, sgh, sgm, sgd, sob, soh, som, sod,
        q_heads, groups, seq_q, seq_k, offset, scale, scale_log2, win_lo, win_left, win_right,
        CAUSAL: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
        DOCS: tl.constexpr, WINDOW: tl.constexpr):
    """dq of one q tile, written (or with ADD added) into the fp32 DQ (strides sg*); its k tiles
    as in the forward. It runs before ``_dkdv`` and writes that kernel's D = rowsum(dO * O) of its
    rows into ``Delta``, from the fp32 merged ``Out`` (strides so*): one read of O, no separate
    passes. Q, K, V, DO are ``_to_fp16``'s copies (their heads' amax in *Amax).

    Scales (powers of two; e_x is x's copy's exponent): S and dP come out of the products times
    2^(e_q + e_k) and 2^(e_dO + e_V). Row i's dS is rounded as dS 2^(e_dO + e_V - E_i), where
    2 |dO_i|_1 < 2^E_i (in copy units) bounds |dP - D| 2^-15, so |dS| stays below 2^15."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // groups
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load(Q + b * sqb + h * sqh, rows, sqm, seq_q, dims, sqd, True, HEAD_DIM, BLOCK_D)
    do = _load(DO + b * sdb + h * sdh, rows, sdm, seq_q, dims, sdd, True, HEAD_DIM, BLOCK_D)
    lse = tl.load(Lse + b * slb + h * slh + rows * slm, mask=rows < seq_q, other=0.0)
    o = _load(Out + b * sob + h * soh, rows, som, seq_q, dims, sod, True, HEAD_DIM, BLOCK_D)
    do32 = do.to(tl.float32)
    e_q = _fp16_exponent(QAmax + bh)
    e_do = _fp16_exponent(DOAmax + bh)
    kv_bh = b * (q_heads // groups) + hk  # the kv head, as b * Hkv + hk
    e_k = _fp16_exponent(KAmax + kv_bh)
    e_v = _fp16_exponent(VAmax + kv_bh)
    delta = tl.sum(do32 * o, 1)  # D 2^e_dO
    tl.store(Delta + b * slb + h * slh + rows * slm, delta * _pow2(-e_do), mask=rows < seq_q)
    # E_i; a nonzero row's |dO_i|_1 >= 2^-24 (fp16's least), so the floor only meets zero rows
    row_exp = tl.maximum(_exponent(2.0 * tl.sum(tl.abs(do32), 1)), -30)
    dp_scale = _pow2(-row_exp)  # dP's products are 2^(e_dO + e_V) dP: dS's scale less e_dO + e_V
    delta = delta * _pow2(e_v - row_exp)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lse2 = lse * _LOG2E
    scale_log2 = scale_log2 * _pow2(-e_q - e_k)
    if DOCS:
        row_seg, row_lim, lo, hi = _documents_q_tile(SegQ, LimQ, CuK, rows, m0, seq_q, BLOCK_M,
                                                     CAUSAL)
        dq = _dq_tiles(dq, q, do, lse2, dp_scale, delta, k_base, v_base, skn, skd, svn, svd,
                       rows, dims, lo, hi, seq_q, seq_k, offset, scale_log2, True, CAUSAL,
                       BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, True, SegK, row_seg, row_lim, win_lo,
                       PosQ, PosK, win_left, win_right, WINDOW)
    else:
        start, first_full, full_end, end = _q_tile_bounds(m0, seq_k, offset, win_lo, CAUSAL,
                                                          WINDOW, BLOCK_M, BLOCK_N)
        dq = _dq_tiles(dq, q, do, lse2, dp_scale, delta, k_base, v_base, skn, skd, svn, svd,
                       rows, dims, start, first_full, seq_q, seq_k, offset, scale_log2, True,
                       CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, False, SegK, rows, rows,
                       win_lo, PosQ, PosK, win_left, win_right, WINDOW)
        dq = _dq_tiles(dq, q, do, lse2, dp_scale, delta, k_base, v_base, skn, skd, svn, svd,
                       rows, dims, first_full, full_end, seq_q, seq_k, offset, scale_log2, False,
                       CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, False, SegK, rows, rows,
                       win_lo, PosQ, PosK, win_left, win_right, WINDOW)
        dq = _dq_tiles(dq, q, do, lse2, dp_scale, delta, k_base, v_base, skn, skd, svn, svd,
                       rows, dims, full_end, end, seq_q, seq_k, offset, scale_log2, True, CAUSAL,
                       BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, False, SegK, rows, rows, win_lo, PosQ,
                       PosK, win_left, win_right, WINDOW)
    # dq's products are 2^(e_dO + e_V - E_i + e_k) dq
    unscale = _pow2(row_exp) * (_pow2(-e_do - e_v) * _pow2(-e_k) * scale)
    _store(DQ + b * sgb + h * sgh, rows, sgm, seq_q, dims, sgd, dq * unscale[:, None], ADD,
           HEAD_DIM, BLOCK_D)
