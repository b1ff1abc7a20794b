"""Device names, group keys and instance keys (collective.keys)."""

from __future__ import annotations

import pytest

from collective.errors import UsageError
from collective.keys import (
    GROUP_KEY_START,
    INSTANCE_KEY_START,
    group_keys,
    instance_keys,
    parse_device,
    parse_devices,
    qualified_device,
)

# --- parse_device ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu:0", ("CPU", 0)),
        ("CPU:3", ("CPU", 3)),
        ("gpu:12", ("GPU", 12)),
        ("  cpu:1  ", ("CPU", 1)),
        ("cpu:007", ("CPU", 7)),
        ("device:cpu:2", ("CPU", 2)),
        ("/device:GPU:1", ("GPU", 1)),
        ("Tpu:4", ("TPU", 4)),
    ],
)
def test_parse_device_normalises_kind_to_upper_case_and_index_to_int(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "cpu",
        "cpu:",
        ":0",
        "0",
        "cpu:-1",
        "cpu:1.5",
        "cpu 0",
        "cpu:0:1",
        "c9u:0",
        "cpu:0,cpu:1",
        "/job:worker/task:0/device:CPU:0",
        "//device:cpu:0",
        "device:",
        "cpu:0x1",
    ],
)
def test_parse_device_raises_usage_error_for_an_invalid_string(text):
    with pytest.raises(UsageError, match="invalid device"):
        parse_device(text)


@pytest.mark.parametrize("text", ["cpu:\u0663", "cpu:\uff11", "cpu:\u0967"])
def test_parse_device_rejects_an_index_written_with_non_ascii_digits(text):
    with pytest.raises(UsageError):
        parse_device(text)


# --- parse_devices -----------------------------------------------------------------------------


def test_parse_devices_splits_a_comma_separated_string_and_keeps_its_order():
    assert parse_devices("cpu:1,cpu:0,gpu:3") == ["cpu:1", "cpu:0", "gpu:3"]


def test_parse_devices_normalises_every_entry_to_lower_case_kind_and_plain_index():
    assert parse_devices(" CPU:01 , /device:GPU:2,device:cpu:0") == ["cpu:1", "gpu:2", "cpu:0"]


def test_parse_devices_accepts_a_list_as_well_as_a_string():
    assert parse_devices(["CPU:0", "cpu:1"]) == ["cpu:0", "cpu:1"]


def test_parse_devices_ignores_empty_entries():
    assert parse_devices("cpu:0,,cpu:1,") == ["cpu:0", "cpu:1"]
    assert parse_devices(["cpu:0", "  ", ""]) == ["cpu:0"]


@pytest.mark.parametrize(
    "text",
    ["cpu:0,cpu:0", "cpu:0,CPU:0", "cpu:0,cpu:00", "cpu:1, /device:CPU:1", ["gpu:2", "GPU:2"]],
)
def test_parse_devices_rejects_a_device_listed_twice_after_normalisation(text):
    with pytest.raises(UsageError, match="listed twice"):
        parse_devices(text)


@pytest.mark.parametrize("text", ["", "   ", ",", " , ,", [], ["", " "]])
def test_parse_devices_rejects_an_empty_device_list(text):
    with pytest.raises(UsageError, match="no devices given"):
        parse_devices(text)


@pytest.mark.parametrize("text", ["cpu:0,gpu", "cpu:0;cpu:1", ["cpu:0", "cpu-1"]])
def test_parse_devices_rejects_any_invalid_entry(text):
    with pytest.raises(UsageError, match="invalid device"):
        parse_devices(text)


# --- qualified_device --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "device", "expected"),
    [
        (0, "cpu:0", "/job:worker/task:0/device:CPU:0"),
        (1, "cpu:0", "/job:worker/task:1/device:CPU:0"),
        (7, "/device:gpu:02", "/job:worker/task:7/device:GPU:2"),
        (3, " CPU:5 ", "/job:worker/task:3/device:CPU:5"),
    ],
)
def test_qualified_device_is_the_tensorflow_style_cluster_wide_name(rank, device, expected):
    assert qualified_device(rank, device) == expected


def test_qualified_device_raises_usage_error_for_an_invalid_device():
    with pytest.raises(UsageError, match="invalid device"):
        qualified_device(0, "cpu0")


# --- group_keys --------------------------------------------------------------------------------


def test_group_keys_gives_one_key_per_distinct_device_set():
    keys = group_keys([["a", "b"], ["c"], ["a", "b"], ["c"]])
    assert keys == {("a", "b"): GROUP_KEY_START, ("c",): GROUP_KEY_START + 1}


def test_group_keys_ignores_the_order_of_devices_within_a_set():
    keys = group_keys([["b", "a", "c"], ["c", "a", "b"], ["a", "c", "b"]])
    assert keys == {("a", "b", "c"): GROUP_KEY_START}


def test_group_keys_are_numbered_from_the_start_in_order_of_first_appearance():
    keys = group_keys([["z"], ["m", "y"], ["a"], ["y", "m"]])
    assert list(keys.items()) == [
        (("z",), GROUP_KEY_START),
        (("m", "y"), GROUP_KEY_START + 1),
        (("a",), GROUP_KEY_START + 2),
    ]


def test_group_keys_of_no_device_sets_is_empty():
    assert group_keys([]) == {}


def test_group_keys_are_the_same_for_the_same_device_sets():
    sets = [["/job:worker/task:1/device:CPU:0", "/job:worker/task:0/device:CPU:0"], ["x"]]
    assert group_keys(sets) == group_keys([list(reversed(s)) for s in sets])


def test_group_keys_start_at_one():
    assert GROUP_KEY_START == 1
    assert group_keys([["cpu:0"]])[("cpu:0",)] == 1


# --- instance_keys -----------------------------------------------------------------------------


def test_instance_keys_number_variables_in_model_order_from_the_start():
    assert instance_keys(["z", "a", "m"]) == {
        "z": INSTANCE_KEY_START,
        "a": INSTANCE_KEY_START + 1,
        "m": INSTANCE_KEY_START + 2,
    }


def test_instance_keys_are_deterministic():
    names = [f"layer{i}/kernel" for i in range(50)]
    assert instance_keys(names) == instance_keys(list(names))


def test_instance_keys_are_unique_per_variable():
    names = [f"v{i}" for i in range(1000)]
    keys = instance_keys(names)
    assert len(keys) == len(names)
    assert len(set(keys.values())) == len(names)


def test_instance_keys_depend_on_model_order():
    assert instance_keys(["a", "b"]) != instance_keys(["b", "a"])


def test_instance_keys_of_no_variables_is_empty():
    assert instance_keys([]) == {}


def test_a_device_index_past_the_digit_limit_is_a_usage_error_not_an_int_overflow():
    # int() refuses past 4,300 digits with a ValueError: before, a traceback (INTERNAL at the chief).
    with pytest.raises(UsageError, match=r"its index has more than 9 digits") as info:
        parse_devices(["cpu:" + "9" * 5000])
    assert len(str(info.value)) < 300


def test_a_duplicate_among_many_devices_is_found_and_named():
    devices = [f"cpu:{i}" for i in range(4096)] + ["cpu:7"]
    with pytest.raises(UsageError, match="device cpu:7 is listed twice"):
        parse_devices(devices)
