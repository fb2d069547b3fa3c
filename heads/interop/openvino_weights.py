"""Weight-only compression of an OpenVINO IR: int8 and int4 weights for the target's matmuls.

What CPU users of OpenVINO run is rarely an f32 IR: optimum-intel's exports default to 8-bit
weights and offer 4-bit, and on a memory-bound 2-core CPU that is the fastest plain decoding the
engine has. So a speed claim for OpenVINO needs those types beside f32
(docs/reports/2026-12-04-xeon-amx: 4-bit plain decodes faster than the f32 IR's GenAI default
there).

The pass rewrites every MatMul whose second input is a 2-D f32 constant (every linear layer and
the LM head; the embedding gather keeps its f32 table, of which decoding reads one row a token)
into the decompression pattern OpenVINO's CPU plugin recognises and runs without expanding the
weights: a low-precision constant -> Convert to f32 -> (minus a zero point) -> times a scale.

- `int8`: symmetric, one scale per output row: q = round(w / s), s = max|w| / 127, q in i8.
- `int4`: asymmetric, one scale and zero point per group of 32 inputs of each row (u4 values
  0..15); a row whose input size is not a multiple of 32 falls back to `int8`.

Written without NNCF (which optimum-intel uses for the same job), so set-up installs nothing more.
"""

from __future__ import annotations

import numpy as np

COMPRESSED_TYPES = ("int8", "int4")
INT4_GROUP = 32


def _quantise_int8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q [out, in] int8, scale [out, 1])."""
    scale = np.abs(rows).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    return np.clip(np.round(rows / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def _quantise_int4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [out, groups, 32] in 0..15, zero point [out, groups, 1] in 0..15, scale alike)."""
    groups = rows.reshape(rows.shape[0], -1, INT4_GROUP)
    low, high = groups.min(axis=2, keepdims=True), groups.max(axis=2, keepdims=True)
    scale = (high - low) / 15.0
    scale[scale == 0] = 1.0
    zero = np.clip(np.round(-low / scale), 0, 15)
    q = np.clip(np.round(groups / scale) + zero, 0, 15)
    return q.astype(np.uint8), zero.astype(np.uint8), scale.astype(np.float32)


def _uses_int4(kind: str, rows: np.ndarray) -> bool:
    return kind == "int4" and rows.shape[1] % INT4_GROUP == 0


def dequantized(kind: str, rows: np.ndarray) -> np.ndarray:
    """What `kind` turns `rows` ([out, in] f32) into, in numpy: the reference the tests hold the
    compressed IR to."""
    if _uses_int4(kind, rows):
        q, zero, scale = _quantise_int4(rows)
        return ((q.astype(np.float32) - zero) * scale).reshape(rows.shape)
    q, scale = _quantise_int8(rows)
    return q.astype(np.float32) * scale


def _decompressed(ops, ov, kind: str, rows: np.ndarray):
    """The IR subgraph that yields `rows` as `kind` stores them ([out, in] f32)."""
    if _uses_int4(kind, rows):
        q, zero, scale = _quantise_int4(rows)
        values = ops.convert(ops.constant(q, ov.Type.u4), ov.Type.f32)
        zero_point = ops.convert(ops.constant(zero, ov.Type.u4), ov.Type.f32)
        grouped = ops.multiply(ops.subtract(values, zero_point), ops.constant(scale))
        shape = ops.constant(np.array(rows.shape, dtype=np.int64))
        return ops.reshape(grouped, shape, False)
    q, scale = _quantise_int8(rows)
    return ops.multiply(ops.convert(ops.constant(q, ov.Type.i8), ov.Type.f32), ops.constant(scale))


def compress_weights(model, kind: str) -> int:
    """Rewrite `model`'s (an openvino.Model) constant 2-D f32 matmul weights in place as `kind`
    (int8 or int4); returns how many matmuls were rewritten."""
    import openvino as ov
    from openvino import opset13 as ops

    if kind not in COMPRESSED_TYPES:
        raise ValueError(f"compress_weights: kind={kind!r}, use one of {COMPRESSED_TYPES}.")
    done = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        const = node.input_value(1).get_node()
        if const.get_type_name() != "Constant" or const.get_element_type() != ov.Type.f32:
            continue
        data = const.get_data()
        if data.ndim != 2:
            continue
        transposed = bool(node.get_attributes()["transpose_b"])
        rows = np.ascontiguousarray(data if transposed else data.T, dtype=np.float32)
        new = _decompressed(ops, ov, kind, rows)
        if not transposed:
            new = ops.transpose(new, ops.constant(np.array([1, 0], dtype=np.int64)))
        node.input(1).replace_source_output(new.output(0))
        done += 1
    return done
