"""The shared routing view's hub on Ray (`shared_view.ViewHub` in a small named actor, one
per engine deployment) and a router's exchanges with it (`RemoteView`).

The actor is created by the first router that exchanges (`get_if_exists`, no CPU), owned
by that router's process: if that process goes, the actor goes with it, the other routers'
exchanges fail (each routes on its own view, `shared_view.ViewClient.failed`) and the next
exchange creates it anew, where every router publishes again within a period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import ray

from pagefleet.cluster.routing.shared_view import PeerUpdate, Publication, ViewHub

NAMESPACE = "pagefleet-routing"


def hub_name(app_name: str, deployment_name: str) -> str:
    """The named actor of one deployment's shared view."""
    return f"routing-view:{app_name}:{deployment_name}"


class ViewHubActor:
    """`ViewHub` with the actor's clock."""

    def __init__(self, peer_ttl_s: float) -> None:
        self.hub = ViewHub(peer_ttl_s)

    def exchange(
        self, router: str, publication: Publication, since: Mapping[str, int]
    ) -> dict[str, PeerUpdate]:
        return self.hub.exchange(router, publication, since, time.time())


class RemoteView:
    """A router's connection to its deployment's hub actor (created on first use).

    The handle is kept across exchanges that time out (the actor may still be starting on
    a loaded node): the actor lives only while some handle to it does, so dropping it would
    end the actor being waited for. It is dropped only when a call fails otherwise (the
    actor died), so that the next exchange finds or creates the new one."""

    def __init__(self, name: str, timeout_s: float, peer_ttl_s: float) -> None:
        self.name, self.timeout_s, self.peer_ttl_s = name, timeout_s, peer_ttl_s
        self._actor: Any = None
        self._connecting: asyncio.Future[Any] | None = None

    def _connect(self) -> Any:
        return (
            ray.remote(ViewHubActor)
            .options(name=self.name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0)
            .remote(self.peer_ttl_s)
        )

    async def _handle(self) -> Any:
        """The actor's handle; while the look-up (a GCS call, in a thread) runs, raises.
        Raises once Ray is shut down in this process (a driver's router outlives it)."""
        if not ray.is_initialized():
            self._actor = None
            raise RuntimeError("Ray is not initialized")
        if self._actor is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(asyncio.to_thread(self._connect))
            await asyncio.wait([self._connecting], timeout=self.timeout_s)
            if not self._connecting.done():
                raise TimeoutError(f"looking up {self.name}")
            connecting, self._connecting = self._connecting, None
            self._actor = connecting.result()
        return self._actor

    async def exchange(
        self, router: str, publication: Publication, since: Mapping[str, int]
    ) -> dict[str, PeerUpdate]:
        """One round trip; raises if the hub does not answer within `timeout_s`."""
        actor = await self._handle()
        try:
            ref = actor.exchange.remote(router, publication, dict(since))
            return await asyncio.wait_for(ref, self.timeout_s)
        except TimeoutError:
            raise
        except Exception:
            self._actor = None
            raise
