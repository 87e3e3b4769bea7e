"""aristax.argtypes: the argparse converters of the CLI and the benchmark scripts."""

from __future__ import annotations

import argparse

import pytest

from aristax import argtypes


@pytest.mark.parametrize("convert, text, want", [
    (argtypes.positive_int, "3", 3), (argtypes.nonnegative_int, "0", 0),
    (argtypes.positive_float, "0.25", 0.25), (argtypes.positive_float, "1e3", 1000.0),
    (argtypes.positive_ints, "1,2,4", [1, 2, 4]), (argtypes.positive_ints, "7", [7]),
    (argtypes.mesh_shape, "2x4", (2, 4)), (argtypes.mesh_shape, "8", (8,)),
    (argtypes.mesh_shape, "1X2x2", (1, 2, 2)),
])
def test_accepts(convert, text, want):
    got = convert(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("convert, text, said", [
    (argtypes.positive_int, "0", "give an integer >= 1"),
    (argtypes.positive_int, "2.5", "is not an integer"),
    (argtypes.nonnegative_int, "-1", "give an integer >= 0"),
    (argtypes.positive_float, "0", "give a finite number > 0"),
    (argtypes.positive_float, "inf", "give a finite number > 0"),
    (argtypes.positive_float, "nan", "give a finite number > 0"),
    (argtypes.positive_float, "fast", "is not a number"),
    (argtypes.positive_ints, "1,,2", "give integers >= 1 separated by commas"),
    (argtypes.positive_ints, "1,0", "give integers >= 1"),
    (argtypes.positive_ints, "", "give integers >= 1"),
    (argtypes.mesh_shape, "abc", "joined by x"),
    (argtypes.mesh_shape, "2x0", "axis sizes >= 1"),
    (argtypes.mesh_shape, "2x", "axis sizes >= 1"),
])
def test_refuses_with_the_value_and_the_fix(convert, text, said):
    with pytest.raises(argparse.ArgumentTypeError, match=said) as err:
        convert(text)
    assert repr(text) in str(err.value)
