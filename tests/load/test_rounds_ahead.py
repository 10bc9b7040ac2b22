"""`read_ahead.RoundsAhead`: an exchanged variable's rounds are read on their
own thread, a bounded number ahead of the round being placed."""

import pytest

from keras_hub_dist.load.read_ahead import RoundsAhead


def _counted(n, made, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise OSError(f"round {i} failed")
        made.append(i)
        yield i


def test_rounds_are_read_a_bounded_number_ahead():
    made, depth = [], 2
    stream = RoundsAhead(_counted(20, made), depth)
    seen = []
    for item in stream:
        # At the moment round `item` is taken: `depth` more may wait in the
        # queue and one more in the producer's hand, no others.
        assert item + 1 <= len(made) <= item + depth + 2, (item, len(made))
        seen.append(item)
    stream.close()
    assert seen == list(range(20)) == made


def test_a_failed_round_is_raised_to_the_consumer_after_the_good_ones():
    made = []
    stream = RoundsAhead(_counted(10, made, fail_at=3), 2)
    seen = []
    with pytest.raises(OSError, match="round 3 failed"):
        for item in stream:
            seen.append(item)
    stream.close()
    assert seen == [0, 1, 2]


def test_closing_stops_the_reading():
    made, depth = [], 2
    stream = RoundsAhead(_counted(1000, made), depth)
    first = next(iter(stream))
    stream.close()
    assert first == 0
    assert not stream._thread.is_alive()
    assert len(made) <= 1 + depth + 2  # nothing read after the close
