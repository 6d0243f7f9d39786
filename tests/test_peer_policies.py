"""The simulator's model of the peers' cache_aware routing (bench/peer_policies.py)."""

from bench.peer_policies import CacheAware
from policies.api import RequestView
from policies.registry import load_policy
from tests.views import fleet, worker


def prompt(*blocks: int, tail: int = 8) -> RequestView:
    """A prompt of the given block hashes plus `tail` tokens short of another block."""
    return RequestView(request_id="r", num_tokens=16 * len(blocks) + tail, block_hashes=blocks)


def test_a_prefix_seen_before_follows_its_first_sender_past_the_threshold():
    policy, f = CacheAware(), fleet(worker("a"), worker("b"), worker("c"))
    first = policy.route(prompt(1, 2, 3, 4), f).worker
    assert policy.route(prompt(1, 2, 3, 9), f).worker == first
    assert policy.route(prompt(1, 7, 8, 9), f).worker != first  # a quarter of the prompt: under 0.3


def test_a_new_prefix_goes_to_the_smallest_tree():
    policy, f = CacheAware(), fleet(worker("a"), worker("b"))
    assert policy.route(prompt(1, 2, 3, 4), f).worker == "a"
    assert policy.route(prompt(5, 6), f).worker == "b"
    assert policy.route(prompt(7), f).worker == "b"  # b's tree (2 blocks) is still the smaller


def test_imbalance_overrides_the_match_with_the_least_loaded():
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    f = fleet(worker("a"), worker("b"))
    assert policy.route(prompt(1, 2, 3, 4), f).worker == "a"
    assert policy.route(prompt(1, 2, 3, 5), fleet(worker("a", in_flight=4), worker("b"))).worker == "a"
    assert policy.route(prompt(1, 2, 3, 6), fleet(worker("a", in_flight=6), worker("b", in_flight=1))).worker == "b"
    assert policy.route(prompt(1, 2, 3, 7), fleet(worker("a", in_flight=6), worker("b", in_flight=5))).worker == "a"


def test_the_simulator_loads_it_by_module_path():
    assert load_policy("bench.peer_policies:CacheAware").name == "cache_aware"
