"""``check_int``: the one int check behind every public constructor's arguments."""

from __future__ import annotations

import pytest

from hf_blockdiag_cp._validate import check_int
from hf_blockdiag_cp.data.packing import check_overflow


@pytest.mark.parametrize("value, kwargs", [(0, {}), (-3, {}), (1, {"minimum": 1}), (0, {"below": ("n", 1)}),
                                           (2, {"minimum": 0, "below": ("cp_size", 3)})])
def test_accepted_values_are_returned(value, kwargs):
    assert check_int("x", value, **kwargs) == value


@pytest.mark.parametrize("value, kwargs, message", [
    (True, {}, "x=True must be an int"),
    (1.0, {}, "x=1.0 must be an int"),
    (None, {}, "x=None must be an int"),
    ("4", {"minimum": 1}, "x='4' must be an int >= 1"),
    (0, {"minimum": 1}, "x=0 must be an int >= 1"),
    (2, {"minimum": 0, "below": ("cp_size", 2)}, "x=2 must be an int in [0, cp_size=2)"),
    (-1, {"minimum": 0, "below": ("cp_size", 2)}, "x=-1 must be an int in [0, cp_size=2)"),
    (5, {"below": ("n", 5)}, "x=5 must be an int < n=5"),
    (-1, {"minimum": 0, "hint": "e.g. tokenizer.pad_token_id"},
     "x=-1 must be an int >= 0 (e.g. tokenizer.pad_token_id)"),
])
def test_rejected_values_name_the_argument(value, kwargs, message):
    with pytest.raises(ValueError) as info:
        check_int("x", value, **kwargs)
    assert str(info.value) == message


def test_check_overflow():
    assert check_overflow("truncate") == "truncate"
    with pytest.raises(ValueError, match="overflow='cut' is not one of split, truncate, error"):
        check_overflow("cut")
