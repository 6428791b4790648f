"""`jax.lax.ragged_all_to_all` on GPUs (and TPUs), an exact emulation of it on XLA:CPU.

XLA:CPU has no ragged all-to-all: with jax 0.10.2 a `shard_map` calling it on fake CPU devices
compiles to `UNIMPLEMENTED: HLO opcode ragged-all-to-all is not supported by XLA:CPU
ThunkEmitter` (jax-ml/jax#34755 asks for it). `ragged_all_to_all` therefore lowers to the
primitive on every platform but CPU (`jax.lax.platform_dependent`, decided when the function is
lowered: the other branch is not in the compiled program) and on CPU to
`emulated_ragged_all_to_all`, which computes the same result from one dense `all_to_all`:

    chunks [K, chunk_rows, ...]   chunk i: operand[input_offsets[i] : + send_sizes[i]], zero-padded
    all_to_all over axis_name     the K / n chunks each device sends to each other device
    scatter into `output`         chunk i of source s at all_to_all(output_offsets)[i] (where the
                                  sender said), recv_sizes[i] rows; every other row of `output`
                                  kept

which is `jax.lax.ragged_all_to_all`'s documented semantics (K = len(input_offsets) chunks, chunk
i sent to device i // (K / n) of the n along `axis_name`). Its gradients are those of the dense
ops (a gather, an all-to-all, a scatter), which move the same rows back as the primitive's
transpose (another ragged all-to-all). The emulation moves every chunk padded to `chunk_rows`
rows: it is for CPU tests and fake devices, not a measure of the primitive's traffic.

Example (inside a `shard_map` over axis "x" of 2 devices, as `jax.lax.ragged_all_to_all`'s
docstring example):
    device 0: operand [1, 2, 2], input_offsets [0, 1], send_sizes [1, 2], output_offsets [0, 0],
              recv_sizes [1, 1]  ->  [1, 3, 0, 0]
    device 1: operand [3, 4, 0], input_offsets [0, 1], send_sizes [1, 1], output_offsets [1, 2],
              recv_sizes [2, 1]  ->  [2, 2, 4, 0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name: tuple[str, ...], chunk_rows: int) -> jax.Array:  # fmt: skip
    """`jax.lax.ragged_all_to_all(...)`, emulated on CPU (module doc).

    Args:
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name: as
            `jax.lax.ragged_all_to_all` (the offsets and sizes int32 [K]).
        chunk_rows: the most rows any chunk has (the emulation pads each chunk to it; a chunk
            larger loses its rows past it), ignored by the primitive.
    """

    def emulated(*args):
        return emulated_ragged_all_to_all(*args, axis_name=axis_name, chunk_rows=chunk_rows)

    def native(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

    return jax.lax.platform_dependent(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
        cpu=emulated, default=native,
    )  # fmt: skip


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name: tuple[str, ...],
                               chunk_rows: int) -> jax.Array:  # fmt: skip
    """`jax.lax.ragged_all_to_all`'s result from a dense `all_to_all` of chunks of `chunk_rows`
    rows (module doc); rows out of range are neither read nor written."""
    rows = jnp.arange(chunk_rows, dtype=jnp.int32)
    read = jnp.where(rows < send_sizes[:, None], input_offsets[:, None] + rows, operand.shape[0])
    chunks = operand.at[read].get(mode="fill", fill_value=0)  # [K, chunk_rows, ...]
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # by source
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    write = jnp.where(rows < recv_sizes[:, None], at[:, None] + rows, output.shape[0])
    flat = received.reshape(-1, *operand.shape[1:])
    return output.at[write.reshape(-1)].set(flat, mode="drop")
