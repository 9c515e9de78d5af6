"""The launcher's uvicorn server: it stops once its engine has been dead for the grace, and only then."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import uvicorn
from fastapi import FastAPI

from jaxserve.entrypoints.launcher import ApiServer


def test_the_server_stops_once_the_engine_has_been_dead_for_the_grace():
    engine = SimpleNamespace(dead_reason=None)
    server = ApiServer(uvicorn.Config(FastAPI()), engine, "m", engine_dead_grace_s=0.3, announce=False)
    tick = lambda: asyncio.run(server.on_tick(0))  # noqa: E731
    assert tick() is False and not server.engine_died
    engine.dead_reason = "the engine's step loop ended: RuntimeError('bug')"
    assert tick() is False and server.engine_died  # still answering (503) during the grace
    time.sleep(0.35)
    assert tick() is True


def test_a_live_engine_never_stops_the_server_and_ctrl_c_still_does():
    server = ApiServer(uvicorn.Config(FastAPI()), SimpleNamespace(dead_reason=None), "m", announce=False)
    assert asyncio.run(server.on_tick(0)) is False
    server.should_exit = True
    assert asyncio.run(server.on_tick(0)) is True and not server.engine_died
