"""What the gateway reads from a vLLM server's HTTP endpoints: recorded answers of vLLM 0.32."""

import json

import pytest

from gateway.vllm_metrics import (
    BadAnswer,
    parse_metrics,
    parse_models,
    parse_sources,
    replay_address,
    subscribe_address,
    worker_id,
)
from gateway.vllm_worker import Spec, parse_spec
from tests.vllm_data import DATA


def test_recorded_metrics_give_load_geometry_and_start_time():
    load = parse_metrics((DATA / "vllm-0.32-metrics.txt").read_text())
    assert (load.running, load.waiting, load.block_size, load.num_blocks) == (6, 0, 32, 48)
    assert load.usage == pytest.approx(0.3829787234042553)
    assert load.kv_blocks() == (30, 48)
    assert load.started == pytest.approx(1.79616614582e9)


def test_data_parallel_engines_add_up_and_sglang_names_are_read():
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} NaN',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0',
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0',
            'sglang:num_queue_reqs{model_name="m"} 4',
        ]
    )
    load = parse_metrics(text)
    assert (load.running, load.waiting, load.block_size, load.num_blocks) == (5, 5, 16, 200)
    assert load.usage == pytest.approx(0.25) and load.started is None
    assert parse_metrics("garbage\n# only comments\nvllm:num_requests_running{") == parse_metrics("")


def test_models_and_event_sources():
    assert parse_models(json.loads((DATA / "vllm-0.32-models.json").read_text())) == ("smollm2-135m", 1024)
    lora = {"data": [{"id": "adapter", "parent": "base"}, {"id": "base", "parent": None, "max_model_len": 7}]}
    assert parse_models(lora) == ("base", 7)
    for bad in ({}, {"data": []}, {"data": [{"id": 3}]}, []):
        with pytest.raises(BadAnswer):
            parse_models(bad)
    (src,) = parse_sources(json.loads((DATA / "vllm-0.32-kv-event-sources.json").read_text()))
    assert (src.rank, src.endpoint, src.replay, src.topic) == (0, "tcp://*:18111", "tcp://*:18112", "kv")
    assert parse_sources({"0": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}}) == []
    with pytest.raises(BadAnswer):
        parse_sources({"x": {}})


@pytest.mark.parametrize(
    "endpoint,address,bind",
    [
        ("tcp://*:5557", "tcp://10.0.0.5:5557", False),  # vLLM binds: connect on the worker's host
        ("tcp://[::]:5557", "tcp://10.0.0.5:5557", False),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", True),  # vLLM connects: the subscriber binds
        ("ipc:///tmp/kv.sock", "ipc:///tmp/kv.sock", False),
    ],
)
def test_where_a_subscriber_meets_the_publisher(endpoint, address, bind):
    assert subscribe_address(endpoint, "10.0.0.5") == (address, bind)


def test_replay_is_always_reached_on_the_workers_host():
    assert replay_address("tcp://*:5558", "h") == "tcp://h:5558"
    assert replay_address("tcp://0.0.0.0:5558", "::1") == "tcp://[::1]:5558"
    assert replay_address("tcp://10.1.1.1:5558", "h") == "tcp://10.1.1.1:5558"


def test_worker_specs():
    assert parse_spec("http://h:1") is None
    assert parse_spec("vllm:http://h:8000/") == Spec("http://h:8000")
    assert parse_spec("sglang:http://h:30000?kv_events=tcp://h:5557&kv_replay=tcp://h:5558&kv_topic=kv") == Spec(
        "http://h:30000", "tcp://h:5557", "tcp://h:5558", "kv"
    )
    for bad in ("vllm:h:8000", "vllm:http://h:1?events=x", "vllm:ftp://h:1"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert worker_id("http://127.0.0.1:8001") == "vllm@127.0.0.1:8001" == worker_id("http://127.0.0.1:8001/")
