"""`paged` command line: `paged generate --model PATH "prompt"`, `paged serve MODEL`, `paged bench KIND`.

Engine flags come from paged.EngineConfig's fields (paged/config.py), the same for every command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

from paged.models.builtin import DEFAULT_MODEL
from paged.config import add_engine_arguments, engine_kwargs_from_cli_args
from paged.serving.api_keys import parse_api_keys
from paged.reasoning import REASONING_PARSERS
from paged.serving.protocol import MAX_BATCH_PROMPTS
from paged.serving.tool_calls import TOOL_CALL_PARSERS
from paged.serving.vllm_flags import add_vllm_flags, check_vllm_flags


def _batch_limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_BATCH_PROMPTS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_BATCH_PROMPTS}, got {value}")
    return value


def _add_model_and_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    parser.add_argument("--model", default=None,
                        help=f"HF checkpoint directory or hub id (default: {DEFAULT_MODEL}, the built-in demo "
                             "model, offline)")
    add_engine_arguments(parser, exclude=exclude)
    add_vllm_flags(parser)


def _model(args: argparse.Namespace) -> str:
    """--model, or `paged serve MODEL`'s positional one (both: they must agree)."""
    positional = getattr(args, "model_positional", None)
    if positional and args.model and positional != args.model:
        raise ValueError(f"two models given: {positional!r} and --model {args.model!r}")
    return positional or args.model or DEFAULT_MODEL


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    parser.add_argument("--ignore-eos", action="store_true")


# Query parameters that carry credentials (a client may send its key as ?api_key=...): never written to a log.
_SECRET_QUERY = re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access[_-]?token|auth|password|secret)=)[^&#\s]*")


class RedactQuerySecrets(logging.Filter):
    """Masks credential-bearing query parameters in uvicorn's access-log lines (args: client, method, path,
    HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "=" in args[2]:
            record.args = (*args[:2], _SECRET_QUERY.sub(r"\1REDACTED", args[2]), *args[3:])
        return True


def _configure_logging(level: str = "info") -> None:
    """paged's own INFO lines (the start-up summary) on stderr; JAX's start-up chatter (no TPU or GPU backend
    found, compilation cache notes) only as warnings and errors."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("jax._src.xla_bridge", "jax._src.compilation_cache", "jax._src.compiler", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("paged").setLevel(level.upper())


def _generate(args: argparse.Namespace) -> int:
    from paged import LLM, SamplingParams

    check_vllm_flags(args)
    if not args.json:
        _configure_logging("warning" if args.quiet else "info")

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                            stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    llm = LLM(_model(args), **engine_kwargs_from_cli_args(args))
    loaded = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=not args.json)
    done = time.perf_counter()
    if args.json:
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason}
                          for o in outputs], indent=2))
        return 0
    for output in outputs:
        completion = output.outputs[0]
        print(f"\n{output.prompt}\033[1m{completion.text}\033[0m" if sys.stdout.isatty()
              else f"\n{output.prompt}{completion.text}")
        print(f"  [{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    engine = llm.engine
    print(f"\nmodel {engine.model_name}" + (f" ({engine.model_description})" if engine.model_description else ""),
          file=sys.stderr)
    print(f"load {loaded - start:.1f}s, generate {done - loaded:.1f}s (incl. compilation: "
          f"{llm.engine.num_compilations} shapes), {num_tokens} tokens", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Loads MODEL with the engine flags given (dtype, quantization, tensor parallel size, ...) and writes it
    as an Orbax checkpoint that `paged serve OUT` restores (models/orbax_checkpoint.py)."""
    from paged import LLM

    check_vllm_flags(args)
    _configure_logging("info")  # the start-up summary says what was loaded: dtype, quantization, devices
    options = {"num_kv_blocks": 2, "max_model_len": 1, **engine_kwargs_from_cli_args(args)}  # no pool to speak of
    started = time.perf_counter()
    llm = LLM(args.source, show_progress=False, **options)
    llm.save(args.out)
    print(f"wrote {args.out} ({llm.engine.weight_bytes['total'] / 2**20:,.1f} MiB of weights in "
          f"{time.perf_counter() - started:.1f} s)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from paged import LLMEngine
    from paged.serving.async_engine import AsyncEngine
    from paged.serving.metrics import EngineMetrics
    from paged.serving.app import build_app
    from paged.serving.connections import header_deadline_protocol
    from paged.serving.state import ServerLimits
    from paged.sampling_params import MAX_LOGPROBS
    from paged import multihost
    from paged.serving.replicas import ReplicatedEngine

    _configure_logging(args.log_level if args.log_level in ("debug", "info", "warning", "error") else "info")
    check_vllm_flags(args)
    if args.precompile and args.enforce_eager:
        raise ValueError("--precompile and --enforce-eager contradict each other (serve precompiles by default)")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the top logprobs the step computes), "
                         f"got {args.max_logprobs}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (" + ", ".join(TOOL_CALL_PARSERS) + ")")
    model = _model(args)
    adapters = parse_lora_modules(args.lora_modules or [])
    if adapters and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    env_key = os.environ.get("PAGED_API_KEY")
    api_keys = parse_api_keys((args.api_key or []) + ([env_key] if env_key else []), args.api_keys_file)
    options = engine_kwargs_from_cli_args(args)
    name = args.served_model_name or model
    metrics = EngineMetrics(name)
    server: list[uvicorn.Server] = []

    def on_engine_death(error: BaseException) -> None:
        # Every request has been failed already; stop serving so a supervisor restarts the process.
        logging.getLogger("paged.serve").critical("the engine loop died (%r): shutting down", error)
        if server:
            server[0].should_exit = True

    replicas = []
    for rank in range(options["data_parallel_size"]):  # each replica on its own devices (data_parallel_rank)
        engine = LLMEngine(model, **{**options, "data_parallel_rank": rank})
        if not engine.is_leader:  # a multi-host follower: process 0 serves, this one runs its steps
            logging.getLogger("paged.serve").info("following process 0 (it serves HTTP); running its steps here")
            engine.follow()
            return 0
        if not args.enforce_eager:  # as vLLM warms up before it serves: no compile stalls on first requests
            engine.precompile(show_progress=True)
        replicas.append(AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests,
                                    batching_delay_ms=args.batching_delay_ms, observer=metrics,
                                    on_death=on_engine_death,
                                    stream_stall_timeout_s=args.stream_stall_timeout_s or None))
    async_engine = replicas[0] if len(replicas) == 1 else ReplicatedEngine(replicas)
    limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                          allow_request_chat_template=args.trust_request_chat_template,
                          max_logprobs=args.max_logprobs, max_prompts_per_request=args.max_prompts_per_request,
                          max_reply_logprobs=args.max_reply_logprobs,
                          responses_store_bytes=int(args.responses_store_mb * 2**20),
                          responses_store_ttl_s=args.responses_store_ttl_s)
    for adapter in adapters:  # read now: a bad adapter stops the start, not a request
        for replica in replicas:
            replica.engine.load_adapter(adapter)
    app = build_app(async_engine, name, metrics, api_keys=api_keys, model_path=model, limits=limits,
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    reasoning_parser=args.reasoning_parser, lora_adapters=adapters)
    # uvicorn stops accepting on SIGINT/SIGTERM, lets in-flight requests finish for up to the grace period,
    # then the app's shutdown aborts whatever is left.
    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # uvicorn cancels what still runs when the grace period ends, which cuts a stream mid-event: end
            # every stream with an error event a moment before that instead.
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:
                message = f"the server is shutting down (its {grace} s grace period ran out)"
                asyncio.get_running_loop().call_later(max(grace - 0.5, 0.0), async_engine.fail_all, message)
            await super().shutdown(sockets)
            for replica in replicas:  # their threads have stopped: a multi-host run's followers may go too
                replica.engine.stop_followers()
            multihost.leave()  # before uvicorn re-raises the signal, which would skip jax's own exit hook

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace_s,
                            timeout_keep_alive=args.timeout_keep_alive,
                            http=header_deadline_protocol(args.header_timeout_s))
    logging.getLogger("uvicorn.access").addFilter(RedactQuerySecrets())  # after Config has set up logging
    server.append(GracefulServer(config))
    server[0].run()
    if async_engine.error is not None:
        print(f"paged: error: the engine died: {async_engine.error!r}", file=sys.stderr)
        return 3
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib
    module = importlib.import_module(f"paged.benchmarks.{args.kind}")
    return module.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged", description="paged: paged-attention LLM inference in JAX")
    parser.add_argument("--version", action="version", version=f"paged {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts are batched together)")
    gen.add_argument("--json", action="store_true", help="print results as JSON")
    gen.add_argument("--quiet", action="store_true", help="no start-up summary")
    _add_model_and_engine_args(gen, exclude=("data_parallel_size", "data_parallel_rank"))  # one engine
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL",
                       help="the model, as in `vllm serve MODEL` (or --model)")
    _add_model_and_engine_args(serve, exclude=("data_parallel_rank",))  # serve runs every replica
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help="require Authorization: Bearer KEY on every route but /health and /metrics; repeat for "
                            "several keys (named key-0, key-1, ...; the PAGED_API_KEY variable adds one more)")
    serve.add_argument("--api-keys-file", default=None,
                       help='a JSON list of keys with names and limits: [{"name": "team-a", "key": "...", '
                            '"requests_per_minute": 60, "tokens_per_minute": 100000}]; over a limit is HTTP 429')
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (with --enable-lora): name=path, or JSON "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="beyond this many waiting requests, new ones get HTTP 503")
    serve.add_argument("--batching-delay-ms", type=float, default=0.0,
                       help="wait up to this long for more arrivals before a step while the batch is small")
    serve.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20,
                       help="larger request bodies get HTTP 413 (default: 4 MiB)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template (Jinja run on this server; off by default)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide when to call tools (tool_choice auto); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how tool calls are found in the text of tool_choice=auto outputs")
    serve.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="separate a reasoning model's thinking (<think>...</think>) into reasoning_content")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="top logprobs a request may ask for per token (logprobs, top_logprobs, "
                            "prompt_logprobs; at most 20)")
    serve.add_argument("--max-prompts-per-request", type=_batch_limit, default=4096,
                       help=f"prompts one completions request may batch (default: 4096; at most {MAX_BATCH_PROMPTS})")
    serve.add_argument("--max-reply-logprobs", type=int, default=2**20,
                       help="logprob entries a non-streamed reply may carry, n x max tokens x (top logprobs + 1) "
                            "over its prompts (default: 1,048,576); streams are not bounded by this")
    serve.add_argument("--responses-store-mb", type=float, default=64,
                       help="memory for stored Responses (store: true), which previous_response_id continues and "
                            "GET /v1/responses/{id} reads; the oldest go first (0: keep none; default 64)")
    serve.add_argument("--responses-store-ttl-s", type=float, default=3600,
                       help="forget a stored response this many seconds after it was made (default 3600)")
    serve.add_argument("--stream-stall-timeout-s", type=float, default=60.0,
                       help="abort a streamed request whose client reads nothing for this long while output "
                            "waits (0: never; default 60)")
    serve.add_argument("--timeout-keep-alive", type=int, default=5,
                       help="close an idle keep-alive connection after this many seconds (uvicorn's; default 5)")
    serve.add_argument("--header-timeout-s", type=float, default=30.0,
                       help="close a connection whose request headers have not all arrived this many seconds "
                            "after it opened, or after its previous response (0: never; default 30)")
    serve.add_argument("--precompile", action="store_true",
                       help="compile every step shape before serving (the default; --enforce-eager turns it off)")
    serve.add_argument("--shutdown-grace-s", type=int, default=30)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    convert = sub.add_parser("convert", help="write a model as an Orbax checkpoint (weights as loaded: dtype, "
                                             "quantization) that `paged serve OUT` restores")
    convert.add_argument("source", metavar="MODEL", help="HF checkpoint directory or hub id")
    convert.add_argument("out", metavar="OUT", help="a new directory")
    add_engine_arguments(convert, exclude=("data_parallel_size", "data_parallel_rank", "max_model_len",
                                           "num_kv_blocks"))
    add_vllm_flags(convert)
    convert.set_defaults(func=_convert)

    kinds = ["throughput", "serve", "soak", "startup", "memory", "device_memory", "kv_cache_dtype", "kernels", "matmul",
             "embed", "long_context"]
    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(kinds)} (flags after the kind)")
    bench.add_argument("kind", choices=kinds)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (see --help of each)")
    bench.set_defaults(func=_bench)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("paged")
    except PackageNotFoundError:  # run from a source tree that was never installed
        import paged
        return paged.__version__


def parse_lora_modules(values: list[str]) -> list:
    """`--lora-modules` values as LoRARequests: name=path, or vLLM's JSON form {"name", "path", "base_model_name"}."""
    from paged.serving.lora_routes import new_lora_request
    adapters = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not JSON with a name and a path") from None
            base = spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path or JSON, got {value!r}")
            base = None
        if any(a.lora_name == name for a in adapters):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        adapters.append(new_lora_request(name, path, base))
    return adapters


def main(argv: list[str] | None = None) -> int:
    """The `paged` command (argv None: the process's own arguments, and tcmalloc preloaded on CPU hosts:
    serving/allocator.py) or, given argv, the same in this process as it is."""
    if argv is None:
        from paged.serving.allocator import preload_tcmalloc
        preload_tcmalloc()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError) as exc:
        print(f"paged: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
