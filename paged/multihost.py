"""Several hosts: one engine over every process's devices, driven by process 0.

`jax.distributed` joins the processes (its coordinator runs in process 0) and XLA's collectives carry each
layer's reductions between hosts. The leader (process 0) runs the scheduler, the block manager and any API
server. Before each device operation it publishes that operation's host inputs (the same static-shaped numpy
arrays it then passes to the jitted step) in jax.distributed's key-value store; every follower reads them in
order and makes the same jitted call on its part of the global mesh, so all processes run one SPMD program
and only the leader reads results back. Followers serve no HTTP.

Loss of a process: the coordinator ends every other process once one stops sending heartbeats
(`distributed_heartbeat_timeout_s`), so neither a dead leader nor a dead follower leaves the rest waiting in
a collective. A leader that exits normally tells its followers to stop first.

The published operations are pickled: the store is reachable only by the run's own processes, which trust
each other as they trust the shared checkpoint.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle

import jax

logger = logging.getLogger(__name__)

ENV = {"distributed_coordinator_address": "PAGED_COORDINATOR_ADDRESS",
       "distributed_num_processes": "PAGED_NUM_PROCESSES", "distributed_process_id": "PAGED_PROCESS_ID"}


def settings(config) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, process id) from the config, else from the environment;
    None for a single-process run. Raises ValueError when only some are given."""
    values = {}
    for field, variable in ENV.items():
        value = getattr(config, field)
        if value is None and os.environ.get(variable):
            raw = os.environ[variable]
            try:
                value = raw if field == "distributed_coordinator_address" else int(raw)
            except ValueError:
                raise ValueError(f"${variable} must be an integer, got {raw!r}") from None
        values[field] = value
    if all(v is None for v in values.values()):
        return None
    missing = [f for f, v in values.items() if v is None]
    if missing:
        raise ValueError(f"a multi-host run needs all of {', '.join(ENV)} (flags or ${', $'.join(ENV.values())}); "
                         f"missing: {', '.join(missing)}")
    address, count, process = values.values()
    if not 0 <= process < count:
        raise ValueError(f"distributed_process_id={process} must be in [0, distributed_num_processes={count})")
    return address, count, process


def initialize(config) -> bool:
    """Joins the multi-host run the config (or environment) names, once per process, before JAX picks its
    devices; True when this process is one of several."""
    found = settings(config)
    if found is None or found[1] == 1:
        return False
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    address, count, process = found
    # CPU devices of different processes reach each other through gloo (XLA's CPU collectives); GPUs and
    # TPUs use their own (NCCL, ICI), whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, count, process,
                               heartbeat_timeout_seconds=config.distributed_heartbeat_timeout_s)
    logger.info("process %d of %d joined the run coordinated at %s", process, count, address)
    return True


@dataclasses.dataclass(frozen=True)
class Start:
    """The leader's fingerprint (options and model), checked by every follower before anything runs."""

    fingerprint: dict


@dataclasses.dataclass(frozen=True)
class Launch:
    """One jitted step: its host inputs (a StepInputs of numpy arrays), and whether it reads the samples of
    the step launched before it on the device (async scheduling)."""

    inputs: object
    chained: bool


@dataclasses.dataclass(frozen=True)
class CopyBlocks:
    """Copy-on-write of KV blocks: (source, destination) pairs."""

    pairs: list[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Stop:
    """The run is over."""


Operation = Start | Launch | CopyBlocks | Stop


class StepChannel:
    """The leader's device operations (`Operation`s), in order, from the leader to every follower.

    Each one is a key `paged/op/<n>` in the coordinator's key-value store. Followers stay within a step or
    two of the leader (every step's collectives wait for all processes), so the leader deletes keys `KEEP`
    operations behind it and the store stays small.
    """

    KEEP = 64
    POLL_MS = 60_000  # a follower waits this long per try; an idle leader is not an error

    def __init__(self):
        from jax._src import distributed
        self.client = distributed.global_state.client
        self.leader = jax.process_index() == 0
        self.sequence = 0
        if self.leader:
            atexit.register(self.stop)

    def publish(self, op: Operation) -> None:
        assert self.leader, "only process 0 publishes"
        self.client.key_value_set_bytes(f"paged/op/{self.sequence}", pickle.dumps(op, protocol=5))
        if self.sequence >= self.KEEP:
            self.client.key_value_delete(f"paged/op/{self.sequence - self.KEEP}")
        self.sequence += 1

    def receive(self) -> Operation:
        key = f"paged/op/{self.sequence}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, self.POLL_MS)
                break
            except Exception as exc:  # noqa: BLE001 - jax raises its runtime error for a timeout
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise
        self.sequence += 1
        return pickle.loads(data)

    def stop(self) -> None:
        """Tells the followers the run is over (at the leader's exit; safe to call twice)."""
        if self.leader and self.sequence >= 0:
            try:
                self.publish(Stop())
            except Exception:  # noqa: BLE001 - the coordinator may be gone already
                pass
            self.sequence = -1


def leave() -> None:
    """Leaves a multi-host run now: waits at jax.distributed's shutdown barrier for the other processes (as its
    own exit hook would, where a process ends by a signal and skips that hook)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def fingerprint(config, model_config) -> dict:
    """What every process must agree on: the engine's options but the process id (and enforce_eager, which
    only the leader acts on), and the model's shape."""
    options = {k: v for k, v in dataclasses.asdict(config).items()
               if k not in ("distributed_process_id", "enforce_eager")}
    return {"options": repr(sorted(options.items())), "model": repr(model_config)}


def check_same_run(channel: StepChannel, mine: dict) -> None:
    """The leader publishes its fingerprint first; a follower started with other options or another model
    stops with a message instead of running a different program (which would hang the collectives)."""
    if channel.leader:
        channel.publish(Start(mine))
        return
    op = channel.receive()
    if not isinstance(op, Start):
        raise RuntimeError(f"expected the leader's start message, got {op!r}: the processes are out of step")
    leaders = op.fingerprint
    for what in ("model", "options"):
        if leaders[what] != mine[what]:
            raise ValueError(f"this process's {what} differ from the leader's; every process must run the same "
                             f"command (but its process id).\n leader: {leaders[what]}\n here:   {mine[what]}")
