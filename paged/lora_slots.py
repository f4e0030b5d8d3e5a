"""Which LoRA adapter sits in which device slot, and which adapters wait in host memory.

The device holds `max_loras` slots of stacked factors in every adapted layer; a request runs only while its
adapter has a slot, and a slot changes adapter only when no running request uses it (the scheduler holds a
request back instead, as vLLM does when a step already has `max_loras` adapters). Adapters read from disk are
kept in host memory up to `max_cpu_loras`, least recently used first out, so a slot refills without reading
the files again. Loading an adapter into a slot writes the device arrays in place: no shape changes, no
recompilation.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from paged.lora import LoRAAdapter, LoRAConfig, LoRARequest


class LoRASlots:
    """`read(request)` reads an adapter from disk; `write(slot, adapter)` puts its factors in a device slot."""

    def __init__(self, config: LoRAConfig, read: Callable[[LoRARequest], LoRAAdapter],
                 write: Callable[[int, LoRAAdapter], None]):
        self.config = config
        self._read = read
        self._write = write
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # name -> adapter, least recent first
        self.slot_adapter: list[str | None] = [None] * config.max_loras
        self.slot_users = [0] * config.max_loras
        self._last_used = [0] * config.max_loras
        self._clock = 0
        # Slots whose adapter was removed while requests still ran with it: emptied when the last one ends,
        # never handed to a new request (a name loaded again may be another adapter).
        self._retired: set[int] = set()

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory (read now if it is not), marked most recently used."""
        adapter = self.host.get(request.lora_name)
        if adapter is None:
            adapter = self._read(request)
            self.host[request.lora_name] = adapter
            self._evict_host(keep=request.lora_name)
        self.host.move_to_end(request.lora_name)
        return adapter

    def _evict_host(self, keep: str) -> None:
        """Drops the least recently used adapters past max_cpu_loras, never `keep` or one in a slot."""
        in_slots = set(self.slot_adapter)
        for name in list(self.host):
            if len(self.host) <= self.config.host_capacity:
                return
            if name not in in_slots and name != keep:
                del self.host[name]

    def _slot_of(self, name: str) -> int | None:
        for slot, held in enumerate(self.slot_adapter):
            if held == name and slot not in self._retired:
                return slot
        return None

    def can_acquire(self, request: LoRARequest) -> bool:
        """Whether `acquire` would give `request` a slot now."""
        return self._slot_of(request.lora_name) is not None or 0 in self.slot_users

    def acquire(self, request: LoRARequest) -> int | None:
        """The slot `request` runs in, its adapter placed there if it was not; None when every slot is in use
        by other adapters (the request waits)."""
        self._clock += 1
        name = request.lora_name
        slot = self._slot_of(name)
        if slot is None:
            idle = [s for s in range(len(self.slot_adapter)) if self.slot_users[s] == 0]
            if not idle:
                return None
            # An empty slot first, else the one idle the longest.
            slot = min(idle, key=lambda s: (self.slot_adapter[s] is not None, self._last_used[s]))
            adapter = self.load(request)
            self._write(slot, adapter)
            self.slot_adapter[slot] = name
        self.slot_users[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """A request that ran in `slot` finished, was aborted or preempted."""
        if self.slot_users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.slot_users[slot] -= 1
        if self.slot_users[slot] == 0 and slot in self._retired:
            self._retired.discard(slot)
            self.slot_adapter[slot] = None

    def remove(self, name: str) -> bool:
        """Forgets adapter `name` (host memory and its idle slot); False if it was not loaded. A slot in use
        keeps it until its requests finish."""
        known = self.host.pop(name, None) is not None
        slot = self._slot_of(name)
        if slot is not None:
            if self.slot_users[slot] == 0:
                self.slot_adapter[slot] = None
            else:
                self._retired.add(slot)
            known = True
        return known

    def loaded_adapters(self) -> list[str]:
        """Adapters held in host memory or a slot."""
        return list(dict.fromkeys([*self.host, *(name for name in self.slot_adapter if name is not None)]))

    def running_adapters(self) -> list[str]:
        return [name for name, users in zip(self.slot_adapter, self.slot_users) if name is not None and users]
