"""``kvmesh chaos``: a fleet under steady load, faults injected on a schedule, each scenario's bounds
checked, and a report (rich table, JSON, timeline PNG).

Modules: :mod:`.bounds` (bounds and scenario results), :mod:`.schedule` (phase lengths and the
fault log), :mod:`.load` (the steady load and its per-second series), :mod:`.procs` (RSS and open
files of the fleet's processes), one module per scenario family (:mod:`.fleet_faults`,
:mod:`.corruption`, :mod:`.fuzz_events`, :mod:`.fuzz_http`, :mod:`.tenants`, :mod:`.overload`,
:mod:`.soak`), :mod:`.harness` (runs them in order on one fleet) and :mod:`.report`.
"""

from kvmesh.chaos.bounds import ScenarioResult

# The harness (``kvmesh.chaos.harness.run``) and the report pull in aiohttp and the fleet: they are
# imported where they run, so ``kvmesh --help`` stays fast.
__all__ = ["ScenarioResult"]
