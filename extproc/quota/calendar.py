"""Window bounds in epoch seconds: fixed windows and calendar periods in a time zone.

A calendar window is the local day, ISO week (from Monday) or month in an IANA zone: across
a DST change a day lasts 23 or 25 hours, a month 28 to 31 days. A window starts at the first
instant of its first local day: local midnight, or, where a zone's clocks jump over
midnight (America/Santiago, Asia/Beirut in some years), the first instant after the jump.

The processor asks for bounds per admission and per lease batch, so the last bounds of each
(period, zone) are cached and reused while they hold ``now``: the common call is one dict
look-up and two comparisons.
"""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

from extproc.quota.base import Period, WindowSpec

_DAY = dt.timedelta(days=1)

# (period, timezone) -> the last (start, end) computed; replaced when ``now`` leaves it.
_cache: dict[tuple[str, str], tuple[int, int]] = {}


def window_bounds(window: WindowSpec, now_s: int) -> tuple[int, int]:
    """[start, end) in epoch seconds of the window that holds now_s."""
    kind = window.kind
    if kind == "fixed":
        start = now_s - now_s % window.seconds
        return start, start + window.seconds
    if kind == "calendar":
        if window.period is None:
            raise ValueError("a calendar window needs a period (day, week or month)")
        return calendar_bounds(window.period, window.timezone, now_s)
    if kind == "sliding":
        raise ValueError("a sliding window has no bounds: it is counted in buckets")
    raise ValueError(f"unknown window kind {kind!r}")


def reset_after_s(window: WindowSpec, now: float) -> float:
    """Seconds from ``now`` until the window holding it ends (``Retry-After``, reset headers)."""
    _, end = window_bounds(window, int(now))
    return max(0.0, end - now)


def calendar_bounds(period: Period, timezone: str, now_s: int) -> tuple[int, int]:
    """[start, end) of the ``period`` in ``timezone`` holding ``now_s``: the cached bounds
    while they hold it (one look-up, two comparisons), else computed and cached."""
    key = (period, timezone)
    bounds = _cache.get(key)
    if bounds is not None and bounds[0] <= now_s < bounds[1]:
        return bounds
    bounds = compute_calendar_bounds(period, timezone, now_s)
    _cache[key] = bounds
    return bounds


def compute_calendar_bounds(period: Period, timezone: str, now_s: int) -> tuple[int, int]:
    """Uncached bounds of the ``period`` in ``timezone`` holding ``now_s``."""
    if period not in ("day", "week", "month"):
        raise ValueError(f"unknown calendar period {period!r}; expected day, week or month")
    zone = ZoneInfo(timezone)
    first = _first_day(period, dt.datetime.fromtimestamp(now_s, zone).date())
    start = day_start(first, zone)
    # Where a zone's clock steps back over midnight, an instant can show the previous local
    # date after the next day began: the windows still tile time, so walk forward to the one
    # holding now_s.
    while True:
        following = _next_first_day(period, first)
        end = day_start(following, zone)
        if now_s < end:
            return start, end
        first, start = following, end


def day_start(day: dt.date, zone: ZoneInfo) -> int:
    """The first instant (epoch seconds) whose local date in ``zone`` is ``day``."""
    midnight = dt.datetime(day.year, day.month, day.day)
    # Both readings of local midnight: they differ only around a transition. A reading that
    # maps back to midnight is real; the earliest real one is the day's first instant.
    readings = sorted(int(midnight.replace(tzinfo=zone, fold=fold).timestamp()) for fold in (0, 1))
    real = [t for t in readings if _local(t, zone) == midnight]
    if real:
        return real[0]
    # Midnight falls in a gap: the day starts at the jump, between the two readings (the
    # earlier shows the previous day, the later this one); find it to the second.
    lo, hi = readings
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _local(mid, zone).date() >= day:
            hi = mid
        else:
            lo = mid
    return hi


def _local(t: int, zone: ZoneInfo) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, zone).replace(tzinfo=None, fold=0)


def _first_day(period: Period, day: dt.date) -> dt.date:
    if period == "day":
        return day
    if period == "week":
        return day - dt.timedelta(days=day.weekday())
    return day.replace(day=1)


def _next_first_day(period: Period, first: dt.date) -> dt.date:
    if period == "day":
        return first + _DAY
    if period == "week":
        return first + dt.timedelta(days=7)
    if first.month == 12:
        return dt.date(first.year + 1, 1, 1)
    return dt.date(first.year, first.month + 1, 1)


def clear_cache() -> None:
    """Forget cached bounds (tests; a changed tzdata is picked up by a restart anyway)."""
    _cache.clear()
