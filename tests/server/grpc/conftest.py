"""tritonclient.grpc clients for the servers of tests/server/conftest.py (each runs gRPC on a free port) and the
helpers the gRPC tests share: input tensors, raw ModelInferRequests, and a stream's responses collected."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

NUMPY_TYPES = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
               "FP64": np.float64}


def kind_of(value) -> str:
    if isinstance(value, str):
        return "BYTES"
    if isinstance(value, bool):
        return "BOOL"
    return "INT32" if isinstance(value, int) else "FP32"


def tensor(name: str, value, datatype: str | None = None) -> grpcclient.InferInput:
    """One input of one element, [1] shaped, as tritonclient sends it (raw_input_contents)."""
    datatype = datatype or kind_of(value)
    array = np.array([value], dtype=object if datatype == "BYTES" else NUMPY_TYPES[datatype])
    item = grpcclient.InferInput(name, [1], datatype)
    item.set_data_from_numpy(array)
    return item


def inputs(**values) -> list[grpcclient.InferInput]:
    return [tensor(name, value) for name, value in values.items()]


def text(result, name: str = "text_output") -> str:
    return result.as_numpy(name).reshape(-1)[0].decode()


def client_for(running, **options) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(running.grpc_address, **options)


@pytest.fixture()
def client(server):
    c = client_for(server)
    yield c
    c.close()


@pytest.fixture()
def stub(server):
    """The generated stub on a plain channel: requests tritonclient would not build (typed contents, bad ones)."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def stream(client, model: str, requests: list[tuple[list, str]], headers: dict | None = None) -> list[tuple]:
    """Send the requests on one stream, half-close it, and return every (result, error) the callback received."""
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)), headers=headers)
    for request_inputs, request_id in requests:
        client.async_stream_infer(model, request_inputs, request_id=request_id)
    client.stop_stream()  # waits until the server has answered every request and ended the stream
    return [received.get_nowait() for _ in range(received.qsize())]


def final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def raw_request(model: str, *items, **fields) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest from (name, datatype, shape, contents field, values) items (typed contents)."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    for name, datatype, shape, field, values in items:
        item = request.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(item.contents, field).extend(values)
    return request
