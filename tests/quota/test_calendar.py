"""Window bounds: fixed windows and calendar periods across month ends, DST and odd zones.

Expected bounds are written as UTC instants worked out by hand from each zone's rules, so
the tests do not trust the code's own use of zoneinfo.
"""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo, available_timezones

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.quota import calendar
from extproc.quota.base import Period, WindowSpec
from extproc.quota.calendar import (
    calendar_bounds,
    compute_calendar_bounds,
    day_start,
    reset_after_s,
    window_bounds,
)


def utc(*args: int) -> int:
    return int(dt.datetime(*args, tzinfo=dt.UTC).timestamp())


def local(tz: str, *args: int) -> int:
    return int(dt.datetime(*args, tzinfo=ZoneInfo(tz)).timestamp())


def cal(period: str, tz: str = "UTC") -> WindowSpec:
    return WindowSpec(kind="calendar", period=period, timezone=tz)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    calendar.clear_cache()


def test_fixed_window_is_epoch_aligned() -> None:
    spec = WindowSpec(kind="fixed", seconds=60)
    assert window_bounds(spec, 1_000_000_019) == (999_999_960, 1_000_000_020)
    assert window_bounds(spec, 120) == (120, 180)
    assert window_bounds(spec, 179) == (120, 180)


def test_sliding_window_has_no_bounds() -> None:
    with pytest.raises(ValueError, match="sliding"):
        window_bounds(WindowSpec(kind="sliding", seconds=60, bucket_s=1), 100)


def test_calendar_window_without_period_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="period"):
        window_bounds(WindowSpec(kind="calendar"), 100)


def test_unknown_period_and_zone_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="period"):
        compute_calendar_bounds("year", "UTC", 100)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="Nowhere/Land"):
        window_bounds(cal("day", "Nowhere/Land"), 100)


@pytest.mark.parametrize(
    ("now", "period", "start", "end"),
    [
        # Jan 31 -> Feb 1
        (utc(2026, 1, 31, 23, 59, 59), "day", utc(2026, 1, 31), utc(2026, 2, 1)),
        (utc(2026, 1, 31, 23, 59, 59), "month", utc(2026, 1, 1), utc(2026, 2, 1)),
        (utc(2026, 2, 1), "month", utc(2026, 2, 1), utc(2026, 3, 1)),
        # February in a non-leap and a leap year, and the leap day itself
        (utc(2026, 2, 28, 12), "month", utc(2026, 2, 1), utc(2026, 3, 1)),
        (utc(2026, 2, 28, 12), "day", utc(2026, 2, 28), utc(2026, 3, 1)),
        (utc(2028, 2, 28, 12), "day", utc(2028, 2, 28), utc(2028, 2, 29)),
        (utc(2028, 2, 29, 23, 59, 59), "day", utc(2028, 2, 29), utc(2028, 3, 1)),
        (utc(2028, 2, 29), "month", utc(2028, 2, 1), utc(2028, 3, 1)),
        (utc(2100, 2, 28, 1), "day", utc(2100, 2, 28), utc(2100, 3, 1)),  # 2100: no leap
        # Dec 31 -> Jan 1 for day, month, and an ISO week spanning the new year
        (utc(2026, 12, 31, 23, 59, 59), "day", utc(2026, 12, 31), utc(2027, 1, 1)),
        (utc(2026, 12, 31, 23, 59, 59), "month", utc(2026, 12, 1), utc(2027, 1, 1)),
        (utc(2027, 1, 1), "month", utc(2027, 1, 1), utc(2027, 2, 1)),
        (utc(2027, 1, 1), "week", utc(2026, 12, 28), utc(2027, 1, 4)),  # Mon Dec 28
        (utc(2027, 1, 3, 23, 59, 59), "week", utc(2026, 12, 28), utc(2027, 1, 4)),
        (utc(2027, 1, 4), "week", utc(2027, 1, 4), utc(2027, 1, 11)),
    ],
)
def test_utc_month_and_year_ends(now: int, period: str, start: int, end: int) -> None:
    assert window_bounds(cal(period), now) == (start, end)


# Europe/Berlin 2026: CET (+1) -> CEST (+2) on Sun Mar 29 at 02:00, back on Sun Oct 25 at
# 03:00. America/New_York 2026: EST (-5) -> EDT (-4) on Sun Mar 8, back on Sun Nov 1.
@pytest.mark.parametrize(
    ("tz", "now", "period", "start", "end", "hours"),
    [
        (
            "Europe/Berlin",
            utc(2026, 3, 29, 12),
            "day",
            utc(2026, 3, 28, 23),
            utc(2026, 3, 29, 22),
            23,
        ),
        (
            "Europe/Berlin",
            utc(2026, 10, 25, 12),
            "day",
            utc(2026, 10, 24, 22),
            utc(2026, 10, 25, 23),
            25,
        ),
        (
            "Europe/Berlin",
            utc(2026, 3, 29, 12),
            "week",
            utc(2026, 3, 22, 23),
            utc(2026, 3, 29, 22),
            167,
        ),
        (
            "Europe/Berlin",
            utc(2026, 10, 25, 12),
            "week",
            utc(2026, 10, 18, 22),
            utc(2026, 10, 25, 23),
            169,
        ),
        (
            "Europe/Berlin",
            utc(2026, 3, 15),
            "month",
            utc(2026, 2, 28, 23),
            utc(2026, 3, 31, 22),
            743,
        ),
        (
            "Europe/Berlin",
            utc(2026, 10, 15),
            "month",
            utc(2026, 9, 30, 22),
            utc(2026, 10, 31, 23),
            745,
        ),
        (
            "America/New_York",
            utc(2026, 3, 8, 12),
            "day",
            utc(2026, 3, 8, 5),
            utc(2026, 3, 9, 4),
            23,
        ),
        (
            "America/New_York",
            utc(2026, 11, 1, 12),
            "day",
            utc(2026, 11, 1, 4),
            utc(2026, 11, 2, 5),
            25,
        ),
        ("America/New_York", utc(2026, 3, 4), "week", utc(2026, 3, 2, 5), utc(2026, 3, 9, 4), 167),
        (
            "America/New_York",
            utc(2026, 11, 1, 12),
            "week",
            utc(2026, 10, 26, 4),
            utc(2026, 11, 2, 5),
            169,
        ),
        (
            "America/New_York",
            utc(2026, 3, 20),
            "month",
            utc(2026, 3, 1, 5),
            utc(2026, 4, 1, 4),
            743,
        ),
        (
            "America/New_York",
            utc(2026, 11, 20),
            "month",
            utc(2026, 11, 1, 4),
            utc(2026, 12, 1, 5),
            721,
        ),
    ],
)
def test_dst_changes_make_days_weeks_and_months_an_hour_shorter_or_longer(
    tz: str, now: int, period: str, start: int, end: int, hours: int
) -> None:
    assert window_bounds(cal(period, tz), now) == (start, end)
    assert end - start == hours * 3600


def test_the_instant_of_the_boundary_belongs_to_the_next_window() -> None:
    spec = cal("month", "Europe/Berlin")
    boundary = utc(2026, 2, 28, 23)  # Mar 1 00:00 CET
    assert window_bounds(spec, boundary - 1)[1] == boundary
    assert window_bounds(spec, boundary)[0] == boundary
    assert reset_after_s(spec, boundary - 10) == 10.0
    assert reset_after_s(spec, boundary - 0.5) == 0.5


@pytest.mark.parametrize(
    ("tz", "now", "period", "start", "end"),
    [
        # UTC+14: the local day starts at 10:00 UTC the day before
        (
            "Pacific/Kiritimati",
            utc(2026, 2, 28, 10),
            "day",
            utc(2026, 2, 28, 10),
            utc(2026, 3, 1, 10),
        ),
        (
            "Pacific/Kiritimati",
            utc(2026, 2, 28, 9, 59, 59),
            "day",
            utc(2026, 2, 27, 10),
            utc(2026, 2, 28, 10),
        ),
        (
            "Pacific/Kiritimati",
            utc(2026, 2, 28, 10),
            "month",
            utc(2026, 2, 28, 10),
            utc(2026, 3, 31, 10),
        ),
        (
            "Pacific/Kiritimati",
            utc(2026, 12, 31, 10),
            "month",
            utc(2026, 12, 31, 10),
            utc(2027, 1, 31, 10),
        ),
        # UTC-11: the local day starts at 11:00 UTC the same day
        (
            "Pacific/Pago_Pago",
            utc(2026, 3, 1, 10, 59, 59),
            "month",
            utc(2026, 2, 1, 11),
            utc(2026, 3, 1, 11),
        ),
        (
            "Pacific/Pago_Pago",
            utc(2026, 3, 1, 11),
            "month",
            utc(2026, 3, 1, 11),
            utc(2026, 4, 1, 11),
        ),
        (
            "Pacific/Pago_Pago",
            utc(2027, 1, 1, 10),
            "week",
            utc(2026, 12, 28, 11),
            utc(2027, 1, 4, 11),
        ),
    ],
)
def test_zones_at_utc_plus_14_and_minus_11(
    tz: str, now: int, period: str, start: int, end: int
) -> None:
    assert window_bounds(cal(period, tz), now) == (start, end)


@pytest.mark.parametrize(
    ("tz", "day", "start"),
    [
        # Santiago springs forward at 24:00 (-4) -> 01:00 (-3): the day starts at 01:00 local
        ("America/Santiago", dt.date(2024, 9, 8), utc(2024, 9, 8, 4)),
        # Beirut 2022: 00:00 (+2) -> 01:00 (+3) on Sun Mar 27
        ("Asia/Beirut", dt.date(2022, 3, 27), utc(2022, 3, 26, 22)),
        # Sao Paulo 2018: 00:00 (-3) -> 01:00 (-2) on Sun Nov 4
        ("America/Sao_Paulo", dt.date(2018, 11, 4), utc(2018, 11, 4, 3)),
    ],
)
def test_a_day_whose_midnight_does_not_exist_starts_at_the_jump(
    tz: str, day: dt.date, start: int
) -> None:
    zone = ZoneInfo(tz)
    assert day_start(day, zone) == start
    assert dt.datetime.fromtimestamp(start, zone).date() == day
    assert dt.datetime.fromtimestamp(start - 1, zone).date() < day
    assert window_bounds(cal("day", tz), start) == (start, start + 23 * 3600)
    # the day before ends there, however long it was
    assert window_bounds(cal("day", tz), start - 1)[1] == start


def test_a_day_whose_midnight_repeats_starts_at_the_first_one() -> None:
    # Sao Paulo 2018: 00:00 (-2) -> 23:00 Sat (-3) on Sun Feb 18: Saturday (from 00:00 -2,
    # 02:00 UTC) has 25 hours, its last hour twice; Sunday's midnight happens once
    spec = cal("day", "America/Sao_Paulo")
    assert window_bounds(spec, utc(2018, 2, 18, 2, 30)) == (
        utc(2018, 2, 17, 2),
        utc(2018, 2, 18, 3),
    )
    assert window_bounds(spec, utc(2018, 2, 18, 3)) == (utc(2018, 2, 18, 3), utc(2018, 2, 19, 3))


def test_cache_reuses_bounds_while_they_hold_and_moves_on_after() -> None:
    spec = cal("day", "Europe/Berlin")
    first = window_bounds(spec, utc(2026, 3, 29, 12))
    assert window_bounds(spec, utc(2026, 3, 29, 13)) is first
    # the backends' entry point shares the cache
    assert calendar_bounds("day", "Europe/Berlin", utc(2026, 3, 29, 14)) is first
    following = window_bounds(spec, first[1])
    assert following == (first[1], utc(2026, 3, 30, 22))
    # going back in time (a test clock) is served right too
    assert window_bounds(spec, first[1] - 1) == first
    # zones and periods have their own entries
    assert window_bounds(cal("day", "UTC"), utc(2026, 3, 29, 12)) == (
        utc(2026, 3, 29),
        utc(2026, 3, 30),
    )


def test_calls_within_a_period_compute_its_bounds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-admission call is a cache hit: zoneinfo arithmetic runs once per period and
    zone (README: 0.2-0.5 us a hit against 18 us computed)."""
    computed: list[tuple[str, str, int]] = []

    def counting(period: Period, timezone: str, now_s: int) -> tuple[int, int]:
        computed.append((period, timezone, now_s))
        return compute_calendar_bounds(period, timezone, now_s)

    monkeypatch.setattr(calendar, "compute_calendar_bounds", counting)
    spec = cal("month", "Europe/Berlin")
    start, end = window_bounds(spec, utc(2026, 3, 15))
    for now in range(start, end, 977):  # ~2,700 calls across the whole month
        assert window_bounds(spec, now) == (start, end)
    assert window_bounds(spec, end - 1) == (start, end)
    assert len(computed) == 1
    window_bounds(spec, end)  # the next month: computed once more
    window_bounds(cal("day", "Europe/Berlin"), end)  # another period: its own entry
    assert len(computed) == 3


ZONES = sorted(available_timezones())
periods = st.sampled_from(["day", "week", "month"])
zones = st.sampled_from(ZONES)
any_instant = st.integers(min_value=utc(1971, 1, 1), max_value=utc(2037, 12, 1))


@st.composite
def near_local_midnight(draw: st.DrawFn) -> tuple[str, int]:
    """A zone and an instant within two hours of one of its local midnights, where DST
    jumps at midnight (Santiago, Beirut, Sao Paulo, ...) make days start off 00:00."""
    tz = draw(zones)
    day = draw(st.dates(min_value=dt.date(1971, 1, 2), max_value=dt.date(2037, 11, 30)))
    midnight = int(dt.datetime(day.year, day.month, day.day, tzinfo=ZoneInfo(tz)).timestamp())
    return tz, midnight + draw(st.integers(min_value=-7200, max_value=7200))


zoned_instants = st.one_of(st.tuples(zones, any_instant), near_local_midnight())


def first_local_day(period: str, day: dt.date) -> dt.date:
    if period == "day":
        return day
    if period == "week":
        return day - dt.timedelta(days=day.weekday())
    return day.replace(day=1)


@settings(max_examples=400, deadline=None)
@given(period=periods, zoned=zoned_instants)
def test_bounds_hold_now_and_tile_time(period: str, zoned: tuple[str, int]) -> None:
    tz, now = zoned
    spec = cal(period, tz)
    start, end = window_bounds(spec, now)
    assert start <= now < end
    assert window_bounds(spec, end)[0] == end
    assert window_bounds(spec, start - 1)[1] == start
    # A day lasts 1..47 h in every zone's history (Samoa skipped a whole day in 2011)
    assert {"day": 0, "week": 6 * 86400, "month": 27 * 86400}[period] < end - start
    assert end - start <= {"day": 2, "week": 8, "month": 32}[period] * 86400


@settings(max_examples=400, deadline=None)
@given(period=periods, zoned=zoned_instants)
def test_start_is_the_first_instant_of_the_right_local_day(
    period: str, zoned: tuple[str, int]
) -> None:
    tz, now = zoned
    zone = ZoneInfo(tz)
    start, _ = compute_calendar_bounds(period, tz, now)  # type: ignore[arg-type]
    first = first_local_day(period, dt.datetime.fromtimestamp(now, zone).date())
    shown = dt.datetime.fromtimestamp(start, zone)
    assert shown.date() == first
    # local midnight, or the first instant after a jump over it
    before = dt.datetime.fromtimestamp(start - 1, zone)
    assert shown.time() == dt.time(0) or before.date() < first
    assert before.date() < first
    if period == "week":
        assert shown.weekday() == 0
    if period == "month":
        assert shown.day == 1
