"""N `vllm serve` replicas on loopback ports behind vLLM's own router (``vllm-router``).

    python -m vllm.benchmarks.router --replicas 2 --policy consistent_hash -- \\
        --scheduling-policy continuum --num-gpu-blocks-override 256

Each replica is a ``RemoteServer`` (its own process group, a free 127.0.0.1 port,
``VLLM_CPU_THREADS`` threads); the router (``python -m vllm_router.launch_router``, from
the ``vllm-router`` wheel) listens on ``--port`` and forwards to them. Ctrl-C, SIGTERM or
SIGHUP stops the router, then every replica's whole process group: nothing is left.
docs/router.md says which identity routes a job (``X-Session-ID``) and pins it.

    python -m vllm.benchmarks.router --pd 1:1 -- --num-gpu-blocks-override 256

``--pd P:D`` starts disaggregated prefill instead (``PDSet``): P ``kv_producer`` and D
``kv_consumer`` servers (``--kv-transfer-config``, TcpConnector) behind the router's
``--vllm-pd-disaggregation``, which prefills on a producer and decodes on a consumer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import requests
import zmq

from vllm.benchmarks.server import RemoteServer, popen_session, stop_session
from vllm.config import CacheConfig, field_default, parse_json_object
from vllm.distributed.kv_events import rank_endpoint
from vllm.entrypoints.utils import LOOPBACK, get_open_port

# The router's load-balancing policies in vllm-router 0.1.17 (its --policy choices).
ROUTING_POLICIES = (
    "consistent_hash",
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "kv_aware",
    "sticky_least_loaded",
)
# Not a --policy of the router: its Program layer (--enable-program-scheduling) in front of
# consistent_hash, which then routes only the requests without a Program identity.
PROGRAM_ROUTING = "program"
ROUTINGS = (*ROUTING_POLICIES, PROGRAM_ROUTING)
# A replica killed mid-run must cost its jobs seconds, not the router's defaults (a
# health check every 60 s, 3 failures to mark it down): a request to it is retried and,
# once its circuit opens after 3 failures, re-hashed onto the healthy replicas.
FAST_FAILOVER = (
    "--health-check-interval-secs", "2",
    "--health-failure-threshold", "2",
    "--cb-failure-threshold", "3",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "200",
    "--retry-max-backoff-ms", "1000",
)  # fmt: skip


def program_scheduling_config(
    token_capacity: int | None = None, overrides: dict | None = None
) -> dict:
    """Our choice of vllm-router's Program-scheduling config (its
    ``--program-scheduling-config-json``; the schema is ``ProgramSchedulingConfig`` in its
    ``src/config/types.rs``, unknown keys ignored, omitted keys at its defaults).

    Requests opt in by ``vllm_xargs.agentic_context`` (the default key); a new Program is
    bound by consistent hash (the same key as the ``consistent_hash`` policy when the
    request carries ``X-Session-ID``); ``global_queue`` on (its docs' recommended mode: a
    paused Program resumes on its previous replica first, elsewhere only if the capacity
    checks allow it); ``token_capacity`` (a replica's KV pool in tokens) turns on its
    token-based admission, without it only ``max_active_programs_per_target`` (64)
    bounds a replica. ``overrides`` replace any key."""
    config: dict = {
        "program_scheduling_enable_key": "vllm_xargs.agentic_context",
        "binding_strategy": "consistent_hash",
        "global_queue": True,
        "resume_order": "mru",
        "metrics_interval_seconds": 1.0,
    }
    if token_capacity is not None:
        config["token_capacity_per_dp_rank"] = token_capacity
    config.update(overrides or {})
    return config


def program_scheduling_args(config: dict) -> list[str]:
    """The router flags that turn the Program layer on with ``config``."""
    compact = json.dumps(config, separators=(",", ":"), sort_keys=True)
    return ["--enable-program-scheduling", "--program-scheduling-config-json", compact]


def router_flags(
    policy: str, router_args: Sequence[str] = (), program_config: dict | None = None
) -> list[str]:
    """The router's flags beyond its URLs and ports: ``--policy``, ``FAST_FAILOVER``, the
    Program layer for ``policy`` ``"program"`` (``program_config``, default
    ``program_scheduling_config()``), then ``router_args`` (which win: later flags
    replace earlier ones)."""
    if policy not in ROUTINGS:
        raise ValueError(f"policy must be one of {ROUTINGS}, got {policy!r}")
    if program_config is not None and policy != PROGRAM_ROUTING:
        raise ValueError(f"program_config is for policy {PROGRAM_ROUTING!r}, not {policy!r}")
    program: list[str] = []
    if policy == PROGRAM_ROUTING:
        program = program_scheduling_args(program_config or program_scheduling_config())
        policy = "consistent_hash"  # routes what carries no Program identity
    return ["--policy", policy, *FAST_FAILOVER, *program, *router_args]


KV_EVENTS_FLAG = "--kv-events-config"
KV_AWARE = "kv_aware"
DEFAULT_BLOCK_SIZE = field_default(CacheConfig, "block_size")


def _take_flag(args: Sequence[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last wins) and
    ``args`` without it."""
    value, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _replica_endpoint(endpoint: str, index: int) -> str:
    """Replica ``index``'s own ZeroMQ address: vLLM's rule for data-parallel ranks
    (``vllm.distributed.kv_events.rank_endpoint``), the first replica's own port kept."""
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{KV_EVENTS_FLAG} endpoint {endpoint!r}: replicas need tcp:// or ipc://")
    return rank_endpoint(endpoint, index)


def _connect_address(endpoint: str) -> str:
    """Where a subscriber on this machine reaches a bound ``endpoint``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{LOOPBACK}:{endpoint[len(wildcard) :]}"
    return endpoint


def replica_kv_events(
    serve_args: Sequence[str], index: int, socket_dir: str | None = None
) -> tuple[list[str], dict | None]:
    """Replica ``index``'s serve arguments and its KV events' config (None: no events).

    Replicas cannot share one event socket: a ``--kv-events-config`` in ``serve_args``
    gets per-replica endpoints (``_replica_endpoint``). ``socket_dir`` (the ``kv_aware``
    routing, which needs the events): without one, each replica publishes on Unix sockets
    of its own there, with a replay socket; events switched off are an error (the router
    would see no cache)."""
    required = socket_dir is not None
    value, rest = _take_flag(serve_args, KV_EVENTS_FLAG)
    if value is None:
        if not required:
            return list(serve_args), None
        # Unix sockets: bound by the replica (vLLM binds tcp only on a wildcard host, which
        # would publish the prompts' tokens beyond this machine) and reachable only here.
        config = {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{socket_dir}/replica{index}-events",
            "replay_endpoint": f"ipc://{socket_dir}/replica{index}-replay",
        }
    else:
        config = parse_json_object(value, KV_EVENTS_FLAG)
        if required and config.get("enable_kv_cache_events") is not True:
            raise ValueError(
                f"the {KV_AWARE} routing needs the replicas' KV events: drop {KV_EVENTS_FLAG} "
                'or set "enable_kv_cache_events": true'
            )
        if required and config.get("topic"):  # before any replica starts
            raise ValueError(f"the {KV_AWARE} routing reads no topic: drop the events' topic")
        config["endpoint"] = _replica_endpoint(config.get("endpoint", "tcp://*:5557"), index)
        if config.get("replay_endpoint"):
            config["replay_endpoint"] = _replica_endpoint(config["replay_endpoint"], index)
    return [*rest, KV_EVENTS_FLAG, json.dumps(config)], config


class EventForwarder:
    """Republishes one replica's KV events from its Unix socket on a loopback TCP port.

    vllm-router subscribes to TCP sources only, and vLLM's rule binds a TCP publisher only
    on a wildcard host (every interface: the prompts' tokens would leave the machine).
    So a replica binds a Unix socket and this forwards it (XSUB -> XPUB, subscriptions
    upstream) on 127.0.0.1 alone. The replay protocol (a direct request, three frames)
    does not cross a broker: the router gets no replay source through one.
    """

    def __init__(self, source: str) -> None:
        self._ctx = zmq.Context()
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        xsub.connect(source)
        self.endpoint = f"tcp://{LOOPBACK}:{xpub.bind_to_random_port(f'tcp://{LOOPBACK}')}"
        control = f"inproc://kv-events-forwarder-{id(self)}"
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.bind(control)
        peer = self._ctx.socket(zmq.PAIR)
        peer.connect(control)
        self._thread = threading.Thread(
            target=self._run, args=(xpub, xsub, peer), name="kv-events-forwarder", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _run(xpub: zmq.Socket, xsub: zmq.Socket, control: zmq.Socket) -> None:
        try:
            zmq.proxy_steerable(xpub, xsub, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (xpub, xsub, control):
                sock.close(linger=0)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._control.send(b"TERMINATE")
            self._thread.join(5)
        self._control.close(linger=0)
        if not self._thread.is_alive():  # else its sockets are still open: leave the context
            self._ctx.term()


def kv_event_sources(
    replicas: Sequence[tuple[str, str, str | None]], model: str, block_size: int
) -> list[str]:
    """vllm-router's flags that feed its ``kv_aware`` policy: each replica's (URL, event
    address, replay address or None) as a static event source, the served model, the
    block size."""
    flags = ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
    for url, endpoint, replay in replicas:
        flags += ["--kv-event-source", f"{url}={endpoint}"]
        if replay is not None:
            flags += ["--kv-event-replay-source", f"{url}={replay}"]
    return flags


def router_installed() -> bool:
    """Whether the ``vllm-router`` wheel (``pip install vllm-router==0.1.17``) is here."""
    return importlib.util.find_spec("vllm_router") is not None


class ReplicaSet:
    """``replicas`` servers with ``serve_args`` and the router in front (``policy``: one of
    ``ROUTINGS``; ``"program"`` is the router's Program layer over ``consistent_hash``,
    configured by ``program_config``, default ``program_scheduling_config()``).

    ``base`` is the router's URL; ``replicas[i].base`` each replica's; ``router_args`` the
    router's arguments beyond the URLs and ports. ``stop()`` (also on leaving a ``with``
    block) ends the router and every replica. ``RuntimeError`` (everything already
    stopped) if a replica or the router does not come up.
    """

    def __init__(
        self,
        replicas: int,
        serve_args: Sequence[str] = (),
        policy: str = "consistent_hash",
        router_args: Sequence[str] = (),
        port: int | None = None,
        threads_per_replica: int = 1,
        log_dir: str | None = None,
        timeout_s: float = 240.0,
        program_config: dict | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        env, logs = self._init_fleet(
            router_flags(policy, router_args, program_config), threads_per_replica, log_dir
        )
        kv_aware = policy == KV_AWARE
        if kv_aware:  # the replicas' event sockets (removed by stop())
            self._socket_dir = tempfile.mkdtemp(prefix="vllm-kv-events-")
        events: list[dict | None] = []
        try:
            launches = []
            for i in range(replicas):
                args, config = replica_kv_events(serve_args, i, self._socket_dir)
                events.append(config)
                launches.append((f"replica{i}", args))
            self._start_replicas(launches, logs, env, timeout_s)
            if kv_aware:  # the router subscribes to every replica's events
                block, _ = _take_flag(serve_args, "--block-size")
                model = self.replicas[0].served_model(_take_flag(serve_args, "--api-key")[0])
                pairs = zip(self.replicas, events, strict=True)
                sources = [self._event_source(replica, config) for replica, config in pairs]
                flags = kv_event_sources(sources, model, int(block or DEFAULT_BLOCK_SIZE))
                self.router_args = [*self.router_args, *flags]
            self._start_router(port, logs, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _init_fleet(
        self, router_args: list[str], threads_per_replica: int, log_dir: str | None
    ) -> tuple[dict[str, str], Path | None]:
        """The empty fleet (nothing started): the router's flags, and the replicas'
        environment and log folder (made here)."""
        if not router_installed():
            raise RuntimeError("vllm-router is not installed: pip install vllm-router==0.1.17")
        self.router_args = router_args
        self.replicas: list[RemoteServer] = []
        self.router: subprocess.Popen | None = None
        self._log: IO[str] | None = None
        self._forwarders: list[EventForwarder] = []
        self._socket_dir: str | None = None
        env = {**os.environ, "VLLM_CPU_THREADS": str(threads_per_replica)}
        logs = Path(log_dir) if log_dir else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        return env, logs

    def _start_replicas(
        self,
        launches: Sequence[tuple[str, Sequence[str]]],
        logs: Path | None,
        env: dict[str, str],
        timeout_s: float,
    ) -> None:
        """One ``RemoteServer`` per (name, serve arguments), appended to ``replicas`` (its
        output in ``<name>.log`` under ``logs``); all load at once, then each is waited for."""
        for name, args in launches:
            log = str(logs / f"{name}.log") if logs else None
            server = RemoteServer(*args, timeout_s=timeout_s, log_path=log, env=env, wait=False)
            self.replicas.append(server)
        for server in self.replicas:
            server.wait_healthy()

    def _worker_flags(self) -> list[str]:
        """The router's flags that name the replicas."""
        return ["--worker-urls", *(r.base for r in self.replicas)]

    def groups(self) -> list[list[int]]:
        """Replica indices by role: the fleet serves while each group has one alive."""
        return [list(range(len(self.replicas)))]

    def names(self) -> list[str]:
        """Each replica's name in messages."""
        return [f"replica {i}" for i in range(len(self.replicas))]

    def _event_source(self, replica: RemoteServer, config: dict) -> tuple[str, str, str | None]:
        """(URL, event address, replay address) of a replica for the router: its own TCP
        addresses, or a forwarder's for a Unix socket."""
        endpoint, replay = config["endpoint"], config.get("replay_endpoint")
        if endpoint.startswith("tcp://"):
            if not (replay and replay.startswith("tcp://")):
                replay = None
            return replica.base, _connect_address(endpoint), replay and _connect_address(replay)
        forwarder = EventForwarder(endpoint)
        self._forwarders.append(forwarder)
        return replica.base, forwarder.endpoint, None

    def _start_router(self, port: int | None, logs: Path | None, timeout_s: float) -> None:
        """vllm-router on ``port`` (None: a free one) in front of the replicas."""
        self.port = port or get_open_port()
        self.base = f"http://{LOOPBACK}:{self.port}"
        cmd = [
            sys.executable, "-m", "vllm_router.launch_router",
            "--host", LOOPBACK,
            "--port", str(self.port),
            *self._worker_flags(),
            "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(get_open_port()),
            "--worker-startup-check-interval", "1",
            *self.router_args,
        ]  # fmt: skip
        self._log = open(logs / "router.log", "w") if logs else open(os.devnull, "w")
        self.router = popen_session(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.router.returncode}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"vllm-router did not start in {timeout_s:g} s")

    def stop(self) -> None:
        """The router first (no new request reaches a stopping replica), then each
        replica's process group; safe to call twice."""
        if self.router is not None:
            stop_session(self.router, grace_s=10)
        if self._log:
            self._log.close()
            self._log = None
        for server in self.replicas:
            server.stop()
        for forwarder in self._forwarders:
            forwarder.stop()
        self._forwarders = []
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


KV_TRANSFER_FLAG = "--kv-transfer-config"
KV_CONNECTOR = "TcpConnector"  # this engine's transport for vLLM's NIXL protocol
PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
# The routings a P/D router takes: its own policies, except kv_aware (its prefill side
# needs --pd-kv-events sources, not wired here) and our Program layer.
PD_ROUTINGS = tuple(p for p in ROUTING_POLICIES if p != KV_AWARE)


def parse_pd(text: str) -> tuple[int, int]:
    """``"P:D"`` (``--pd``): how many producers (prefill) and consumers (decode)."""
    prefill, sep, decode = text.partition(":")
    try:
        counts = int(prefill), int(decode)
    except ValueError:
        counts = (0, 0)
    if not sep or min(counts) < 1:
        raise ValueError(f"--pd must be PREFILL:DECODE, two counts of at least 1, got {text!r}")
    return counts


def pd_serve_args(serve_args: Sequence[str], role: str, index: int = 0) -> list[str]:
    """A producer's or consumer's serve arguments: ``serve_args`` with a
    ``--kv-transfer-config`` of ``role``. A config in ``serve_args`` keeps its other keys
    (connector ``TcpConnector`` when it names none); a fixed ``kv_port`` becomes
    ``kv_port + index`` (producer ``index``'s block server; consumers bind none)."""
    if role not in (PRODUCER, CONSUMER):
        raise ValueError(f"role must be {PRODUCER!r} or {CONSUMER!r}, got {role!r}")
    value, rest = _take_flag(serve_args, KV_TRANSFER_FLAG)
    config = parse_json_object(value, KV_TRANSFER_FLAG) if value is not None else {}
    if "kv_role" in config:
        raise ValueError(f"{KV_TRANSFER_FLAG}: --pd sets each replica's kv_role; drop it")
    config.setdefault("kv_connector", KV_CONNECTOR)
    config["kv_role"] = role
    if config.get("kv_port") and role == PRODUCER:
        config["kv_port"] = int(config["kv_port"]) + index
    return [*rest, KV_TRANSFER_FLAG, json.dumps(config, separators=(",", ":"))]


def pd_worker_flags(prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> list[str]:
    """vllm-router's vLLM P/D mode over these producers and consumers (``nixl``: the
    two-stage kv_transfer_params exchange, which TcpConnector speaks)."""
    flags = ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url in prefill_urls:
        flags += ["--prefill", url]
    for url in decode_urls:
        flags += ["--decode", url]
    return flags


class PDSet(ReplicaSet):
    """Disaggregated prefill behind the router: ``num_prefill`` producers and
    ``num_decode`` consumers, each ``vllm serve`` with ``serve_args`` and a
    ``--kv-transfer-config`` of its role (``pd_serve_args``), and vllm-router in
    ``--vllm-pd-disaggregation`` mode in front (``policy`` for both sides; one of
    ``PD_ROUTINGS``). ``prefills``/``decodes`` are the two groups; ``replicas`` is both,
    producers first. Start-up, logs (``prefill<i>.log``, ``decode<i>.log``,
    ``router.log``), the fast failover and ``stop()`` are ``ReplicaSet``'s."""

    def __init__(
        self,
        num_prefill: int,
        num_decode: int,
        serve_args: Sequence[str] = (),
        policy: str = "consistent_hash",
        router_args: Sequence[str] = (),
        port: int | None = None,
        threads_per_replica: int = 1,
        log_dir: str | None = None,
        timeout_s: float = 240.0,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"P/D needs a producer and a consumer, got {num_prefill}:{num_decode}")
        if policy not in PD_ROUTINGS:
            raise ValueError(f"a P/D router's policy must be one of {PD_ROUTINGS}, got {policy!r}")
        launches = [(f"prefill{i}", pd_serve_args(serve_args, PRODUCER, i))
                    for i in range(num_prefill)]  # fmt: skip
        launches += [(f"decode{i}", pd_serve_args(serve_args, CONSUMER)) for i in range(num_decode)]
        self.num_prefill = num_prefill
        env, logs = self._init_fleet(
            router_flags(policy, router_args), threads_per_replica, log_dir
        )
        try:
            self._start_replicas(launches, logs, env, timeout_s)
            self._start_router(port, logs, timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def prefills(self) -> list[RemoteServer]:
        return self.replicas[: self.num_prefill]

    @property
    def decodes(self) -> list[RemoteServer]:
        return self.replicas[self.num_prefill :]

    def _worker_flags(self) -> list[str]:
        return pd_worker_flags([r.base for r in self.prefills], [r.base for r in self.decodes])

    def groups(self) -> list[list[int]]:
        n = len(self.replicas)
        return [list(range(self.num_prefill)), list(range(self.num_prefill, n))]

    def names(self) -> list[str]:
        return [f"prefill {i}" for i in range(self.num_prefill)] + [
            f"decode {i}" for i in range(len(self.replicas) - self.num_prefill)
        ]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.benchmarks.router",
        description="N vllm serve replicas behind vllm-router; the arguments after -- go "
        "to every `vllm serve`.",
    )
    parser.add_argument("--replicas", type=int, default=2, help="how many `vllm serve`")
    parser.add_argument(
        "--pd",
        metavar="PREFILL:DECODE",
        default=None,
        help="disaggregated prefill instead of --replicas: this many kv_producer and "
        "kv_consumer servers (TcpConnector) behind the router's --vllm-pd-disaggregation",
    )
    parser.add_argument(
        "--policy",
        choices=ROUTINGS,
        default="consistent_hash",
        help="the router's --policy, or program: its Program layer over consistent_hash",
    )
    parser.add_argument(
        "--program-config-json",
        type=json.loads,
        default=None,
        help="with --policy program: keys that replace program_scheduling_config()'s",
    )
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--threads-per-replica", type=int, default=1, help="VLLM_CPU_THREADS of each replica"
    )
    parser.add_argument("--log-dir", default=None, help="replica<i>.log and router.log here")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more vllm-router argument (repeat: --router-arg=--queue-size --router-arg=8)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="start-up limit, s")
    return parser


def _watch(fleet: ReplicaSet) -> int:
    """Serve until the router exits or the last replica of a group does (the router fails
    the jobs of a dead replica over to the others; a P/D fleet needs a producer and a
    consumer); 1 then, after saying which."""
    dead: set[int] = set()
    names = fleet.names()
    while fleet.router is not None and fleet.router.poll() is None:
        for i, replica in enumerate(fleet.replicas):
            if i not in dead and replica.proc.poll() is not None:
                dead.add(i)
                print(f"{names[i]} exited ({replica.proc.returncode})", file=sys.stderr)
        if any(dead.issuperset(group) for group in fleet.groups()):
            print("every replica of a role exited; stopping the router", file=sys.stderr)
            return 1
        time.sleep(1.0)
    print("vllm-router exited; stopping the replicas", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = make_parser()
    args = parser.parse_args(argv[:split])
    serve_args = argv[split + 1 :]
    program_config = None
    if args.policy == PROGRAM_ROUTING:
        program_config = program_scheduling_config(overrides=args.program_config_json)
    elif args.program_config_json is not None:
        parser.error("--program-config-json needs --policy program")
    pd = None
    if args.pd is not None:
        try:
            pd = parse_pd(args.pd)
        except ValueError as e:
            parser.error(str(e))
        if args.policy not in PD_ROUTINGS:
            parser.error(f"--pd takes --policy {' / '.join(PD_ROUTINGS)}, not {args.policy}")

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        common = dict(
            policy=args.policy,
            router_args=args.router_arg,
            port=args.port,
            threads_per_replica=args.threads_per_replica,
            log_dir=args.log_dir,
            timeout_s=args.timeout,
        )
        if pd is not None:
            fleet = PDSet(*pd, serve_args, **common)
            mode = f"P/D {args.pd}, {args.policy}"
        else:
            fleet = ReplicaSet(args.replicas, serve_args, program_config=program_config, **common)
            mode = args.policy
        with fleet:
            for name, replica in zip(fleet.names(), fleet.replicas, strict=True):
                print(f"{name}: {replica.base}", flush=True)
            print(f"vllm-router ({mode}): {fleet.base}  (Ctrl-C stops all)", flush=True)
            return _watch(fleet)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
