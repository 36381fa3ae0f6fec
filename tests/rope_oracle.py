"""NumPy reference for the fused Q/K rotary position embedding (spec/rope.md).

Written from the spec alone, never from the library code. Everything is computed in float64
unless a caller asks for another dtype (``dtype=np.float32`` gives the spec's golden: a float32
reference that the tests then cast once to float16/bfloat16).

The rotation ``rot`` is built from explicit index arithmetic (one source index and one sign
per output position) rather than from slicing and concatenation, so that the oracle does not
share its shape of code with a jnp implementation. ``rotation_matrix`` builds the same map
as an explicit r x r matrix for the adjoint checks in ``test_rope_oracle.py``.
"""

import numpy as np

MODES = ("half", "quarter", "interleave")
LAYOUTS = ("BSND", "BSH", "SBND", "BNSD", "TND")

# Axis roles per layout: position of the batch, sequence and head axes (None: absent).
# BSH is the legacy name of the 4-D BSND layout.
LAYOUT_AXES = {
    "BSND": {"rank": 4, "batch": 0, "seq": 1, "head": 2},
    "BSH": {"rank": 4, "batch": 0, "seq": 1, "head": 2},
    "SBND": {"rank": 4, "batch": 1, "seq": 0, "head": 2},
    "BNSD": {"rank": 4, "batch": 0, "seq": 2, "head": 1},
    "TND": {"rank": 3, "batch": None, "seq": 0, "head": 1},
}


def rot_index(mode, r):
    """(src, sign) with ``rot(x)[j] == sign[j] * x[src[j]]`` for a row x of length r."""
    src = np.empty(r, dtype=np.int64)
    sign = np.empty(r, dtype=np.float64)
    if mode == "half":
        assert r % 2 == 0, r
        h = r // 2
        for j in range(r):
            if j < h:  # first half of the output: -x2
                src[j], sign[j] = j + h, -1.0
            else:  # second half: x1
                src[j], sign[j] = j - h, 1.0
    elif mode == "quarter":
        assert r % 4 == 0, r
        q = r // 4
        for j in range(r):
            block, off = divmod(j, q)
            # output quarters: (-x2, x1, -x4, x3); blocks are 0-based here
            src_block, sg = {0: (1, -1.0), 1: (0, 1.0), 2: (3, -1.0), 3: (2, 1.0)}[block]
            src[j], sign[j] = src_block * q + off, sg
    elif mode == "interleave":
        assert r % 2 == 0, r
        for j in range(r):
            if j % 2 == 0:  # rot[2m] = -x[2m+1]
                src[j], sign[j] = j + 1, -1.0
            else:  # rot[2m+1] = x[2m]
                src[j], sign[j] = j - 1, 1.0
    else:
        raise AssertionError(f"unknown mode {mode!r}")
    return src, sign


def rotation_matrix(mode, r):
    """The r x r matrix R with rot(x) == R @ x."""
    src, sign = rot_index(mode, r)
    mat = np.zeros((r, r), dtype=np.float64)
    mat[np.arange(r), src] = sign
    return mat


def rotate(x, mode):
    """rot(x) along the last axis (the whole last axis is rotated)."""
    src, sign = rot_index(mode, x.shape[-1])
    return x[..., src] * sign.astype(x.dtype)


def _as(x, dtype):
    return np.asarray(x).astype(dtype)


def check_layout(query, key, cos, sin, layout):
    """Assert that the shapes form a valid call (guards the test helpers, not the library)."""
    ax = LAYOUT_AXES[layout]
    rank = ax["rank"]
    assert query.ndim == key.ndim == cos.ndim == sin.ndim == rank, (
        query.shape, key.shape, cos.shape, sin.shape, layout)
    assert cos.shape == sin.shape
    for i in range(rank):  # every axis but N matches between query and key
        if i != ax["head"]:
            assert query.shape[i] == key.shape[i], (query.shape, key.shape)
    assert cos.shape[ax["head"]] == 1
    assert cos.shape[ax["seq"]] == query.shape[ax["seq"]]
    if ax["batch"] is not None:
        assert cos.shape[ax["batch"]] in (1, query.shape[ax["batch"]])
    assert cos.shape[-1] <= query.shape[-1]


def rope_forward(x, c, s, mode, dtype=np.float64):
    """out[..., :r] = x[..., :r] * c + rot(x[..., :r]) * s; out[..., r:] = x[..., r:].

    c and s broadcast against x[..., :r] (head axis 1, batch axis 1 or B: plain NumPy
    broadcasting does exactly the spec's broadcast in every layout).
    """
    x = _as(x, dtype)
    c = _as(c, dtype)
    s = _as(s, dtype)
    r = c.shape[-1]
    out = x.copy()
    xr = x[..., :r]
    out[..., :r] = xr * c + rotate(xr, mode) * s
    return out


def apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half",
                         dtype=np.float64):
    """Reference forward: (q_out, k_out) in ``dtype``."""
    check_layout(np.asarray(query), np.asarray(key), np.asarray(cos), np.asarray(sin), layout)
    return (rope_forward(query, cos, sin, rotary_mode, dtype),
            rope_forward(key, cos, sin, rotary_mode, dtype))


def rope_adjoint_x(g, c, s):
    """Half-mode adjoint wrt x, written literally from the spec formula.

    dx[:r] = cat(c1*g1 + s2*g2, c2*g2 - s1*g1);  dx[r:] = g[r:]
    """
    g = _as(g, np.float64)
    c = _as(c, np.float64)
    s = _as(s, np.float64)
    r = c.shape[-1]
    h = r // 2
    g1, g2 = g[..., :h], g[..., h:r]
    c1, c2 = c[..., :h], c[..., h:]
    s1, s2 = s[..., :h], s[..., h:]
    first = c1 * g1 + s2 * g2
    second = c2 * g2 - s1 * g1
    dx = g.copy()
    dx[..., :h] = first
    dx[..., h:r] = second
    return dx


def rope_adjoint_x_matrix(g, c, s, mode):
    """Adjoint wrt x from the explicit rotation matrix: dx[:r] = c*g + R^T (s*g)."""
    g = _as(g, np.float64)
    c = _as(c, np.float64)
    s = _as(s, np.float64)
    r = c.shape[-1]
    mat = rotation_matrix(mode, r)
    gr = g[..., :r]
    dx = g.copy()
    dx[..., :r] = c * gr + (s * gr) @ mat  # row-vector form of R^T y
    return dx


def reduce_to_cos(a, cos_shape, layout):
    """Sum a (query-shaped, last axis r) over the broadcast axes of cos: the head axis, plus the
    batch axis when cos has batch 1."""
    ax = LAYOUT_AXES[layout]
    out = a.sum(axis=ax["head"], keepdims=True)
    if ax["batch"] is not None and cos_shape[ax["batch"]] == 1:
        out = out.sum(axis=ax["batch"], keepdims=True)
    assert out.shape == tuple(cos_shape), (out.shape, cos_shape)
    return out


def apply_rotary_pos_emb_grad(grad_query_out, grad_key_out, cos, sin, query=None, key=None,
                              layout="BSND"):
    """Reference backward (half mode): (dq, dk, dcos, dsin), float64; dcos/dsin None without
    query/key."""
    assert (query is None) == (key is None)
    cos = _as(cos, np.float64)
    sin = _as(sin, np.float64)
    gq = _as(grad_query_out, np.float64)
    gk = _as(grad_key_out, np.float64)
    r = cos.shape[-1]
    dq = rope_adjoint_x(gq, cos, sin)
    dk = rope_adjoint_x(gk, cos, sin)
    if query is None:
        return dq, dk, None, None
    q = _as(query, np.float64)[..., :r]
    k = _as(key, np.float64)[..., :r]
    dcos = (reduce_to_cos(gq[..., :r] * q, cos.shape, layout)
            + reduce_to_cos(gk[..., :r] * k, cos.shape, layout))
    dsin = (reduce_to_cos(gq[..., :r] * rotate(q, "half"), cos.shape, layout)
            + reduce_to_cos(gk[..., :r] * rotate(k, "half"), cos.shape, layout))
    return dq, dk, dcos, dsin
