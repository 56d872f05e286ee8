"""Reading named metrics out of a Prometheus exposition without a pass over every line."""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st

from kvmesh.router.exposition import gauge_totals, has_line, parse_prometheus_gauges, sample_lines
from kvmesh.router.lora_state import LORA_INFO_METRIC, LoraState, parse_lora_info

# Names that prefix one another, so a search by name meets lines of other metrics.
NAMES = ["m", "m_sum", "mm", "vllm:num_requests_waiting", "vllm:num_requests_waiting_total", LORA_INFO_METRIC]

_label_values = st.text(alphabet='abc ,{}="\\', max_size=6)
_values = st.sampled_from(["1", "0.25", "-3", "NaN", "+Inf", "x", "1e3", ""])


@st.composite
def exposition_lines(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(NAMES))
    kind = draw(st.sampled_from(["plain", "labels", "comment", "type", "junk", "unclosed"]))
    value = draw(_values)
    if kind == "plain":
        return f"{name} {value}"
    if kind == "labels":
        adapters = draw(st.sampled_from(["x", "x,y", "z", ""]))
        return f'{name}{{a="{draw(_label_values)}",running_lora_adapters="{adapters}"}} {value} 123'
    if kind == "comment":
        return f"# HELP {name} help"
    if kind == "type":
        return f"# TYPE {name} gauge"
    if kind == "unclosed":
        return f'{name}{{a="b" {value}'
    return draw(st.text(alphabet="m_ {}#1\t", max_size=8))


expositions = st.tuples(
    st.lists(exposition_lines(), max_size=25), st.sampled_from(["\n", "\r\n"]), st.booleans()
).map(lambda t: t[1].join(t[0]) + (t[1] if t[2] else ""))


def _lines(text: str) -> list[str]:
    return text.replace("\r\n", "\n").split("\n")


@given(expositions)
def test_sample_lines_are_the_lines_of_that_metric(text: str) -> None:
    for name in NAMES:
        expected = [line for line in _lines(text) if line.startswith((name + "{", name + " "))]
        assert sample_lines(text, name) == expected


@given(expositions)
def test_gauge_totals_equal_the_full_parse_restricted_to_the_names(text: str) -> None:
    full = parse_prometheus_gauges(text)
    for names in (NAMES, NAMES[:2], [NAMES[3]]):
        assert gauge_totals(text, names) == {n: v for n, v in full.items() if n in names}


@given(expositions)
def test_has_line_finds_whole_lines_only(text: str) -> None:
    lines = set(_lines(text))
    for name in NAMES:
        for line in (f"# TYPE {name} gauge", f"{name} 1", name):
            assert has_line(text, line) == (line in lines)


def _lora_reference(text: str) -> tuple[float, str] | None:
    """The newest sample's labels, by a pass over every line."""
    best: tuple[float, str] | None = None
    prefix = LORA_INFO_METRIC + "{"
    for line in _lines(text):
        end = line.rfind("}")
        if not line.startswith(prefix) or end < 0 or not line[end + 1 :].split():
            continue
        try:
            stamp = float(line[end + 1 :].split()[0])
        except ValueError:
            continue
        if math.isfinite(stamp) and (best is None or stamp >= best[0]):
            best = (stamp, line[len(prefix) : end])
    return best


@given(expositions)
@example('vllm:lora_requests_info{a="\\",running_lora_adapters="x,y"} 1 123')
def test_lora_info_is_the_newest_sample(text: str) -> None:
    state = parse_lora_info(text)
    newest = _lora_reference(text)
    if newest is None:
        declared = f"# TYPE {LORA_INFO_METRIC} gauge" in _lines(text)
        assert state == (LoraState() if declared else None)
    else:  # the state the newest sample alone gives (its labels read as any sample's are)
        assert state == parse_lora_info(f"{LORA_INFO_METRIC}{{{newest[1]}}} 1\n")


@given(
    st.lists(st.tuples(st.integers(0, 50), st.sampled_from(["x", "x,y", "z", ""])), min_size=1, max_size=6)
)
def test_lora_info_takes_the_latest_stamp(samples: list[tuple[int, str]]) -> None:
    lines = [f'{LORA_INFO_METRIC}{{max_lora="2",running_lora_adapters="{a}"}} {t}' for t, a in samples]
    text = "# TYPE vllm:h histogram\nvllm:h_bucket 1\n" + "\n".join(lines) + "\n"
    latest = max(t for t, _ in samples)
    adapters = [a for t, a in samples if t == latest][-1]  # of equal stamps, the last printed
    state = parse_lora_info(text)
    assert state is not None
    assert state.running == frozenset(filter(None, adapters.split(",")))
    assert state.max_lora == 2


def test_gauges_of_a_vllm_sized_page() -> None:
    histogram = "\n".join(f'vllm:h_bucket{{le="{b}"}} 3' for b in range(1000))
    text = f'# TYPE vllm:num_requests_waiting gauge\n{histogram}\nvllm:num_requests_waiting{{engine="0"}} 4\n'
    text += 'vllm:num_requests_waiting{engine="1"} 2\nvllm:num_requests_waiting_total 9\n'
    assert gauge_totals(text, ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]) == {
        "vllm:num_requests_waiting": 6.0
    }
