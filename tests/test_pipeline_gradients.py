"""The accumulator layout of pipelined programs: slots for like stages, flat vectors otherwise."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from keras_ipu.keras.pipelined.gradients import GradientLayout

LIKE = [[(0, (4, 3), "float32"), (1, (3,), "float32")],
        [(2, (4, 3), "float32"), (3, (3,), "float32")]]
UNLIKE = [[(0, (40, 30), "float32")], [(1, (30, 40), "float32"), (2, (5,), "float32")]]


def _flat_lengths(variables):
    return {"float32": max(sum(int(np.prod(s)) for _, s, _ in ipu) for ipu in variables)}


def test_like_stages_share_slots_and_unlike_ones_use_flat_vectors():
    like = GradientLayout.of(LIKE, _flat_lengths(LIKE))
    assert like.slots == (((4, 3), "float32"), ((3,), "float32"))
    assert like.slot_of == ({0: 0, 1: 1}, {2: 0, 3: 1})
    unlike = GradientLayout.of(UNLIKE, _flat_lengths(UNLIKE))
    assert unlike.slots is None  # slots would hold 2,405 values against 1,205


def test_pack_update_and_unpack_agree_in_both_layouts():
    rng = np.random.default_rng(0)
    for variables in (LIKE, UNLIKE):
        layout = GradientLayout.of(variables, _flat_lengths(variables))
        for ipu, ipu_variables in enumerate(variables):
            grads = {i: jnp.asarray(rng.standard_normal(s), "float32")
                     for i, s, _ in ipu_variables}
            first = dict(list(grads.items())[:1])
            packed = layout.pack(ipu, first, "float32")  # the others are zeros
            acc = layout.update(ipu, packed, grads, lambda old, g: old + 2 * g)
            for (index, shape, _), got in zip(ipu_variables, layout.unpack(ipu, acc)):
                expected = 2 * grads[index] + (grads[index] if index in first else 0)
                assert got.shape == shape
                np.testing.assert_allclose(got, expected, rtol=1e-6)
