"""Which engine replica serves each request: one policy, its state, and its adapters.

- config: `RoutingConfig`, the router's settings, and the policies a config may name
- reports: what a replica reports (`routing_stats_from_engine`) and the router's view of
  it (`ReplicaLoad`)
- ledger: what a router sent each replica that its report does not include yet
- state: `RouterState`, what the router remembers (reservations, sent prompts, owners)
- prefill_drain: each replica's prefill backlog between its reports
- policy: `choose_replica`, the most_free_blocks score (each term a named function)
- scale_in: the hand-off of a leaving replica's prompt chains and the scale-in notice
- router: `Router`, the lifecycle calls (reconcile, choose, record, notice, retain) the
  Serve adapter and the lab's simulator both make
- shared_view: one view across ingress replicas (each router's sends and prompt owners
  merged into every other's); view_actor: its hub, a small named actor per deployment
- serve_common, serve_routers: the Ray Serve adapters, registered by import path
  (`request_router_config`)
- ray_prefix_affinity: Ray Serve LLM's prefix-cache affinity router, as a baseline

Pure parts (config to router) import no Ray; the adapters drive them through the
lifecycle calls `RouterState` names. docs/routing.md has the rationale and the figures.
"""
