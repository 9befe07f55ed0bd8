#!/usr/bin/python3
"""make_corpus.py -- writes the seed corpus of the fuzz harnesses into fuzz/corpus/.

Valid inputs, written by hand in the protobuf wire format and precondd's snapshot format, so
each harness starts from requests, snapshots and answers that reach deep into the code (a
fuzzer left alone with random bytes rarely gets past the first length field). Run it again
after a format changes; the files are small and kept in the tree.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint(num << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 1:
        return key + payload
    if wire == 2:
        return key + varint(len(payload)) + payload
    if wire == 5:
        return key + payload
    raise ValueError(wire)


def s(num, text):
    return field(num, 2, text if isinstance(text, bytes) else text.encode())


def u(num, v):
    return field(num, 0, v)


def packed_len(n):
    return n * (n + 1) // 2


def identity_packed(n, scale=1.0):
    vals = []
    for i in range(n):
        for j in range(i, n):
            vals.append(scale * (1.0 + i) if i == j else 0.01)
    return vals


def matrix(n, vals, bf16=False):
    if bf16:
        data = b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:]
                        for v in vals)
        return u(1, n) + u(2, 1) + s(3, data)
    return u(1, n) + s(3, struct.pack("<%df" % len(vals), *vals))


def write(folder, name, data):
    d = os.path.join(HERE, "corpus", folder)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def service():
    # fuzz_service.c's store holds job "j": tensor w 12 x 18 in 6 x 6 blocks, and b (18).
    def tensor(name, dims):
        return s(1, name) + s(2, b"".join(varint(d) for d in dims))
    reg_same = (s(1, "j") + s(3, tensor("w", [12, 18])) + s(3, tensor("b", [18])) +
                s(4, u(1, 6)) + s(5, "worker"))
    reg_new = s(1, "k") + s(3, tensor("w", [8, 12])) + s(4, u(1, 4) + field(3, 5, struct.pack("<f", 0.99)))
    write("service", "register-same", bytes([0]) + reg_same)
    write("service", "register-new", bytes([0]) + reg_new)
    write("service", "register-reuse-ended", bytes([0]) + reg_new + u(6, 1))
    blk = u(1, 1) + s(2, matrix(6, identity_packed(6))) + s(3, matrix(6, identity_packed(6)))
    blk16 = u(1, 2) + s(2, matrix(6, identity_packed(6), True)) + s(3, matrix(6, identity_packed(6), True))
    write("service", "push-fp32", bytes([1]) + s(1, "j") + u(2, 6) + s(3, blk))
    write("service", "push-two-bf16", bytes([1]) + s(1, "j") + u(2, 7) + s(3, blk) + s(3, blk16))
    write("service", "fetch-have", bytes([2]) + s(1, "j") + s(2, u(1, 0) + u(2, 1)) + u(4, 9))
    write("service", "fetch-bf16", bytes([2]) + s(1, "j") + u(3, 1))
    write("service", "stats-blocks", bytes([3]) + s(1, "j") + u(2, 1))
    write("service", "stats-all", bytes([3]) + u(2, 1))
    write("service", "health", bytes([4]))
    write("service", "end-job", bytes([5]) + s(1, "j"))


def snapshot():
    def le(fmt, *v):
        return struct.pack("<" + fmt, *v)

    def st(text):
        return le("I", len(text)) + text.encode()

    job = (st("j") + le("I", 0) + le("I", 4) + le("I", 0) + le("f", 1.0) + le("I", 4) +
           le("d", 1e-6) + le("I", 0) + le("Q", 3) +
           le("I", 1) + st("w") + le("I", 2) + le("QQ", 4, 8) +
           le("I", 1) + st("worker"))
    vals = identity_packed(4)

    def blocks(fmt):
        out = le("I", 2)
        for bid in range(2):
            out += le("I", bid) + le("QQ", 4, 4) + le("QQQQ", 3, 1, 1, 0) + le("dd", 1e-4, 0.5)
            if fmt >= 3:  # resets, failures in a row, last failure
                out += le("Q", 1) + le("I", 2) + st("left: not converged")
            out += le("%df" % len(vals), *vals) * 2
            out += bytes([1]) + le("QQ", 1, 3) + le("d", 1e-4) + le("II", 0, 5)
            if fmt >= 2:  # the result's aux figures
                out += le("ddd", 1.0, 0.0, 0.0)
            out += le("%df" % len(vals), *vals) * 2
        return out

    # First byte: the format, 1 + byte % 4 (fuzz_snapshot.c).
    write("snapshot", "one-job-two-blocks", bytes([0]) + le("I", 1) + job + blocks(1))
    write("snapshot", "format-3", bytes([2]) + le("I", 1) + job + blocks(3))
    write("snapshot", "empty", bytes([0]) + le("I", 0))
    # Format 4: the names of ended jobs follow the jobs (name, unix time, how).
    ended = le("I", 2) + st("gone") + le("QI", 1764590400, 0) + st("idle") + le("QI", 1764590460, 1)
    write("snapshot", "format-4-ended", bytes([3]) + le("I", 1) + job + blocks(3) + ended)


def fetch_decode():
    # fuzz_fetch_decode.c: block b has orders (1, 2, 3, 4, 7, 8, 16, 33)[b % 8] and [b / 8 % 8].
    r0 = (u(1, 0) + u(2, 1) + u(3, 1) + field(4, 1, struct.pack("<d", 1e-3)) +
          s(6, matrix(1, [2.0])) + s(7, matrix(1, [3.0])) + u(8, 4))
    r9 = (u(1, 9) + u(2, 2) + s(6, matrix(2, identity_packed(2), True)) +
          s(7, matrix(2, identity_packed(2), True)))
    write("fetch_decode", "two-blocks", s(1, r0) + s(1, r9))
    write("fetch_decode", "empty", b"")


def codec():
    vals = [0.0, -0.0, 1.0, -2.5, 3.3895314e38, 1e-40, float("inf"), float("nan"), 65504.0]
    write("codec", "specials", bytes([3]) + struct.pack("<%df" % len(vals), *vals))
    write("codec", "order-4", bytes([4]) + struct.pack("<10f", *identity_packed(4)))


if __name__ == "__main__":
    service()
    snapshot()
    fetch_decode()
    codec()
