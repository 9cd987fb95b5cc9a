"""KServe v2 gRPC with the real tritonclient.grpc client: health, metadata, config, index and statistics as HTTP
answers them; ModelInfer (raw and typed contents) and ModelStreamInfer with the same outputs as the HTTP routes;
errors with their status codes; the same Prometheus counters."""

from __future__ import annotations

import json

import grpc
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests.server.grpc.conftest import final, inputs, raw_request, stream, tensor, text
from tests.server.test_metrics import value

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def http_text(server, model: str, body: dict) -> str:
    response = server.http.post(f"/v2/models/{model}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()["text_output"]


# ---- health, metadata, config, repository --------------------------------------------------------------------

def test_health_and_server_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tensorrt_llm") and client.is_model_ready("tensorrt_llm", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("tensorrt_llm", "7")
    meta = client.get_server_metadata()
    assert meta.name == "specserve" and meta.version and "model_repository" in meta.extensions


@pytest.mark.parametrize("model", ["tensorrt_llm", "eagle_model", "ensemble"])
def test_model_metadata_and_config_are_the_http_documents(client, server, model):
    http_meta = server.http.get(f"/v2/models/{model}").json()
    meta = client.get_model_metadata(model)
    assert (meta.name, list(meta.versions), meta.platform) == (http_meta["name"], http_meta["versions"],
                                                               http_meta["platform"])
    for ours, theirs in ((meta.inputs, http_meta["inputs"]), (meta.outputs, http_meta["outputs"])):
        assert [(t.name, t.datatype, list(t.shape)) for t in ours] == [
            (t["name"], t["datatype"], t["shape"]) for t in theirs]
    http_config = server.http.get(f"/v2/models/{model}/config").json()
    config = client.get_model_config(model).config
    assert config.name == model and config.max_batch_size == http_config["max_batch_size"]
    assert config.model_transaction_policy.decoupled == http_config["model_transaction_policy"]["decoupled"]
    assert [i.name for i in config.input] == [i["name"] for i in http_config["input"]]
    assert config.parameters["speculative_method"].string_value == "ngram"
    assert config.dynamic_batching.default_queue_policy.max_queue_size > 0


def test_repository_index_and_statistics(client, server):
    index = client.get_model_repository_index()
    http_index = server.http.post("/v2/repository/index").json()
    assert [(m.name, m.state) for m in index.models] == [(m["name"], m.get("state", "")) for m in http_index]
    ready = client.get_model_repository_index(as_json=True, headers=None)
    assert {m["name"] for m in ready["models"]} >= {"tensorrt_llm", "preprocessing"}
    stats = client.get_inference_statistics("tensorrt_llm").model_stats
    assert [(s.name, s.version) for s in stats] == [("tensorrt_llm", "1")]
    with pytest.raises(InferenceServerException) as err:
        client.get_inference_statistics("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_load_and_unload_over_grpc(client):
    """Explicit model-control mode (the server all tests here share): unload, not ready, load again, ready and
    serving."""
    client.unload_model("plain")
    assert not client.is_model_ready("plain")
    with pytest.raises(InferenceServerException) as err:
        client.infer("plain", inputs(text_input="hi", sampling_param_max_tokens=2))
    assert err.value.status() == "StatusCode.NOT_FOUND"
    client.load_model("plain", config=json.dumps({"max_batch_size": 0}))
    assert client.is_model_ready("plain")
    assert text(client.infer("plain", inputs(text_input="hi", sampling_param_max_tokens=2)))
    with pytest.raises(InferenceServerException) as err:
        client.load_model("not_in_repo")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "not_in_repo" in err.value.message()


# ---- ModelInfer ------------------------------------------------------------------------------------------------

def test_infer_equals_the_http_route(client, server):
    greedy = {"text_input": PROMPT, "sampling_param_max_tokens": 16, "sampling_param_exclude_input_from_output": True}
    result = client.infer("tensorrt_llm", inputs(**greedy), request_id="r1")
    assert text(result) == http_text(server, "tensorrt_llm", greedy) != ""
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("tensorrt_llm", "1", "r1")
    # the prompt echoed unless excluded, as over HTTP
    echoed = client.infer("tensorrt_llm", inputs(text_input=PROMPT, sampling_param_max_tokens=16))
    assert text(echoed) == PROMPT + text(result)


def test_infer_outputs_asked_for_and_the_three_styles(client, server):
    import tritonclient.grpc as grpcclient

    wanted = [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("finish_reason")]
    result = client.infer("tensorrt_llm", inputs(text_input="Once upon", sampling_param_max_tokens=4,
                                                 return_finish_reason=True, sampling_param_return_perf_metrics=True),
                          outputs=wanted)
    assert [o.name for o in result.get_response().outputs] == ["text_output", "finish_reason"]
    assert text(result, "finish_reason") in ("length", "stop")
    perf = client.infer("tensorrt_llm", inputs(text_input="Once upon", sampling_param_max_tokens=4,
                                               sampling_param_return_perf_metrics=True))
    assert int(text(perf, "total_draft_tokens")) >= int(text(perf, "total_accepted_draft_tokens")) >= 0
    # vLLM: sampling_parameters as JSON text, exact length with ignore_eos
    params = json.dumps({"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    vllm = client.infer("eagle_model", inputs(text_input=PROMPT, sampling_parameters=params,
                                              exclude_input_in_output=True, return_num_output_tokens=True))
    assert vllm.as_numpy("num_output_tokens").reshape(-1)[0] == 6
    assert text(vllm) == http_text(server, "eagle_model", {"text_input": PROMPT, "sampling_parameters": params,
                                                           "exclude_input_in_output": True})
    # the ensemble (max_batch_size 4): [1, 1] outputs and its sequence parameters; genai-perf's inputs
    ensemble = client.infer("ensemble", inputs(text_input=PROMPT, max_tokens=5, min_length=5,
                                               exclude_input_in_output=True))
    assert list(ensemble.get_response().outputs[0].shape) == [1, 1]
    assert ensemble.get_response().parameters["sequence_start"].bool_param is False


def test_typed_contents_equal_raw_contents(client, stub):
    """The same request with typed `contents` (as some clients send) and raw_input_contents (tritonclient)."""
    typed = stub.ModelInfer(raw_request(
        "tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", [PROMPT.encode()]),
        ("sampling_param_max_tokens", "INT32", [1], "int_contents", [8]),
        ("sampling_param_temperature", "FP32", [1], "fp32_contents", [0.0]),
        ("sampling_param_exclude_input_from_output", "BOOL", [1], "bool_contents", [True]),
        ("sampling_param_seed", "UINT64", [1], "uint64_contents", [3])), timeout=60)
    raw = client.infer("tensorrt_llm", inputs(text_input=PROMPT, sampling_param_max_tokens=8,
                                              sampling_param_temperature=0.0,
                                              sampling_param_exclude_input_from_output=True))
    assert typed.raw_output_contents[0][4:].decode() == text(raw)


# ---- ModelStreamInfer ------------------------------------------------------------------------------------------

def test_stream_deltas_join_to_the_http_output(client, server):
    greedy = {"text_input": PROMPT, "sampling_param_max_tokens": 24, "sampling_param_exclude_input_from_output": True}
    responses = stream(client, "tensorrt_llm", [(inputs(**greedy, stream=True), "s1")])
    assert all(error is None for _, error in responses)
    results = [result for result, _ in responses]
    assert len(results) > 1 and all(r.get_response().id == "s1" for r in results)
    assert [final(r) for r in results] == [False] * (len(results) - 1) + [True]
    assert "".join(text(r) for r in results) == http_text(server, "tensorrt_llm", greedy)
    # the same over HTTP generate_stream: the same pieces
    http = server.http.post("/v2/models/tensorrt_llm/generate_stream", json={**greedy, "stream": True})
    pieces = [json.loads(block[6:])["text_output"] for block in http.text.split("\n\n") if block]
    assert "".join(pieces) == "".join(text(r) for r in results)


def test_stream_styles_cumulative_vllm_and_one_response(client, server):
    # llmapi `streaming`: each response repeats the whole text so far, prompt included
    responses = stream(client, "tensorrt_llm", [(inputs(text_input=PROMPT, sampling_param_max_tokens=12,
                                                        streaming=True), "c")])
    texts = [text(r) for r, _ in responses]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[0].startswith(PROMPT)
    assert texts[-1] == http_text(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 12})
    # vLLM: deltas, exclude_input_in_output = false refused in-band
    params = json.dumps({"max_tokens": 10, "temperature": 0})
    responses = stream(client, "eagle_model", [
        (inputs(text_input=PROMPT, sampling_parameters=params, stream=True), "v"),
        (inputs(text_input=PROMPT, sampling_parameters=params, stream=True, exclude_input_in_output=False), "bad")])
    good = [r for r, error in responses if error is None]
    errors = [str(error) for _, error in responses if error is not None]
    assert errors == ["When streaming, `exclude_input_in_output` = False is not allowed."]
    assert "".join(text(r) for r in good) == http_text(server, "eagle_model", {
        "text_input": PROMPT, "sampling_parameters": params, "exclude_input_in_output": True})
    # a request that does not stream: one response, flagged final
    responses = stream(client, "tensorrt_llm", [(inputs(text_input="Once", sampling_param_max_tokens=4), "one")])
    assert len(responses) == 1 and final(responses[0][0]) and text(responses[0][0]).startswith("Once")


def test_a_failing_request_on_a_stream_harms_no_other(client, server):
    """Requests on one stream run together; the bad ones answer with their error (and id), the good one with its
    text, and the stream ends normally."""
    greedy = {"text_input": PROMPT, "sampling_param_max_tokens": 16, "sampling_param_exclude_input_from_output": True}
    responses = stream(client, "tensorrt_llm", [
        (inputs(**greedy, stream=True), "good"),
        (inputs(text_input=PROMPT, sampling_param_temperature=-1.0), "bad-temperature"),
        (inputs(text_input=PROMPT, sampling_param_top_p=2.0), "bad-top-p"),
        ([tensor("text_input", 5, "INT32")], "bad-type")])
    errors = sorted(str(error) for _, error in responses if error is not None)
    assert len(errors) == 3 and any("temperature" in e for e in errors) and any("top_p" in e for e in errors)
    assert any("text_input" in e for e in errors)
    good = [r for r, error in responses if error is None]
    assert {r.get_response().id for r in good} == {"good"} and final(good[-1])
    assert "".join(text(r) for r in good) == http_text(server, "tensorrt_llm", greedy)
    # streaming from a model that is not decoupled: refused in-band, as Triton words it
    responses = stream(client, "plain", [(inputs(text_input="hi", sampling_param_max_tokens=2, stream=True), "p")])
    assert [str(e) for _, e in responses] == ["Streaming is only supported in decoupled mode."]


# ---- errors ----------------------------------------------------------------------------------------------------

def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


@pytest.mark.parametrize("request_inputs, fragment", [
    (inputs(text_input="x", sampling_param_temperature=-1.0), "temperature"),
    (inputs(text_input="x", sampling_param_top_p=1.5), "top_p"),
    (inputs(text_input="x", sampling_param_seed=-1), "seed"),
    (inputs(text_input="x", sampling_param_max_tokens=0), "max_tokens"),
    ([tensor("text_input", "x"), tensor("sampling_param_max_tokens", 2.5)], "max_tokens"),
    ([tensor("text_input", 7, "INT32")], "text_input"),
    (inputs(sampling_param_max_tokens=4), "text_input"),
    (inputs(text_input="x", no_such_input=1), "no_such_input"),
    (inputs(text_input="x", stream=True), "ModelStreamInfer"),
    (inputs(text_input="x", sampling_param_best_of=2), "best_of"),
])
def test_bad_input_is_invalid_argument(client, request_inputs, fragment):
    status, message = status_of(lambda: client.infer("tensorrt_llm", request_inputs))
    assert status == "StatusCode.INVALID_ARGUMENT" and fragment in message


@pytest.mark.parametrize("message, fragment", [
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [2], "bytes_contents", [b"x"])), "shape"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [-1], "bytes_contents", [b"x"])), "shape"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", [b"\xff\xfe"])), "UTF-8"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", [b"x"]),
                 ("sampling_param_max_tokens", "INT32", [1], "fp32_contents", [4.0])), "int_contents"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", [b"x"]),
                 ("sampling_param_temperature", "FP16", [1], "fp32_contents", [0.5])), "FP16"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", [b"x"]),
                 ("text_input", "BYTES", [1], "bytes_contents", [b"y"])), "more than once"),
    (raw_request("tensorrt_llm", ("text_input", "BYTES", [1], "bytes_contents", []),
                 raw_input_contents=[b"\x01\x00\x00\x00x", b"extra"]), "raw_input_contents"),
    (service_pb2.ModelInferRequest(model_name="tensorrt_llm", inputs=[service_pb2.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1])], raw_input_contents=[b"\x09\x00\x00\x00x"]), "malformed"),
    (service_pb2.ModelInferRequest(model_name="tensorrt_llm", inputs=[service_pb2.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1])], raw_input_contents=[b"\x01\x00\x00\x00x"],
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="nope")]), "nope"),
])
def test_malformed_tensors_are_invalid_argument(stub, message, fragment):
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(message, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()


def test_not_found_unimplemented_and_the_server_goes_on(client, stub):
    for call in (lambda: client.infer("nope", inputs(text_input="x")), lambda: client.get_model_metadata("nope"),
                 lambda: client.get_model_config("nope"), lambda: client.get_model_metadata("tensorrt_llm", "9")):
        status, message = status_of(call)
        assert status == "StatusCode.NOT_FOUND" and ("nope" in message or "version 9" in message)
    with pytest.raises(grpc.RpcError) as err:
        stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(repository_name="other"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "repository_name" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert text(client.infer("tensorrt_llm", inputs(text_input="still here", sampling_param_max_tokens=2)))


def test_metrics_count_grpc_requests(client, server):
    before = server.metrics_text()
    client.infer("tensorrt_llm", inputs(text_input="Once upon", sampling_param_max_tokens=3))
    stream(client, "tensorrt_llm", [(inputs(text_input="Once upon", sampling_param_max_tokens=3, stream=True), "m")])
    status_of(lambda: client.infer("tensorrt_llm", inputs(text_input="x", sampling_param_temperature=-1.0)))
    after = server.metrics_text()

    def delta(name, **labels):
        labels = {"model": "tensorrt_llm", "version": "1", **labels}
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("nv_inference_request_success") == 2
    assert delta("nv_inference_request_failure", reason="OTHER") == 1
    assert delta("nv_inference_count") >= 2 and delta("nv_inference_request_duration_us") > 0


def test_clients_asking_for_an_empty_final_response_get_a_final_flag(client):
    """perf_analyzer / genai-perf ask `triton_enable_empty_final_response`: the stream still ends with one response
    flagged final (the last one with text, as Triton's TRT-LLM and vLLM backends flag theirs)."""
    import queue

    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer("tensorrt_llm", inputs(text_input="Once", sampling_param_max_tokens=6, stream=True),
                              request_id="e", enable_empty_final_response=True)
    client.stop_stream()
    responses = [received.get_nowait() for _ in range(received.qsize())]
    assert responses and all(error is None for _, error in responses)
    assert [final(r) for r, _ in responses] == [False] * (len(responses) - 1) + [True]
