"""One sharded training step of a RoPE + flash-attention layer, across processes.

    python examples/multiprocess_step.py           # 2 local processes, 2 CPU devices each
    python examples/multiprocess_step.py --single  # the same step in one process, 4 devices

The launcher starts N worker processes of this script on localhost. Each worker
calls `jax.distributed.initialize` (CPU collectives through gloo) and takes two
CPU devices; the global mesh ("data", "model") = (N, 2) has one row per process.
The batch is sharded over "data" (each process feeds only its own rows, through
`jax.make_array_from_process_local_data`) and the heads over "model"; the
weights are replicated, so their gradients are all-reduced across processes.
A second part runs context-parallel attention on one long sequence whose tokens
are split over the processes (ring: key/value blocks travel between them).
With --single one process holds all 2N devices and runs the same program on
the same data (the reference the multi-process result must match).

Each process prints `checksum {json}` (loss and gradient sums, replicated on
every process); the launcher checks that the processes agree and prints it once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

LOCAL_DEVICES = 2
SEQ, MODEL_DIM, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 32, 4, 2, 8


def free_port() -> int:
    """A localhost port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the step (runs in a worker; jax is imported only there) -----------------

def make_inputs(processes):
    """Global batch and weights, the same in every process (numpy, seeded)."""
    import numpy as np
    rng = np.random.default_rng(0)
    batch = 2 * processes
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x, target = normal(batch, SEQ, MODEL_DIM), normal(batch, SEQ, MODEL_DIM)
    scale = 1.0 / np.sqrt(MODEL_DIM)
    params = {name: normal(*shape) * np.float32(scale) for name, shape in (
        ("wq", (MODEL_DIM, Q_HEADS * HEAD_DIM)), ("wk", (MODEL_DIM, KV_HEADS * HEAD_DIM)),
        ("wv", (MODEL_DIM, KV_HEADS * HEAD_DIM)), ("wo", (Q_HEADS * HEAD_DIM, MODEL_DIM)))}
    long = 8 * processes  # context parallel: divisible by 2 x the "data" axis
    qkv = (normal(1, long, Q_HEADS, HEAD_DIM), normal(1, long, KV_HEADS, HEAD_DIM),
           normal(1, long, KV_HEADS, HEAD_DIM))
    return x, target, params, qkv


def run_step(processes):
    """Builds the mesh, places this process's rows, runs the step; returns the checksum."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_rope as jr

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(processes, LOCAL_DEVICES), ("data", "model"))
    rows, heads = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None, "model"))
    replicated = NamedSharding(mesh, P())

    x, target, params, qkv = make_inputs(processes)
    me, count = jax.process_index(), jax.process_count()
    mine = lambda n: slice(me * n // count, (me + 1) * n // count)  # this process's part
    x, target = (jax.make_array_from_process_local_data(rows, a[mine(len(a))], a.shape)
                 for a in (x, target))
    tokens = NamedSharding(mesh, P(None, "data"))
    qkv = [jax.make_array_from_process_local_data(tokens, a[:, mine(a.shape[1])], a.shape)
           for a in qkv]
    params = {k: jax.make_array_from_process_local_data(replicated, v, v.shape)
              for k, v in params.items()}
    cos, sin = jr.rope_cos_sin(jnp.arange(SEQ), HEAD_DIM)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]

    def loss_fn(params, x, target):
        b = x.shape[0]
        split = lambda w, n: jax.lax.with_sharding_constraint(
            (x @ w).reshape(b, SEQ, n, HEAD_DIM), heads)
        q, k = split(params["wq"], Q_HEADS), split(params["wk"], KV_HEADS)
        v = split(params["wv"], KV_HEADS)
        q, k = jr.apply_rotary_pos_emb(q, k, cos, sin)
        out = jr.flash_attention_score(q, k, v, sparse_mode=2)[0]  # causal
        y = out.reshape(b, SEQ, Q_HEADS * HEAD_DIM) @ params["wo"]
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def step(params, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return jax.lax.with_sharding_constraint((loss, grads, new), replicated)

    @jax.jit
    def context_parallel(q, k, v):
        attend = lambda q, k, v: jr.context_parallel_attention(
            q, k, v, mesh=mesh, seq_axis="data", sparse_mode=2)  # causal, zig-zag balanced
        loss, grads = jax.value_and_grad(lambda *a: jnp.sum(attend(*a) ** 2), (0, 1, 2))(q, k, v)
        return loss, jax.lax.with_sharding_constraint(grads, replicated)

    loss, grads, new = step(params, x, target)
    cp_loss, cp_grads = context_parallel(*qkv)
    # Everything here is replicated: every process can read it whole.
    checksum = {"loss": float(loss)}
    for name in sorted(grads):
        g, p = np.asarray(grads[name]), np.asarray(new[name])
        checksum[f"{name}_grad_sum"] = float(g.sum())
        checksum[f"{name}_grad_sq"] = float((g.astype(np.float64) ** 2).sum())
        checksum[f"{name}_new_sum"] = float(p.sum())
    checksum["cp_loss"] = float(cp_loss)
    for name, g in zip(("dq", "dk", "dv"), cp_grads):
        checksum[f"cp_{name}_sq"] = float((np.asarray(g).astype(np.float64) ** 2).sum())
    return checksum


def worker(args):
    import jax
    single = args.process_id is None
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES * (args.processes if single else 1))
    if not single:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes,
                                   process_id=args.process_id, initialization_timeout=60)
    if args.backend:
        import jax_rope as jr
        jr.set_backend(args.backend)
    checksum = run_step(args.processes)
    print(f"process {jax.process_index()} of {jax.process_count()}: "
          f"{len(jax.local_devices())} of {len(jax.devices())} devices", flush=True)
    print("checksum", json.dumps(checksum, sort_keys=True), flush=True)
    if not single:
        jax.distributed.shutdown()


# --- the launcher ------------------------------------------------------------

def launch(args) -> int:
    port = free_port()
    base = [sys.executable, os.path.abspath(__file__), "--processes", str(args.processes),
            "--port", str(port)] + (["--backend", args.backend] if args.backend else [])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(base + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(args.processes)]
    deadline, failed = time.monotonic() + args.timeout, None
    try:
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break  # one died: the others would wait for it until their own timeouts
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate() for p in procs]
    sums = [[line[len("checksum "):] for line in out.splitlines() if line.startswith("checksum ")]
            for out, _ in outputs]
    if failed is not None or any(p.returncode != 0 for p in procs) or not all(sums):
        for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
            print(f"--- process {i}: exit {p.returncode}\n{out[-2000:]}{err[-4000:]}",
                  file=sys.stderr)
        reason = "timed out" if failed is None and time.monotonic() > deadline else "failed"
        print(f"multi-process step {reason}", file=sys.stderr)
        return 1
    values = [json.loads(s[-1]) for s in sums]
    if any(v != values[0] for v in values):
        print(f"processes disagree: {values}", file=sys.stderr)
        return 1
    for out, _ in outputs:
        print(*[line for line in out.splitlines() if line.startswith("process ")])
    print(f"{args.processes} processes agree")
    print("checksum", json.dumps(values[0], sort_keys=True))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--single", action="store_true",
                        help="run the N-process step in this one process instead")
    parser.add_argument("--backend", choices=("ffi", "fallback"), default=None,
                        help="jax_rope backend (default: auto)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for all workers")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.single or args.process_id is not None:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
