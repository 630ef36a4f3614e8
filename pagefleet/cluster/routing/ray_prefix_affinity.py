"""Ray Serve LLM's `PrefixCacheAffinityRouter` (Ray 2.60) on pagefleet's requests: a baseline.

`routing: prefix_cache_affinity` (serve_routers.request_router_config) routes
the engine deployment with Ray's own prefix-aware router, unchanged but for what it reads of
a request. Ray's router keeps a character prefix tree (a `PrefixTreeActor`, one detached
actor per deployment, which every router of the deployment shares) of the prompts it has
routed, one tenant per replica. For each request it takes Serve's power-of-two pair as a
fallback; when the replicas' queue lengths differ by at most `imbalanced_threshold`
(default: any difference), it offers the replicas whose tree holds the longest prefix of the
prompt, if that prefix is at least `match_rate_threshold` (10 %) of it, else the replicas
holding the fewest characters; Serve then takes the one with the shortest queue of those.
After routing it inserts the prompt under the chosen replica. It sees no KV-cache state:
what a replica evicted stays in the tree (unless `do_eviction` trims it by size).

What the adapter changes. Ray's router reads the prompt as text from a call argument's
`prompt` or `messages` (an OpenAI request object). pagefleet's ingress sends one
`ReplicaRequest` whose prompt is token ids (chat template applied); its text is not sent.
So `_extract_text_from_request` gives Ray's tree the prompt's token ids as text, one
character per token (`prompt_text`): matching prefixes of that text is matching token
prefixes, which is what a replica's prefix cache reuses, and the match rate is the
fraction of the prompt's tokens matched (Ray's is of its characters). A call without a
prompt (an engine info or health call) is routed by Serve's power of two alone, and
not inserted. Router kwargs (`routing` kwargs: `imbalanced_threshold`,
`match_rate_threshold`, `do_eviction`, ...) pass through to Ray's `initialize_state`.

Cost, as Ray ships it: each decision makes two or three blocking `ray.get` round trips to
the tree actor from the router's event loop (the ingress's), and each routed request one
more. Loads no torch (Ray's module imports only Ray Serve), like the rest of the ingress.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from pagefleet.cluster.routing.serve_common import CountsRoutes, carries_prompt, prompt_of

# Token id t is character t, past the UTF-16 surrogates (which no string should hold).
_SURROGATES = range(0xD800, 0xE000)


def prompt_text(token_ids: Sequence[int]) -> str:
    """One character per token id: the prefix tree's text for a tokenized prompt."""
    low, width = _SURROGATES.start, len(_SURROGATES)
    return "".join(chr(t if t < low else t + width) for t in token_ids)


class RayPrefixCacheAffinityRouter(CountsRoutes, PrefixCacheAffinityRouter):
    """Ray's `PrefixCacheAffinityRouter` reading the `ReplicaRequest`'s token ids, with
    pagefleet's routing metrics (`pagefleet:routed_requests`, policy prefix_cache_affinity)."""

    policy_name = "prefix_cache_affinity"

    def initialize_state(self, **kwargs: Any) -> None:
        self._init_metrics()
        PrefixCacheAffinityRouter.initialize_state(self, **kwargs)

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        return prompt_text(prompt_of(pending_request)[0])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not carries_prompt(pending_request):  # Ray's would divide by the empty text
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request
            )
        return await PrefixCacheAffinityRouter.choose_replicas(
            self, candidate_replicas, pending_request
        )

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        CountsRoutes.on_request_routed(self, pending_request, replica_id, result)
        if carries_prompt(pending_request):  # into the tree, under the replica that took it
            PrefixCacheAffinityRouter.on_request_routed(self, pending_request, replica_id, result)
