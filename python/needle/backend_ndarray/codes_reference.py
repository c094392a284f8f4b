"""How every backend packs k-bit codes (src/README.md: pack_codes, unpack_scale), part of ndarray_backend_numpy.

n codes of `bits` bits each (1 <= bits <= 8) in ceil(n·bits / 8) bytes: code i at bits [i·bits, (i+1)·bits) of
a least-significant-bit-first stream (bit j of the stream is bit j % 8 of byte j // 8). So every 8 codes fill
exactly `bits` bytes: each group of 8 is a little-endian integer of `bits` bytes, code j of the group at bit
j·bits. That is how every backend packs them, so their bytes agree.
"""
import operator

import numpy as np


def code_bytes(n, bits):
    """Bytes holding n packed codes of `bits` bits."""
    return -(-n * bits // 8)


def check_bits(fn, bits, low=1):
    """bits as an int in low..8: TypeError for a float (as the compiled modules), else ValueError outside."""
    bits = operator.index(bits)
    if not low <= bits <= 8:
        raise ValueError(f"{fn}: bits must be in {low}..8, got {bits}")
    return bits


def pack_code_values(codes, bits):
    """Codes (integers < 2**bits, any shape) -> their packed bytes (uint8, ceil(n·bits / 8))."""
    codes = np.asarray(codes).reshape(-1)
    n, groups = codes.size, -(-codes.size // 8)
    padded = np.zeros(groups * 8, dtype=np.uint64)
    padded[:n] = codes
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    acc = np.bitwise_or.reduce(padded.reshape(groups, 8) << shifts, axis=1) if groups else np.zeros(0, np.uint64)
    packed = (acc[:, None] >> (np.arange(bits, dtype=np.uint64) * np.uint64(8))) & np.uint64(0xFF)
    return packed.astype(np.uint8).reshape(-1)[:code_bytes(n, bits)]


def unpack_code_values(packed, n, bits):
    """The inverse of pack_code_values: n codes (uint8) from their packed bytes."""
    groups = -(-n // 8)
    padded = np.zeros(groups * bits, dtype=np.uint64)
    padded[:code_bytes(n, bits)] = np.asarray(packed).reshape(-1)[:code_bytes(n, bits)]
    acc = np.bitwise_or.reduce(padded.reshape(groups, bits) << (np.arange(bits, dtype=np.uint64) * np.uint64(8)),
                               axis=1) if groups else np.zeros(0, np.uint64)
    codes = (acc[:, None] >> (np.arange(8, dtype=np.uint64) * np.uint64(bits))) & np.uint64(2**bits - 1)
    return codes.astype(np.uint8).reshape(-1)[:n]
