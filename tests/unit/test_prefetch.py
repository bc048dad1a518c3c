"""core/params/prefetch.py: the recorded order stage 3 prefetches along (pure bookkeeping, no tensors)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.core.params.prefetch import RecordedOrder, reverse_first_calls

orders = st.lists(st.integers(min_value=1, max_value=6), max_size=12)


def _run(order: RecordedOrder, calls: list[int], prefetch: int) -> list[list[int]]:
    """One pass: what would be prefetched after each call."""
    order.begin()
    predicted = []
    for unit in calls:
        order.visit(unit)
        predicted.append(order.upcoming(prefetch))
    return predicted


@settings(max_examples=200, deadline=None)
@given(first=orders, calls=orders, prefetch=st.integers(min_value=0, max_value=3))
def test_prefetches_only_what_the_pass_then_calls_while_on_track(first, calls, prefetch):
    """While a pass follows its record, every unit predicted next is the one called next: no wasted gather."""
    order = RecordedOrder(first)
    order.end()
    for _ in range(2):  # the record pass, then the pass that follows it
        predicted = _run(order, calls, prefetch)
        on_record = calls == order.recorded
        if on_record:
            for i, upcoming in enumerate(predicted):
                assert upcoming == calls[i + 1:i + 1 + prefetch]
        order.end()
        assert order.recorded == (calls if calls else order.recorded)


@settings(max_examples=200, deadline=None)
@given(first=orders, calls=orders)
def test_leaving_the_record_stops_prefetching_for_the_rest_of_the_pass(first, calls):
    order = RecordedOrder(first)
    order.begin()
    off = False
    for position, unit in enumerate(calls):
        order.visit(unit)
        off = off or position >= len(first) or first[position] != unit
        if off:
            assert order.upcoming(2) == []
            assert not order.called_again(unit)
    changed = order.end()
    assert changed == (bool(calls) and calls != first)


def test_called_again_follows_the_recorded_call_count():
    order = RecordedOrder([1, 2, 1, 3])
    order.begin()
    order.visit(1)
    assert order.called_again(1)  # recorded twice, called once so far
    order.visit(2)
    assert not order.called_again(2)
    order.visit(1)
    assert not order.called_again(1)
    assert order.upcoming(5) == [3]


def test_backward_first_guess_is_the_forward_reversed_each_unit_once():
    assert reverse_first_calls([1, 2, 3, 2, 4]) == [4, 2, 3, 1]
    assert reverse_first_calls([]) == []
