"""The uvicorn configs the client-limit tests serve with: a bare one with given limits, and the
very configs `kvgate worker` and `kvgate gateway` build from their flags."""

import types
from collections.abc import Callable
from typing import cast

import uvicorn
from starlette.types import ASGIApp

from gateway import cli_args as gateway_cli
from gateway import server as gateway_server
from gateway.app import Gateway
from workers import cli as worker_cli
from workers.http_server import ClientLimits, protocol_class

Configure = Callable[[ASGIApp], uvicorn.Config]


def limited(limits: ClientLimits) -> Configure:
    """A bare uvicorn config serving with the client connection of `limits`."""
    return lambda app: uvicorn.Config(app, http=protocol_class(limits), lifespan="off", log_level="warning")


class Idle:
    draining, in_flight, idle = False, 0, True


def worker_config(*flags: str) -> Configure:
    """The config of the server `kvgate worker FLAGS` runs (workers/cli.py `http_server`)."""
    args = worker_cli.parser().parse_args(["--model", "smollm2-135m", *flags])
    return lambda app: worker_cli.http_server(args, app, Idle()).config


def gateway_config(*flags: str) -> Configure:
    """The config of the server `kvgate gateway FLAGS` runs (gateway/server.py `http_server`)."""
    args = gateway_cli.parser().parse_args(list(flags))
    return lambda app: (
        gateway_server.http_server(cast(Gateway, types.SimpleNamespace(app=app, admission=Idle())), args).config
    )
