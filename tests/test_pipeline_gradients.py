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
            packed = layout.pack(ipu, first, {"float32": "float32"})  # the others are zeros
            acc = layout.update(ipu, packed, grads, lambda old, g: old + 2 * g)
            for (index, shape, _), got in zip(ipu_variables, layout.unpack(ipu, acc)):
                expected = 2 * grads[index] + (grads[index] if index in first else 0)
                assert got.shape == shape
                np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_each_variable_dtype_accumulates_in_its_own_type_in_both_layouts():
    like = [[(0, (4, 3), "float32"), (1, (3,), "float16")],
            [(2, (4, 3), "float32"), (3, (3,), "float16")]]
    unlike = [[(0, (40, 30), "float32"), (1, (3,), "float16")],
              [(2, (30, 40), "float32"), (3, (3,), "float16")]]
    accumulators = {"float32": "bfloat16", "float16": "float32"}
    for variables, lengths, slots in ((like, {"float32": 12, "float16": 3}, True),
                                      (unlike, {"float32": 1200, "float16": 3}, False)):
        layout = GradientLayout.of(variables, lengths)
        assert (layout.slots is not None) == slots
        grads = {v[0]: jnp.ones(v[1], v[2]) for v in variables[0]}
        for acc in (layout.zeros(accumulators), layout.pack(0, grads, accumulators)):
            if slots:
                got = [(str(a.dtype), kind) for a, (_, kind) in zip(acc, layout.slots)]
            else:
                got = [(str(a.dtype), kind) for kind, a in acc.items()]
            assert got and all(dtype == accumulators[kind] for dtype, kind in got)


def test_a_flat_update_touches_only_the_given_variables_one_run_at_a_time():
    # IPU 0: float32 variables 0, 1, 3, 5 and float16 variable 2 among them; IPU 1 is shorter.
    variables = [[(0, (3, 2), "float32"), (1, (4,), "float32"), (2, (5,), "float16"),
                  (3, (2,), "float32"), (5, (40, 30), "float32")], [(4, (30, 40), "float32")]]
    lengths = {"float32": 1212, "float16": 5}
    layout = GradientLayout.of(variables, lengths)
    assert layout.slots is None
    rng = np.random.default_rng(1)
    old = {dtype: jnp.asarray(rng.standard_normal(n), "float32") for dtype, n in lengths.items()}
    grads = {i: jnp.asarray(rng.standard_normal(s), "float32")
             for ipu in variables for i, s, _ in ipu}
    given = {i: grads[i] for i in (0, 1, 3, 5)}  # variable 2 is another stage's
    # Back to back per dtype: the float32 ones are one run, the whole vector.
    assert [(kind, offset, len(parts)) for kind, offset, parts in layout._runs(0, given)] == [
        ("float32", 0, 4)]
    acc = layout.update(0, old, given, lambda o, g: o + 2 * g)
    for (index, _, _), was, now in zip(variables[0], layout.unpack(0, old),
                                       layout.unpack(0, acc)):
        expected = was + 2 * grads[index] if index in given else was
        np.testing.assert_allclose(now, expected, rtol=1e-6)
    # Without variable 1, variable 3 starts a run of its own.
    assert [(k, o) for k, o, _ in layout._runs(0, {0: grads[0], 3: grads[3]})] == [
        ("float32", 0), ("float32", 10)]
    # IPU 1's padding, past its variable, keeps its values.
    acc = layout.update(1, old, {4: grads[4]}, lambda o, g: o + 2 * g)
    np.testing.assert_allclose(acc["float32"][:1200], old["float32"][:1200] + 2 * grads[4].ravel(),
                               rtol=1e-6)
    np.testing.assert_array_equal(acc["float32"][1200:], old["float32"][1200:])
