"""Flow control: requests the pool has no room for wait in bounded queues, by priority band and by flow (tenant),
and are dispatched one at a time as room frees, instead of being routed into pods that are already full.

`queues` holds the waiting requests and decides who goes next (pure: every time is given); `controller` runs it
on the event loop: admits, wakes the next request on every event that can free room, expires what waits too long.
"""
