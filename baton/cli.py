"""`baton generate ...`; engine options are derived from the config tree, one flag per field."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from urllib.parse import urlsplit

from baton.config import (
    CacheConfig,
    EngineConfig,
    KVTierConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)

_CONFIG_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, KVTierConfig)


def _flag_type(annotation: str):
    if annotation.startswith("bool"):
        return bool
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def add_config_args(parser: argparse.ArgumentParser, sections=_CONFIG_SECTIONS) -> None:
    for section in sections:
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            kind = _flag_type(str(f.type))
            doc = (f.metadata or {}).get("help")
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
            elif str(f.type).startswith("list"):  # repeatable: argparse copies the default before appending
                group.add_argument(flag, action="append", default=[], help=doc)
            else:
                group.add_argument(flag, type=kind, default=f.default, help=doc)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, as vLLM takes it: {"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": k, ...}',
    )


def _section(section, args: argparse.Namespace):
    return section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)})


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kv_transfer = _section(KVTransferConfig, args) if hasattr(args, "kv_role") else KVTransferConfig()
    return EngineConfig(
        model=_section(ModelConfig, args),
        cache=_section(CacheConfig, args),
        scheduler=_section(SchedulerConfig, args),
        kv_transfer=kv_transfer,
        parallel=_section(ParallelConfig, args),
        kv_tier=_section(KVTierConfig, args),
        seed=args.seed,
        speculative=SpeculativeConfig.parse(args.speculative_config),
    )


def _generate(args: argparse.Namespace) -> None:
    import logging

    from baton.engine.engine import LLMEngine
    from baton.sampling_params import SamplingParams
    from baton.tokenizer import apply_chat_template

    config = engine_config(args)
    logging.basicConfig(level=config.env.log_level, format="%(levelname)s %(name)s: %(message)s")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(config)
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])}
    rid = engine.add_request(prompt, params)
    printed = 0
    if not args.chat:
        print(args.prompt, end="", flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                text = out.outputs[0].text
                print(text[printed:], end="", flush=True)
                printed = len(text)
    print()


def _serve(args: argparse.Namespace) -> None:
    import logging

    config = engine_config(args)
    if config.parallel.node_rank > 0:  # another host's ranks: no scheduler, no API here
        from baton.parallel.worker import run_node

        logging.basicConfig(level=config.env.log_level, format="%(levelname)s %(name)s: %(message)s")
        run_node(config)
        return
    server = _section(ServerConfig, args)
    server.api_key = server.api_key or config.env.api_key
    config.internal_key(server.api_key)  # refuse a PD role without its own secret now, not after loading
    if config.kv_tier.kv_tier:
        config.kv_tier_secret_bytes(server.api_key)  # the same for a KV tier

    import uvicorn

    from baton.engine.async_engine import AsyncEngine
    from baton.engine.engine import LLMEngine
    from baton.server.app import build_app

    logging.basicConfig(level=config.env.log_level, format="%(levelname)s %(name)s: %(message)s")
    async_engine = AsyncEngine(lambda: LLMEngine(config), server.stall_timeout_s)
    if async_engine.engine.ranks is not None:
        import os
        import threading

        # a rank that died ends this worker non-zero, after /health has said 503 for a moment
        async_engine.engine.ranks.on_lost.append(lambda why: threading.Timer(2.0, os._exit, (1,)).start())
    app = build_app(async_engine, server, config.model.model)
    # The engine thread and the event loop trade the GIL every step; a shorter switch interval
    # than the default 5 ms hands it over sooner (c1 TPOT about 5% lower in A/B runs here).
    sys.setswitchinterval(0.0005)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was there before it: make that one a normal exit, so a clean shutdown exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        app,
        host=server.host,
        port=server.port,
        log_level=config.env.log_level.lower(),
        timeout_graceful_shutdown=server.graceful_shutdown_s,
    )


def _router(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    from baton.config import EnvSettings, check_kv_secret
    from baton.handoff.remote_prefill import RemotePrefill
    from baton.router.allowed_hosts import LOOPBACK, AllowedHosts
    from baton.router.app import build_router_app
    from baton.router.proxy import Router
    from baton.router.settings import RouterSettings
    from baton.router.workers import WorkerSet

    if args.workers and args.decode:
        raise ValueError("give the routed workers as --workers, or as --decode with --prefill workers, not both")
    if args.prefill and not args.decode:
        raise ValueError("--prefill workers need --decode workers")
    env = EnvSettings.read()
    api_key = args.api_key or env.api_key
    admin_key = args.admin_key or env.router_admin_key
    secret = check_kv_secret(args.kv_secret or env.kv_secret, api_key, "a PD router") if args.prefill else None
    if admin_key is not None and admin_key in (api_key, secret):
        raise ValueError("the admin key must differ from the API key and the kv secret")
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = _section(RouterSettings, args)
    urls = args.workers or args.decode or []
    # the workers given here are the operator's own; others may join only on the allowed hosts
    given = [h for h in (urlsplit(u).hostname for u in urls) if h]
    allowed = AllowedHosts([*(args.allowed_worker_hosts or LOOPBACK), *given])
    workers = WorkerSet(settings, urls, allowed)
    prefill = None
    if args.prefill:
        prefill = RemotePrefill(
            args.prefill, secret, args.span_format, args.max_kv_span_bytes, settings.first_byte_timeout_s
        )
    router = Router(workers, settings, prefill)
    app = build_router_app(router, api_key=api_key, max_request_bytes=args.max_request_bytes, admin_key=admin_key)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)


def _pd(args: argparse.Namespace) -> None:
    """A prefill worker, a decode worker (different KV dtype, block size and layout) and a router."""
    import os
    import secrets
    import subprocess

    from baton.bench.procs import stop_processes, wait_healthy

    base = [sys.executable, "-m", "baton.cli", "serve", "--model", args.model, "--served-model-name", args.model]
    # one secret for the trio, through the environment (a command line is visible to every user)
    env = {**os.environ, "BATON_KV_SECRET": os.environ.get("BATON_KV_SECRET") or secrets.token_hex(32)}
    p_port, d_port = args.port + 100, args.port + 200
    # `kill <pid>` must stop the workers too: SIGTERM becomes SystemExit, so the finally below runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    procs = [
        subprocess.Popen(
            [
                *base,
                "--kv-role",
                "prefill",
                "--port",
                str(p_port),
                "--block-size",
                "16",
                "--kv-cache-dtype",
                "bfloat16",
            ],
            env=env,
        ),
        subprocess.Popen(
            [*base, "--kv-role", "decode", "--port", str(d_port), "--block-size", "64", "--kv-layout", "HND"],
            env=env,
        ),
    ]
    try:
        for port, proc in zip((p_port, d_port), procs):
            try:
                wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=600)
            except RuntimeError as e:
                raise ValueError(f"a worker did not start: {e}") from None
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "baton.cli",
                    "router",
                    "--port",
                    str(args.port),
                    "--prefill",
                    f"http://127.0.0.1:{p_port}",
                    "--decode",
                    f"http://127.0.0.1:{d_port}",
                ],
                env=env,
            )
        )
        print(
            f"router on http://127.0.0.1:{args.port} (prefill :{p_port}, decode :{d_port}); Ctrl-C stops all",
            flush=True,
        )
        procs[-1].wait()
    finally:
        stop_processes(procs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="An LLM serving engine for hybrid models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    add_config_args(serve, (ServerConfig, KVTransferConfig))
    serve.set_defaults(func=_serve)
    router = sub.add_parser(
        "router",
        help="OpenAI routes over many workers: prefix-aware or round-robin routing, and the prefill/decode front",
    )
    router.add_argument(
        "--workers", nargs="*", default=[], help="worker URLs (more join at run time: POST /v1/router/workers)"
    )
    router.add_argument("--prefill", nargs="*", help="PD: prefill worker URLs (round-robin)")
    router.add_argument("--decode", nargs="*", default=[], help="PD: decode worker URLs, routed like --workers")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--span-format", choices=["grouped", "dense"], default="grouped")
    router.add_argument("--api-key", default=None, help="clients must send it (or BATON_API_KEY); forwarded to workers")
    router.add_argument(
        "--kv-secret", default=None, help="PD: the workers' kv secret (or BATON_KV_SECRET); not the API key"
    )
    router.add_argument(
        "--admin-key",
        default=None,
        help="(or BATON_ROUTER_ADMIN_KEY) guards listing, adding and removing workers; without it those routes "
        "do not exist",
    )
    router.add_argument(
        "--allowed-worker-hosts",
        nargs="*",
        default=None,
        help="host names and IP networks workers may be added on (default: loopback); the workers given at "
        "start are always allowed",
    )
    router.add_argument("--max-kv-span-bytes", type=int, default=KVTransferConfig.max_kv_span_bytes)
    router.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes)
    from baton.router.settings import RouterSettings

    add_config_args(router, (RouterSettings,))
    router.set_defaults(func=_router)
    pd = sub.add_parser("pd", help="start a prefill worker, a decode worker and a router on this machine")
    pd.add_argument("--model", default="smollm2-135m")
    pd.add_argument("--port", type=int, default=8000)
    pd.set_defaults(func=_pd)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_serve = bench.add_parser("serve", help="benchmark an OpenAI-compatible server like vLLM's bench serve")
    bench_serve_module().add_args(bench_serve)
    bench_serve.set_defaults(func=lambda a: bench_serve_module().main(a))
    return parser


def bench_serve_module():
    from baton.bench import serve

    return serve


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        ops = sys.modules.get("baton.ops")  # imported only by commands that run a model (torch is slow to load)
        if ops is None or not isinstance(e, ops.OpsBuildError):
            raise
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
