"""What the encoder connector's halves send each other, as plain ``@dataclass(slots=True)``.

Scheduler -> worker, once per step (``OrbitKVECMetadata``): the outputs to put into vLLM's encoder
cache (already fetched and verified by the scheduler half, so a load cannot fail on the worker)
and, for each item the encoder runs for this step, the store keys to save its output under (one
per tenant and salt that asked for it).

Worker -> scheduler (``OrbitKVECWorkerMeta``): the worker's counters since its last report, which
the scheduler half adds to its stats (vLLM's V1 model runner does not collect a worker's EC stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from ..metadata import pickled_by_fields


@pickled_by_fields
@dataclass(slots=True)
class EncoderLoad:
    mm_hash: str
    output: torch.Tensor  # on the CPU, verified; the worker moves it to its device


@pickled_by_fields
@dataclass(slots=True)
class OrbitKVECMetadata(ECConnectorMetadata):
    loads: list[EncoderLoad] = field(default_factory=list)
    # mm_hash -> store keys to save the output under, for items the encoder runs for this step.
    saves: dict[str, list[str]] = field(default_factory=dict)


@pickled_by_fields
@dataclass(slots=True)
class OrbitKVECWorkerMeta(ECConnectorWorkerMetadata):
    counters: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> OrbitKVECWorkerMeta:
        assert isinstance(other, OrbitKVECWorkerMeta)
        for name, value in other.counters.items():
            self.counters[name] = self.counters.get(name, 0) + value
        return self
