"""A gRPC client that cancels (a deadline, a cancelled stream) stops its request at the next step; a full queue is
UNAVAILABLE (as Triton answers it); an engine failure ends only its own request; the server goes on."""

from __future__ import annotations

import queue
import threading

import pytest
from tritonclient.utils import InferenceServerException

from tests.server.conftest import wait_for
from tests.server.grpc.conftest import client_for, inputs, stream, text

LONG = dict(text_input="Once upon a time", sampling_param_max_tokens=400, ignore_eos=True)


@pytest.fixture()
def slow_client(slow_server):
    c = client_for(slow_server)
    yield c
    c.close()


def test_a_deadline_cancels_the_request(slow_server, slow_client):
    runner = slow_server.runner
    with pytest.raises(InferenceServerException) as err:
        slow_client.infer("slow", inputs(**LONG), client_timeout=0.5)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert wait_for(lambda: runner.stats()["cancelled"] == 1 and runner.stats()["running"] == 0)
    assert slow_server.engine.steps < 100  # 400 asked
    assert wait_for(lambda: 'nv_inference_request_failure{model="slow",reason="CANCELED",version="1"} 1'
                    in slow_server.metrics_text())
    assert text(slow_client.infer("slow", inputs(text_input="hi", sampling_param_max_tokens=2)))


def test_cancelling_the_stream_cancels_its_requests(slow_server, slow_client):
    runner = slow_server.runner
    received: queue.Queue = queue.Queue()
    slow_client.start_stream(callback=lambda result, error: received.put((result, error)))
    slow_client.async_stream_infer("slow", inputs(**LONG, stream=True), request_id="a")
    slow_client.async_stream_infer("slow", inputs(**LONG, stream=True), request_id="b")
    result, error = received.get(timeout=30)
    assert error is None and text(result)
    assert wait_for(lambda: runner.stats()["running"] == 1 and runner.stats()["queued"] == 1)  # one at a time
    slow_client.stop_stream(cancel_requests=True)
    assert wait_for(lambda: runner.stats()["cancelled"] == 2 and runner.stats()["running"] == 0)
    assert slow_server.engine.steps < 200
    assert text(slow_client.infer("slow", inputs(text_input="hi", sampling_param_max_tokens=2)))


def test_cancel_by_id_over_grpc(slow_server, slow_client):
    """The LLM API's `stop: true` with a request's id cancels it (answered as TRT-LLM does); the cancelled request
    ends with its error on the stream."""
    runner = slow_server.runner
    received: queue.Queue = queue.Queue()
    slow_client.start_stream(callback=lambda result, error: received.put((result, error)))
    slow_client.async_stream_infer("slow", inputs(**LONG, stream=True), request_id="victim")
    assert received.get(timeout=30)[1] is None
    with pytest.raises(InferenceServerException) as err:
        slow_client.infer("slow", inputs(stop=True), request_id="victim")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "cancelled" in err.value.message()
    assert wait_for(lambda: runner.stats()["cancelled"] == 1 and runner.stats()["running"] == 0)
    slow_client.stop_stream()
    errors = [str(e) for _, e in (received.get_nowait() for _ in range(received.qsize())) if e is not None]
    assert len(errors) == 1 and "cancel" in errors[0].lower()


def test_a_full_queue_is_unavailable(slow_server):
    runner = slow_server.runner
    body = inputs(text_input="Once upon a time", sampling_param_max_tokens=16, ignore_eos=True)
    results = {}

    def run(i):
        with client_for(slow_server) as c:
            results[i] = text(c.infer("slow", body))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]  # 1 running + 2 queued (the limit)
    for i, thread in enumerate(threads):
        thread.start()
        assert wait_for(lambda: runner.pending == i + 1)
    with client_for(slow_server) as c, pytest.raises(InferenceServerException) as err:
        c.infer("slow", body)
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "queue" in err.value.message()
    for thread in threads:
        thread.join(60)
    assert len(results) == 3 and all(results.values())


def test_an_engine_failure_ends_only_its_request(slow_server, slow_client):
    boom = inputs(text_input="boom boom boom", sampling_param_max_tokens=20, ignore_eos=True)
    with pytest.raises(InferenceServerException) as err:
        slow_client.infer("slow", boom)
    assert err.value.status() == "StatusCode.INTERNAL" and "boom" in err.value.message()
    responses = stream(slow_client, "slow", [(inputs(text_input="boom boom boom", sampling_param_max_tokens=20,
                                                     ignore_eos=True, stream=True), "boom"),
                                             (inputs(text_input="fine", sampling_param_max_tokens=4,
                                                     stream=True), "fine")])
    errors = [str(e) for _, e in responses if e is not None]
    assert len(errors) == 1 and "boom" in errors[0]
    fine = [r for r, e in responses if e is None and r.get_response().id == "fine"]
    assert fine and fine[-1].get_response().parameters["triton_final_response"].bool_param
