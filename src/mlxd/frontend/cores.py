"""A front end's engine cores: one :class:`CoreClient` per device, routing and fan-out.

With ``engine.devices`` naming several devices (data parallel) every front end talks to
every core. A generation goes to one core (frontend/routing.py: prefix affinity, then
load); an encoder or tokenizer call to the least busy core; the model manager's calls
(``Loaded``, ``Status``, ``Unload``, ``Metrics``, ``Forget``, a ``Touch`` without a
request: enginecore/protocol.py) go to every core that is up, and their answers are merged
by the caller. A core's death fails its own requests only (its CoreClient's), the others
keep serving while its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from mlxd.core.errors import Unavailable
from mlxd.enginecore import protocol as p
from mlxd.frontend.client import CoreClient
from mlxd.frontend.routing import PrefixRouter, block_hashes


def _unavailable() -> Unavailable:
    return Unavailable(
        "the engine core is not running (restarting); retry shortly", headers={"Retry-After": "2"}
    )


class CorePool:
    def __init__(
        self,
        run_dirs: Sequence[str | Path],
        *,
        devices: Sequence[str | None] | None = None,
        affinity_slack: int = 8,
        affinity_min_tokens: int = 64,
    ) -> None:
        devices = list(devices) if devices is not None else [None] * len(run_dirs)
        self.clients = [
            CoreClient(d, index=i, device=dev)
            for i, (d, dev) in enumerate(zip(run_dirs, devices, strict=True))
        ]
        self.router = PrefixRouter(slack=affinity_slack, min_tokens=affinity_min_tokens)

    def __len__(self) -> int:
        return len(self.clients)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        for c in self.clients:
            await c.start()

    async def wait_ready(self, timeout: float) -> None:
        """Every core up with its pinned models (at start: a core that cannot load them is
        a configuration error, whichever device it is on)."""
        await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))

    @property
    def startup_error(self) -> str | None:
        errors = [
            f"core {c.index}: {c.startup_error}" if len(self.clients) > 1 else str(c.startup_error)
            for c in self.clients
            if c.startup_error
        ]
        return "; ".join(errors) if errors else None

    async def close(self) -> None:
        for c in self.clients:
            if c.started:
                await c.close()

    # -- state -------------------------------------------------------------------------------
    @property
    def serving(self) -> list[CoreClient]:
        return [c for c in self.clients if c.serving]

    @property
    def alive(self) -> list[CoreClient]:
        return [c for c in self.clients if c.alive]

    @property
    def epochs(self) -> tuple[int, ...]:
        return tuple(c.epoch for c in self.clients)

    @property
    def deaths(self) -> int:
        return sum(c.deaths for c in self.clients)

    # -- choosing a core ---------------------------------------------------------------------
    def pick(self, model: str, tokens: Sequence[int], salt: str | None = None) -> CoreClient:
        """The core for a generation of ``tokens`` under cache ``salt`` (see
        frontend/routing.py)."""
        if len(self.clients) == 1:
            c = self.clients[0]
            if not c.serving:
                raise _unavailable()
            return c
        loads = [c.load if c.serving else None for c in self.clients]
        if all(load is None for load in loads):
            raise _unavailable()
        hashes = block_hashes(model, tokens, self.router.block, salt) if tokens else []
        return self.clients[self.router.choose(loads, hashes)]

    def least_busy(self) -> CoreClient:
        """For calls (encoders, tokenizing, a request's model lookup) that have no prefix
        to follow: the core a generation without one would get."""
        loads = [c.load if c.serving else None for c in self.clients]
        if all(load is None for load in loads):
            raise _unavailable()
        return self.clients[self.router.least(loads)]

    # -- calls -------------------------------------------------------------------------------
    async def call(self, request: p.Request[p.R]) -> p.R:
        """One call on the least busy core."""
        return await self.least_busy().call(request)

    async def call_all(
        self, request: p.Request[p.R], *, timeout: float | None = None
    ) -> list[tuple[CoreClient, p.R | BaseException]]:
        """The call on every live core, concurrently: (core, result or the exception it
        raised) per core, in core order; a dead core is left out."""
        live = self.alive

        async def one(c: CoreClient) -> p.R:
            return await asyncio.wait_for(c.call(request), timeout)

        results = await asyncio.gather(*(one(c) for c in live), return_exceptions=True)
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
        return list(zip(live, results, strict=True))

    async def metrics_texts(self) -> list[tuple[CoreClient, str | None]]:
        """Each live core's Prometheus exposition, in core order (None: it did not answer)."""
        return [
            (c, None if isinstance(r, BaseException) else r.text.decode())
            for c, r in await self.call_all(p.Metrics())
        ]

    async def values_all(self, request: p.Request[p.R]) -> list[tuple[CoreClient, p.R]]:
        """:meth:`call_all`'s results; a core that died meanwhile is left out as a dead one
        is, any other failure is raised (the first core's)."""
        results = await self.call_all(request)
        for c, r in results:
            if isinstance(r, BaseException) and c.alive:
                raise r
        return [(c, r) for c, r in results if not isinstance(r, BaseException)]
