"""An endpoint's device KV capacity from vLLM's ``vllm:cache_config_info`` gauge.

vLLM exports its ``CacheConfig`` as an info-style gauge: one sample per engine, always 1, whose
labels are the config's fields as strings. vLLM 0.32 on CPU prints (labels trimmed)::

    vllm:cache_config_info{block_size="128",...,engine="0",...,num_gpu_blocks="182",
        num_gpu_blocks_override="None",...} 1.0

The capacity is ``num_gpu_blocks × block_size`` tokens (vLLM-CPU calls its CPU KV blocks "gpu"
blocks too). ``num_gpu_blocks`` is the pool vLLM allocated, after ``--num-gpu-blocks-override``;
with data parallelism the front end sums it over its engines and every engine's sample carries that
sum, so one sample holds the endpoint's whole capacity. For hybrid models (sliding-window or Mamba
groups sharing the pool) this overstates the tokens of context that fit, as vLLM's own
``kv_cache_size_tokens`` label notes; the router indexes the full-attention group only, for which
it is exact.

The gauge is constant for the life of the server, so :class:`CacheConfigWatch` keeps the sample
lines it last parsed and parses again only when they change (a restart with another config).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from kvmesh.core.types import PodId

logger = logging.getLogger(__name__)

CACHE_CONFIG_METRIC = "vllm:cache_config_info"
_SAMPLE = CACHE_CONFIG_METRIC + "{"
_SAMPLE_AFTER_NEWLINE = "\n" + _SAMPLE
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_MAX_DIGITS = 15
"""Longer label values are rejected before ``int`` (which refuses over 4,300 digits by raising)."""


def cache_config_samples(text: str) -> str:
    """The gauge's sample lines in a Prometheus exposition, as printed; empty when absent.

    A metric family's samples are consecutive, so the block ends at the first other line.
    """
    if text.startswith(_SAMPLE):
        start = 0
    else:
        start = text.find(_SAMPLE_AFTER_NEWLINE) + 1
        if start == 0:
            return ""
    pos = start
    while True:
        newline = text.find("\n", pos)
        if newline < 0:
            return text[start:]
        pos = newline + 1
        if not text.startswith(_SAMPLE, pos):
            return text[start:newline]


def _positive_int(value: str | None) -> int:
    if value is None or not value.isascii() or not value.isdigit() or len(value) > _MAX_DIGITS:
        return 0
    return int(value)


def capacity_of_samples(samples: str) -> int:
    """KV capacity in tokens (``num_gpu_blocks × block_size``, the largest over the samples) of
    ``vllm:cache_config_info`` sample lines; 0 when no sample carries both labels as positive
    integers (e.g. ``num_gpu_blocks="None"``)."""
    best = 0
    for line in samples.split("\n"):
        end = line.rfind("}")
        if not line.startswith(_SAMPLE) or end < 0:
            continue
        labels = dict(_LABEL.findall(line, len(_SAMPLE), end))
        tokens = _positive_int(labels.get("num_gpu_blocks")) * _positive_int(labels.get("block_size"))
        best = max(best, tokens)
    return best


@dataclass(slots=True)
class CacheConfigWatch:
    """One endpoint's KV capacity as read from its ``/metrics`` scrapes.

    Attributes:
        pod: the endpoint, named in the log line of an unreadable gauge.
        samples: the sample lines last parsed (empty: the gauge was absent).
        capacity_tokens: their capacity; 0 unknown (absent or unreadable).
        num_unreadable: distinct sample blocks that carried no capacity, each logged once.
    """

    pod: PodId
    samples: str = ""
    capacity_tokens: int = 0
    num_unreadable: int = 0

    def read(self, text: str) -> int:
        """The capacity in one scrape's exposition, parsed only when the gauge's lines changed.

        Args:
            text: the endpoint's ``GET /metrics`` body.

        Returns:
            KV capacity in tokens; 0 when the endpoint does not export the gauge or its labels
            do not give one.
        """
        samples = cache_config_samples(text)
        if samples == self.samples:
            return self.capacity_tokens
        self.samples = samples
        self.capacity_tokens = capacity_of_samples(samples) if samples else 0
        if samples and not self.capacity_tokens:
            self.num_unreadable += 1
            logger.warning(
                "endpoint %s: %s carries no positive num_gpu_blocks and block_size; KV capacity unknown",
                self.pod,
                CACHE_CONFIG_METRIC,
            )
        return self.capacity_tokens
