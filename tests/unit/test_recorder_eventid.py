"""Event ids: unique, increasing even when the clock steps back, tied to time, below 2**53."""
from hypothesis import given
from hypothesis import strategies as st

from qag.runstore.eventid import EPOCH_MS, MAX_ID, SEQ_BITS, IdClock, id_floor, id_ms


def test_layout():
    assert id_floor(EPOCH_MS) == 0
    assert id_floor(EPOCH_MS + 1) == 1 << SEQ_BITS
    assert id_ms(id_floor(1_764_490_000_000)) == 1_764_490_000_000
    # 42 bits of milliseconds: ids stay exact in a JavaScript number until 2164
    assert id_floor(EPOCH_MS + (1 << 42) - 1) <= MAX_ID < 2**53


@given(st.lists(st.tuples(st.integers(-5000, 5000), st.integers(1, 5000)), min_size=1, max_size=200))
def test_strictly_increasing_whatever_the_clock_does(steps):
    now = [1_764_490_000_000]
    clock = IdClock(0, clock=lambda: now[0])
    last = 0
    for jump, n in steps:
        now[0] += jump  # forwards, backwards, or standing still
        first = clock.take(n)
        assert first > last
        assert first >= id_floor(now[0])  # never behind the clock
        last = first + n - 1
        assert last < 2**53


def test_burst_borrows_the_next_milliseconds_then_waits_for_the_clock():
    clock = IdClock(0, clock=lambda: EPOCH_MS + 10)
    a = clock.take(5000)  # more than 2048 ids in one ms
    assert a == id_floor(EPOCH_MS + 10)
    b = clock.take(1)
    assert b == a + 5000
    assert id_ms(b) == EPOCH_MS + 12


def test_resumes_above_a_stored_last_id():
    stored = id_floor(EPOCH_MS + 10**9)  # a store written by a clock far ahead of ours
    clock = IdClock(stored, clock=lambda: EPOCH_MS)
    assert clock.take(1) == stored + 1


@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 3]), st.integers(1, 3000), st.integers(-3, 5)),
                min_size=1, max_size=100))
def test_writers_sharing_a_store_never_mint_the_same_id(steps):
    now = [EPOCH_MS + 10**6]
    clocks = [IdClock(0, clock=lambda: now[0], writer=w, writers=4) for w in range(4)]
    seen: set[int] = set()
    last = [0] * 4
    for w, n, jump in steps:
        now[0] += jump
        first = clocks[w].take(n)
        ids = range(first, first + 4 * n, 4)
        assert first > last[w] and all(i % 4 == w for i in (ids[0], ids[-1]))
        assert not seen.intersection(ids)
        seen.update(ids)
        last[w] = ids[-1]


def test_a_writer_resumes_on_its_own_progression_above_every_stored_id():
    stored = id_floor(EPOCH_MS + 10**9) + 6  # written by writer 2 of 4
    c = IdClock(stored, clock=lambda: EPOCH_MS, writer=1, writers=4)
    first = c.take(3)
    assert first > stored and first % 4 == 1
