"""The garbage collector set up for a serving router process.

Two costs of CPython's cyclic collector show up per proxied request:

* Generation-0 collections run every 700 net container allocations. A router with dozens of
  requests in flight crosses that count on the rise of every burst (each request holds its body,
  headers, futures and routing objects until it ends), so collections ran every ~20 requests
  without reclaiming much: what a request allocates is freed by reference counting when it ends.
* Full collections traverse every tracked object, including the several hundred thousand that
  importing the tokenizer stack creates and that live as long as the process.

:func:`tune_for_serving` freezes what startup allocated (later collections skip it) and raises the
generation-0 threshold above what the requests in flight hold, so collections run for real
garbage. The older generations' thresholds stay as they are.
"""

from __future__ import annotations

import gc

SERVING_GEN0_THRESHOLD = 20_000
"""Net container allocations between generation-0 collections while serving (CPython's default:
700); well above what a few hundred requests in flight hold."""


def tune_for_serving(gen0_threshold: int = SERVING_GEN0_THRESHOLD) -> None:
    """Freeze the objects allocated so far and collect generation 0 less often.

    Call once per process, after the app is built and before serving.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
