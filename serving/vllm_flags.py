"""vLLM's command-line flags that `paged` has no field for: accepted where they change nothing here, refused
with a reason where they would change what a user gets.

A vLLM user's launch script should run or fail with a message that says why, never with argparse's bare
"unrecognized arguments". Flags that map onto an engine option are the options themselves (`--max-model-len`,
`--gpu-memory-utilization`, `--enforce-eager`, ...: paged/config.py).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("paged")

# flag -> (takes a value, why it is a no-op here)
ACCEPTED = {
    "--trust-remote-code": (False, "paged runs no code from checkpoints: every architecture it serves is built in"),
    "--disable-log-requests": (False, "paged does not log request contents"),
    "--disable-log-stats": (False, "paged logs no periodic stats; /metrics has them"),
    "--disable-frontend-multiprocessing": (False, "the server and the engine share one process here"),
    "--device": (True, "jax chooses the platform (JAX_PLATFORMS picks one)"),
    "--convert": (True, "a pooling runner on a causal LM embeds (--runner pooling); classifiers come from their "
                        "checkpoint or --hf-overrides"),
    "--enable-reasoning": (False, "reasoning is separated whenever --reasoning-parser is given (as in vLLM "
                                  "since it dropped this flag)"),
}

# flag -> (takes a value, the value that is fine, why others are refused)
REFUSED = {
    "--pipeline-parallel-size": (True, "1", "pipeline parallelism is not implemented; use --tensor-parallel-size "
                                            "(and --data-parallel-size)"),
    "--cpu-offload-gb": (True, "0", "weight offloading is not implemented"),
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags without an effect or not implemented here")
    for flag, (takes_value, why) in ACCEPTED.items():
        group.add_argument(flag, dest=_dest(flag), default=None, help=f"accepted; {why}",
                           **({"metavar": "VALUE"} if takes_value else {"action": "store_const", "const": True}))
    for flag, (takes_value, fine, why) in REFUSED.items():
        group.add_argument(flag, dest=_dest(flag), default=None, help=f"refused unless {fine}: {why}" if fine
                           else f"refused: {why}",
                           **({"metavar": "VALUE"} if takes_value else {"action": "store_const", "const": True}))


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Logs what the accepted flags mean here; raises ValueError naming a refused flag that was given."""
    for flag, (_, why) in ACCEPTED.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        if flag == "--convert":
            if value not in ("auto", "none", "embed"):
                raise ValueError(f"--convert {value}: a causal LM becomes a classifier through --hf-overrides "
                                 "(classifier_from_token, docs/pooling.md); --convert takes auto, none or embed")
            if value == "embed" and getattr(args, "runner", None) == "auto":
                args.runner = "pooling"  # vLLM: converting to an embedding model runs the pooling runner
        if flag == "--device" and value not in ("auto", "cpu", "cuda", "tpu"):
            raise ValueError(f"--device {value}: paged runs on cpu, cuda or tpu, chosen by jax")
        logger.info("%s accepted without effect: %s", flag, why)
    for flag, (_, fine, why) in REFUSED.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and (fine is None or str(value) != fine):
            raise ValueError(f"{flag}{'' if value is True else ' ' + str(value)}: {why}")


def _dest(flag: str) -> str:
    return "vllm_" + flag[2:].replace("-", "_")
