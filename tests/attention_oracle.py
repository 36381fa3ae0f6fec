"""NumPy float64 reference for masked attention (spec/attention.md).

Written from the spec alone, never from the library code: the dense mask of every
``sparse_mode`` (0..8, True = masked out), layout conversion to and from (B, N, S, D), masked
softmax attention with grouped-query heads, the scores, the softmax statistics with the
"invalid line" convention for fully masked rows, and the analytic softmax backward.

The mask of one sequence is built element by element from the spec's table (``seq_mask``),
so it shares no tile logic with a kernel. Varlen (TND) inputs are handled as one packed
"batch" whose cross-sequence positions are masked, so the attention core has one shape.

The second half holds NumPy-only input builders shared by the test files (``make_case``);
nothing here imports JAX or jax_rope.
"""

import numpy as np

FLOAT32_LOWEST = float(np.finfo(np.float32).min)  # -3.4028235e38: masked score, invalid max
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38: softmax_sum of an invalid row
INT_MAX = 2147483647
SPARSE_MODES = tuple(range(9))
LAYOUTS = ("BSND", "BNSD", "BSH", "SBH", "TND")
COMPRESSED_SHAPE = (2048, 2048)
PREFIX_COMPRESSED_SHAPE = (3072, 2048)
# Modes whose geometry comes from the mode alone; a given atten_mask is the compressed one.
COMPRESSED_MODES = (2, 3, 4, 6, 7, 8)


# ----------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------

def seq_mask(mode, sq, skv, pre_tokens=INT_MAX, next_tokens=INT_MAX, *, prefix=None,
             user=None, band=False):
    """(sq, skv) bool mask of one sequence (or one batch element), True = masked.

    ``user``: this sequence's (sq, skv) window of atten_mask (modes 0 and 1), or None.
    ``prefix``: this batch element's prefix (modes 5 and 6).
    ``band``: modes 7/8 only, whether this is the band sequence (the last / first non-empty).
    Written per element from the spec's table; i is the query row, j the key column.
    """
    delta = skv - sq
    m = np.zeros((sq, skv), dtype=bool)
    for i in range(sq):
        for j in range(skv):
            if mode == 0:
                if user is None:
                    v = False
                else:
                    inside = i - pre_tokens <= j <= i + next_tokens
                    v = bool(user[i, j]) or not inside
            elif mode == 1:
                v = bool(user[i, j])
            elif mode == 2:
                v = j > i
            elif mode == 3:
                v = j > i + delta
            elif mode == 4:
                v = (j - i > next_tokens + delta) or (i - j > pre_tokens - delta)
            elif mode in (5, 6):
                v = (j > i + delta) and (j >= prefix)
            elif mode == 7:
                v = (j - i > next_tokens + delta) if band else (j > i + delta)
            elif mode == 8:
                v = (j - i > next_tokens + delta) if band else (j > i)
            else:
                raise AssertionError(f"sparse_mode {mode}")
            m[i, j] = v
    return m


def canonical_atten_mask(atten_mask):
    """A non-varlen atten_mask as bool (Bm, Nm, Sq, Skv); (Sq, Skv) becomes (1, 1, Sq, Skv)."""
    a = np.asarray(atten_mask) != 0
    if a.ndim == 2:
        a = a[None, None]
    assert a.ndim == 4, a.shape
    return a


def uses_atten_mask(mode):
    """Modes whose atten_mask carries the mask (0, 1; 5 holds the prefix mask itself)."""
    return mode in (0, 1)


def dense_mask(mode, sq, skv, pre_tokens=INT_MAX, next_tokens=INT_MAX, *, prefix=None,
               atten_mask=None, batch=None):
    """Non-varlen mask, bool (Bo, No, sq, skv): Bo is batch (or the mask's batch, or the
    prefix length, or 1) and No is the atten_mask's head count (1 without a per-head mask)."""
    am = None
    if atten_mask is not None and uses_atten_mask(mode):
        am = canonical_atten_mask(atten_mask)
        assert am.shape[-2:] == (sq, skv), (am.shape, sq, skv)
    if batch is None:
        if am is not None:
            batch = am.shape[0]
        elif prefix is not None:
            batch = len(prefix)
        else:
            batch = 1
    heads = am.shape[1] if am is not None else 1
    out = np.zeros((batch, heads, sq, skv), dtype=bool)
    for b in range(batch):
        for n in range(heads):
            user = None if am is None else am[b if am.shape[0] > 1 else 0, n]
            pb = None if prefix is None else int(prefix[b])
            out[b, n] = seq_mask(mode, sq, skv, pre_tokens, next_tokens, prefix=pb, user=user)
    return out


def seq_lens(cumulative):
    """Per-sequence lengths from cumulative ends ([2, 4, 4] -> [2, 2, 0])."""
    c = [int(x) for x in np.asarray(cumulative).reshape(-1)]
    return [b - a for a, b in zip([0] + c[:-1], c)]


def cumulative(lengths):
    return [int(x) for x in np.cumsum(lengths)]


def band_sequence(mode, lq, lkv):
    """Index of the band sequence of modes 7 (last non-empty) and 8 (first non-empty); a
    sequence is non-empty when it has query rows, whatever its key columns (the operator's
    tiling takes the first / last nonzero actualSeqQLen entry). None when all are empty."""
    idx = [b for b in range(len(lq)) if lq[b] > 0]
    if not idx:
        return None
    return idx[-1] if mode == 7 else idx[0]


def varlen_mask(mode, actual_seq_qlen, actual_seq_kvlen, pre_tokens=INT_MAX,
                next_tokens=INT_MAX, *, prefix=None, atten_mask=None, tq=None, tkv=None):
    """Varlen (TND) mask over the packed tokens, bool (tq, tkv): every position between
    different sequences is masked; sequence b uses its own Sq_b, Skv_b and, for modes 0/1,
    the top-left (Sq_b, Skv_b) window of the (maxSq, maxSkv) atten_mask."""
    lq, lkv = seq_lens(actual_seq_qlen), seq_lens(actual_seq_kvlen)
    assert len(lq) == len(lkv)
    cq, ckv = cumulative(lq), cumulative(lkv)
    tq = cq[-1] if tq is None else tq
    tkv = ckv[-1] if tkv is None else tkv
    am = None
    if atten_mask is not None and uses_atten_mask(mode):
        am = np.asarray(atten_mask) != 0
        assert am.ndim == 2, am.shape
    band_b = band_sequence(mode, lq, lkv) if mode in (7, 8) else None
    out = np.ones((tq, tkv), dtype=bool)
    q0 = kv0 = 0
    for b in range(len(lq)):
        user = None if am is None else am[:lq[b], :lkv[b]]
        pb = None if prefix is None else int(prefix[b])
        out[q0:q0 + lq[b], kv0:kv0 + lkv[b]] = seq_mask(
            mode, lq[b], lkv[b], pre_tokens, next_tokens, prefix=pb, user=user,
            band=(b == band_b))
        q0 += lq[b]
        kv0 += lkv[b]
    return out


def sparse_mask(sparse_mode, q_len, kv_len, *, pre_tokens=INT_MAX, next_tokens=INT_MAX,
                prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, atten_mask=None):
    """Reference of jr.sparse_mask: bool (B or 1, Sq, Skv), or (Tq, Tkv) when varlen."""
    if actual_seq_qlen is not None:
        return varlen_mask(sparse_mode, actual_seq_qlen, actual_seq_kvlen, pre_tokens,
                           next_tokens, prefix=prefix, atten_mask=atten_mask, tq=q_len,
                           tkv=kv_len)
    m = dense_mask(sparse_mode, q_len, kv_len, pre_tokens, next_tokens, prefix=prefix,
                   atten_mask=atten_mask)
    assert m.shape[1] == 1, "sparse_mask has no head axis: use a mask with one head"
    return m[:, 0]


def compressed_mask(mode):
    """The NPU's compressed mask for a mode: 2048x2048 ``M0[r][c] = c > r`` (modes 2, 3, 4,
    7, 8), or 3072x2048 for mode 6 (rows 0..2047 M0; rows 2048..3071 left 1024 columns 0,
    right 1024 columns 1)."""
    r = np.arange(2048)[:, None]
    c = np.arange(2048)[None, :]
    m0 = c > r
    if mode != 6:
        return m0
    tail = np.zeros((1024, 2048), dtype=bool)
    tail[:, 1024:] = True
    return np.concatenate([m0, tail], axis=0)


def band_valid(pre, nxt, sq, skv):
    """The spec's band rule on top-left tokens (pre', next')."""
    if pre < 0 and nxt < 0:
        return False
    if pre < 0 and not (nxt >= -pre and -pre < skv):
        return False
    if nxt < 0 and not (-nxt <= pre and -nxt < sq):
        return False
    return True


def to_top_left(mode, pre, nxt, sq, skv):
    """(pre', next'): mode 4 converts from the bottom-right origin, the others are as given."""
    if mode == 4:
        d = skv - sq
        return pre - d, nxt + d
    return pre, nxt


# ----------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------

def to_bnsd(x, layout, heads=None):
    """(B, N, S, D) float64 from one input in ``layout``; TND becomes (1, N, T, D).

    heads: N for BSH/SBH (the hidden axis is N * D)."""
    x = np.asarray(x).astype(np.float64)
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)
    if layout == "SBH":
        s, b, h = x.shape
        return x.reshape(s, b, heads, h // heads).transpose(1, 2, 0, 3)
    if layout == "TND":
        return x.transpose(1, 0, 2)[None]
    raise AssertionError(layout)


def from_bnsd(y, layout):
    """Inverse of to_bnsd: (B, N, S, D) to ``layout`` (TND expects B == 1)."""
    b, n, s, d = y.shape
    if layout == "BSND":
        return y.transpose(0, 2, 1, 3)
    if layout == "BNSD":
        return y
    if layout == "BSH":
        return y.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "SBH":
        return y.transpose(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "TND":
        assert b == 1
        return y[0].transpose(1, 0, 2)
    raise AssertionError(layout)


def head_counts(query, key, layout, head_num=None):
    """(N1, N2, D) of a call."""
    q, k = np.shape(query), np.shape(key)
    if layout in ("BSH", "SBH"):
        d = q[-1] // head_num
        return head_num, k[-1] // d, d
    if layout == "BNSD":
        return q[1], k[1], q[-1]
    return q[-2], k[-2], q[-1]


# ----------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------

def kv_head_index(n1, n2):
    """Query head n uses key/value head n // (N1 // N2)."""
    assert n1 % n2 == 0
    g = n1 // n2
    return np.array([n // g for n in range(n1)])


def attend(q, k, v, mask, scale):
    """Masked softmax attention of one batch element, float64.

    q (N1, Sq, D), k (N2, Skv, D), v (N2, Skv, Dv), mask bool broadcastable to (N1, Sq, Skv).
    Returns dict: scores (masked ones -3.4028235e38), p, out, max, sum (invalid rows: out 0,
    max -3.4028235e38, sum 3.4028235e38).
    """
    n1, sq, _ = q.shape
    skv = k.shape[1]
    kvh = kv_head_index(n1, k.shape[0])
    kg, vg = k[kvh], v[kvh]
    mask = np.broadcast_to(mask, (n1, sq, skv))
    raw = scale * np.einsum("nid,njd->nij", q, kg)
    scores = np.where(mask, FLOAT32_LOWEST, raw)
    valid = ~mask.all(axis=-1) if skv else np.zeros((n1, sq), dtype=bool)
    mx = np.where(valid, np.max(np.where(mask, -np.inf, raw), axis=-1, initial=-np.inf),
                  FLOAT32_LOWEST)
    e = np.where(mask, 0.0, np.exp(np.where(mask, 0.0, raw - mx[..., None])))
    sm = e.sum(axis=-1)
    p = e / np.where(valid, sm, 1.0)[..., None]
    out = np.einsum("nij,njd->nid", p, vg)
    return {"scores": scores, "p": p, "out": out, "max": mx,
            "sum": np.where(valid, sm, FLOAT32_MAX), "kv_heads": kvh}


def attend_grad(q, k, v, p, dout, scale):
    """Analytic backward of ``attend`` for one batch element, float64: (dq, dk, dv).

    dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dP * P)); dQ = scale dS K;
    dK = scale dS^T Q; GQA sums the query heads of each key/value head."""
    n1 = q.shape[0]
    n2 = k.shape[0]
    kvh = kv_head_index(n1, n2)
    kg, vg = k[kvh], v[kvh]
    dv_h = np.einsum("nij,nid->njd", p, dout)
    dp = np.einsum("nid,njd->nij", dout, vg)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = scale * np.einsum("nij,njd->nid", ds, kg)
    dk_h = scale * np.einsum("nij,nid->njd", ds, q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for n in range(n1):
        dk[kvh[n]] += dk_h[n]
        dv[kvh[n]] += dv_h[n]
    return dq, dk, dv


def _masks_for(q4, k4, layout, sparse_mode, pre_tokens, next_tokens, atten_mask, prefix,
               actual_seq_qlen, actual_seq_kvlen):
    """Per batch element mask, broadcastable to (N1, Sq, Skv)."""
    b, _, sq, _ = q4.shape
    skv = k4.shape[2]
    if layout == "TND":
        m = varlen_mask(sparse_mode, actual_seq_qlen, actual_seq_kvlen, pre_tokens,
                        next_tokens, prefix=prefix, atten_mask=atten_mask, tq=sq, tkv=skv)
        return [m[None]]
    m = dense_mask(sparse_mode, sq, skv, pre_tokens, next_tokens, prefix=prefix,
                   atten_mask=atten_mask, batch=None)
    return [m[i if m.shape[0] > 1 else 0] for i in range(b)]


def _forward(query, key, value, *, input_layout="BSND", head_num=None, scale=None,
             sparse_mode=0, pre_tokens=INT_MAX, next_tokens=INT_MAX, atten_mask=None,
             prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    n1, n2, d = head_counts(query, key, input_layout, head_num)
    q4 = to_bnsd(query, input_layout, n1)
    k4 = to_bnsd(key, input_layout, n2)
    v4 = to_bnsd(value, input_layout, n2)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    masks = _masks_for(q4, k4, input_layout, sparse_mode, pre_tokens, next_tokens, atten_mask,
                       prefix, actual_seq_qlen, actual_seq_kvlen)
    res = [attend(q4[i], k4[i], v4[i], masks[i], scale) for i in range(q4.shape[0])]
    return q4, k4, v4, scale, res


def flash_attention_score(query, key, value, **kw):
    """Reference forward: (out in the layout with value's last dim, softmax_max, softmax_sum)
    in float64; statistics (B, N1, Sq), or (Tq, N1) for TND."""
    layout = kw.get("input_layout", "BSND")
    _, _, _, _, res = _forward(query, key, value, **kw)
    out = from_bnsd(np.stack([r["out"] for r in res]), layout)
    mx = np.stack([r["max"] for r in res])
    sm = np.stack([r["sum"] for r in res])
    if layout == "TND":
        return out, mx[0].T, sm[0].T
    return out, mx, sm


def attention_scores(query, key, **kw):
    """Reference scores: float64 (B, N1, Sq, Skv), or (N1, Tq, Tkv) for TND."""
    layout = kw.get("input_layout", "BSND")
    value = key  # the scores do not read value; any same-head-count array works
    _, _, _, _, res = _forward(query, key, value, **kw)
    s = np.stack([r["scores"] for r in res])
    return s[0] if layout == "TND" else s


def flash_attention_grad(query, key, value, dout, **kw):
    """Reference gradient of sum(out * dout) wrt (query, key, value), float64, each in its
    input's layout."""
    layout = kw.get("input_layout", "BSND")
    q4, k4, v4, scale, res = _forward(query, key, value, **kw)
    n1 = q4.shape[1]
    do4 = to_bnsd(dout, layout, n1)
    grads = [attend_grad(q4[i], k4[i], v4[i], res[i]["p"], do4[i], scale)
             for i in range(q4.shape[0])]
    dq, dk, dv = (np.stack([g[j] for g in grads]) for j in range(3))
    return from_bnsd(dq, layout), from_bnsd(dk, layout), from_bnsd(dv, layout)


def visible_mask(query, key, **kw):
    """(B, N1, Sq, Skv) bool of positions that are NOT masked (same as scores > lowest)."""
    _, _, _, _, res = _forward(query, key, key, **kw)
    return np.stack([r["scores"] != FLOAT32_LOWEST for r in res])


# ----------------------------------------------------------------------------------------
# Input builders (NumPy only), shared by the test files
# ----------------------------------------------------------------------------------------

def layout_shape(layout, b, s, n, d):
    """Shape of one input in ``layout``; for TND ``s`` is the token count T and b is unused."""
    return {"BSND": (b, s, n, d), "BNSD": (b, n, s, d), "BSH": (b, s, n * d),
            "SBH": (s, b, n * d), "TND": (s, n, d)}[layout]


def random_atten_mask(rng, shape, density=0.3, dtype=bool):
    m = rng.random(shape) < density
    return m.astype(np.uint8) if np.dtype(dtype) == np.uint8 else m


def make_case(rng, layout="BSND", dtype=np.float32, *, B=2, Sq=4, Skv=None, N1=2, N2=None,
              D=8, Dv=None, seq_q=None, seq_kv=None, **op):
    """Random (args, kw) for one call: args = [query, key, value] NumPy arrays of ``dtype``
    (generated in float64, rounded once), kw the keyword arguments (layout, head_num for
    BSH/SBH, cumulative actual_seq_* for TND from the per-sequence lengths seq_q/seq_kv) plus
    the op keywords passed through (sparse_mode, pre_tokens, ...)."""
    Skv = Sq if Skv is None else Skv
    N2 = N1 if N2 is None else N2
    Dv = D if Dv is None else Dv
    kw = dict(op)
    kw["input_layout"] = layout
    if layout == "TND":
        seq_kv = seq_q if seq_kv is None else seq_kv
        tq, tkv = int(sum(seq_q)), int(sum(seq_kv))
        kw["actual_seq_qlen"] = cumulative(seq_q)
        kw["actual_seq_kvlen"] = cumulative(seq_kv)
        shapes = [(tq, N1, D), (tkv, N2, D), (tkv, N2, Dv)]
    else:
        shapes = [layout_shape(layout, B, Sq, N1, D), layout_shape(layout, B, Skv, N2, D),
                  layout_shape(layout, B, Skv, N2, Dv)]
    if layout in ("BSH", "SBH"):
        kw["head_num"] = N1
    args = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return args, kw


def ref_kwargs(kw):
    """Keyword arguments as NumPy values for the oracle (lists stay lists)."""
    out = {}
    for name, v in kw.items():
        if name in ("atten_mask",) and v is not None:
            v = np.asarray(v)
        out[name] = v
    return out


def f64(a):
    return np.asarray(a).astype(np.float64)


def _first_valid_band(mode, candidates, pairs):
    """The first (pre, next) of candidates valid for every (sq, skv) in pairs."""
    for pre, nxt in candidates:
        if all(band_valid(*to_top_left(mode, pre, nxt, sq, skv), sq, skv)
               for sq, skv in pairs):
            return pre, nxt
    return INT_MAX, INT_MAX


def mode_kwargs(mode, rng, B, Sq, Skv, N1=1, mask_dtype=bool):
    """Op keywords that make a valid non-varlen call of ``mode`` (random atten_mask for 0/1,
    a band for 0/4, a valid prefix for 5/6 with mode 5's exact prefix mask)."""
    kw = {"sparse_mode": mode}
    if mode in (0, 4):
        pre, nxt = _first_valid_band(mode, [(2, 1), (1, 0), (3, -1), (Skv, Sq)], [(Sq, Skv)])
        kw.update(pre_tokens=pre, next_tokens=nxt)
    if mode == 0:
        kw["atten_mask"] = random_atten_mask(rng, (B, 1, Sq, Skv), 0.2, mask_dtype)
    if mode == 1:
        kw["atten_mask"] = random_atten_mask(rng, (Sq, Skv), 0.3, mask_dtype)
    if mode in (5, 6):
        kw["prefix"] = [int(x) for x in rng.integers(max(Skv - Sq, 0), Skv + 1, size=B)]
    if mode == 5:
        m = dense_mask(6, Sq, Skv, prefix=kw["prefix"])
        kw["atten_mask"] = m.astype(np.uint8) if np.dtype(mask_dtype) == np.uint8 else m
    return kw


def varlen_kwargs(mode, rng, lq, lkv):
    """Op keywords for a valid varlen (TND) call of ``mode`` with lengths lq, lkv (modes 7/8
    take their tokens from the band sequence; mode 6 a valid prefix per sequence)."""
    kw = {"sparse_mode": mode}
    pairs = [(a, b) for a, b in zip(lq, lkv) if a and b]
    if mode in (0, 4):
        pre, nxt = _first_valid_band(mode, [(2, 1), (max(lkv) + 1, 1), (max(lkv), max(lq))],
                                     pairs)
        kw.update(pre_tokens=pre, next_tokens=nxt)
    if mode in (0, 1):
        kw["atten_mask"] = random_atten_mask(rng, (max(lq), max(lkv)), 0.25)
    if mode == 6:
        kw["prefix"] = [int(rng.integers(max(b - a, 0), b + 1)) for a, b in zip(lq, lkv)]
    if mode in (7, 8):
        bi = band_sequence(mode, lq, lkv)
        fq, fkv = lq[bi], lkv[bi]
        if mode == 7:
            assert fq <= fkv, "mode 7 needs last Sq <= last Skv"
            kw.update(pre_tokens=fkv + 1, next_tokens=min(0, fq - fkv + 1))
        else:
            kw.update(pre_tokens=fkv, next_tokens=fq - fkv + 1)
    return kw
