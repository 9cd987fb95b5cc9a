"""Hostile ModelInfer / ModelStreamInfer requests: hypothesis builds requests mixing valid and invalid tensors
(names, datatypes, shapes, typed or raw contents, request parameters) for every model.

The properties, for every request:
- the RPC ends OK or with a client-error code, never INTERNAL / UNKNOWN, within 30 s; on a stream, the request
  gets responses ending with `triton_final_response` or one in-band error, and the stream itself ends OK;
- a tensor whose shape does not hold its data is INVALID_ARGUMENT (for a model that exists: NOT_FOUND comes first);
- greedy outputs are the same after the hostile requests as before them.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from tests.server.test_hostile import GOOD_PROMPTS, MODELS

EXAMPLES = 200
CLIENT_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
NAMES = ("text_input", "max_tokens", "sampling_param_max_tokens", "temperature", "sampling_param_temperature",
         "top_p", "top_k", "seed", "stream", "streaming", "stop", "end_id", "exclude_input_in_output",
         "sampling_parameters", "min_length", "return_finish_reason", "bogus", "")
DTYPES = ("BYTES", "INT32", "INT64", "UINT8", "UINT64", "FP32", "FP64", "BOOL", "FP16", "BF16", "STRING", "",
          "int32")
# no subnormal floats: the kernels run with flush-to-zero, where hypothesis refuses to make them
FIELDS = {"bool_contents": st.lists(st.booleans(), max_size=3),
          "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
          "int64_contents": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
          "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=3),
          "uint64_contents": st.lists(st.integers(0, 2**64 - 1), max_size=3),
          "fp32_contents": st.lists(st.floats(width=32, allow_subnormal=False), max_size=3),
          "fp64_contents": st.lists(st.floats(allow_subnormal=False), max_size=3),
          "bytes_contents": st.lists(st.one_of(st.sampled_from([p.encode() for p in GOOD_PROMPTS]),
                                               st.binary(max_size=12), st.just(b"{\"max_tokens\": 3}")),
                                     max_size=3)}
SHAPES = st.one_of(st.sampled_from([[1], [1, 1], [2], [0], [], [-1], [3, 2**62], [2**63 - 1]]),
                   st.lists(st.integers(-2, 3), max_size=3))
PARAMETERS = st.dictionaries(st.sampled_from(["max_tokens", "temperature", "stream", "seed", "priority", "bogus",
                                              "triton_enable_empty_final_response", "sequence_id"]),
                             st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1),
                                       st.floats(allow_subnormal=False), st.text(max_size=8)), max_size=2)


RAW_FORMS = {("BYTES", "bytes_contents"), ("INT32", "int_contents")}  # what the raw form is built from here


def raw_element(datatype: str, value) -> bytes:
    """A valid raw_input_contents entry for one value of `datatype` (BYTES: length-prefixed)."""
    if datatype == "BYTES":
        return len(value).to_bytes(4, "little") + value
    return int(value).to_bytes(4, "little", signed=True)


@st.composite
def requests(draw) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from([*MODELS, "nope", ""])),
                                            id=draw(st.sampled_from(["", "h1", "x" * 300])))
    good = [("text_input", "BYTES", "bytes_contents", [draw(st.sampled_from(GOOD_PROMPTS)).encode()]),
            ("max_tokens", "INT32", "int_contents", [draw(st.integers(1, 6))])]
    items = [{"name": n, "datatype": d, "shape": [1], "field": f, "values": v} for n, d, f, v in good]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["add", "edit", "edit", "drop"]))
        if kind == "add" or not items:
            field = draw(st.sampled_from(sorted(FIELDS)))
            items.append({"name": draw(st.sampled_from(NAMES)), "datatype": draw(st.sampled_from(DTYPES)),
                          "shape": draw(SHAPES), "field": field, "values": draw(FIELDS[field])})
        elif kind == "edit":
            item = draw(st.sampled_from(items))
            key = draw(st.sampled_from(["name", "datatype", "shape", "values"]))
            item[key] = draw({"name": st.sampled_from(NAMES), "datatype": st.sampled_from(DTYPES), "shape": SHAPES,
                              "values": FIELDS[item["field"]]}[key])
        else:
            items.remove(draw(st.sampled_from(items)))
    raw = draw(st.booleans()) and all((i["datatype"], i["field"]) in RAW_FORMS for i in items)
    for item in items:
        tensor = request.inputs.add(name=item["name"], datatype=item["datatype"], shape=item["shape"])
        if raw:
            request.raw_input_contents.append(b"".join(raw_element(item["datatype"], v) for v in item["values"]))
        else:
            getattr(tensor.contents, item["field"]).extend(item["values"])
    if raw and draw(st.integers(0, 5)) == 0:  # a malformed blob
        request.raw_input_contents[0] = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x01", b""]))
    for key, value in draw(PARAMETERS).items():
        parameter = request.parameters[key]
        kind = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(parameter, kind, value)
    return request


def shape_mismatch(request: service_pb2.ModelInferRequest) -> str:
    """Why a request must be INVALID_ARGUMENT for its shapes ('' if it need not be): typed contents only."""
    if request.raw_input_contents:
        return ""
    for tensor in request.inputs:
        count = sum(len(getattr(tensor.contents, f)) for f in FIELDS)
        if any(d < 0 for d in tensor.shape) or math.prod(tensor.shape) != count:
            return f"input {tensor.name!r} has shape {list(tensor.shape)} for {count} elements"
    return ""


def unary_problem(stub, request) -> str | None:
    try:
        stub.ModelInfer(request, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
        if code not in CLIENT_ERRORS:
            return f"{code}: {details}"
    reason = shape_mismatch(request)
    if reason and request.model_name in MODELS and code != grpc.StatusCode.INVALID_ARGUMENT:  # else NOT_FOUND first
        return f"{code} though {reason}"
    return None


def stream_problem(stub, request) -> str | None:
    try:
        responses = list(stub.ModelStreamInfer(iter([request]), timeout=30))
    except grpc.RpcError as err:
        return f"the stream ended {err.code()}: {err.details()}"
    errors = [r.error_message for r in responses if r.error_message]
    if errors:
        return None if len(responses) == 1 else f"{len(responses)} responses around an error: {errors}"
    if not responses or not responses[-1].infer_response.parameters["triton_final_response"].bool_param:
        return f"{len(responses)} responses, the last not final"
    if shape_mismatch(request):
        return f"answered though {shape_mismatch(request)}"
    return None


def greedy_outputs(stub) -> list[bytes]:
    outputs = []
    for prompt in GOOD_PROMPTS:
        request = service_pb2.ModelInferRequest(model_name="tensorrt_llm")
        request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
            prompt.encode())
        request.inputs.add(name="max_tokens", datatype="INT32", shape=[1]).contents.int_contents.append(8)
        outputs.append(stub.ModelInfer(request, timeout=30).raw_output_contents[0])
    return outputs


@pytest.mark.parametrize("rpc", ["ModelInfer", "ModelStreamInfer"])
def test_hostile_grpc_requests(stub, rpc):
    before = greedy_outputs(stub)
    failures, count = [], [0]
    check = unary_problem if rpc == "ModelInfer" else stream_problem

    @settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(request=requests())
    def each(request) -> None:
        count[0] += 1
        problem = check(stub, request)
        if problem:
            failures.append(f"{problem}\n    {request}".replace("\n", " "))

    each()
    assert greedy_outputs(stub) == before, "greedy outputs changed after the hostile requests"
    assert count[0] >= EXAMPLES // 2 * 0.9, f"only {count[0]} examples ran"
    assert not failures, f"{len(failures)} of {count[0]} hostile requests failed:\n" + "\n".join(failures[:20])
