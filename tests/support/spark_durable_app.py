"""Promises and a schedule in one application, for the Spark runtime's test."""

from __future__ import annotations

from promises_app import orders
from schedules_app import beat, ticks

from charon import Application

app = Application("sparkdurable", [orders, ticks])
app.schedule("*/2 * * * * *", key="every-second", name="heartbeat", catch_up=1)(beat)
