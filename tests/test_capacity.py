"""The one capacity syntax: slot counts, percentages of all experts, memory budgets; everything else refused."""

import pytest

from moecache.capacity import capacity_spec, parse_capacities, parse_capacity
from moecache.errors import MoecacheError

MiB = 2**20


def slots(value, num_keys=1664, expert_bytes=6 * MiB):
    return parse_capacity(value, key="capacity", num_keys=num_keys, expert_bytes=expert_bytes)


@pytest.mark.parametrize(
    "value,expected",
    [
        (0, 0),
        (416, 416),
        ("416", 416),
        (1664, 1664),
        ("25%", 416),  # 26 layers x 64 experts: exactly 416
        ("100%", 1664),
        ("0%", 0),
        ("12.5%", 208),
        ("10%", 166),  # 166.4 rounds down
        ("0.1%", 1),  # 1.664 rounds down
        ("12GiB", 1664),  # 12 GiB / 6 MiB = 2048 slots > 1664 keys: every key has a slot
        ("600MiB", 100),
        ("601MiB", 100),  # 100.17 rounds down
        ("1.5GB", 238),  # 1.5e9 / 6291456 = 238.4
        ("6291456B", 1),
        (" 25% ", 416),
    ],
)
def test_accepted_forms(value, expected):
    assert slots(value) == expected


def test_percentage_is_exact_decimal_not_float():
    # 29% of 100 keys is 29 exactly (0.29 * 100 in binary floating point is 28.999999999999996)
    assert slots("29%", num_keys=100) == 29
    assert slots("57%", num_keys=100) == 57


@pytest.mark.parametrize(
    "value,culprit",
    [
        (3.7, "capacity=3.7"),
        (4.0, "capacity=4.0"),
        (True, "capacity=true"),
        (False, "capacity=false"),
        (None, "capacity=null"),
        ("abc", "capacity='abc'"),
        ("3.7", "capacity='3.7'"),
        (-1, "capacity=-1"),
        ("101%", "capacity=101%"),
        ("-5%", "capacity='-5%'"),
        ("12XB", "unknown unit 'XB'"),
        ("12 gib", "unknown unit 'gib'"),
        ({"a": 1}, "capacity={'a': 1}"),
        ("", "capacity=''"),
    ],
)
def test_refused_forms_name_the_value(value, culprit):
    with pytest.raises(MoecacheError) as info:
        slots(value)
    assert culprit in str(info.value) and "\n" not in str(info.value)


def test_above_the_expert_count_is_refused_for_slots_but_a_budget_fits_everything():
    with pytest.raises(MoecacheError, match="capacity=25: more slots than experts \\(24 in all\\)"):
        slots(25, num_keys=24)
    assert slots("1TiB", num_keys=24) == 24


def test_memory_budget_needs_the_expert_size():
    with pytest.raises(MoecacheError, match="capacity=12GiB: a memory budget needs the expert size"):
        slots("12GiB", expert_bytes=None)
    assert slots("25%", expert_bytes=None) == 416


def test_list_form():
    assert parse_capacities([0, "25%", "600MiB"], key="capacity", num_keys=1664, expert_bytes=6 * MiB) == [
        0,
        416,
        100,
    ]
    assert parse_capacities(8, key="capacity", num_keys=24, expert_bytes=None) == [8]
    with pytest.raises(MoecacheError, match="capacity=\\[\\]: an empty list"):
        parse_capacities([], key="capacity", num_keys=24, expert_bytes=None)
    with pytest.raises(MoecacheError, match="capacity\\[1\\]=3.7"):
        parse_capacities([1, 3.7], key="capacity", num_keys=24, expert_bytes=None)
    with pytest.raises(MoecacheError, match="capacity\\[1\\]=\\[2\\]"):
        parse_capacities([1, [2]], key="capacity", num_keys=24, expert_bytes=None)
    with pytest.raises(MoecacheError, match="capacity\\[1\\]=25%: comes to 6 slots"):
        parse_capacities([6, "25%"], key="capacity", num_keys=24, expert_bytes=None)


def test_syntax_is_checked_without_the_trace():
    assert capacity_spec("25%", key="capacity").kind == "percent"
    assert capacity_spec("12GiB", key="capacity").kind == "bytes"
    assert capacity_spec(7, key="capacity").kind == "slots"
