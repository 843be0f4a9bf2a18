"""How many output tokens a streamed response reserves, and when: the lease-ahead rule.

Pure functions of four numbers, so the rule is stated (and tested) in one place:

* ``batch`` — the plan's lease batch (``batch_tokens``);
* ``max_output`` — the most the request can produce (``max_tokens`` × ``n``);
* ``leased`` — output tokens reserved so far (admission's share included);
* ``delivered`` — output tokens already forwarded to the client.

The rule. The lease is counted in whole batches of output: batch 1 is tokens
``1..batch``, batch 2 the next ``batch``, and so on.

1. Admission reserves the prompt plus the start of batch 1: ``min(batch, ADMISSION_CAP)``
   output tokens (never more than ``max_output``). The meter tops that up to the whole of
   batch 1 on the stream's first event, so one batch is in hand before the first token,
   and nothing more.
2. The next batch is reserved once the current one is half used (``ceil(batch / 2)`` of its
   tokens delivered), so at most one batch is reserved ahead of the one being delivered:
   after each lease the stream holds between ``batch / 2`` and ``1.5 × batch`` undelivered.
3. No lease goes past ``max_output``.
4. Once a lease is granted in part (the budget is nearly spent), nothing more is leased
   ahead: the next lease is asked for when an event needs it (``cover_lease``), as late as
   possible, so tokens that finishing streams refund meanwhile can still be had.

Why. Tokens a stream holds but has not delivered are budget nobody else can use until it
settles and refunds them. Streams that each held prompt + two batches before their first
token (the former rule: ``leased - delivered <= batch`` is already true at 0 delivered)
filled a small budget with reservations, so a burst had requests refused with budget
left. Half a batch in hand is still many round trips' worth of output (16 tokens at batch
32 is ~300 ms at 20 ms per token; a lease takes ~1 ms), so events don't wait on Redis.

The admission cap bounds what admission alone leaves unusable at the end of a window: a
request is refused when its prompt plus its first reservation doesn't fit, so at batch 128
up to ``prompt + 127`` tokens could stay unused; capped, the tail is under
``prompt + ADMISSION_CAP`` whatever the batch. Its price, when ``batch`` > the cap: one more
lease (the top-up) per stream, and new requests get in on a small room left and compete
with running streams for the last tokens, so more answers are cut near the end of a budget
(a refused lease ends a stream). An admission script that reserves prompt +
``min(batch, room left)`` (at least ``ADMISSION_CAP``) would do the same without the top-up.
"""

from __future__ import annotations

# Output tokens admission reserves at most, whatever the batch (the default batch size).
ADMISSION_CAP = 32


def first_lease(batch: int, max_output: int) -> int:
    """Output tokens admission reserves with the prompt for a lease-ahead stream.

    ``min(batch, ADMISSION_CAP, max_output)``: the start of the first batch. The meter
    tops it up to a whole batch (``next_lease`` at 0 delivered) on the first event.
    """
    _check(batch)
    return max(0, min(batch, ADMISSION_CAP, max_output))


def lease_target(delivered: int, batch: int) -> int:
    """Output tokens that should be reserved once ``delivered`` have gone to the client.

    Whole batches: through the batch being delivered, plus the next one once the current
    is half used, i.e. ``((delivered + batch - ceil(batch/2)) // batch + 1) * batch``. At 0
    delivered it is one batch; at batch 32 it becomes 64 at the 16th token, 96 at the 48th.
    """
    _check(batch)
    half = (batch + 1) // 2
    return ((max(0, delivered) + batch - half) // batch + 1) * batch


def next_lease(leased: int, delivered: int, batch: int, max_output: int) -> int:
    """Output tokens to reserve now in the background; 0 when no lease is due.

    The shortfall of ``leased`` against ``lease_target(delivered, batch)``, capped by
    ``max_output``: a whole batch when the current one has just reached half use, the rest
    of batch 1 right after admission (see ``first_lease``), 0 while the lease covers the
    target. Once a lease has been granted in part (``leased`` is off the batch grid: the
    budget is nearly spent) nothing is leased ahead any more: ``cover_lease`` asks when an
    event needs the tokens, as late as possible, so what finishing streams refund in the
    meantime can still be had, instead of asking again at once and being refused.
    """
    top = min(lease_target(delivered, batch), max_output)
    if leased >= top:
        return 0
    if leased % batch and leased != first_lease(batch, max_output):
        return 0
    return top - leased


def lease_due_at(leased: int, batch: int, max_output: int) -> int | None:
    """The fewest delivered tokens at which ``next_lease`` asks for more; None: never.

    ``next_lease(leased, d, ...) > 0`` exactly when ``d >= lease_due_at(leased, ...)``, so
    the meter compares one integer per event instead of evaluating the rule.
    """
    _check(batch)
    if leased >= max_output or (leased % batch and leased != first_lease(batch, max_output)):
        return None
    return max(0, (leased // batch - 1) * batch + (batch + 1) // 2)


def cover_lease(leased: int, need: int, batch: int, max_output: int) -> int:
    """Output tokens to reserve when events carrying ``need`` tokens in all are waiting.

    At least the shortfall ``need - leased`` (even past ``max_output``: an upstream that
    overruns its limit is still charged for what it sends), and as much as brings the
    lease to the target for ``need`` delivered, so the lease is back on whole batches.
    """
    return max(need - leased, min(lease_target(need, batch), max_output) - leased)


# A lease takes at most this fraction of the room the tenant had left at the last charge.
FAIR_SHARE_DIVISOR = 8


def fair_share(amount: int, room_left: int | None) -> int:
    """``amount``, capped to a share of the budget still free when the budget runs low.

    Near the end of a budget, a whole batch per stream would hand the last tokens to the
    first streams that ask (held, mostly unused, until they settle) and refuse the rest:
    each lease takes at most ``room_left / FAIR_SHARE_DIVISOR`` (at least 1), so the room
    is spread over the streams that need it. ``None``: room unknown (no token limit seen).
    """
    if room_left is None:
        return amount
    return max(1, min(amount, room_left // FAIR_SHARE_DIVISOR))


# A refusal that other requests' refunds may lift (they hold leases they may not use) is
# asked again this often, for up to ``refund_wait_ms``.
REFUND_RETRY_S = 0.05


def refund_retries(wait_s: float) -> int:
    """How many times such a refusal is asked again before it stands."""
    return max(0, round(wait_s / REFUND_RETRY_S))


def _check(batch: int) -> None:
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
