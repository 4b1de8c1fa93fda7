"""`kvgate mock-engine`: one simulated vLLM instance (OpenAI API, prefix cache, queue, metrics).

It hashes prompts with the same settings flags (or `--config` file) as the gateway, so the blocks
it publishes to the KV store are the keys the gateway looks up. With `--kv-events-endpoint` it also
publishes its prefix cache's changes as vLLM's KV events (ZMQ, vLLM 0.32's wire format).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from kvgate.bench.loadgen import run_async
from kvgate.config.loader import ConfigError, add_settings_arguments, load_settings
from kvgate.config.pd import SGLANG_DEFAULT_BOOTSTRAP_PORT
from kvgate.engine_model import ServiceProfile
from kvgate.mock_engine.kv_event_wire import EVENT_ENCODINGS, HASH_FORMATS
from kvgate.mock_engine.kv_events import DEFAULT_TOPIC, KVEventsOptions
from kvgate.mock_engine.pd import PDRole
from kvgate.mock_engine.publishers import PUBLISH_BACKENDS, PublisherOptions, open_publisher
from kvgate.mock_engine.server import DEFAULT_MODEL, MockEngineConfig, start_mock_engine

# The settings that shape the engine's keys and its tokenizer; the rest are gateway-only.
_SETTINGS_FIELDS = (
    "host",
    "tokenizer",
    "chat_template",
    "tokenize_cache_bytes",
    "hash_seed",
    "kvs_hash_algo",
    "kvs_chunk_size",
    "kvs_key_format",
    "kvs_model_name",
    "kvs_iris_meta_prefix",
    "kvs_vllm_block_prefix",
    "kvs_redis_url",
    "kvs_redis_key_prefix",
    "kvs_redis_block_ttl_s",
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "mock-engine",
        help="run a simulated vLLM instance",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    add_settings_arguments(parser, only=_SETTINGS_FIELDS)
    defaults = ServiceProfile()
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per modelled GPU second (0.1: ten times faster than the GPU)",
    )
    parser.add_argument(
        "--cache-capacity-blocks",
        type=int,
        default=0,
        help=f"KV cache size in blocks of --kvs-chunk-size tokens (0: "
        f"{defaults.cache_capacity_blocks * defaults.block_size} tokens, an 80 GB GPU)",
    )
    parser.add_argument(
        "--store-segment-blocks",
        type=int,
        default=0,
        help="blocks of the engine's own DRAM segment of the KV store behind its cache: computed blocks are "
        "kept there, loaded back instead of recomputed, and published to --kvs-backend (0: none, the store "
        "lists what the cache holds)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="chunked-prefill token budget of one step",
    )
    parser.add_argument("--max-running-requests", type=int, default=defaults.max_running_requests)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest prompt + max_tokens accepted (0: the KV capacity)",
    )
    parser.add_argument(
        "--kvs-backend",
        choices=PUBLISH_BACKENDS,
        default="none",
        help="where to publish cached blocks (embedded only works in-process, e.g. kvgate demo)",
    )
    parser.add_argument(
        "--kvs-local-ip",
        default="127.0.0.2",
        help="this engine's endpoint in the store: the IP its Mooncake client binds, or the name it claims "
        "Redis entries under; the gateway maps it to the instance (kvs_endpoints). One loopback IP per "
        "engine (127.0.0.2, .3, ...) on a single machine",
    )
    parser.add_argument("--mooncake-master", default="127.0.0.1:50051", help="Mooncake master RPC address")
    parser.add_argument(
        "--mooncake-metadata-url",
        default="http://127.0.0.1:8080/metadata",
        help="Mooncake HTTP metadata server URL",
    )
    # --- KV events, as vLLM's --kv-events-config (docs/MOCK_KV_EVENTS.md) ---
    parser.add_argument(
        "--kv-events-endpoint", default=None,
        help="publish KV events on this ZMQ PUB endpoint, e.g. tcp://*:5557; as vLLM it binds with `*`, `::`, "
        "ipc:// or inproc://, and connects to tcp://HOST:PORT (where a subscriber binds)",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint", default=None,
        help="also answer replay requests (from a sequence number) on this ZMQ ROUTER endpoint",
    )
    parser.add_argument("--kv-events-topic", default=DEFAULT_TOPIC, help="the topic frame of every message")
    parser.add_argument(
        "--kv-events-encoding", choices=EVENT_ENCODINGS, default="map",
        help="map: events as maps tagged by type (vLLM 0.32); array: positional arrays (older vLLM)",
    )
    parser.add_argument(
        "--kv-events-hash", choices=HASH_FORMATS, default="int",
        help="int: the low 64 bits of each block hash (vLLM's default); bytes: the raw 32 bytes "
        "(vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    # --- prefill/decode disaggregation (docs/PD.md) ---
    parser.add_argument("--role", choices=("neutral", "prefill", "decode"), default="neutral",
                        help="neutral serves whole requests; prefill and decode implement --pd-protocol's hand-off")
    parser.add_argument("--pd-protocol", choices=("sglang", "vllm"), default=None,
                        help="the hand-off a prefill or decode engine implements")
    parser.add_argument("--bootstrap-port", type=int, default=None,
                        help="prefill: also serve the KV hand-off on this port (SGLang's bootstrap server, "
                        "default 8998 with sglang; vLLM's Mooncake connector)")
    parser.add_argument("--kv-transfer-tokens-per-s", type=float, default=PDRole.kv_transfer_tokens_per_s,
                        help="decode: modelled prompt tokens per second of the KV transfer from the prefill engine")
    parser.add_argument("--egress-tokens-per-s", type=float, default=None,
                        help="prefill: the link its KV leaves by, in modelled prompt tokens per second (a remote "
                        "Prefill-as-a-Service cluster's egress); transfers queue on it one at a time")
    parser.add_argument(
        "--no-prompt-tokens-details",
        action="store_true",
        help="omit usage.prompt_tokens_details (cached tokens), as vLLM without --enable-prompt-tokens-details",
    )
    parser.add_argument(
        "--check", action="store_true", help="validate the flags and configuration, print the result and exit"
    )
    parser.set_defaults(func=run)


def _engine_config(args: argparse.Namespace) -> MockEngineConfig:
    cli_values = {name: getattr(args, name) for name in _SETTINGS_FIELDS if hasattr(args, name)}
    settings = load_settings(cli_values, config_path=args.config)
    try:
        # By default the GPU keeps its capacity in tokens whatever the block size.
        profile = ServiceProfile().with_block_size(settings.kvs_chunk_size)
        profile = dataclasses.replace(
            profile,
            cache_capacity_blocks=args.cache_capacity_blocks or profile.cache_capacity_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_running_requests=args.max_running_requests,
        )
        return MockEngineConfig(
            pd=_pd_role(args),
            model=args.model,
            seed=args.seed,
            time_scale=args.time_scale,
            profile=profile,
            max_model_len=args.max_model_len,
            settings=settings,
            report_cached_tokens=not args.no_prompt_tokens_details,
            kv_events=_kv_events(args),
            store_segment_blocks=args.store_segment_blocks,
        )
    except ValueError as exc:
        raise ConfigError(f"configuration error:\n  {exc}") from None


def _kv_events(args: argparse.Namespace) -> KVEventsOptions | None:
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    return KVEventsOptions(
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic,
        encoding=args.kv_events_encoding,
        hash_format=args.kv_events_hash,
    )


def _pd_role(args: argparse.Namespace) -> PDRole | None:
    if args.role == "neutral":
        if args.pd_protocol or args.bootstrap_port or args.egress_tokens_per_s is not None:
            raise ValueError("--pd-protocol, --bootstrap-port and --egress-tokens-per-s need --role prefill or decode")
        return None
    if args.pd_protocol is None:
        raise ValueError(f"--role {args.role} needs --pd-protocol sglang | vllm")
    if args.role == "decode" and args.bootstrap_port:
        raise ValueError("--bootstrap-port belongs to a prefill engine")
    bootstrap = args.bootstrap_port
    if bootstrap is None and args.role == "prefill" and args.pd_protocol == "sglang":
        bootstrap = SGLANG_DEFAULT_BOOTSTRAP_PORT
    if args.kv_transfer_tokens_per_s <= 0:
        raise ValueError("--kv-transfer-tokens-per-s must be positive")
    if args.egress_tokens_per_s is not None and (args.role != "prefill" or args.egress_tokens_per_s <= 0):
        raise ValueError("--egress-tokens-per-s belongs to a prefill engine and must be positive")
    return PDRole(args.role, args.pd_protocol, args.kv_transfer_tokens_per_s, bootstrap, args.egress_tokens_per_s)


def _pd_summary(config: MockEngineConfig) -> str:
    pd = config.pd
    if pd is None:
        return ""
    bootstrap = f", bootstrap port {pd.bootstrap_port}" if pd.bootstrap_port else ""
    return f", {pd.role} engine ({pd.protocol} hand-off{bootstrap})"


def _kv_events_summary(config: MockEngineConfig) -> str:
    events = config.kv_events
    if events is None:
        return ""
    replay = f", replay on {events.replay_endpoint}" if events.replay_endpoint else ""
    return (f", KV events on {events.endpoint} (topic {events.topic!r}, {events.encoding} events, "
            f"{events.hash_format} hashes{replay})")


def _publisher_options(args: argparse.Namespace, config: MockEngineConfig) -> PublisherOptions:
    if args.kvs_backend == "embedded":
        raise ConfigError(
            "--kvs-backend embedded needs the gateway in the same process: use kvgate demo, "
            "or redis / mooncake for a stand-alone engine"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be in 0..65535")
    return PublisherOptions(
        backend=args.kvs_backend,
        settings=config.settings,
        local_ip=args.kvs_local_ip,
        mooncake_master=args.mooncake_master,
        mooncake_metadata_url=args.mooncake_metadata_url,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = _engine_config(args)
        options = _publisher_options(args, config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        s = config.settings
        print(
            f"mock-engine configuration OK: model {config.model}, {config.profile.cache_capacity_blocks} "
            f"blocks of {config.profile.block_size} tokens, time scale {config.time_scale}, "
            f"keys {s.kvs_hash_algo}/{s.kvs_key_format} seed {s.hash_seed!r}, publishing to {options.backend}"
            + _pd_summary(config)
            + _kv_events_summary(config)
        )
        return 0
    run_async(lambda: _serve(args, config, options))
    return 0


async def _serve(args: argparse.Namespace, config: MockEngineConfig, options: PublisherOptions) -> None:
    from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # A stop signal closes the engine cleanly: its blocks are withdrawn from the store.
        loop.add_signal_handler(sig, stop.set)
    s = config.settings
    tokenizer = TokenizerService(
        await asyncio.to_thread(load_tokenizer, s.tokenizer, s.chat_template), s.tokenize_cache_bytes
    )
    try:
        publisher = await open_publisher(options)
        handle = await start_mock_engine(
            config,
            host=s.host,
            port=args.port,
            tokenizer=tokenizer,
            publisher=publisher,
            name=f"mock-engine:{args.port}",
        )
        events = handle.engine.kv_events
        where = f", KV events on {events.endpoint}" if events is not None else ""
        print(
            f"mock engine {config.model} serving on {handle.url} (publishing to {options.backend}{where})",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            await handle.close()
    finally:
        tokenizer.close()
