"""The blockwise random Hadamard transform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import ops_reference as ref
import pytest

from nvfp4_ops import TE_SIGNS, hadamard_matrix, hadamard_transform


def test_matrix_is_te_signs_times_sylvester_and_orthonormal():
    h = hadamard_matrix()
    np.testing.assert_array_equal(h, ref.hadamard16())
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    assert TE_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    assert np.all(np.abs(h) == 0.25)


def test_transform_twice_with_transpose_gives_x_back():
    x = jax.random.normal(jax.random.key(0), (3, 64, 5))
    y = hadamard_transform(x, axis=1)
    assert not np.allclose(np.asarray(y), np.asarray(x))
    back = hadamard_transform(y, axis=1, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)


def test_transform_matches_tilewise_matmul_and_preserves_contractions():
    a = jax.random.normal(jax.random.key(1), (4, 32))
    b = jax.random.normal(jax.random.key(2), (6, 32))
    ra, rb = hadamard_transform(a), hadamard_transform(b)
    np.testing.assert_array_equal(np.asarray(ra), np.asarray(ref.rotate(a)))
    np.testing.assert_allclose(np.asarray(ra @ rb.T), np.asarray(a @ b.T), rtol=1e-5, atol=1e-5)


def test_other_sizes_and_errors():
    h4 = hadamard_matrix(4, signs=None)
    np.testing.assert_allclose(h4 @ h4.T, np.eye(4), atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="multiple of size=16"):
        hadamard_transform(jnp.ones((3, 20)))
    with pytest.raises(ValueError, match="must be \\+1 or -1"):
        hadamard_matrix(4, signs=(1, 2, 1, 1))
