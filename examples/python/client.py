#!/usr/bin/python3
"""A precond client in Python (grpcio): register, push statistics, fetch roots, read stats.

Shows that any standard gRPC client generated from proto/precond/v1/precond.proto talks to
precondd. Stubs are generated at run time into a temporary folder with grpc_tools.protoc
(Debian: python3-grpcio, python3-grpc-tools, python3-numpy), so nothing is checked in.

    examples/python/client.py --addr 127.0.0.1:50551          # against a running precondd
    examples/python/client.py --addr unix:/tmp/precondd.sock --token-file tok

It registers job "py-example" with one 256 x 96 weight (block size 128: two blocks of
128 x 96), pushes G G^T and G^T G of random gradients for a few steps, waits for the
daemon's roots, checks them against numpy (R^(-1/4) R^(-1/4) R^(-1/4) R^(-1/4) ~ (R + ridge)^-1),
fetches again to show only newer versions come back, and prints the daemon's stats.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
MAX_MESSAGE = 256 << 20  # as precondd: a 4096-block push is about 64 MiB


def load_stubs():
    """Generates precond_pb2 / precond_pb2_grpc into a temp dir and imports them."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="precond-stubs-")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", "precond/v1/precond.proto"])
    if rc != 0:
        sys.exit(f"grpc_tools.protoc failed ({rc}) on {PROTO_ROOT}/precond/v1/precond.proto")
    sys.path.insert(0, out)
    from precond.v1 import precond_pb2, precond_pb2_grpc  # noqa: E402
    return precond_pb2, precond_pb2_grpc


def packed_upper(a):
    """Upper triangle row by row: the wire's packed layout."""
    return a[np.triu_indices(a.shape[0])].astype("<f4")


def unpack_upper(values, n):
    a = np.zeros((n, n), dtype=np.float64)
    a[np.triu_indices(n)] = values
    return a + np.triu(a, 1).T


def decode(pb2, m):
    if m.encoding == pb2.ENCODING_BF16:
        raw = np.frombuffer(m.data, dtype="<u2").astype(np.uint32) << 16
        return unpack_upper(raw.view(np.float32), m.n)
    return unpack_upper(np.frombuffer(m.data, dtype="<f4"), m.n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--addr", default=os.environ.get("PRECOND_ADDR", "127.0.0.1:50551"))
    ap.add_argument("--token-file", help="shared token, sent as 'authorization: Bearer T'")
    ap.add_argument("--job", default="py-example")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for roots")
    args = ap.parse_args()

    import grpc
    pb2, pb2_grpc = load_stubs()
    metadata = []
    if args.token_file:
        with open(args.token_file) as f:
            metadata.append(("authorization", "Bearer " + f.readline().strip()))
    options = [("grpc.max_receive_message_length", MAX_MESSAGE),
               ("grpc.max_send_message_length", MAX_MESSAGE)]
    channel = grpc.insecure_channel(args.addr, options=options)
    stub = pb2_grpc.PreconditionerStub(channel)

    shape = (256, 96)
    reg = stub.Register(pb2.RegisterRequest(
        job=args.job, mode=pb2.MODE_SHAMPOO, worker=f"python-{os.getpid()}",
        tensors=[pb2.TensorSpec(name="dense.w", shape=list(shape))],
        shampoo=pb2.ShampooOptions(block_size=128, root_exponent=4, epsilon=1e-6)),
        metadata=metadata, timeout=10, wait_for_ready=True)
    print(f"registered {args.job}: {len(reg.blocks)} blocks, resumed at step {reg.resumed_step}")
    for b in reg.blocks:
        print(f"  block {b.block_id}: rows {b.row0}+{b.rows}, cols {b.col0}+{b.cols}, owner {b.owner}")

    rng = np.random.default_rng(0)
    sums = {}
    for step in range(1, args.steps + 1):
        g = rng.standard_normal(shape).astype(np.float32)
        blocks = []
        for b in reg.blocks:
            gb = g[b.row0:b.row0 + b.rows, b.col0:b.col0 + b.cols].astype(np.float64)
            left, right = gb @ gb.T, gb.T @ gb
            sl, sr = sums.get(b.block_id, (0, 0))
            sums[b.block_id] = (sl + left, sr + right)
            blocks.append(pb2.BlockStatistics(
                block_id=b.block_id,
                left=pb2.PackedMatrix(n=b.rows, data=packed_upper(left).tobytes()),
                right=pb2.PackedMatrix(n=b.cols, data=packed_upper(right).tobytes())))
        r = stub.PushStatistics(pb2.PushRequest(job=args.job, step=step, blocks=blocks),
                                metadata=metadata, timeout=10)
        print(f"step {step}: pushed {len(blocks)} blocks, {r.accepted} accepted")

    # Poll until every block has a root computed from the last step.
    have, roots = {}, {}
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        resp = stub.FetchPreconditioners(pb2.FetchRequest(
            job=args.job, step=args.steps,
            have=[pb2.BlockVersion(block_id=k, version=v) for k, v in have.items()]),
            metadata=metadata, timeout=10)
        for p in resp.preconditioners:
            have[p.block_id] = p.version
            roots[p.block_id] = p
        if len(roots) == len(reg.blocks) and all(
                p.source_step >= args.steps for p in roots.values()):
            break
        time.sleep(0.05)
    else:
        sys.exit(f"no roots for every block within {args.timeout} s")

    worst = 0.0
    for b in reg.blocks:
        p = roots[b.block_id]
        # Which daemon-side statistic the root came from depends on its EMA; with the
        # default beta2 = 1 it is the sum of the pushed increments.
        for side, stat in (("left", sums[b.block_id][0]), ("right", sums[b.block_id][1])):
            x = decode(pb2, getattr(p, side))
            x4 = np.linalg.matrix_power(x, 4)
            lam = np.linalg.eigvalsh(stat)[-1]
            ridge = 1e-6 * max(lam, 1e-16)
            a = stat + ridge * np.eye(stat.shape[0])
            rel = np.linalg.norm(x4 @ a - np.eye(a.shape[0])) / np.sqrt(a.shape[0])
            worst = max(worst, rel)
        print(f"block {b.block_id}: version {p.version}, source step {p.source_step}, "
              f"method {pb2.Method.Name(p.method)}, error {p.error:.2e}")
    print(f"max |X^4 (A + ridge I) - I| (rms) over blocks: {worst:.2e}")

    again = stub.FetchPreconditioners(pb2.FetchRequest(
        job=args.job, have=[pb2.BlockVersion(block_id=k, version=v) for k, v in have.items()]),
        metadata=metadata, timeout=10)
    print(f"fetch with current versions returned {len(again.preconditioners)} newer blocks")

    st = stub.GetStats(pb2.StatsRequest(job=args.job, blocks=True), metadata=metadata, timeout=10)
    print(f"precondd {st.version}: {st.roots_computed} roots computed, {st.roots_failed} failed, "
          f"queue depth {st.queue_depth}, bytes in {st.bytes_in}, out {st.bytes_out}")
    for b in st.block_stats:
        print(f"  {b.job}/{b.block_id} {b.tensor} {b.rows}x{b.cols}: version {b.version}, "
              f"staleness {b.staleness}, last {b.last_compute_ms:.2f} ms")
    channel.close()


if __name__ == "__main__":
    main()
