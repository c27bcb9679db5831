#!/usr/bin/env python3
"""Writes the seed corpus (tests/fuzz/corpus/seed-*): one input per interesting shape, in the layout
fuzz_checks.hpp describes. The fuzzer grows its own corpus from these; regression inputs are kept
beside them as regression-*."""
import pathlib
import struct

HALF, BF16, F32, F64 = 0, 1, 2, 3
PACK = {HALF: "e", F32: "f", F64: "d"}


def elements(kind, values):
    if kind == BF16:  # the upper half of the float's bits
        return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in values)
    return b"".join(struct.pack("<" + PACK[kind], v) for v in values)


def raw16(bits):
    return b"".join(struct.pack("<H", b) for b in bits)


def single(kind, values, max_norm=64, epsilon=0, limit=64, stride=1, offset3=False, raw=b""):
    head = kind | ((stride - 1) << 2) | (0x10 if offset3 else 0)
    return bytes([head, max_norm, epsilon, limit, 0, 0]) + raw + (elements(kind, values) if values else b"")


def group(kinds, parts, max_norm=64, epsilon=0):
    types = sum(k << (2 * j) for j, k in enumerate(kinds))
    body = b""
    for j, (k, values) in enumerate(zip(kinds, parts)):
        if j + 1 < len(kinds):
            body += bytes([len(values)])
        body += elements(k, values)
    return bytes([0x20, max_norm, epsilon, 64, len(kinds) - 1, types]) + body


inf, nan = float("inf"), float("nan")
seeds = {
    "half-burn-300": single(HALF, [300.0]),
    "half-60000-pair": single(HALF, [60000.0, 60000.0]),
    "half-max-and-subnormal": single(HALF, [65504.0, -65504.0, 5.96e-8, 1.0], stride=2, offset3=True),
    "half-1024-tens": single(HALF, [10.0] * 1024, max_norm=7),
    "half-odd-length-mixed": single(HALF, [1e-7, 3e4, -2.5, 6e-5, 0.0, -0.0, 1e4], max_norm=100, epsilon=1),
    "half-raw-nan-payloads": bytes([0, 64, 0, 64, 0, 0]) + raw16([0x7e01, 0x7c00, 0xfc00, 0x0001, 0x8001, 0x7bff]),
    "half-inf": single(HALF, [1.0, inf, -2.0], max_norm=7),
    "half-clip-by-value-limit-zero": single(HALF, [3.0, -3.0, 0.0, nan], limit=1),
    "bf16-near-max": single(BF16, [3.38e38, -3.38e38, 1.0], stride=3),
    "bf16-tiny": single(BF16, [1e-39, 2e-40, -9e-41], max_norm=32),
    "bf16-nan": single(BF16, [1.0, nan], max_norm=3),
    "f32-1e20-pair": single(F32, [1e20, 1e20], max_norm=7),
    "f32-max": single(F32, [3.4028235e38] * 5, stride=2),
    "f32-subnormals": single(F32, [1e-45, -1e-44, 1e-40, 1e-38], max_norm=100, offset3=True),
    "f32-mixed-magnitudes": single(F32, [1e30, 1e-30, -1e10, 1.0, 3e-39, -7e37, 2.0] * 150, max_norm=120),
    "f32-raw-max-norm": single(F32, [3.0, 4.0], max_norm=0, raw=struct.pack("<d", 2.5)),
    "f32-negative-max-norm": single(F32, [3.0, 4.0], max_norm=4),
    "f32-nan-max-norm": single(F32, [3.0, 4.0], max_norm=3),
    "f32-bad-epsilon": single(F32, [3.0, 4.0], epsilon=2, raw=struct.pack("<d", -1.0)),
    "f32-epsilon-pytorch": single(F32, [3.0, 4.0], epsilon=1, max_norm=100),
    "f64-1e300-pair": single(F64, [1e300, 1e300], max_norm=7),
    "f64-1.5e308-pair": single(F64, [1.5e308, 1.5e308], max_norm=7),
    "f64-max-many": single(F64, [1.7976931348623157e308] * 700, max_norm=200, stride=2),
    "f64-subnormals": single(F64, [5e-324, -1e-320, 2e-310, 1e-300], max_norm=100),
    "f64-mixed": single(F64, [1e200, -1e-200, 3.0, 1e-310, -2e150] * 40, max_norm=90, offset3=True),
    "f64-infinite-max-norm": single(F64, [1e300, 1e300], max_norm=2),
    "f64-max-norm-zero": single(F64, [1.0, -2.0, 3.0], max_norm=1),
    "empty-half": single(HALF, []),
    "empty-f64": single(F64, []),
    "group-half-f32": group([HALF, F32], [[300.0, -400.0], [1e20, 1.0, -2.0]]),
    "group-all-types": group([HALF, BF16, F32, F64], [[1.0] * 7, [3e38, 2.0], [1e-40, 5.0], [1e300, -1e-300, 4.0]],
                             max_norm=100),
    "group-nan-in-last": group([F32, F64], [[1.0, 2.0], [3.0, nan]], max_norm=20),
    "group-inf-bad-max-norm": group([HALF, HALF], [[1.0, inf], [2.0]], max_norm=4),
    "group-empty-parts": group([F64, HALF, F32], [[], [], []]),
}
corpus = pathlib.Path(__file__).resolve().parent / "corpus"
corpus.mkdir(exist_ok=True)
for name, data in seeds.items():
    (corpus / ("seed-" + name)).write_bytes(data)
