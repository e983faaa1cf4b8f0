"""Wire codecs: how float32 data crosses between processes when a reduction
is compressed (``codec=`` of allreduce / psum / pmean / allreduce_gradients).

The engine (xla_ffi/engine/codec.h) encodes each process's contribution,
decodes it on the server, sums in float32 in rank order, and encodes the
result once more for the way back; every process keeps the decoded result,
so all of them hold the same bits. The codec applies to the bytes the
transport carries: inside a host the host stage moves float32 through memory
(exact), and a group of one process sends nothing.

  none  float32, 4 bytes per element.
  bf16  bfloat16, round to nearest even: 2 bytes.
  fp16  float16 with a power-of-two scale per block of 256 elements that
        keeps the block's largest magnitude below 2^15: 2 bytes + 4 per block.
  int8  int8 with a scale per block (largest magnitude / 127, cut to 17
        significant bits so that decoding is exact), round to nearest even:
        1 byte + 4 per block. A block that holds inf or NaN decodes to NaN; one
        whose largest magnitude is below 2^-100 decodes to zeros.

Blocks start at multiples of 256 elements of each reduced buffer. This module
holds the same codecs in numpy (``roundtrip_np``: the engine's bits, for
checks) and in jax (``roundtrip``). Error feedback takes what the engine
itself reports it lost (allreduce.bind_with_loss), since which process
encodes what depends on the topology.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

CODECS = ("none", "bf16", "fp16", "int8")
BLOCK = 256
# int8: blocks whose largest magnitude is below this decode to zeros.
INT8_SMALLEST = np.float32(2.0**-100)
# Bytes per element on the wire, and per block for the scale.
_VALUE_BYTES = {"none": 4, "bf16": 2, "fp16": 2, "int8": 1}
_SCALE_BYTES = {"none": 0, "bf16": 0, "fp16": 4, "int8": 4}


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; herring_jax's codecs are "
                         f"{', '.join(repr(c) for c in CODECS)}")
    return codec


def wire_bytes(codec: str, count: int) -> int:
    """Bytes of `count` float32 elements encoded (one whole buffer)."""
    blocks = -(-count // BLOCK)
    return count * _VALUE_BYTES[codec] + blocks * _SCALE_BYTES[codec]


def _blocks_np(x: np.ndarray) -> tuple[np.ndarray, int]:
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    pad = (-flat.size) % BLOCK
    return np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, BLOCK), flat.size


def _int8_scale_np(m: np.ndarray) -> np.ndarray:
    s = (m / np.float32(127)).astype(np.float32)
    return (s.view(np.uint32) & np.uint32(0xFFFFFF80)).view(np.float32)


def roundtrip_np(codec: str, x: np.ndarray) -> np.ndarray:
    """decode(encode(x)) in numpy, bit for bit as the engine computes it."""
    check_codec(codec)
    x = np.asarray(x, dtype=np.float32)
    if codec == "none":
        return x.copy()
    if codec == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    b, n = _blocks_np(x)
    a = np.abs(b)
    finite = a <= np.finfo(np.float32).max
    m = np.max(np.where(finite, a, np.float32(0)), axis=1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if codec == "fp16":
            e = np.frexp(m)[1].astype(np.int32)
            s = np.where(m == 0, np.float32(1),
                         np.ldexp(np.float32(1), np.maximum(e - 15, -126)).astype(np.float32))
            s = s.astype(np.float32)
            inv = (np.float32(1) / s).astype(np.float32)
            out = (b * inv).astype(np.float16).astype(np.float32) * s
        else:
            bad = ~np.all(finite, axis=1, keepdims=True)
            zero = m < INT8_SMALLEST
            safe_m = np.where(zero, np.float32(1), m).astype(np.float32)
            inv = (np.float32(127) / safe_m).astype(np.float32)
            q = np.clip(np.rint(b * inv), -127, 127).astype(np.int8)
            s = np.where(bad, np.float32(np.nan),
                         np.where(zero, np.float32(0), _int8_scale_np(m))).astype(np.float32)
            out = q.astype(np.float32) * s
    return out.astype(np.float32).reshape(-1)[:n].reshape(x.shape)


def roundtrip(codec: str, x):
    """decode(encode(x)) in jax, for a float32 array whose blocks start at its
    first element (a flat buffer as the engine reduces it): what a process's
    contribution becomes on the wire."""
    import jax
    import jax.numpy as jnp

    check_codec(codec)
    if codec == "none":
        return x
    if codec == "bf16":
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    shape, n = x.shape, x.size
    flat = x.reshape(-1)
    b = jnp.pad(flat, (0, (-n) % BLOCK)).reshape(-1, BLOCK)
    a = jnp.abs(b)
    finite = a <= jnp.finfo(jnp.float32).max
    m = jnp.max(jnp.where(finite, a, 0.0), axis=1, keepdims=True)
    if codec == "fp16":
        e = jnp.frexp(m)[1]
        s = jnp.where(m == 0, 1.0, jnp.ldexp(jnp.float32(1), jnp.maximum(e - 15, -126)))
        out = (b * (1.0 / s)).astype(jnp.float16).astype(jnp.float32) * s
    else:
        bad = ~jnp.all(finite, axis=1, keepdims=True)
        zero = m < INT8_SMALLEST
        inv = jnp.float32(127) / jnp.where(zero, 1.0, m)
        q = jnp.clip(jnp.round(b * inv), -127, 127)
        scale = jax.lax.bitcast_convert_type(m / jnp.float32(127), jnp.uint32)
        cut = scale & jnp.uint32(0xFFFFFF80)
        s = jnp.where(bad, jnp.nan,
                      jnp.where(zero, 0.0, jax.lax.bitcast_convert_type(cut, jnp.float32)))
        out = q * s
    return out.reshape(-1)[:n].reshape(shape)


def reduce_np(codec: str, op: str, contributions: list[np.ndarray], devices: int) -> np.ndarray:
    """The engine's compressed reduction over the transport of float32
    `contributions` (one per process of the group, in rank order, each
    already summed over its devices), `devices` devices in all (mean)."""
    acc = roundtrip_np(codec, contributions[0])
    for x in contributions[1:]:
        acc = acc + roundtrip_np(codec, x)
    if op == "mean":
        acc = acc / np.float32(devices)
    return roundtrip_np(codec, acc.astype(np.float32))
