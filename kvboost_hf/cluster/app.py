"""``kvboost-hf serve --ray``: the server as a Ray Serve application, one model per replica.

:func:`build_application` binds the ingress to the replica deployment (its router: ``prefix``, the
exact prefix-aware :class:`~.router.PrefixRouter`, or ``pow2``, Ray's default); :func:`serve_on_ray`
starts (or joins) Ray, runs the application on ``--host``/``--port`` and stops it on SIGINT/SIGTERM,
letting Serve drain in-flight requests first.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvboost_hf.cluster.ingress import Ingress
from kvboost_hf.cluster.metrics import MetricsBoard
from kvboost_hf.cluster.replica import ModelReplica
from kvboost_hf.server.command import ServeError, check_serve_args, served_model_name

logger = logging.getLogger(__name__)

APP_NAME = "kvboost"
ROUTING_STATS_PERIOD_S = 0.5  # how often replicas report what their stores hold
DRAIN_TIMEOUT_S = 60.0  # a stopping replica finishes its requests for up to this long


def replica_options(args: argparse.Namespace) -> dict:
    """Serve options of the replica deployment from the flags."""
    from ray.serve.config import RequestRouterConfig

    from kvboost_hf.cluster.router import PrefixRouter

    options: dict = {
        "name": "kvboost-replica",
        "ray_actor_options": {"num_cpus": args.cpus_per_replica},
        # Admission is the server's own (its queue, 503s): Serve only caps what a replica holds at once.
        "max_ongoing_requests": args.max_queue + args.max_batch_size,
        "graceful_shutdown_timeout_s": min(DRAIN_TIMEOUT_S, args.request_timeout),
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if args.min_replicas is not None or args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        high = args.max_replicas if args.max_replicas is not None else max(low, args.replicas)
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "initial_replicas": min(max(args.replicas, low), high),
                                         "target_ongoing_requests": max(2, args.max_batch_size // 4)}
    else:
        options["num_replicas"] = args.replicas
    if args.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10.0,
            request_router_kwargs={"model": args.model, "api_keys_file": getattr(args, "api_keys", None),
                                   "imbalance": args.router_imbalance})
    return options


def build_application(args: argparse.Namespace):
    """The Serve application the flags describe: an ingress in front of ``--replicas`` model replicas."""
    from ray import serve

    threads = max(1, int(args.cpus_per_replica))  # build_app keeps --torch-threads when it is given
    board = serve.deployment(MetricsBoard, name="kvboost-metrics", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=1000).bind()
    replicas = serve.deployment(ModelReplica, **replica_options(args)).bind(args, threads, board)
    ingress = serve.deployment(Ingress, name="kvboost-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(replicas, board)


def serve_on_ray(args: argparse.Namespace, ready: threading.Event | None = None,
                 stop: threading.Event | None = None) -> int:
    """Run the application until SIGINT/SIGTERM (or ``stop``); ``ready`` is set once it serves."""
    check_serve_args(args)  # --ray flags included
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise ServeError(f"--ray needs Ray Serve: pip install 'kvboost_hf[ray]' ({err})") from err
    own_ray = args.ray_address is None
    if own_ray:
        high = args.max_replicas if args.max_replicas is not None else args.replicas
        ray.init(num_cpus=max(1, int(high * args.cpus_per_replica + 0.999)), include_dashboard=False,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=args.ray_address, logging_level=logging.WARNING)
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"serving {served_model_name(args)} on http://{args.host}:{args.port}/v1 "
              f"({args.replicas} Ray Serve replica(s), router {args.router})", file=sys.stderr, flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
        logger.info("stopping: draining in-flight requests")
        serve.delete(APP_NAME)  # replicas stop taking requests and finish theirs (graceful shutdown)
        serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_ray:
            ray.shutdown()
    return 0
