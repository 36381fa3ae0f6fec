"""The query-row chunks and key windows the jax.numpy fallback (fallback.py)
computes its score grids in.

A long call goes through its query rows in chunks whose float32 score grid takes
at most GRID_CHUNK_BYTES, so it holds O(chunk x Skv) at a time, not O(Sq x Skv).
Each chunk runs against a window of key columns that holds every key its rows
can see: where the sparse mode's band is known when tracing (the padded layouts
without a prefix) the windows leave out what the band hides, elsewhere a window
is every key. `in_row_chunks` runs a computation over them; `Rows` is what that
computation is given.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.attention import masks, sparse_modes


#: The most bytes of one float32 score grid (B x N1 x rows x Skv) the forward and backward
#: build at a time: longer calls go through their query rows in chunks that fit.
GRID_CHUNK_BYTES = 64 << 20


class Rows(NamedTuple):
    """Query rows of a score grid and the key columns they are computed against: the int32
    indices `at` (masks.query_rows, or a chunk's), the extras with the rows and columns they
    hold, the query rows' count where chunks pad the rows past it (None: none padded), and
    the window of `keys` key columns from `first_key` (an int, or a traced int32 scalar in
    a scan over chunks) that every key the rows can see lies in."""
    at: jax.Array
    extras: dict
    padded_past: int | None
    first_key: object
    keys: int

    @property
    def cols(self):
        return masks.key_columns(self.keys, self.first_key)

    def covers(self, length):
        """Whether the window is known, when tracing, to be every one of `length` keys."""
        return isinstance(self.first_key, int) and self.first_key == 0 and self.keys == length


def all_rows(q_len, kv_len, extras):
    """Every query row against every key (one chunk)."""
    return Rows(masks.query_rows(q_len), extras, None, 0, kv_len)


def window(x, rows, axis):
    """x's slice along `axis` (of key columns or key rows) at the window of `rows`."""
    if rows.covers(x.shape[axis]):
        return x
    return jax.lax.dynamic_slice_in_dim(x, rows.first_key, rows.keys, axis)


def placed(x, rows, length, axis):
    """x, of the window's length along `axis`, placed at the window in zeros of `length`."""
    if rows.covers(length):
        return x
    shape = x.shape[:axis] + (length,) + x.shape[axis + 1:]
    return _accumulated(jnp.zeros(shape, x.dtype), x, rows, axis)


def _accumulated(total, x, rows, axis):
    """total + x, where x covers the window of `rows` along `axis` of total (None: all of
    it); only the window is read and written."""
    if axis is None or rows.covers(total.shape[axis]):
        return total + x
    held = jax.lax.dynamic_slice_in_dim(total, rows.first_key, rows.keys, axis)
    return jax.lax.dynamic_update_slice_in_dim(total, held + x, rows.first_key, axis)


def row_indexed(options, name, x, q_len):
    """Whether an extra operand has a row per query row (axis 2): a padded layout's element
    mask, and its bias tensor of Sq rows."""
    if options.varlen:
        return False
    return name == "mask" or (name == "bias" and options.bias == "tensor" and x.shape[2] == q_len)


def column_indexed(options, name):
    """Whether an extra operand has a column per key column (last axis): a padded layout's
    element mask and bias tensor."""
    return not options.varlen and (name == "mask" or (name == "bias" and options.bias == "tensor"))


#: At most this many key-window widths per call, each one a scan over its chunks (compiled
#: once, with temporaries of its own: the chunks of all of them together hold at most
#: GRID_CHUNK_BYTES of scores). Windows are taken where they leave out at least WINDOW_GAIN
#: of the score grid; to that end chunks may be cut finer (a half, a quarter, an eighth)
#: down to WINDOW_MIN_ROWS query rows (smaller products run far below the machine's speed).
WINDOW_WIDTHS = 4
WINDOW_GAIN = 0.1
WINDOW_MIN_ROWS = 64


def _key_spans(options, q_len, kv_len, size, count):
    """Per chunk of `size` query rows: [lo, hi), the key columns its rows can see, or every
    column where the band is not known when tracing (TND lengths and prefixes may be
    traced). Elsewhere the call's sequence table is masks.sequence_table of its options and
    sizes alone, every row the same; both limits of a row's band never decrease down the
    rows, so a chunk's span runs from its first row's lowest column to its last row's
    highest (an element mask only hides more)."""
    if options.varlen or sparse_modes.rule(options.sparse_mode).needs_prefix:
        return [(0, kv_len)] * count
    firsts = np.arange(count) * size
    lasts = np.minimum(firsts + size, q_len) - 1
    with jax.ensure_compile_time_eval():  # the table of these modes is a constant
        table = masks.sequence_table(options, 1, q_len, kv_len)
        lo = np.asarray(masks.visible_columns(table, jnp.asarray(firsts, jnp.int32))[0])[0]
        hi = np.asarray(masks.visible_columns(table, jnp.asarray(lasts, jnp.int32))[1])[0]
    return [(int(a), max(int(a), int(b) + 1)) for a, b in zip(lo, hi)]


class Windows(NamedTuple):
    """Query-row chunks of `size` rows and their key windows: per chunk the first column,
    and per run of consecutive chunks (start, stop, width) with one window width."""
    size: int
    count: int
    firsts: list
    runs: list

    @property
    def scores(self):
        """The scores of one score grid computed over all the chunks."""
        return self.size * sum((stop - start) * width for start, stop, width in self.runs)

    @property
    def held(self):
        """The scores of one grid that the runs' chunks hold together (one chunk each)."""
        return self.size * sum(width for _, _, width in self.runs)


def _windows(spans, kv_len, size, widths):
    """Chunks of `size` rows with the key column spans `spans`: at most `widths` runs of
    chunks, each as wide as its widest span, each window inside [0, kv_len)."""
    count = len(spans)
    per_run = -(-count // widths)
    runs = []
    for start in range(0, count, per_run):
        stop = min(start + per_run, count)
        width = min(kv_len, max(1, max(hi - lo for lo, hi in spans[start:stop])))
        if runs and runs[-1][2] == width:
            runs[-1] = (runs[-1][0], stop, width)
        else:
            runs.append((start, stop, width))
    chunk_widths = [width for start, stop, width in runs for _ in range(start, stop)]
    firsts = [max(0, min(lo, kv_len - w)) for (lo, _), w in zip(spans, chunk_widths)]
    return Windows(size, count, firsts, runs)


def chunk_windows(options, q_len, kv_len, grids):
    """The chunks of a call with `grids` (B x N1) score grids and their key windows (see
    WINDOW_WIDTHS): every key in chunks of the most rows that GRID_CHUNK_BYTES allows, or
    the windows that compute the fewest scores (a causal call: 5/8 of the grid)."""
    size = max(1, min(q_len, GRID_CHUNK_BYTES // max(grids * kv_len * 4, 1)))
    chunks = lambda rows: max(1, -(-q_len // rows))
    plain = _windows([(0, kv_len)] * chunks(size), kv_len, size, 1)
    budget = max(GRID_CHUNK_BYTES, plain.held * grids * 4)
    best = plain
    for rows in [size] + [size // d for d in (2, 4, 8) if size // d >= WINDOW_MIN_ROWS]:
        spans = _key_spans(options, q_len, kv_len, rows, chunks(rows))
        for widths in range(1, WINDOW_WIDTHS + 1):
            windows = _windows(spans, kv_len, rows, widths)
            if windows.held * grids * 4 <= budget and windows.scores < best.scores:
                best = windows
    return best if best.scores <= (1 - WINDOW_GAIN) * plain.scores else plain


def in_row_chunks(compute, options, q_len, kv_len, row_operands, extras, summed_axes=()):
    """compute(rows, row_operands) -> (per-row results, summed results) over all q_len query
    rows, each chunk of rows (chunk_windows; the last one padded) against its window of
    key columns: the per-row results (row axis 2) joined, the summed ones (a tuple) added in
    order, each at the window along its axis in `summed_axes` (None: not windowed). The row
    operands (and row-indexed extras) have rows on axis 2 and B, N1 on axes 0 and 1;
    column-indexed extras are cut to the window."""
    batch, heads = row_operands[0].shape[:2]
    windows = chunk_windows(options, q_len, kv_len, batch * heads)
    size, count = windows.size, windows.count

    def rows_of(at, padded_past, first, width, held):
        rows = Rows(at, {**extras, **held}, padded_past, first, width)
        return rows._replace(extras={
            n: window(x, rows, x.ndim - 1) if column_indexed(options, n) else x
            for n, x in rows.extras.items()})

    def full_width(parts, rows):
        return tuple(x if axis is None else placed(x, rows, kv_len, axis)
                     for x, axis in zip(parts, summed_axes))

    if count == 1:
        rows = rows_of(masks.query_rows(q_len), None, windows.firsts[0], windows.runs[0][2], {})
        per_row, parts = compute(rows, row_operands)
        return per_row, full_width(parts, rows)
    padded_past = q_len if count * size > q_len else None
    chunk_rows = lambda start: start + masks.query_rows(size)
    row_extras = {n: x for n, x in extras.items() if row_indexed(options, n, x, q_len)}

    def chunked(x):  # (.., .., q_len, ...) -> (count, .., .., size, ...)
        x = jnp.pad(x, [(0, 0)] * 2 + [(0, count * size - q_len)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(x.shape[:2] + (count, size) + x.shape[3:]), 2, 0)

    def joined(x):  # (count, .., .., size, ...) -> (.., .., q_len, ...)
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (count * size,) + x.shape[4:])[:, :, :q_len]

    chunks = (jnp.arange(count, dtype=jnp.int32) * size, jnp.asarray(windows.firsts, jnp.int32),
              jax.tree.map(chunked, row_operands), jax.tree.map(chunked, row_extras))

    def chunk_results(width, chunk):
        start, first, operands, held = chunk
        rows = rows_of(chunk_rows(start), padded_past, first, width, held)
        return rows, *compute(rows, operands)

    def run_chunks(width):  # the scan step over the chunks of one window width
        def step(summed, chunk):
            rows, per_row, parts = chunk_results(width, chunk)
            return tuple(_accumulated(total, x, rows, axis)
                         for total, x, axis in zip(summed, parts, summed_axes)), per_row
        return step

    def full_width_parts(chunk):
        rows, _, parts = chunk_results(windows.runs[0][2], chunk)
        return full_width(parts, rows)

    parts = jax.eval_shape(full_width_parts, jax.tree.map(lambda x: x[0], chunks))
    summed = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), parts)
    runs = []
    for start, stop, width in windows.runs:
        summed, per_row = jax.lax.scan(run_chunks(width), summed,
                                       jax.tree.map(lambda x: x[start:stop], chunks))
        runs.append(per_row)
    per_row = jax.tree.map(lambda *parts: jnp.concatenate(parts), *runs)
    return jax.tree.map(joined, per_row), summed
