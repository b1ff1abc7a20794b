"""Mirrored and sync-on-read variables: creation rules, replicas, aggregation, collections."""

from __future__ import annotations

import numpy as np
import pytest

from collective.errors import FrozenError, InvalidVariableError
from collective.model import Aggregation, Synchronization, VariableSpec
from collective.variables import (
    MirroredVariable,
    SyncOnReadVariable,
    VariableStore,
    create_variable,
    default_store,
    reset_default_store,
)

ONE = ["cpu:0"]
THREE = ["cpu:0", "cpu:1", "cpu:2"]


@pytest.fixture(autouse=True)
def _fresh_default_store():
    reset_default_store()
    yield
    reset_default_store()


@pytest.fixture
def store() -> VariableStore:
    return VariableStore()


def make(name="w", value=None, devices=THREE, store=None, **kwargs):
    if value is None:
        value = np.zeros(3, dtype=np.float32)
    return create_variable(name, value, devices, store=store or VariableStore(), **kwargs)


def per_replica(*rows, dtype=np.float32):
    return [np.array(row, dtype=dtype) for row in rows]


# -- replicas ----------------------------------------------------------------------------------


def test_a_single_device_variable_has_one_replica_named_like_the_variable():
    v = make(devices=ONE)
    assert v.replica_names == ["w"]
    assert len(v.replicas) == 1
    assert v.devices == ("cpu:0",)


def test_replicas_on_later_devices_are_named_name_slash_replica_i():
    v = make(name="dense/kernel", devices=THREE)
    assert v.replica_names == ["dense/kernel", "dense/kernel/replica_1", "dense/kernel/replica_2"]
    assert len(v.replicas) == 3
    assert v.devices == tuple(THREE)


def test_every_replica_starts_with_the_initial_value_and_its_shape_and_dtype():
    init = np.arange(6, dtype=np.int32).reshape(2, 3)
    v = make(value=init)
    assert v.shape == (2, 3)
    assert v.dtype == np.dtype(np.int32)
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, init)
        assert replica.dtype == np.int32


def test_replicas_are_independent_so_mutating_one_leaves_the_others_alone():
    v = make(value=np.zeros(3, dtype=np.float32))
    v.replicas[1][0] = 7.0
    assert v.replicas[1][0] == 7.0
    assert v.replicas[0][0] == 0.0
    assert v.replicas[2][0] == 0.0


def test_replicas_do_not_share_memory_with_each_other_or_the_initial_value():
    init = np.ones(4, dtype=np.float64)
    v = make(value=init)
    arrays = [init, *v.replicas]
    for i, a in enumerate(arrays):
        for b in arrays[i + 1 :]:
            assert not np.shares_memory(a, b)


def test_share_first_makes_replica_zero_the_given_array_and_copies_the_rest():
    buffer = np.arange(3, dtype=np.float32)
    v = make(value=buffer, share_first=True)
    assert v.replicas[0] is buffer
    assert not np.shares_memory(v.replicas[1], buffer)
    assert not np.shares_memory(v.replicas[2], buffer)
    buffer[0] = 42.0
    assert v.read_value()[0] == 42.0
    assert v.replicas[1][0] == 0.0


def test_share_first_keeps_the_shared_buffer_live_through_assign():
    buffer = np.zeros(3, dtype=np.float32)
    v = make(value=buffer, share_first=True)
    v.assign([1.0, 2.0, 3.0])
    assert v.replicas[0] is buffer
    np.testing.assert_array_equal(buffer, [1.0, 2.0, 3.0])


def test_share_first_also_shares_the_array_a_callable_returns():
    produced = np.ones(2, dtype=np.float32)
    v = make(value=lambda: produced, share_first=True)
    assert v.replicas[0] is produced


def test_without_share_first_replica_zero_is_a_copy_of_the_given_array():
    buffer = np.arange(3, dtype=np.float32)
    v = make(value=buffer)
    assert v.replicas[0] is not buffer
    assert not np.shares_memory(v.replicas[0], buffer)


def test_share_first_copies_a_read_only_array_because_replicas_must_be_writeable():
    buffer = np.arange(3, dtype=np.float32)
    buffer.flags.writeable = False
    v = make(value=buffer, share_first=True)
    assert v.replicas[0] is not buffer
    v.assign(np.ones(3, dtype=np.float32))
    np.testing.assert_array_equal(buffer, [0.0, 1.0, 2.0])


def test_share_first_copies_a_value_that_is_not_a_numpy_array():
    value = [1.0, 2.0]
    v = make(value=value, share_first=True)
    v.replicas[0][0] = 9.0
    assert value == [1.0, 2.0]


def test_the_spec_describes_the_variable_with_a_numpy_dtype_string():
    v = make(name="b", value=np.zeros((2, 2), dtype=np.float32), aggregation="mean")
    assert v.spec == VariableSpec(
        name="b",
        shape=(2, 2),
        dtype="<f4",
        synchronization=Synchronization.ON_WRITE,
        aggregation=Aggregation.MEAN,
        trainable=True,
    )


# -- synchronization, aggregation and trainable --------------------------------------------------


def test_auto_synchronization_becomes_on_write_and_gives_a_mirrored_variable():
    v = make(synchronization=Synchronization.AUTO)
    assert isinstance(v, MirroredVariable)
    assert v.synchronization is Synchronization.ON_WRITE
    assert v.spec.synchronization is Synchronization.ON_WRITE


def test_on_read_synchronization_gives_a_sync_on_read_variable():
    v = make(synchronization=Synchronization.ON_READ)
    assert isinstance(v, SyncOnReadVariable)
    assert v.synchronization is Synchronization.ON_READ


def test_modes_may_be_given_as_strings_in_any_case():
    v = make(synchronization="On_Read", aggregation="only_first_replica")
    assert isinstance(v, SyncOnReadVariable)
    assert v.aggregation is Aggregation.ONLY_FIRST_REPLICA


def test_none_synchronization_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match=r"variable 'w'.*synchronization NONE"):
        make(synchronization=Synchronization.NONE)


def test_an_unknown_synchronization_string_is_rejected_naming_the_mode_and_variable():
    with pytest.raises(InvalidVariableError, match=r"'on_wednesday'.*variable 'w'") as info:
        make(synchronization="on_wednesday")
    assert isinstance(info.value, ValueError)


def test_an_unknown_aggregation_string_is_rejected_naming_the_mode_and_variable():
    with pytest.raises(InvalidVariableError, match=r"aggregation 'median'.*variable 'w'"):
        make(aggregation="median")


def test_an_aggregation_member_is_not_accepted_as_a_synchronization():
    with pytest.raises(InvalidVariableError, match="variable 'w'"):
        make(synchronization=Aggregation.SUM)


def test_trainable_defaults_to_true_for_mirrored_variables():
    assert make().trainable is True


def test_sync_on_read_variables_are_not_trainable_by_default():
    v = make(synchronization="on_read")
    assert v.trainable is False
    assert v.spec.trainable is False


def test_trainable_true_with_on_read_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match=r"variable 'acc'.*cannot be trainable"):
        make(name="acc", synchronization="on_read", trainable=True)


def test_a_mirrored_variable_may_be_explicitly_not_trainable():
    assert make(trainable=False).trainable is False


def test_trainable_must_be_a_boolean_or_none():
    with pytest.raises(InvalidVariableError, match="variable 'w': trainable"):
        make(trainable="yes")


# -- initial value, name and devices --------------------------------------------------------------


def test_a_missing_initial_value_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match="variable 'w': an initial value is required"):
        create_variable("w", None, THREE, store=VariableStore())


def test_a_callable_initial_value_is_called_exactly_once_with_no_arguments():
    calls = []

    def init():
        calls.append(1)
        return np.full(2, 5.0, dtype=np.float32)

    v = make(value=init)
    assert calls == [1]
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [5.0, 5.0])


def test_a_callable_is_not_called_when_the_definition_is_invalid():
    calls = []
    with pytest.raises(InvalidVariableError):
        make(value=lambda: calls.append(1), synchronization="none")
    assert calls == []


def test_a_callable_returning_none_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match="variable 'w': the initial value callable"):
        make(value=lambda: None)


def test_a_non_numeric_initial_value_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match="variable 'w'.*numeric"):
        make(value=np.array(["a", "b"]))


def test_a_ragged_initial_value_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match="variable 'w'"):
        make(value=[[1.0, 2.0], [3.0]])


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_a_name_must_be_a_non_empty_string(name):
    with pytest.raises(InvalidVariableError, match="non-empty string"):
        create_variable(name, np.zeros(1), ONE, store=VariableStore())


def test_an_empty_device_list_is_rejected_naming_the_variable():
    with pytest.raises(InvalidVariableError, match="variable 'w': at least one device"):
        make(devices=[])


def test_a_duplicated_device_is_rejected_naming_the_variable_and_device():
    with pytest.raises(InvalidVariableError, match="variable 'w': device 'cpu:1' is listed more"):
        make(devices=["cpu:0", "cpu:1", "cpu:1"])


def test_a_bare_device_string_is_rejected_rather_than_split_into_letters():
    with pytest.raises(InvalidVariableError, match="variable 'w': devices must be a list"):
        make(devices="cpu:0")


# -- mirrored variables ----------------------------------------------------------------------------


def test_assigning_one_value_sets_every_replica_of_a_mirrored_variable():
    v = make()
    v.assign(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [1.0, 2.0, 3.0])


def test_reading_a_mirrored_variable_returns_a_copy_of_replica_zero():
    v = make()
    v.assign([4.0, 5.0, 6.0])
    value = v.read_value()
    np.testing.assert_array_equal(value, [4.0, 5.0, 6.0])
    value[0] = -1.0
    assert v.replicas[0][0] == 4.0


def test_mirrored_sum_stores_the_sum_of_per_replica_values_in_every_replica():
    v = make(aggregation="sum")
    v.assign(per_replica([1, 2, 3], [10, 20, 30], [100, 200, 300]))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [111, 222, 333])


def test_mirrored_mean_stores_the_mean_of_per_replica_values_in_every_replica():
    v = make(aggregation="mean")
    v.assign(per_replica([1, 2, 3], [2, 4, 6], [3, 6, 12]))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [2, 4, 7])
        assert replica.dtype == np.float32


def test_mirrored_mean_of_integers_is_cast_back_to_the_integer_dtype():
    v = make(value=np.zeros(2, dtype=np.int32), aggregation="mean")
    v.assign(per_replica([1, 5], [2, 5], [2, 6], dtype=np.int32))
    for replica in v.replicas:
        # means 1.666.. and 5.333.. truncate toward zero
        np.testing.assert_array_equal(replica, [1, 5])
        assert replica.dtype == np.int32


def test_mirrored_sum_of_small_integers_keeps_the_variable_dtype():
    v = make(value=np.zeros(1, dtype=np.int8), aggregation="sum")
    v.assign(per_replica([1], [2], [3], dtype=np.int8))
    assert v.dtype == np.int8
    assert all(replica.dtype == np.int8 for replica in v.replicas)
    np.testing.assert_array_equal(v.read_value(), [6])


def test_mirrored_only_first_replica_stores_replica_zeros_value_everywhere():
    v = make(aggregation="only_first_replica")
    v.assign(per_replica([1, 2, 3], [7, 7, 7], [9, 9, 9]))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [1, 2, 3])


def test_mirrored_none_accepts_equal_per_replica_values():
    v = make(aggregation="none")
    v.assign(per_replica([1, 2, 3], [1, 2, 3], [1, 2, 3]))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [1, 2, 3])


def test_mirrored_none_rejects_differing_per_replica_values_and_changes_nothing():
    v = make(aggregation="none")
    with pytest.raises(
        InvalidVariableError, match=r"variable 'w': aggregation NONE cannot combine"
    ):
        v.assign(per_replica([1, 2, 3], [1, 2, 3], [1, 2, 4]))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [0, 0, 0])


def test_a_tuple_of_arrays_is_per_replica_too():
    v = make(aggregation="sum")
    v.assign(tuple(per_replica([1, 1, 1], [1, 1, 1], [1, 1, 1])))
    np.testing.assert_array_equal(v.read_value(), [3, 3, 3])


def test_assign_per_replica_accepts_any_sequence_with_one_value_per_device():
    v = make(aggregation="sum")
    v.assign_per_replica([[1, 0, 0], [0, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(v.read_value(), [1, 1, 1])


def test_a_list_of_python_numbers_is_one_value_not_per_replica():
    v = make(aggregation="sum")
    v.assign([1.0, 2.0, 3.0])
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [1.0, 2.0, 3.0])


def test_the_wrong_number_of_per_replica_values_is_rejected_naming_the_variable():
    v = make(aggregation="sum")
    with pytest.raises(InvalidVariableError, match="variable 'w': expected 3 per-replica values"):
        v.assign(per_replica([1, 2, 3], [1, 2, 3]))


def test_assigning_a_value_of_the_wrong_shape_is_rejected_naming_both_shapes():
    v = make(name="kernel", value=np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(
        InvalidVariableError,
        match=r"variable 'kernel': cannot assign a value of shape \(3, 2\) "
        r"to a variable of shape \(2, 3\)",
    ):
        v.assign(np.zeros((3, 2), dtype=np.float32))


def test_a_per_replica_value_of_the_wrong_shape_is_rejected_and_changes_nothing():
    v = make(synchronization="on_read", aggregation="sum")
    with pytest.raises(InvalidVariableError, match=r"shape \(2,\) to a variable of shape \(3,\)"):
        v.assign_per_replica([np.ones(3), np.ones(3), np.ones(2)])
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [0, 0, 0])


def test_assigning_floats_to_an_integer_variable_is_rejected_naming_both_dtypes():
    v = make(value=np.zeros(2, dtype=np.int32))
    with pytest.raises(InvalidVariableError, match="dtype float64 to a variable of dtype int32"):
        v.assign(np.array([1.5, 2.5]))


def test_assigning_a_wider_float_to_a_float32_variable_casts_it():
    v = make()
    v.assign(np.array([1.5, 2.5, 3.5], dtype=np.float64))
    assert all(replica.dtype == np.float32 for replica in v.replicas)
    np.testing.assert_array_equal(v.read_value(), [1.5, 2.5, 3.5])


def test_assigning_from_one_of_its_own_replicas_is_safe():
    v = make(synchronization="on_read", aggregation="sum")
    v.assign_per_replica(per_replica([1, 1, 1], [2, 2, 2], [3, 3, 3]))
    replicas = v.replicas
    v.assign_per_replica([replicas[2], replicas[0], replicas[1]])
    np.testing.assert_array_equal(v.replicas[0], [3, 3, 3])
    np.testing.assert_array_equal(v.replicas[1], [1, 1, 1])
    np.testing.assert_array_equal(v.replicas[2], [2, 2, 2])


# -- sync-on-read variables --------------------------------------------------------------------------


def on_read(aggregation, **kwargs):
    return make(synchronization="on_read", aggregation=aggregation, **kwargs)


def test_sync_on_read_per_replica_assign_keeps_each_replicas_own_value():
    v = on_read("sum")
    v.assign(per_replica([1, 2, 3], [4, 5, 6], [7, 8, 9]))
    np.testing.assert_array_equal(v.replicas[0], [1, 2, 3])
    np.testing.assert_array_equal(v.replicas[1], [4, 5, 6])
    np.testing.assert_array_equal(v.replicas[2], [7, 8, 9])


def test_sync_on_read_sum_reads_the_sum_of_the_replicas():
    v = on_read("sum")
    v.assign(per_replica([1, 2, 3], [4, 5, 6], [7, 8, 9]))
    np.testing.assert_array_equal(v.read_value(), [12, 15, 18])


def test_sync_on_read_mean_reads_the_mean_of_the_replicas_in_the_variable_dtype():
    v = on_read("mean")
    v.assign(per_replica([1, 2, 3], [4, 5, 6], [7, 8, 12]))
    value = v.read_value()
    np.testing.assert_array_equal(value, [4, 5, 7])
    assert value.dtype == np.float32


def test_sync_on_read_integer_reads_keep_the_variable_dtype():
    mean = on_read("mean", value=np.zeros(2, dtype=np.int32))
    mean.assign_per_replica(per_replica([1, 5], [2, 5], [2, 6], dtype=np.int32))
    value = mean.read_value()
    # means 1.666.. and 5.333.. truncate toward zero
    np.testing.assert_array_equal(value, [1, 5])
    assert value.dtype == np.int32
    total = on_read("sum", value=np.zeros(1, dtype=np.int8))
    total.assign_per_replica(per_replica([1], [2], [3], dtype=np.int8))
    assert total.read_value().dtype == np.int8


def test_sync_on_read_only_first_replica_reads_replica_zero():
    v = on_read("only_first_replica")
    v.assign(per_replica([1, 2, 3], [4, 5, 6], [7, 8, 9]))
    np.testing.assert_array_equal(v.read_value(), [1, 2, 3])


def test_sync_on_read_none_reads_the_value_when_all_replicas_are_equal():
    v = on_read("none")
    v.assign(per_replica([1, 2, 3], [1, 2, 3], [1, 2, 3]))
    np.testing.assert_array_equal(v.read_value(), [1, 2, 3])


def test_sync_on_read_none_refuses_to_read_differing_replicas_naming_the_variable():
    v = on_read("none")
    v.assign(per_replica([1, 2, 3], [1, 2, 3], [0, 2, 3]))
    with pytest.raises(
        InvalidVariableError, match=r"variable 'w': aggregation NONE cannot combine"
    ):
        v.read_value()


def test_sync_on_read_one_value_assign_sets_every_replica_to_that_value():
    v = on_read("mean")
    v.assign(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    for replica in v.replicas:
        np.testing.assert_array_equal(replica, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(v.read_value(), [1.0, 2.0, 3.0])


def test_sync_on_read_reads_a_new_array_not_a_replica():
    v = on_read("only_first_replica")
    value = v.read_value()
    value[0] = 99.0
    assert v.replicas[0][0] == 0.0


def test_a_scalar_sync_on_read_variable_reads_a_scalar_array():
    v = on_read("sum", value=np.float32(0.0))
    v.assign_per_replica([1.0, 2.0, 3.0])
    value = v.read_value()
    assert value.shape == ()
    assert value == 6.0


# -- collections and freezing -----------------------------------------------------------------------


def test_collections_list_the_distributed_variables_never_their_replicas(store):
    w = create_variable("w", np.zeros(2), THREE, store=store)
    acc = create_variable("acc", np.zeros(1), THREE, synchronization="on_read", store=store)
    frozen = create_variable("emb", np.zeros(2), THREE, trainable=False, store=store)
    assert store.global_variables == [w, acc, frozen]
    assert store.trainable_variables == [w]
    listed = store.global_variables + store.trainable_variables
    for variable in (w, acc, frozen):
        for replica in variable.replicas:
            assert all(replica is not item for item in listed)
    assert all(isinstance(item, (MirroredVariable, SyncOnReadVariable)) for item in listed)


def test_sync_on_read_variables_are_global_but_not_trainable(store):
    acc = create_variable("acc", np.zeros(1), ONE, synchronization="on_read", store=store)
    assert acc in store.global_variables
    assert acc not in store.trainable_variables


def test_the_store_finds_variables_by_name_counts_and_iterates_them(store):
    a = create_variable("a", np.zeros(1), ONE, store=store)
    b = create_variable("b", np.zeros(1), ONE, store=store)
    assert store.get("a") is a
    assert store.get("b") is b
    with pytest.raises(KeyError, match="no variable named 'c'"):
        store.get("c")
    assert len(store) == 2
    assert list(store) == [a, b]
    assert "a" in store
    assert "a/replica_1" not in store


def test_global_step_is_the_variable_named_global_step(store):
    assert store.global_step is None
    create_variable("w", np.zeros(1), ONE, store=store)
    assert store.global_step is None
    step = create_variable("global_step", np.int64(0), ONE, trainable=False, store=store)
    assert store.global_step is step


def test_a_duplicate_name_is_rejected_naming_the_variable(store):
    create_variable("w", np.zeros(1), ONE, store=store)
    with pytest.raises(InvalidVariableError, match="variable 'w'.*already exists"):
        create_variable("w", np.ones(1), ONE, store=store)
    assert len(store) == 1
    assert store.get("w").read_value()[0] == 0.0


def test_the_same_name_may_be_used_in_different_stores():
    a = create_variable("w", np.zeros(1), ONE, store=VariableStore())
    b = create_variable("w", np.zeros(1), ONE, store=VariableStore())
    assert a is not b


def test_adding_a_variable_with_a_taken_name_is_rejected(store):
    create_variable("w", np.zeros(1), ONE, store=store)
    other = create_variable("w", np.zeros(1), ONE, store=VariableStore())
    with pytest.raises(InvalidVariableError, match="variable 'w'.*already exists"):
        store.add(other)


def test_creating_a_variable_after_start_is_rejected_as_frozen(store):
    create_variable("w", np.zeros(1), ONE, store=store)
    assert store.started is False
    store.start()
    assert store.started is True
    with pytest.raises(FrozenError) as info:
        create_variable("x", np.zeros(1), ONE, store=store)
    assert str(info.value) == (
        "cannot create variable 'x': the variable set is frozen once training has started"
    )
    assert isinstance(info.value, RuntimeError)
    assert "x" not in store
    assert len(store) == 1


def test_a_frozen_store_does_not_run_the_initializer(store):
    store.start()
    calls = []
    with pytest.raises(FrozenError):
        create_variable("x", lambda: calls.append(1) or np.zeros(1), ONE, store=store)
    assert calls == []


def test_adding_to_a_started_store_is_rejected_as_frozen(store):
    loose = create_variable("x", np.zeros(1), ONE, store=VariableStore())
    store.start()
    with pytest.raises(FrozenError, match="cannot add variable 'x': the variable set is frozen"):
        store.add(loose)


def test_starting_twice_keeps_the_store_frozen(store):
    store.start()
    store.start()
    assert store.started is True
    with pytest.raises(FrozenError):
        create_variable("x", np.zeros(1), ONE, store=store)


def test_without_a_store_variables_go_to_the_default_store():
    v = create_variable("w", np.zeros(1), ONE)
    assert default_store().get("w") is v
    assert default_store() is default_store()


def test_resetting_the_default_store_gives_an_empty_unstarted_one():
    create_variable("w", np.zeros(1), ONE)
    default_store().start()
    fresh = reset_default_store()
    assert fresh is default_store()
    assert len(fresh) == 0
    assert fresh.started is False
    assert create_variable("w", np.zeros(1), ONE) is fresh.get("w")


def test_sync_on_read_sum_assign_reads_back_the_assigned_value_like_tensorflow():
    v = create_variable(
        "loss_sum", np.zeros(3, np.float32), ["cpu:0", "cpu:1"],
        synchronization="on_read", aggregation="sum", store=VariableStore(),
    )
    v.assign(np.array([6.0, 2.0, 4.0], np.float32))
    np.testing.assert_array_equal(v.replicas[0], [3.0, 1.0, 2.0])
    np.testing.assert_array_equal(v.read_value(), [6.0, 2.0, 4.0])


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, np.dtype([("a", "<f4")]), np.dtype("U3")])
def test_create_variable_refuses_the_dtypes_every_model_source_refuses(dtype):
    from collective._api import ArraysSource
    from collective.errors import ModelError

    value = np.zeros(3, dtype)
    if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize <= 8:
        pytest.skip("long double is float64 on this platform: an ordinary dtype here")
    with pytest.raises(InvalidVariableError, match="variable 'v'") as made:
        create_variable("v", value, ["cpu:0"])
    with pytest.raises(ModelError) as sourced:
        ArraysSource({"v": value})
    # One rule: the same reason in both words.
    reason = str(sourced.value).split(": ", 2)[-1]
    assert reason.split(";")[0] in str(made.value) or "numeric or boolean" in str(made.value)
