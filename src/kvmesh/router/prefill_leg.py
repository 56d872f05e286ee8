"""The P/D prefill leg: the prompt computed on a prefill endpoint before decode starts elsewhere.

The prefill endpoint gets the body with ``kv_transfer_params: {"role": "prefill"}``, no stream and
one output token: it computes the prompt's KV, writes it to the shared store and answers. The
decode endpoint then gets the body with ``{"role": "decode"}`` and loads that KV. A failed leg
costs only time: the decode endpoint computes the prompt itself.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvmesh.core.tenancy import Role
from kvmesh.core.types import PodId
from kvmesh.errors import UpstreamError, UpstreamUnreachableError
from kvmesh.router.endpoints import EndpointPool
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.upstream_http import UpstreamClient

logger = logging.getLogger(__name__)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: ``body`` cut to one unstreamed token, with the prefill role."""
    leg = dict(body)
    leg.update(stream=False, max_tokens=1, kv_transfer_params={"role": Role.PREFILL.value})
    leg.pop("stream_options", None)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def decode_body(body: dict[str, Any]) -> dict[str, Any]:
    """The decode endpoint's body: ``body`` with the decode role."""
    out = dict(body)
    out["kv_transfer_params"] = {"role": Role.DECODE.value}
    return out


class PrefillLeg:
    """Runs prefill legs.

    Args:
        client: the HTTP client to the endpoints.
        pool: the endpoints; connect failures are reported and in-flight requests counted on it.
        metrics: where prefill decisions are counted.
        timeout_s: total time one leg may take.
    """

    def __init__(
        self, client: UpstreamClient, pool: EndpointPool, metrics: RouterMetrics, *, timeout_s: float
    ) -> None:
        self.client = client
        self.pool = pool
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def run(self, path: str, body: dict[str, Any], headers: dict[str, str], pod: PodId) -> None:
        """Send ``body``'s prefill leg to ``pod`` on ``path`` and wait for its answer.

        Failures are logged (and a connect failure reported to the pool), never raised.
        """
        self.metrics.prefill_decisions.labels(pod).inc()
        self.pool.begin_request(pod)
        try:
            resp = await self.client.post(
                pod, path, msgspec.json.encode(prefill_body(body)), headers, timeout_s=self.timeout_s
            )
            try:
                await resp.read()
            finally:
                resp.release()
            if resp.status != 200:
                logger.warning("prefill leg on %s answered %d", pod, resp.status)
        except UpstreamUnreachableError as exc:
            self.pool.report_failure(pod, str(exc))
        except (UpstreamError, TimeoutError, ValueError) as exc:
            logger.warning("prefill leg on %s failed: %s", pod, exc)
        finally:
            self.pool.end_request(pod)
