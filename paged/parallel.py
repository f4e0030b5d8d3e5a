"""Tensor parallelism on one host: the device mesh, where each array lives on it, and attention per shard.

The mesh has one axis, `tensor` (paged.models.linear.TENSOR_AXIS), over `tensor_parallel_size` devices. Weights carry
their Megatron partition specs from `paged.models.linear` (q/k/v and gate/up split their outputs, o and down their
inputs, embeddings and the LM head the vocabulary; norms replicated); XLA's SPMD partitioner follows them and
puts the reductions of the row-parallel layers (o_proj, down_proj) in as all-reduces after each of them.
The KV pool [L, Hkv, blocks, block_size, D] splits over its KV heads (with fewer KV heads than devices, the
loader repeats each one so every device holds one: `kv_head_replicas`); page tables, the step's inputs and the
sampled tokens are replicated, so the host side (scheduler, block manager) is the same as on one device.

Attention kernels are not partitioned by XLA (Pallas and FFI calls are opaque), so `ShardedAttention` runs the
backend under `jax.shard_map`: each device attends with its own query heads over its own KV heads.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from paged.models.linear import TENSOR_AXIS


def replica_devices(tensor_parallel_size: int, data_parallel_size: int = 1, rank: int = 0) -> list:
    """The devices of data-parallel replica `rank`: [rank * tp, (rank + 1) * tp) of `jax.devices()`.

    Raises ValueError, listing the devices found, when tp * dp exceeds them. Over several processes (a
    multi-host run) the mesh takes tp / processes devices of each process, so every process holds a part.
    """
    devices = jax.devices()
    processes = jax.process_count()
    if processes > 1:
        if data_parallel_size != 1:
            raise NotImplementedError("data_parallel_size > 1 does not run over several processes yet")
        if tensor_parallel_size % processes:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be a multiple of the {processes} "
                             "processes: each process holds an equal part of the mesh")
        per_process = tensor_parallel_size // processes
        owned = [[d for d in devices if d.process_index == p] for p in range(processes)]
        short = [p for p, mine in enumerate(owned) if len(mine) < per_process]
        if short:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} over {processes} processes needs "
                             f"{per_process} devices in each; process(es) {short} have fewer: "
                             f"{', '.join(str(d) for d in devices)}")
        return [d for mine in owned for d in mine[:per_process]]
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        sizes = f"tensor_parallel_size={tensor_parallel_size}" + (
            f" x data_parallel_size={data_parallel_size}" if data_parallel_size > 1 else "")
        raise ValueError(f"{sizes} needs {needed} devices; found {len(devices)}: "
                         f"{', '.join(str(d) for d in devices)}")
    return devices[rank * tensor_parallel_size:(rank + 1) * tensor_parallel_size]


def make_mesh(tensor_parallel_size: int, num_heads: int, num_kv_heads: int, devices: list | None = None
              ) -> Mesh | None:
    """The mesh over `devices` (default: the first `tensor_parallel_size` of `jax.devices()`); None for a size
    of 1: the single-device path, unchanged.

    Raises ValueError when the size does not divide the query heads, when it neither divides the KV heads nor
    is a multiple of them, or when it exceeds the devices. With fewer KV heads than devices, each KV head is
    replicated over size / num_kv_heads devices (paged.models.loader.load_model: `kv_head_replicas`), as vLLM does.
    """
    size = tensor_parallel_size
    devices = replica_devices(size) if devices is None else devices
    if size == 1:
        return None
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} neither divides the model's {num_kv_heads} KV heads nor is "
                         "a multiple of them (then each KV head would be replicated over size / KV heads devices)")
    return Mesh(np.asarray(devices), (TENSOR_AXIS,), axis_types=(AxisType.Auto,))


def placement(mesh: Mesh | None, device) -> jax.sharding.Sharding | None:
    """Where a replicated array of the engine lives: every device of the mesh, else the replica's one device
    (None: the default device, uncommitted, as a single-device engine has always run)."""
    if mesh is not None:
        return replicated(mesh)
    return None if device is None else SingleDeviceSharding(device)


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    """[L, Hkv, blocks, block_size, D]: split over the KV heads."""
    return NamedSharding(mesh, PartitionSpec(None, TENSOR_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@dataclasses.dataclass
class ShardedAttention:
    """Runs an attention backend once per tensor shard, on that shard's heads (`jax.shard_map`).

    q [T, Hq, D] and the new k, v [T, Hkv, D] split over heads; the pool over its KV heads; the metadata
    (page tables, positions, ...) is replicated. Every backend's math is per head, so the shards' outputs
    concatenated over heads are the single-device output.
    """

    inner: object
    mesh: Mesh

    def prepare(self, meta):
        return self.inner.prepare(meta)

    def _heads(self):
        return PartitionSpec(None, TENSOR_AXIS, None)

    def write_kv(self, k_cache, v_cache, layer, k, v, meta):
        pool = PartitionSpec(None, TENSOR_AXIS)
        fn = jax.shard_map(lambda kc, vc, layer, k, v, meta: self.inner.write_kv(kc, vc, layer, k, v, meta),
                           mesh=self.mesh, in_specs=(pool, pool, PartitionSpec(), self._heads(), self._heads(),
                                                     PartitionSpec()),
                           out_specs=(pool, pool), check_vma=False)
        return fn(k_cache, v_cache, layer, k, v, meta)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta, *, scale, sliding_window=None, soft_cap=None):
        pool = PartitionSpec(None, TENSOR_AXIS)
        windowed = sliding_window is not None

        def per_shard(q, k, v, kc, vc, layer, meta, window):
            return self.inner.attend(q, k, v, kc, vc, layer, meta, scale=scale,
                                     sliding_window=window if windowed else None, soft_cap=soft_cap)

        fn = jax.shard_map(per_shard, mesh=self.mesh,
                           in_specs=(self._heads(), self._heads(), self._heads(), pool, pool, PartitionSpec(),
                                     PartitionSpec(), PartitionSpec()),
                           out_specs=self._heads(), check_vma=False)
        window = sliding_window if windowed else 0
        return fn(q, k, v, k_cache, v_cache, layer, meta, window)
