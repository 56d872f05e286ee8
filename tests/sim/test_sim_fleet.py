"""Fleets: routing by the router's own scheduler, KV events into its index, the shared tier."""

import dataclasses
import itertools
from typing import Any

import pytest
from sim_helpers import ListWorkload, spec, tokens

from kvmesh.engine.cost_model import CostModel, get_preset
from kvmesh.errors import ConfigError
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.types import EndpointState, RoutingRequest
from kvmesh.sim.fleet import FleetConfig, FleetSimulation, simulate
from kvmesh.sim.report import build_report
from kvmesh.sim.routing import resolve_policy, with_cost_model_prior
from kvmesh.workload import MultiTurnWorkload, SharedPrefixWorkload, Stage

PRESET = "tiny-h100"


def shared_prefix(
    rate: float = 40.0, duration: float = 10.0, seed: int = 3, groups: int = 12
) -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        num_groups=groups, num_prompts_per_group=4, system_prompt_len=1024, question_len=128, output_len=16,
        stages=[Stage(rate, duration)], seed=seed,
    )  # fmt: skip


def fleet(policy: Any, n: int = 4, **kw) -> FleetConfig:
    return FleetConfig(num_replicas=n, model_preset=PRESET, policy=policy, **kw)


def test_precise_routing_finds_more_cache_than_random():
    wl = shared_prefix()
    precise = build_report(simulate(fleet("precise"), wl))
    rnd = build_report(simulate(fleet("random"), wl))
    assert precise.summary.num_failed == rnd.summary.num_failed == 0
    assert precise.summary.hit_rate > rnd.summary.hit_rate + 0.1
    assert precise.summary.ttft.mean < rnd.summary.ttft.mean


def test_replica_events_reach_the_routers_index_with_the_engines_keys():
    sim = FleetSimulation(fleet("precise"))
    wl = shared_prefix(duration=3.0)
    run = sim.run(wl)
    applier = run.router.applier
    assert applier.stats.num_blocks_stored > 0
    assert applier.stats.num_bad_events == applier.stats.num_orphans == 0
    # what the index says a pod holds is exactly what that pod's device cache holds
    for replica in run.replicas:
        held = replica.cache.cached_keys()
        some = next(iter(held))
        holders = run.router.index.lookup([some])
        assert holders and replica.pod in holders[0]
    last = list(wl.requests())[-1]
    keys = run.replicas[0].cache.block_keys(last.prompt_token_ids)
    assert run.router.index.lookup(keys[:1])  # request keys are the index's keys
    assert all(r.keys == [] and r.prompt == [] for r in run.requests)  # released when done


def test_round_robin_spreads_requests_evenly():
    wl = ListWorkload([spec(i, i * 0.05, tokens(i, 200), 4) for i in range(40)])
    run = simulate(fleet("round-robin"), wl)
    assert sorted(r.stats.num_finished for r in run.replicas) == [10, 10, 10, 10]


def test_shared_tier_serves_what_other_replicas_computed_and_counts_its_bytes():
    wl = shared_prefix(groups=48)
    cfg = fleet("random", shared_tier="redis", net_gbps=100.0)
    rep = build_report(simulate(cfg, wl))
    plain = build_report(simulate(fleet("random"), wl))
    assert rep.tiers.shared_hit_tokens > 0
    assert rep.summary.hit_rate > plain.summary.hit_rate + 0.1
    kv_bytes = CostModel(get_preset(PRESET)).model.kv_bytes_per_token
    assert rep.network.read_bytes == rep.tiers.shared_hit_tokens * kv_bytes
    assert rep.network.write_bytes > 0 and rep.network.write_bytes % (256 * kv_bytes) == 0


def test_a_thin_network_makes_shared_hits_slow():
    wl = shared_prefix(rate=20.0, duration=6.0)
    fast = build_report(simulate(fleet("random", shared_tier="redis", net_gbps=400.0), wl))
    thin = build_report(simulate(fleet("random", shared_tier="redis", net_gbps=0.2), wl))
    assert thin.summary.ttft.mean > 2 * fast.summary.ttft.mean


def test_cpu_tier_hits_after_device_eviction():
    toks = [tokens(100 + g, 1024) for g in range(8)]
    specs = [spec(i, i * 0.2, toks[i % 8], 2) for i in range(32)]
    cfg = fleet("round-robin", n=1, kv_capacity_tokens=4096, cpu_tier_tokens=65536)
    rep = build_report(simulate(cfg, ListWorkload(specs)))
    assert rep.tiers.cpu_hit_tokens > 0
    assert rep.tiers.gpu_hit_tokens == 0  # 8 prompts cycle through a 4-prompt device cache: LRU misses


def test_multi_turn_sessions_send_each_turn_after_the_previous_finished():
    wl = MultiTurnWorkload(
        num_conversations=6, num_turns=4, tokens_per_turn=200, output_len=20, conversation_interval_s=0.0
    )
    run = simulate(fleet("precise", n=2), wl)
    by_conv: dict[str, list] = {}
    for r in run.requests:
        by_conv.setdefault(r.group, []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.index)
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival >= prev.finish
            assert nxt.hit_gpu >= prev.prompt_len - 16  # the history is cached (precise keeps sessions home)


def test_default_policy_runs_with_the_cost_model_as_its_prior():
    rep = build_report(simulate(fleet("precise"), shared_prefix(duration=4.0)))
    assert rep.summary.num_failed == 0 and rep.summary.hit_rate > 0.3
    config = with_cost_model_prior(
        resolve_policy("precise"),
        prefill_tokens_per_s=12_345.0,
        queued_request_s=0.2,
        kv_bytes_per_token=1000,
        shared_gbps=80.0,
        max_batched_tokens=4096,
    )
    (ttft,) = [p for p in config["plugins"] if p["type"] == "ttft-estimate-scorer"]
    assert ttft["parameters"]["prefillTokensPerSecond"] == 12_345.0
    assert ttft["parameters"]["maxBatchedTokens"] == 4096
    assert ttft["parameters"]["tierGBps"]["SHARED"] == 10.0  # 80 Gb/s


def test_routers_take_the_models_attention_context_unless_told_to_keep_the_policys():
    def ttft_scorer(sim: FleetSimulation) -> TTFTEstimateScorer:
        (scorer,) = [
            w.scorer
            for w in sim.router.scheduler.profiles["default"].scorers
            if isinstance(w.scorer, TTFTEstimateScorer)
        ]
        return scorer

    model = get_preset(PRESET).model.attention_context_tokens
    assert ttft_scorer(FleetSimulation(fleet("precise"))).attention_context == model
    kept = FleetSimulation(fleet("precise", model_attention_context=False))
    assert ttft_scorer(kept).attention_context == 30_000.0  # the preset's prior, to be learned from
    run = kept.run(shared_prefix(duration=4.0))
    assert all(r.failed is None for r in run.requests)


@pytest.mark.parametrize("policy", ["approximate", "load"])
def test_other_presets_route_every_request(policy):
    rep = build_report(simulate(fleet(policy), shared_prefix(duration=3.0)))
    assert rep.summary.num_ok == rep.summary.num_requests > 0


def test_drained_stages_start_after_the_previous_stage_finished():
    wl = SharedPrefixWorkload(
        num_groups=2, num_prompts_per_group=2, system_prompt_len=64, question_len=16, output_len=400,
        stages=[Stage(4.0, 1.0), Stage(4.0, 1.0)], arrival="constant", seed=1,
    )  # fmt: skip
    cfg = FleetConfig(num_replicas=2, model_preset="llama-3.1-8b-h100", policy="round-robin")
    open_loop = simulate(cfg, wl)
    drained = simulate(dataclasses.replace(cfg, drain_stages=True), wl)
    for run in (open_loop, drained):
        assert len(run.requests) == 6 and all(r.failed is None for r in run.requests)
    first_done = max(r.finish for r in drained.requests if r.stage == 0)
    assert first_done > 1.0  # 400-token answers outlast the 1 s stage
    second = sorted(r.arrival for r in drained.requests if r.stage == 1)
    assert second[0] >= first_done
    # the stage keeps its own spacing, only shifted
    assert [b - a for a, b in itertools.pairwise(second)] == pytest.approx([0.25] * 2)
    assert min(r.arrival for r in open_loop.requests if r.stage == 1) == pytest.approx(1.25)


def _homes(run) -> int:
    return len({(r.group, r.replica) for r in run.requests})


def test_gateways_each_keep_their_own_approximate_history():
    wl = shared_prefix(rate=20.0, duration=6.0, groups=16)
    sticky = {  # prefix weight 2: one history never gives a group a second home
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": {"blockSize": 16}},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }
    one = simulate(fleet(sticky), wl)
    three = simulate(fleet(sticky, gateways=3), wl)
    assert _homes(one) == 16
    assert _homes(three) > 24  # each gateway homes the groups on its own
    assert all(r.failed is None for r in three.requests)
    per_gateway = three.router.routed_by_gateway
    assert len(per_gateway) == 3 and sum(per_gateway) == len(three.requests) and min(per_gateway) > 0
    assert {r.gateway for r in three.requests} == {0, 1, 2}
    # every gateway's in-flight count came back to zero
    assert all(s.in_flight == 0 for states in three.router._states for s in states)


def test_gateways_share_the_event_fed_index():
    wl = shared_prefix(rate=20.0, duration=6.0)
    one = build_report(simulate(fleet("precise"), wl))
    two_run = simulate(fleet("precise", gateways=2), wl)
    assert {id(s.index) for s in two_run.router.schedulers} == {id(two_run.router.index)}
    two = build_report(two_run)
    assert two.summary.hit_rate == pytest.approx(one.summary.hit_rate, abs=0.03)


def test_one_gateway_is_the_default_and_zero_is_refused():
    assert fleet("precise").gateways == 1
    with pytest.raises(ConfigError, match="gateways"):
        fleet("precise", gateways=0)


def test_the_router_learns_what_the_shared_tier_holds_and_loads_past_a_busy_holder():
    prompt = tokens(7, 2048)
    sim = FleetSimulation(fleet("precise", n=2, shared_tier="redis"))
    run = sim.run(ListWorkload([spec(0, 0.0, prompt, 4)]))
    holder = run.replicas[run.requests[0].replica]
    other = next(r for r in run.replicas if r is not holder)
    router = run.router
    request = RoutingRequest("probe", prompt + tokens(8, 64), router.namespace)
    request.prefix = router.scheduler.match(request)
    # the replica announced its write: every endpoint can load the prompt's 256-token chunks
    shared = request.prefix.shared
    assert shared is not None and shared.num_blocks * 16 == 2048
    assert request.prefix.match_of(other.pod) is shared
    idle = [EndpointState(r.pod) for r in run.replicas]
    assert router.scheduler.rank(request, idle)[0] == holder.pod  # on its device beats loading
    busy = [EndpointState(r.pod, pending_prefill_tokens=100_000 if r is holder else 0) for r in run.replicas]
    assert router.scheduler.rank(request, busy)[0] == other.pod  # loading beats its queue


def test_cpu_tier_announces_its_blocks_and_their_eviction_to_the_router():
    from kvmesh.core.hashing import BlockHasher
    from kvmesh.core.types import Medium
    from kvmesh.router.index import MEDIUM_BITS
    from kvmesh.sim.routing import SIM_HASH_ALGO

    toks = [tokens(300 + g, 1024) for g in range(8)]
    specs = [spec(i, i * 0.2, toks[i % 8], 2) for i in range(16)]
    # device 4,096 tokens (4 prompts), CPU tier 6,144 (6 prompts): the oldest prompts leave both
    run = simulate(
        fleet("round-robin", n=1, kv_capacity_tokens=4096, cpu_tier_tokens=6144), ListWorkload(specs)
    )
    router = run.router
    hasher = BlockHasher(router.namespace, router.block_size, SIM_HASH_ALGO)
    pod = run.replicas[0].pod
    cpu, gpu = MEDIUM_BITS[Medium.CPU], MEDIUM_BITS[Medium.GPU]
    chunk_blocks = 256 // router.block_size
    media: list[int] = []
    for g in range(8):
        keys = hasher.hash_blocks(toks[g])
        holders = router.index.lookup(keys)
        media.append(holders[0].get(pod, 0) if holders else 0)
        if holders and holders[0].get(pod, 0) & cpu:
            # the CPU tier holds whole chunks from the start: every announced block is indexed
            assert len(holders) >= chunk_blocks
    # the last prompts sent are in the device tier and the CPU tier; the first ones in neither
    assert all(m & cpu and m & gpu for m in media[-2:])
    assert media[0] == 0 and media[1] == 0
    # some prompt outlived the device tier in the CPU tier alone: priced as a CPU load, not a miss
    assert any(m == cpu for m in media)
