"""ReadAhead: read ahead while the consumer's step can hide a read, read in the caller while it cannot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from datapipes._pacing import START, STOP, ReadAhead

_times = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)


def _feed(policy: ReadAhead, read: float, gap: float, times: int) -> None:
    for _ in range(times):
        policy.observe_read(read)
        policy.observe_gap(gap)


def test_a_new_policy_reads_ahead_until_it_has_seen_the_consumer():
    policy = ReadAhead()
    assert policy.ahead
    policy.observe_gap(0.0)  # no read seen yet: nothing to compare with
    assert policy.ahead and policy.switches == 0


def test_a_consumer_that_asks_at_once_gets_reads_in_the_caller_and_a_slow_one_reads_ahead():
    policy = ReadAhead()
    _feed(policy, read=0.010, gap=0.0001, times=3)
    assert not policy.ahead and policy.switches == 1
    _feed(policy, read=0.010, gap=0.020, times=6)
    assert policy.ahead and policy.switches == 2


def test_between_the_thresholds_the_choice_stays():
    between = (START + STOP) / 2
    for start_ahead in (True, False):
        policy = ReadAhead()
        _feed(policy, read=1.0, gap=1.0 if start_ahead else 0.0, times=8)
        assert policy.ahead is start_ahead
        switches = policy.switches
        _feed(policy, read=1.0, gap=between, times=40)
        assert policy.ahead is start_ahead and policy.switches == switches


def test_one_outlier_does_not_flip_it():
    policy = ReadAhead()
    _feed(policy, read=0.010, gap=0.030, times=8)
    _feed(policy, read=0.010, gap=0.0, times=1)  # one batch the consumer skipped through
    assert policy.ahead


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_times, _times), min_size=1, max_size=60))
def test_disabled_always_reads_ahead(observations):
    policy = ReadAhead(enabled=False)
    for read, gap in observations:
        policy.observe_read(read)
        policy.observe_gap(gap)
        assert policy.ahead
    assert policy.switches == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_times, _times), min_size=1, max_size=60))
def test_it_switches_only_across_a_threshold_of_the_averages(observations):
    """Replays the averages independently: a switch happens exactly when the thresholds say."""
    policy = ReadAhead()
    read = gap = None
    ahead = True
    for r, g in observations:
        read = r if read is None else (r + read) / 2
        gap = g if gap is None else (g + gap) / 2
        policy.observe_read(r)
        policy.observe_gap(g)
        share = gap / read
        if ahead and share < STOP:
            ahead = False
        elif not ahead and share >= START:
            ahead = True
        assert policy.ahead is ahead, (share, observations)


@settings(max_examples=100, deadline=None)
@given(_times, st.floats(min_value=START * 1.01, max_value=100.0), st.booleans())
def test_a_steady_consumer_settles_on_the_right_side(read, share, start_inline):
    """Whatever came before, a steady gap above START reads ahead, one below STOP in the caller."""
    policy = ReadAhead()
    if start_inline:
        _feed(policy, read, 0.0, 4)
    _feed(policy, read, share * read, 40)
    assert policy.ahead
    _feed(policy, read, STOP * 0.99 * read * min(1.0, 1 / share), 40)
    assert not policy.ahead
