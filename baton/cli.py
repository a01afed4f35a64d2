"""`baton generate ...`; engine options are derived from the config tree, one flag per field."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from baton.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

_CONFIG_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)


def _flag_type(annotation: str):
    if annotation.startswith("bool"):
        return bool
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for section in _CONFIG_SECTIONS:
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            kind = _flag_type(str(f.type))
            doc = (f.metadata or {}).get("help")
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
            else:
                group.add_argument(flag, type=kind, default=f.default, help=doc)
    parser.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    parts = {
        section: section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)})
        for section in _CONFIG_SECTIONS
    }
    return EngineConfig(
        model=parts[ModelConfig], cache=parts[CacheConfig], scheduler=parts[SchedulerConfig], seed=args.seed
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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
