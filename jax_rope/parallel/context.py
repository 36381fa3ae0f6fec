"""Context-parallel attention: the sequence axis sharded over a mesh axis.

Each device keeps its query block; key/value blocks visit it (strategy "ring":
`lax.ppermute` around the mesh axis, one block per step; "all_gather": every
block at once). Every (query chunk, key chunk) pair is one fused
`flash_attention_score` call whose sparse_mode/pre/next cut the global mask to
that pair: a pair the mask hides is skipped, a pair it does not touch runs
unmasked, only pairs the mask cuts run banded. Partial results merge through
their log-sum-exp. The backward is a custom_vjp that replays the same pairs with
the fused backward kernel and the *global* statistics (max = lse, sum = 1), so
each pair's gradient is exact; key/value gradients travel home with their block
(ring) or are reduce-scattered (all_gather).

Token order: callers pass the sequence in its natural order, sharded in equal
contiguous blocks over `seq_axis` (device d holds tokens [d*S/n, (d+1)*S/n)),
and get the output back in that order. With load_balance=True the function
re-deals the 2n chunks of length S/(2n) internally in zig-zag order, device i
holding chunks i and 2n-1-i (two ppermutes in, two out), so that under a causal
mask every device does the same work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_rope.attention import ops, sparse_modes
from jax_rope.attention.api import flash_attention_score
from jax_rope.attention.options import DEAD_ROW_SUM, MASK_VALUE, MAX_TOKENS


def _chunk_branches(sparse_mode, pre_tokens, next_tokens, chunks, length):
    """Static branches per chunk offset: ("skip",), ("full",) or ("band", pre, next),
    and a table from offset + chunks - 1 to branch index."""
    # Sq == Skv: each supported mode is a top-left window (rightDownCausal is leftUpCausal).
    pre, nxt = sparse_modes.rule(sparse_mode).top_left_window(pre_tokens, next_tokens)
    branches, index = [], []
    for c in range(-(chunks - 1), chunks):
        o = c * length  # key chunk start - query chunk start
        hi, lo = nxt - o, -(pre + o)  # visible: lo <= j' - i' <= hi
        if max(lo, -(length - 1)) > min(hi, length - 1):
            branch = ("skip",)
        elif hi >= length - 1 and lo <= -(length - 1):
            branch = ("full",)
        else:
            branch = ("band", int(min(-lo, MAX_TOKENS)), int(min(hi, MAX_TOKENS)))
        if branch not in branches:
            branches.append(branch)
        index.append(branches.index(branch))
    return tuple(branches), np.asarray(index, np.int32)


def _lse(softmax_max, softmax_sum):
    dead = softmax_max <= MASK_VALUE
    return jnp.where(dead, -jnp.inf, softmax_max + jnp.log(jnp.where(dead, 1.0, softmax_sum)))


def _call_kwargs(branch, scale):
    if branch[0] == "full":
        return dict(scale=scale, sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS)
    return dict(scale=scale, sparse_mode=4, pre_tokens=branch[1], next_tokens=branch[2])


def _pair_forward(branch, scale, q, k, v):
    """(out float32 (B, L, N1, Dv), lse (B, N1, L)) of one chunk pair."""
    b, length, heads = q.shape[0], q.shape[1], q.shape[2]
    if branch[0] == "skip":
        return (jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32),
                jnp.full((b, heads, length), -jnp.inf, jnp.float32))
    out, softmax_max, softmax_sum = flash_attention_score(q, k, v, **_call_kwargs(branch, scale))
    return out.astype(jnp.float32), _lse(softmax_max, softmax_sum)


def _pair_backward(branch, scale, q, k, v, out, dout, lse):
    if branch[0] == "skip":
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    call = ops.prepare(q, k, v, input_layout="BSND", head_num=None, atten_mask=None,
                       prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                       **_call_kwargs(branch, scale))
    dead = jnp.isneginf(lse)
    softmax_max = jnp.where(dead, MASK_VALUE, lse)
    # A NaN lse (a NaN or Inf reached the row's scores) keeps its NaN sum: the backward then
    # sends NaN to every key the row sees, as the whole-sequence call does.
    softmax_sum = jnp.where(dead, DEAD_ROW_SUM, jnp.where(jnp.isnan(lse), jnp.nan, 1.0))
    softmax_sum = softmax_sum.astype(jnp.float32)
    grads = ops.backward(call.options, call.query, call.key, call.value, out, dout,
                         softmax_max, softmax_sum, call.table, call.extras)
    return tuple(g.astype(jnp.float32) for g in grads)


class _RingSchedule:
    """Everything static about one call: mesh axis, chunking and branches."""

    def __init__(self, axis, devices, strategy, load_balance, seq_len, sparse_mode,
                 pre_tokens, next_tokens, scale):
        self.axis, self.n, self.strategy, self.scale = axis, devices, strategy, scale
        self.slots = 2 if load_balance else 1
        self.chunks = devices * self.slots
        self.length = seq_len // self.chunks
        self.branches, self.index = _chunk_branches(sparse_mode, pre_tokens, next_tokens,
                                                   self.chunks, self.length)

    def chunk(self, device, slot):
        """Global chunk index held in `slot` of `device` (zig-zag when 2 slots)."""
        return device if slot == 0 else 2 * self.n - 1 - device

    def split(self, x):
        return [x[:, i * self.length:(i + 1) * self.length] for i in range(self.slots)]

    def branch(self, q_device, q_slot, kv_device, kv_slot):
        offset = self.chunk(kv_device, kv_slot) - self.chunk(q_device, q_slot)
        return jnp.asarray(self.index)[offset + self.chunks - 1]

    def source(self, t):
        """The device whose key/value block this device works on at step t."""
        return (jax.lax.axis_index(self.axis) - t) % self.n

    def shift(self, x):  # every device sends to the next one
        return jax.lax.ppermute(x, self.axis, [(i, (i + 1) % self.n) for i in range(self.n)])


def _gathered(schedule, k, v):
    """For "all_gather": gathers every device's key/value block once and returns
    src -> the (k, v) block of device `src`, sliced from the gathered whole."""
    k_all = jax.lax.all_gather(k, schedule.axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, schedule.axis, axis=1, tiled=True)
    size = k.shape[1]
    return lambda src: (jax.lax.dynamic_slice_in_dim(k_all, src * size, size, 1),
                        jax.lax.dynamic_slice_in_dim(v_all, src * size, size, 1))


def _forward(schedule, q, k, v):
    """Step t merges the pairs of this device's query chunks with the key/value block of
    device source(t) = (me - t) mod n. The steps are a loop (the program does not grow with
    n); in the ring the next block's ppermute does not wait for this step's products."""
    me = jax.lax.axis_index(schedule.axis)
    q_slots = schedule.split(q)
    branches = [functools.partial(_pair_forward, b, schedule.scale) for b in schedule.branches]

    def step(src, kv, acc):
        outs, lses = list(acc[0]), list(acc[1])
        for ks, (kc, vc) in enumerate(zip(schedule.split(kv[0]), schedule.split(kv[1]))):
            for qs, qc in enumerate(q_slots):
                o, lse = jax.lax.switch(schedule.branch(me, qs, src, ks), branches, qc, kc, vc)
                new = jnp.logaddexp(lses[qs], lse)
                safe = jnp.where(jnp.isneginf(new), 0.0, new)
                w_old = jnp.swapaxes(jnp.exp(lses[qs] - safe), 1, 2)[..., None]
                w_new = jnp.swapaxes(jnp.exp(lse - safe), 1, 2)[..., None]
                outs[qs] = outs[qs] * w_old + o * w_new
                lses[qs] = new
        return tuple(outs), tuple(lses)

    acc = (tuple(jnp.zeros(x.shape[:3] + v.shape[3:], jnp.float32) for x in q_slots),
           tuple(jnp.full((x.shape[0], x.shape[2], x.shape[1]), -jnp.inf, jnp.float32)
                 for x in q_slots))
    if schedule.strategy == "all_gather":
        visit = _gathered(schedule, k, v)

        def gather_step(t, acc):
            src = schedule.source(t)
            return step(src, visit(src), acc)
        acc = jax.lax.fori_loop(0, schedule.n, gather_step, acc)
    else:
        def ring_step(t, carry):
            kv, acc = carry
            return schedule.shift(kv), step(schedule.source(t), kv, acc)
        kv, acc = jax.lax.fori_loop(0, schedule.n - 1, ring_step, ((k, v), acc))
        acc = step(schedule.source(schedule.n - 1), kv, acc)
    outs, lses = acc
    out = jnp.concatenate(outs, axis=1).astype(q.dtype)
    return out, jnp.concatenate(lses, axis=2)


def _backward(schedule, q, k, v, out, lse, dout):
    """The forward's steps again, each pair's gradients from the fused backward: dq stays,
    the visiting block's dk/dv travel with it (ring) or add into the gathered whole."""
    me = jax.lax.axis_index(schedule.axis)
    q_slots, o_slots, d_slots = schedule.split(q), schedule.split(out), schedule.split(dout)
    l_slots = [lse[:, :, i * schedule.length:(i + 1) * schedule.length]
               for i in range(schedule.slots)]
    branches = [functools.partial(_pair_backward, b, schedule.scale) for b in schedule.branches]

    def step(src, blocks, dkv, dq):
        """(dk, dv) of the block of device src and dq, with that step's pairs added."""
        dq, dk_slots, dv_slots = list(dq), schedule.split(dkv[0]), schedule.split(dkv[1])
        for ks, (kc, vc) in enumerate(zip(schedule.split(blocks[0]), schedule.split(blocks[1]))):
            for qs in range(schedule.slots):
                g = jax.lax.switch(schedule.branch(me, qs, src, ks), branches, q_slots[qs], kc, vc,
                                   o_slots[qs], d_slots[qs], l_slots[qs])
                dq[qs] = dq[qs] + g[0]
                dk_slots[ks] = dk_slots[ks] + g[1]
                dv_slots[ks] = dv_slots[ks] + g[2]
        return (jnp.concatenate(dk_slots, axis=1), jnp.concatenate(dv_slots, axis=1)), tuple(dq)

    dq = tuple(jnp.zeros(x.shape, jnp.float32) for x in q_slots)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    if schedule.strategy == "ring":
        def ring_step(t, carry):
            blocks, dkv, dq = carry
            dkv, dq = step(schedule.source(t), blocks, dkv, dq)
            return schedule.shift(blocks), schedule.shift(dkv), dq
        blocks, dkv, dq = jax.lax.fori_loop(0, schedule.n - 1, ring_step, ((k, v), zeros, dq))
        dkv, dq = step(schedule.source(schedule.n - 1), blocks, dkv, dq)
        dk, dv = schedule.shift(dkv)  # the visiting block's gradients go home: one more step
    else:
        visit, size = _gathered(schedule, k, v), k.shape[1]

        def gather_step(t, carry):
            dkv_all, dq = carry
            src = schedule.source(t)
            dkv, dq = step(src, visit(src), zeros, dq)
            return tuple(jax.lax.dynamic_update_slice_in_dim(
                acc, blk + jax.lax.dynamic_slice_in_dim(acc, src * size, size, 1), src * size, 1)
                for acc, blk in zip(dkv_all, dkv)), dq
        dkv_all = (jnp.zeros((k.shape[0], size * schedule.n) + k.shape[2:], jnp.float32),
                   jnp.zeros((v.shape[0], size * schedule.n) + v.shape[2:], jnp.float32))
        dkv_all, dq = jax.lax.fori_loop(0, schedule.n, gather_step, (dkv_all, dq))
        dk, dv = (jax.lax.psum_scatter(x, schedule.axis, scatter_dimension=1, tiled=True)
                  for x in dkv_all)
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(schedule, q, k, v):
    return _forward(schedule, q, k, v)[0]


def _attention_fwd(schedule, q, k, v):
    out, lse = _forward(schedule, q, k, v)
    return out, (q, k, v, out, lse)


def _attention_bwd(schedule, residuals, dout):
    q, k, v, out, lse = residuals
    return _backward(schedule, q, k, v, out, lse, dout.astype(out.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _zigzag(x, axis, n, inverse=False):
    """Natural blocks (device d: chunks 2d, 2d+1) <-> zig-zag (device i: i, 2n-1-i)."""
    def home(c):  # the zig-zag device of chunk c
        return c if c < n else 2 * n - 1 - c
    # Of the two chunks i and 2n-1-i one is even (sent from slot 0), one odd (slot 1).
    perms = [[(d, home(2 * d + s)) for d in range(n)] for s in (0, 1)]
    me = jax.lax.axis_index(axis)
    half = x.shape[1] // 2
    a, b = x[:, :half], x[:, half:]
    if not inverse:
        r0, r1 = (jax.lax.ppermute(p, axis, perm) for p, perm in zip((a, b), perms))
        even = me % 2 == 0  # chunk i is even: it came from a slot 0
        return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis=1)
    even = me % 2 == 0
    send0, send1 = jnp.where(even, a, b), jnp.where(even, b, a)
    back = [[(dst, src) for src, dst in perm] for perm in perms]
    r0, r1 = (jax.lax.ppermute(p, axis, perm) for p, perm in zip((send0, send1), back))
    return jnp.concatenate([r0, r1], axis=1)


def _place(x, sharding):
    """Puts x in the sequence sharding shard_map expects (a no-op when it is)."""
    explicit = any(t == jax.sharding.AxisType.Explicit
                   for t in getattr(sharding.mesh, "axis_types", ()))
    if explicit:
        return jax.sharding.reshard(x, sharding)
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def context_parallel_attention(query, key, value, *, mesh, seq_axis, strategy="ring",
                               sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                               scale=None, load_balance=True):
    """Attention over a sequence sharded on mesh axis `seq_axis`; equals
    `flash_attention_score(query, key, value, input_layout="BSND", ...)[0]`.

    Args:
      query: (B, S, N1, D); key (B, S, N2, D); value (B, S, N2, Dv), layout BSND,
        self-attention lengths (Sq == Skv), tokens in natural order; S divisible
        by n (2n with load_balance), n = mesh.shape[seq_axis].
      mesh, seq_axis: the jax.sharding.Mesh and the name of its sequence axis;
        the computation is a shard_map over the mesh (other axes replicated).
      strategy: "ring" (key/value blocks circulate by ppermute) or "all_gather".
      sparse_mode: 0 (none), 2/3 (causal), 4 (band with pre_tokens/next_tokens).
      scale: None means 1/sqrt(D).
      load_balance: re-deal tokens in zig-zag order inside (see module doc).

    Returns:
      attention_out (B, S, N1, Dv) in query's dtype, sharded like query.
      Differentiable with respect to query, key and value.
    """
    if strategy not in ("ring", "all_gather"):
        raise ValueError(f"strategy must be 'ring' or 'all_gather', got {strategy!r}")
    supported = [int(m) for m, r in sparse_modes.RULES.items() if r.top_left_window]
    if sparse_mode not in supported:
        raise ValueError(f"sparse_mode must be one of {supported} for context parallelism, "
                         f"got {sparse_mode!r}")
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"seq_axis must name an axis of the mesh {mesh.axis_names}, "
                         f"got {seq_axis!r}")
    # The whole-sequence call validates shapes, dtypes and tokens (nothing is computed).
    jax.eval_shape(functools.partial(
        flash_attention_score, scale=scale, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens), query, key, value)
    if query.ndim != 4 or query.shape[1] != key.shape[1]:
        raise ValueError(f"query and key must be BSND with equal sequence lengths, got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    n = mesh.shape[seq_axis]
    parts = n * (2 if load_balance else 1)
    if query.shape[1] % parts:
        raise ValueError(f"sequence length must be divisible by {parts} (mesh axis "
                         f"{seq_axis!r} of size {n}{', load_balance' if load_balance else ''}), "
                         f"got {query.shape[1]}")
    if scale is None:
        scale = 1.0 / float(np.sqrt(query.shape[-1]))
    schedule = _RingSchedule(seq_axis, n, strategy, load_balance, query.shape[1], sparse_mode,
                 pre_tokens, next_tokens, float(scale))

    def local(q, k, v):
        if load_balance:
            q, k, v = (_zigzag(x, seq_axis, n) for x in (q, k, v))
        out = _attention(schedule, q, k, v)
        return _zigzag(out, seq_axis, n, inverse=True) if load_balance else out

    spec = PartitionSpec(None, seq_axis)
    query, key, value = (_place(x, NamedSharding(mesh, spec)) for x in (query, key, value))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)(query, key, value)
