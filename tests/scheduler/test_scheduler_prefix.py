"""Prefix hits: contiguous from block 0, per instance, in tokens, through the endpoint map."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import InstanceConfig
from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.prefix import EndpointMap, prefix_hit_tokens, split_endpoint


def instance(id_: str, *endpoints: str) -> InstanceConfig:
    return InstanceConfig(id=id_, url="http://127.0.0.1:9000", model="m", kvs_endpoints=endpoints)


def blocks(n: int, chunk: int = 4, tail: int = 0) -> list[BlockHash]:
    out = [BlockHash(f"h{i}", chunk, True) for i in range(n)]
    if tail:
        out.append(BlockHash("tail", tail, False))
    return out


A, B = "127.0.0.2:17901", "127.0.0.3:17901"
MAP = EndpointMap.from_instances([instance("a", A), instance("b", "127.0.0.3")])


def test_split_endpoint():
    assert split_endpoint("127.0.0.2:17901") == ("127.0.0.2", "17901")
    assert split_endpoint("127.0.0.2") == ("127.0.0.2", None)
    assert split_endpoint("[::1]:80") == ("::1", "80")
    assert split_endpoint("::1") == ("::1", None)


def test_hits_are_contiguous_from_block_zero():
    locations = [{A, B}, {A}, {B}, {A, B}]
    # a holds blocks 0,1,3 -> 2 blocks; b holds 0,2,3 -> only block 0 counts.
    assert prefix_hit_tokens(blocks(4), locations, MAP, 100) == {"a": 8, "b": 4}


def test_instance_missing_block_zero_has_no_hit():
    assert prefix_hit_tokens(blocks(3), [{A}, {A, B}, {A, B}], MAP, 100) == {"a": 12}
    assert prefix_hit_tokens(blocks(3), [set(), {A, B}, {A, B}], MAP, 100) == {}


def test_unfull_block_counts_its_real_length_and_total_is_capped():
    locations = [{A}, {A}, {A}]
    assert prefix_hit_tokens(blocks(2, tail=3), locations, MAP, 100) == {"a": 11}
    assert prefix_hit_tokens(blocks(2, tail=3), locations, MAP, 10) == {"a": 10}


def test_bare_ip_matches_any_port_and_ip_port_matches_exactly():
    assert prefix_hit_tokens(blocks(1), [{"127.0.0.3:5555"}], MAP, 100) == {"b": 4}
    assert prefix_hit_tokens(blocks(1), [{"127.0.0.2:5555"}], MAP, 100) == {}
    assert prefix_hit_tokens(blocks(1), [{"127.0.0.2"}], MAP, 100) == {}


def test_shared_endpoints_and_instances_with_several_endpoints():
    shared = EndpointMap.from_instances(
        [instance("a", "127.0.0.5"), instance("b", "127.0.0.5:1"), instance("c", "127.0.0.6", "127.0.0.7:2")]
    )
    assert shared.instances_at("127.0.0.5:1") == {"a", "b"}
    assert shared.instances_at("127.0.0.5:9") == {"a"}
    # c holds block 0 on one endpoint and block 1 on the other: still contiguous.
    locations = [{"127.0.0.5:1", "127.0.0.6:3"}, {"127.0.0.7:2", "127.0.0.5:1"}, {"127.0.0.5:9"}]
    assert prefix_hit_tokens(blocks(3), locations, shared, 100) == {"a": 12, "b": 8, "c": 8}


def test_fewer_locations_than_blocks_stop_the_count():
    assert prefix_hit_tokens(blocks(4), [{A}, {A}], MAP, 100) == {"a": 8}


ENDPOINTS = ["127.0.0.2:1", "127.0.0.2:2", "127.0.0.3:1", "127.0.0.4:7"]
PROPERTY_MAP = EndpointMap.from_instances(
    [instance("x", "127.0.0.2:1"), instance("y", "127.0.0.2"), instance("z", "127.0.0.3:1", "127.0.0.4")]
)


@given(
    st.lists(st.sets(st.sampled_from(ENDPOINTS)), max_size=12),
    st.integers(1, 8),
    st.integers(0, 7),
    st.integers(0, 120),
)
def test_matches_a_block_by_block_count(locations, chunk, tail, prompt):
    bs = blocks(len(locations), chunk)
    if tail and bs:
        bs[-1] = BlockHash("tail", tail, False)
    expected = {}
    for inst in ("x", "y", "z"):
        tokens = 0
        for block, endpoints in zip(bs, locations, strict=True):
            if not any(inst in PROPERTY_MAP.instances_at(e) for e in endpoints):
                break
            tokens += block.num_tokens
        if min(tokens, prompt) > 0:
            expected[inst] = min(tokens, prompt)
    assert prefix_hit_tokens(bs, locations, PROPERTY_MAP, prompt) == expected


def test_remembered_endpoints_are_bounded(monkeypatch):
    monkeypatch.setattr(EndpointMap, "MAX_REMEMBERED", 2)
    endpoint_map = EndpointMap.from_instances([instance("a", "127.0.0.2"), instance("b", "127.0.0.3")])
    for port in range(10):
        assert endpoint_map.instances_at(f"127.0.0.2:{port}") == {"a"}
    assert len(endpoint_map.resolved) <= 2
    locations = [{"127.0.0.3:1", "127.0.0.2:1"}, {"127.0.0.3:2"}]
    assert prefix_hit_tokens(blocks(2), locations, endpoint_map, 100) == {"a": 4, "b": 8}
