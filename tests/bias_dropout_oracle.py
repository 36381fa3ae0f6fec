"""NumPy float64 reference for the positional bias (``pse``, ALiBi) and dropout of
``flash_attention_score`` (spec/attention_bias_dropout.md).

Written from the spec alone, never from the library code:
- ``classify_pse``: which form of section 2.1 a ``pse`` shape is (or None when not accepted);
- ``bias_index`` / ``alibi_grids``: where every score-grid position reads its bias (flat index
  into ``pse``, -1 = no bias) and the ALiBi distances, including the TND packed forms, the
  compressed 1024-row form, the start offsets and the mode-8 rule (offsets on sequence 0 only);
- ``threefry2x32``: Threefry-2x32-20 (Random123) on uint32 arrays; ``keep_mask``: the section 3.3
  keep mask; ``pack_bits``/``unpack_bits``: the section 3.2 byte layout;
- ``run``: forward (section 2 score, masking, softmax, dropout of 3.1) and the closed-form
  backward of section 4 (dq, dk, dv, dpse / dslope), all float64.

Masks, layouts and head counts come from ``attention_oracle`` (itself spec-only). The score grid
is the one of ``attention_oracle``: (B, N1, Sq, Skv) per batch, and for TND one packed "batch"
(1, N1, Tq, Tkv) whose cross-sequence positions are masked. Nothing here imports JAX or jax_rope.
"""

import math

import numpy as np

import attention_oracle as ao

FLOAT32_LOWEST = ao.FLOAT32_LOWEST
FLOAT32_MAX = ao.FLOAT32_MAX
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
KS_PARITY = 0x1BD11BDA
COMPRESSED_ROWS = 1024


# ----------------------------------------------------------------------------------------
# Geometry of a call
# ----------------------------------------------------------------------------------------

class Geometry:
    """Sizes of one call. ``segments``: (grid batch, sequence b, q0, kv0, Sq_b, Skv_b) where
    (q0, kv0) is the sequence's corner in the score grid (non-TND: one per batch at (0, 0))."""

    def __init__(self, query, key, *, input_layout="BSND", head_num=None, actual_seq_qlen=None,
                 actual_seq_kvlen=None, **_):
        self.layout = input_layout
        self.n1, self.n2, self.d = ao.head_counts(query, key, input_layout, head_num)
        q4 = np.shape(ao.to_bnsd(np.zeros(np.shape(query)), input_layout, self.n1))
        k4 = np.shape(ao.to_bnsd(np.zeros(np.shape(key)), input_layout, self.n2))
        self.grid = (q4[0], self.n1, q4[2], k4[2])
        self.varlen = input_layout == "TND"
        if self.varlen:
            self.seq_q = ao.seq_lens(actual_seq_qlen)
            self.seq_kv = ao.seq_lens(actual_seq_kvlen)
            self.batch = len(self.seq_q)
            cq = [0] + ao.cumulative(self.seq_q)
            ckv = [0] + ao.cumulative(self.seq_kv)
            self.segments = [(0, b, cq[b], ckv[b], self.seq_q[b], self.seq_kv[b])
                             for b in range(self.batch)]
        else:
            self.batch = q4[0]
            self.sq, self.skv = q4[2], k4[2]
            self.seq_q = [self.sq] * self.batch
            self.seq_kv = [self.skv] * self.batch
            self.segments = [(b, b, 0, 0, self.sq, self.skv) for b in range(self.batch)]


def local_ij(lq, lkv):
    i, j = np.meshgrid(np.arange(lq), np.arange(lkv), indexing="ij")
    return i.astype(np.int64), j.astype(np.int64)


# ----------------------------------------------------------------------------------------
# pse shapes (section 2.1)
# ----------------------------------------------------------------------------------------

def classify_pse(shape, pse_type, geom):
    """The form of a pse shape: "full", "row", "compressed", "packed_full", "packed_row",
    "slopes", or None when section 2.1 does not accept it."""
    shape = tuple(int(s) for s in shape)
    n1, b = geom.n1, geom.batch
    if pse_type in (2, 3):
        return "slopes" if shape in ((n1,), (b, n1)) else None
    if geom.varlen:
        if len(shape) == 1:
            if shape[0] == n1 * sum(a * c for a, c in zip(geom.seq_q, geom.seq_kv)):
                return "packed_full"
            if shape[0] == n1 * sum(geom.seq_kv):
                return "packed_row"
            return None
        if (len(shape) == 4 and shape[0] in (1, b) and shape[1] == n1
                and shape[2] == COMPRESSED_ROWS and shape[3] == max(geom.seq_kv, default=0)):
            return "compressed"
        return None
    if len(shape) != 4 or shape[0] not in (1, b) or shape[1] != n1 or shape[3] != geom.skv:
        return None
    if shape[2] == geom.sq:
        return "full"
    if shape[2] == 1:
        return "row"
    if shape[2] == COMPRESSED_ROWS and geom.sq > COMPRESSED_ROWS:
        return "compressed"
    return None


def bias_index(pse_shape, form, geom):
    """int64 grid (Bg, N1, Sqg, Skvg): the flat index into pse that each score position reads
    (types 0/1), -1 where it reads nothing (bias 0: other sequences, compressed d < -1023)."""
    idx = np.full(geom.grid, -1, dtype=np.int64)
    n1 = geom.n1
    for gb, b, q0, kv0, lq, lkv in geom.segments:
        if lq == 0 or lkv == 0:
            continue
        i, j = local_ij(lq, lkv)
        for n in range(n1):
            if form in ("full", "row"):
                bp, _, rows, cols = pse_shape
                bb = 0 if bp == 1 else b
                r = np.zeros_like(i) if rows == 1 else i
                flat = ((bb * n1 + n) * rows + r) * cols + j
            elif form == "compressed":
                bp, _, rows, w = pse_shape
                bb = 0 if bp == 1 else b
                d = i - j
                row = np.where(d >= 0, rows - 1, rows - 1 + d)
                col = np.where(d >= 0, w - 1 - d, w - 1)
                flat = np.where(d >= -(rows - 1), ((bb * n1 + n) * rows + row) * w + col, -1)
            elif form == "packed_full":
                c_b = sum(a * c for a, c in zip(geom.seq_q[:b], geom.seq_kv[:b]))
                flat = n1 * c_b + (n * lq + i) * lkv + j
            elif form == "packed_row":
                k_b = sum(geom.seq_kv[:b])
                flat = n1 * k_b + n * lkv + j
            else:
                raise AssertionError(form)
            idx[gb, n, q0:q0 + lq, kv0:kv0 + lkv] = flat
    return idx


def offsets_of(b, geom, sparse_mode, q_start_idx, kv_start_idx):
    """(q_start, kv_start) of sequence b: TND mode 8 uses them on sequence 0 only."""
    if geom.varlen and sparse_mode == 8 and b != 0:
        return 0, 0
    return int(q_start_idx), int(kv_start_idx)


def alibi_grids(slopes_shape, pse_type, geom, *, sparse_mode=0, q_start_idx=0, kv_start_idx=0):
    """(slope index grid int64 (-1 = none), g grid float64) with g = |dist| (type 2) or
    sqrt(|dist|) (type 3), dist = (j + kv_start) - (i + q_start)."""
    sidx = np.full(geom.grid, -1, dtype=np.int64)
    g = np.zeros(geom.grid, dtype=np.float64)
    n1 = geom.n1
    for gb, b, q0, kv0, lq, lkv in geom.segments:
        if lq == 0 or lkv == 0:
            continue
        qs, ks = offsets_of(b, geom, sparse_mode, q_start_idx, kv_start_idx)
        i, j = local_ij(lq, lkv)
        a = np.abs((j + ks) - (i + qs)).astype(np.float64)
        if pse_type == 3:
            a = np.sqrt(a)
        for n in range(n1):
            sidx[gb, n, q0:q0 + lq, kv0:kv0 + lkv] = n if len(slopes_shape) == 1 else b * n1 + n
            g[gb, n, q0:q0 + lq, kv0:kv0 + lkv] = a
    return sidx, g


def alibi_bias_f32(slopes, pse_type, geom, **offsets):
    """The ALiBi bias grid with the spec's float32 arithmetic (|dist| rounded to float32,
    float32 sqrt, one float32 multiply by -slope); 0 where no sequence. float32 array."""
    slopes = np.asarray(slopes, dtype=np.float32)
    sidx, dist = alibi_grids(slopes.shape, 2, geom, **offsets)
    a = dist.astype(np.float32)
    if pse_type == 3:
        a = np.sqrt(a)
    s = np.where(sidx >= 0, slopes.reshape(-1)[np.maximum(sidx, 0)], np.float32(0))
    return np.where(sidx >= 0, (-s).astype(np.float32) * a, np.float32(0)).astype(np.float32)


def bias_grid(pse, pse_type, geom, *, sparse_mode=0, q_start_idx=0, kv_start_idx=0):
    """float64 bias grid: P for types 0/1, -slope*g for types 2/3 (0 where nothing is read)."""
    pse = np.asarray(pse).astype(np.float64)
    form = classify_pse(pse.shape, pse_type, geom)
    assert form is not None, (pse.shape, pse_type)
    if pse_type in (2, 3):
        sidx, g = alibi_grids(pse.shape, pse_type, geom, sparse_mode=sparse_mode,
                              q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
        s = np.where(sidx >= 0, pse.reshape(-1)[np.maximum(sidx, 0)], 0.0)
        return -s * g
    idx = bias_index(pse.shape, form, geom)
    return np.where(idx >= 0, pse.reshape(-1)[np.maximum(idx, 0)], 0.0)


# ----------------------------------------------------------------------------------------
# Threefry-2x32-20 and the keep mask (section 3.3), packing (section 3.2)
# ----------------------------------------------------------------------------------------

def _rotl(x, r):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, c0, c1):
    """Random123 Threefry-2x32 with 20 rounds on uint32 arrays (broadcast): (y0, y1)."""
    k0 = np.asarray(k0, dtype=np.uint32)
    k1 = np.asarray(k1, dtype=np.uint32)
    x0 = np.asarray(c0, dtype=np.uint32)
    x1 = np.asarray(c1, dtype=np.uint32)
    x0, x1 = np.broadcast_arrays(x0, x1)
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(KS_PARITY))
    with np.errstate(over="ignore"):
        x0 = x0 + ks[0]
        x1 = x1 + ks[1]
        for s in range(1, 6):
            for r in range(4):
                x0 = x0 + x1
                x1 = _rotl(x1, ROTATIONS[(4 * (s - 1) + r) % 8])
                x1 = x1 ^ x0
            x0 = x0 + ks[s % 3]
            x1 = x1 + ks[(s + 1) % 3] + np.uint32(s)
    return x0.astype(np.uint32), x1.astype(np.uint32)


def keep_threshold(keep_prob):
    return int(math.floor(float(keep_prob) * 2.0 ** 32))


def keep_bits(key_words, keep_prob, r, c):
    y0, _ = threefry2x32(key_words[0], key_words[1], r, c)
    return y0.astype(np.uint64) < np.uint64(keep_threshold(keep_prob))


def keep_mask(key_words, keep_prob, q_len, kv_len, *, batch=1, heads=1, seq_q=None,
              seq_kv=None):
    """Section 3.3: bool (B, N1, Sq, Skv), True = keep; with per-sequence lengths seq_q/seq_kv
    (TND) bool (N1, Tq, Tkv), False between different sequences (Tq/Tkv default to the sums)."""
    k0, k1 = (int(w) for w in key_words)
    if seq_q is None:
        b, n, i, j = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(q_len),
                                 np.arange(kv_len), indexing="ij")
        r = ((b * heads + n) * q_len + i).astype(np.uint32)
        return keep_bits((k0, k1), keep_prob, r, j.astype(np.uint32))
    tq = sum(seq_q) if q_len is None else q_len
    tkv = sum(seq_kv) if kv_len is None else kv_len
    out = np.zeros((heads, tq, tkv), dtype=bool)
    cq = [0] + ao.cumulative(seq_q)
    ckv = [0] + ao.cumulative(seq_kv)
    for bi, (lq, lkv) in enumerate(zip(seq_q, seq_kv)):
        n, i, j = np.meshgrid(np.arange(heads), np.arange(lq), np.arange(lkv), indexing="ij")
        r = (heads * cq[bi] + n * lq + i).astype(np.uint32)
        out[:, cq[bi]:cq[bi] + lq, ckv[bi]:ckv[bi] + lkv] = keep_bits(
            (k0, k1), keep_prob, r, j.astype(np.uint32))
    return out


def element_bits(keep, *, seq_q=None, seq_kv=None):
    """Keep bits in the section 3.2 element order e (B, N1, Sq, Skv; TND per sequence
    [N1, Sq_b, Skv_b] blocks)."""
    keep = np.asarray(keep, dtype=bool)
    if seq_q is None:
        return keep.reshape(-1)
    cq = [0] + ao.cumulative(seq_q)
    ckv = [0] + ao.cumulative(seq_kv)
    parts = [keep[:, cq[b]:cq[b] + lq, ckv[b]:ckv[b] + lkv].reshape(-1)
             for b, (lq, lkv) in enumerate(zip(seq_q, seq_kv))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def packed_size(numel):
    """torch_npu's allocation: ceil(numel / 128) * 16 bytes."""
    return -(-numel // 128) * 16


def pack_bits(bits, size=None):
    """Bit e is bit (e & 7), LSB first, of byte e >> 3; tail bits 0; ``size`` bytes
    (default torch_npu's)."""
    bits = np.asarray(bits, dtype=bool).reshape(-1)
    size = packed_size(bits.size) if size is None else size
    out = np.zeros(size, dtype=np.uint8)
    for e in np.nonzero(bits)[0]:
        out[e >> 3] |= np.uint8(1 << (e & 7))
    return out


def unpack_bits(packed, numel):
    packed = np.asarray(packed, dtype=np.uint8)
    e = np.arange(numel)
    return ((packed[e >> 3] >> (e & 7)) & 1).astype(bool)


def keep_grid_from_bits(bits, geom):
    """Element-order bits -> keep grid in the score-grid shape of ``geom``."""
    bits = np.asarray(bits, dtype=bool)
    if not geom.varlen:
        return bits[:int(np.prod(geom.grid))].reshape(geom.grid)
    grid = np.zeros(geom.grid, dtype=bool)
    e0 = 0
    for gb, b, q0, kv0, lq, lkv in geom.segments:
        m = geom.n1 * lq * lkv
        grid[gb, :, q0:q0 + lq, kv0:kv0 + lkv] = bits[e0:e0 + m].reshape(geom.n1, lq, lkv)
        e0 += m
    return grid


def keep_grid(key_words, keep_prob, geom):
    """The keep mask of a call on its score grid."""
    if geom.varlen:
        return keep_mask(key_words, keep_prob, geom.grid[2], geom.grid[3], heads=geom.n1,
                         seq_q=geom.seq_q, seq_kv=geom.seq_kv)[None]
    return keep_mask(key_words, keep_prob, geom.grid[2], geom.grid[3], batch=geom.grid[0],
                     heads=geom.n1)


# ----------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------

def _score(x, bias, pse_type, scale):
    if bias is None:
        return scale * x
    if pse_type == 1:
        return scale * (x + bias)
    return scale * x + bias  # type 0, and types 2/3 whose bias is -slope * g


def run(query, key, value, dout=None, *, pse=None, pse_type=1, q_start_idx=0, kv_start_idx=0,
        keep_prob=1.0, keep=None, **kw):
    """float64 reference. ``keep``: the keep grid (score-grid shape) or None (no dropout).

    Returns dict: scores ((B, N1, Sq, Skv) or TND (N1, Tq, Tkv), masked -3.4028235e38), out
    (layout), max/sum ((B, N1, Sq) or TND (Tq, N1)), p (grid), and with ``dout`` the gradients
    dq, dk, dv (layouts) and dpse (pse's shape; None without pse)."""
    layout = kw.get("input_layout", "BSND")
    geom = Geometry(query, key, **kw)
    n1, n2 = geom.n1, geom.n2
    q4 = ao.to_bnsd(query, layout, n1)
    k4 = ao.to_bnsd(key, layout, n2)
    v4 = ao.to_bnsd(value, layout, n2)
    scale = 1.0 / np.sqrt(geom.d) if kw.get("scale") is None else float(kw["scale"])
    masks = ao._masks_for(q4, k4, layout, kw.get("sparse_mode", 0),
                          kw.get("pre_tokens", ao.INT_MAX), kw.get("next_tokens", ao.INT_MAX),
                          kw.get("atten_mask"), kw.get("prefix"), kw.get("actual_seq_qlen"),
                          kw.get("actual_seq_kvlen"))
    mask = np.stack([np.broadcast_to(m, geom.grid[1:]) for m in masks])
    kvh = ao.kv_head_index(n1, n2)
    kg, vg = k4[:, kvh], v4[:, kvh]
    x = np.einsum("bnid,bnjd->bnij", q4, kg)
    offs = dict(sparse_mode=kw.get("sparse_mode", 0), q_start_idx=q_start_idx,
                kv_start_idx=kv_start_idx)
    bias = None
    if pse is not None:
        bias = np.where(mask, 0.0, bias_grid(pse, pse_type, geom, **offs))
    raw = _score(x, bias, pse_type, scale)
    raw = np.where(mask, 0.0, raw)
    scores = np.where(mask, FLOAT32_LOWEST, raw)
    valid = ~mask.all(axis=-1) if geom.grid[3] else np.zeros(geom.grid[:3], dtype=bool)
    mx = np.where(valid, np.max(np.where(mask, -np.inf, raw), axis=-1, initial=-np.inf),
                  FLOAT32_LOWEST)
    e = np.where(mask, 0.0, np.exp(np.where(mask, 0.0, raw - np.where(valid, mx, 0.0)[..., None])))
    sm = e.sum(axis=-1)
    p = e / np.where(valid, sm, 1.0)[..., None]
    r = np.ones_like(p) if keep is None else np.asarray(keep, dtype=np.float64) / keep_prob
    z = p * r
    out4 = np.einsum("bnij,bnjd->bnid", z, vg)
    res = {"p": p, "keep_scale_grid": r, "out": ao.from_bnsd(out4, layout)}
    sm = np.where(valid, sm, FLOAT32_MAX)
    if layout == "TND":
        res.update(scores=scores[0], max=mx[0].T, sum=sm[0].T)
    else:
        res.update(scores=scores, max=mx, sum=sm)
    if dout is None:
        return res
    do4 = ao.to_bnsd(dout, layout, n1)
    dv_h = np.einsum("bnij,bnid->bnjd", z, do4)
    dz = np.einsum("bnid,bnjd->bnij", do4, vg)
    dp = dz * r
    rd = np.sum(p * dp, axis=-1, keepdims=True)
    ds = np.where(mask, 0.0, p * (dp - rd))
    dq = scale * np.einsum("bnij,bnjd->bnid", ds, kg)
    dk_h = scale * np.einsum("bnij,bnid->bnjd", ds, q4)
    dk = np.zeros_like(k4)
    dv = np.zeros_like(v4)
    for n in range(n1):
        dk[:, kvh[n]] += dk_h[:, n]
        dv[:, kvh[n]] += dv_h[:, n]
    res.update(dq=ao.from_bnsd(dq, layout), dk=ao.from_bnsd(dk, layout),
               dv=ao.from_bnsd(dv, layout), ds=ds, dpse=None)
    if pse is not None:
        res["dpse"] = pse_gradient(np.shape(pse), pse_type, geom, ds, scale, **offs)
    return res


def pse_gradient(pse_shape, pse_type, geom, ds, scale, **offs):
    """dpse of section 4 from dS (score grid): the adjoint of the bias expansion."""
    flat = np.zeros(int(np.prod(pse_shape)), dtype=np.float64)
    if pse_type in (2, 3):
        sidx, g = alibi_grids(pse_shape, pse_type, geom, **offs)
        sel = sidx >= 0
        np.add.at(flat, sidx[sel], -(ds * g)[sel])
        return flat.reshape(pse_shape)
    form = classify_pse(pse_shape, pse_type, geom)
    idx = bias_index(pse_shape, form, geom)
    sel = idx >= 0
    gs = scale * ds if pse_type == 1 else ds
    np.add.at(flat, idx[sel], gs[sel])
    return flat.reshape(pse_shape)


# ----------------------------------------------------------------------------------------
# Input builders
# ----------------------------------------------------------------------------------------

def make_pse(rng, form, pse_type, geom, *, batch_one=False, dtype=np.float32):
    """A random pse of ``form`` (batch axis 1 when batch_one). Slopes are positive, as ALiBi's."""
    n1, b = geom.n1, geom.batch
    bp = 1 if batch_one else b
    if form == "slopes":
        shape = (n1,) if batch_one else (b, n1)
        return rng.uniform(0.05, 1.0, shape).astype(np.float32)
    if form == "full":
        shape = (bp, n1, geom.sq, geom.skv)
    elif form == "row":
        shape = (bp, n1, 1, geom.skv)
    elif form == "compressed":
        shape = (bp, n1, COMPRESSED_ROWS, max(geom.seq_kv))
    elif form == "packed_full":
        shape = (n1 * sum(a * c for a, c in zip(geom.seq_q, geom.seq_kv)),)
    elif form == "packed_row":
        shape = (n1 * sum(geom.seq_kv),)
    else:
        raise AssertionError(form)
    assert classify_pse(shape, pse_type, geom) == form, (shape, form)
    return rng.standard_normal(shape).astype(dtype)


def alibi_like_compressed(rng, geom, batch_one=True, dtype=np.float32):
    """A compressed-form pse that depends on d = i - j only (the input the NPU form is meant
    for): entry [row, col] = -slope * |d| with d = (row - 1023) + (W - 1 - col), i.e. the last
    1024 rows of a (W, W) ALiBi bias when W >= 1024."""
    n1, b = geom.n1, geom.batch
    bp = 1 if batch_one else b
    w = max(geom.seq_kv)
    slopes = rng.uniform(0.05, 0.5, (bp, n1))
    row = np.arange(COMPRESSED_ROWS)[:, None]
    col = np.arange(w)[None, :]
    d = (row - (COMPRESSED_ROWS - 1)) + (w - 1 - col)
    return (-slopes[:, :, None, None] * np.abs(d)[None, None]).astype(dtype)
