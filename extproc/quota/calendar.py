"""Calendar windows (placeholder until the calendar module lands): local day, ISO week and
month in an IANA zone, as epoch seconds."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo


def _midnight(year: int, month: int, day: int, zone: ZoneInfo) -> int:
    local = datetime(year, month, day, tzinfo=zone)
    return int(local.timestamp())


def calendar_bounds(period: str, timezone: str, now_s: int) -> tuple[int, int]:
    zone = ZoneInfo(timezone)
    local = datetime.fromtimestamp(now_s, zone)
    if period == "day":
        first = local.date()
        nxt = first + timedelta(days=1)
    elif period == "week":
        first = local.date() - timedelta(days=local.weekday())
        nxt = first + timedelta(days=7)
    elif period == "month":
        first = local.date().replace(day=1)
        nxt = (first + timedelta(days=32)).replace(day=1)
    else:
        raise ValueError(f"unknown calendar period {period!r}")
    return (
        _midnight(first.year, first.month, first.day, zone),
        _midnight(nxt.year, nxt.month, nxt.day, zone),
    )
