"""`pagefleet serve MODEL|CONFIG [flags]` (`serve_args`): Ray (embedded or joined), Serve, the app, until Ctrl-C.

With no address (neither --address nor $RAY_ADDRESS) it starts a local Ray
of its own and stops it on exit, with everything Ray started; on a cluster it
deploys the app there and deletes only that app on exit. Failures end with
one line on stderr and exit code 1, never a traceback.

A Ray of its own runs with Ray's token authentication and, for a loopback host, on
127.0.0.1 only (`ray_guard.OwnRayGuard`); of a cluster it joins it says in one line
whether that cluster has authentication on (docs/security.md). Its Serve proxies
answer 431 beyond `limits.max_header_bytes` / `max_headers` (`http.header_limits`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

from pagefleet.engine.checkpoint import generation_defaults

from .config import ConfigError, ServeConfig
from .ray_guard import OwnRayGuard, joined_cluster_line
from .serve_args import serve_config_from_args

APP_NAME = "pagefleet"
# Ctrl-C on our own Ray: how long Serve may take to stop before Ray is shut down under it.
STOP_WAIT_S = 15.0


class LaunchError(Exception):
    pass


def _say(msg: str) -> None:
    print(f"pagefleet: {msg}", flush=True)


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def prepare(args: argparse.Namespace) -> ServeConfig:
    """The config the command line asks for (`serve_args`), the model written if asked,
    and what can be checked before anything starts."""
    config = serve_config_from_args(args)
    if not os.path.isdir(config.model) and config.make_model:
        from .make_model import make_model

        _say(f"writing the {config.make_model} checkpoint to {config.model} ...")
        make_model(config.model, preset=config.make_model)
    try:
        engine = config.engine_config()  # the engine's own validation, before anything starts
    except ValueError as e:
        raise LaunchError(str(e)) from None
    _say_sampling_defaults(engine.checkpoint, engine.generation_config)
    return config


def _say_sampling_defaults(checkpoint: str, generation_config: str) -> None:
    """Which request defaults the checkpoint's generation_config.json gives (vLLM says it too)."""
    defaults = generation_defaults(checkpoint, generation_config)
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        _say(
            f"requests that leave them out sample with the checkpoint's defaults: {shown} "
            "(--generation-config vllm: none)"
        )


def _say_compilation(in_background: bool) -> None:
    """How long an engine replica's start-up spent compiling its forward (one replica's)."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle("EngineReplica", APP_NAME)
        info = handle.info.remote().result(timeout_s=30)
    except Exception:  # the message is a courtesy: never fail a started server for it
        return
    if info.compile_seconds is None and in_background:
        _say("  engine: serving eagerly while the forward compiles (compile_in_background)")
    elif info.compile_seconds is None:
        _say("  engine: eager forward (enforce_eager), no compilation")
    else:
        _say(
            f"  engine: forward compiled (torch.compile) in {info.compile_seconds:.1f} s at "
            "start-up; `engine.enforce_eager: true` skips it"
        )


def serve_main(args: argparse.Namespace) -> int:
    logging.getLogger("pagefleet").setLevel(logging.WARNING)
    try:
        config = prepare(args)
        address = args.address or os.environ.get("RAY_ADDRESS")
        if not address:
            _check_port(config.host, config.port)
        return _run(config, address)
    except (ConfigError, LaunchError) as e:
        print(f"pagefleet: error: {e}", file=sys.stderr, flush=True)
        return 1


def _stop_serve(serve: object) -> None:
    """Stop Serve on our own Ray, waiting at most STOP_WAIT_S.

    Replicas drain for as long as a request may take (drain_s); Ctrl-C on our own Ray ends
    what is in flight after a short wait instead. The wait is a coroutine on this thread,
    cancelled at the deadline, never a thread left inside Ray: Ray's core worker ends the
    whole process, with a non-zero code, when a thread calls into it after ray.shutdown().
    """
    with contextlib.suppress(TimeoutError):
        asyncio.run(asyncio.wait_for(serve.shutdown_async(), STOP_WAIT_S))  # type: ignore[attr-defined]


def _ray_init(ray: object, address: str | None, guard: OwnRayGuard | None) -> None:
    """Start our own Ray under `guard`, or join the cluster at `address` and say whether
    it authenticates."""
    own = guard.init_options() if guard is not None else {}
    ray.init(  # type: ignore[attr-defined]
        # "local": a new cluster of our own, even where `ray start` left one running
        # (a bare ray.init() would join it, and deploy onto someone else's Serve).
        address=address or "local",
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
        configure_logging=True,
        **own,
    )
    if guard is None:
        _say(joined_cluster_line(ray.get_runtime_context().gcs_address))  # type: ignore[attr-defined]
    else:
        _say(guard.describe())


def _run(config: ServeConfig, address: str | None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Before anything imports ray: Ray reads RAY_AUTH_MODE once, when it is imported.
    guard = None if address else OwnRayGuard(config.host)
    if guard is not None:
        guard.apply(os.environ)
    import ray
    from ray import serve

    from .app import build_app
    from .http.header_limits import proxy_env

    if guard is not None:
        os.environ.update(proxy_env(config.limits.max_header_bytes, config.limits.max_headers))

    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    owns_ray = not address
    if owns_ray:
        os.environ.pop("RAY_ADDRESS", None)  # an empty one would make ray.init fail
    try:
        _say("joining Ray at " + address if address else "starting an embedded local Ray ...")
        _ray_init(ray, address, guard)
        # Again: Ray's core worker installs its own SIGTERM handler (it logs and dies), and
        # Kubernetes and systemd stop a server with SIGTERM.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        serve.start(http_options={"host": config.host, "port": config.port})
        scaling = config.autoscaling
        count = (
            f"{config.replicas} engine replica(s)"
            if scaling is None
            else f"engine replicas (autoscaled {scaling.min_replicas}..{scaling.max_replicas}, "
            f"starting at {scaling.initial_replicas or scaling.min_replicas})"
        )
        _say(f"deploying {count} of {config.model}, routed by {config.routing} ...")
        t0 = time.monotonic()
        serve.run(build_app(config.model_dump()), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{config.host}:{config.port}"
        _say(f"ready in {time.monotonic() - t0:.1f} s: model {config.model_name!r} at {url}/v1")
        engine = config.engine_config()
        _say_compilation(engine.compile_in_background and not engine.eager)
        _say(f"  metrics {url}/metrics, health {url}/health; Ctrl-C to stop")
        while not stop.wait(1.0):
            pass
        _say("stopping ...")
        return 0
    except Exception as e:
        msg = str(e).strip().splitlines()
        print(f"pagefleet: error: {type(e).__name__}: {msg[-1] if msg else e}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            if owns_ray:
                _stop_serve(serve)
            else:  # someone else's cluster: Serve drains our app there, we need not wait
                serve.delete(APP_NAME, _blocking=False)
        with contextlib.suppress(Exception):
            ray.shutdown()
        if guard is not None:
            guard.cleanup()
