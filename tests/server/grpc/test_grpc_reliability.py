"""Over gRPC as over HTTP: the API key (`authorization: Bearer <key>` metadata) on every RPC but ServerLive /
ServerReady, load / unload refused outside explicit model-control mode, and the body limit."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.server.grpc.conftest import client_for, inputs, stream, text
from tests.server.test_reliability import locked  # noqa: F401 - the fixture: API key "s3cret", 4 KiB bodies

KEY = {"authorization": "Bearer s3cret"}


@pytest.fixture()
def locked_stub(locked):  # noqa: F811
    with grpc.insecure_channel(locked.grpc_address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_the_api_key_is_required(locked, locked_stub):  # noqa: F811
    request = service_pb2.ModelInferRequest(
        model_name="plain", inputs=[service_pb2.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1])], raw_input_contents=[b"\x04\x00\x00\x00Once"])
    calls = [lambda md: locked_stub.ModelInfer(request, metadata=md, timeout=30),
             lambda md: locked_stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="plain"), metadata=md),
             lambda md: locked_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=md),
             lambda md: list(locked_stub.ModelStreamInfer(iter([request]), metadata=md, timeout=30))]
    for call in calls:
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            with pytest.raises(grpc.RpcError) as err:
                call(metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()
        assert call(tuple(KEY.items()))
    with client_for(locked) as client:
        assert client.is_server_live() and client.is_server_ready()  # open, as HTTP's health routes
        with pytest.raises(InferenceServerException) as err:
            client.is_model_ready("plain")
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        assert text(client.infer("plain", inputs(text_input="Once", sampling_param_max_tokens=2), headers=KEY))
        responses = stream(client, "plain", [(inputs(text_input="Once", sampling_param_max_tokens=2), "k")],
                           headers=KEY)
        assert len(responses) == 1 and responses[0][1] is None


@pytest.mark.parametrize("action", ["load_model", "unload_model"])
def test_load_and_unload_are_refused_outside_explicit_mode(locked, action):  # noqa: F811
    with client_for(locked) as client:
        with pytest.raises(InferenceServerException) as err:
            getattr(client, action)("plain", headers=KEY)
        assert err.value.status() == "StatusCode.UNAVAILABLE"
        assert err.value.message() == "explicit model load / unload is not allowed if polling is enabled"
        assert client.is_model_ready("plain", headers=KEY)


def test_a_message_over_the_body_limit_is_resource_exhausted(locked):  # noqa: F811
    with client_for(locked) as client:
        with pytest.raises(InferenceServerException) as err:
            client.infer("plain", inputs(text_input="x " * 4000, sampling_param_max_tokens=2), headers=KEY)
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert text(client.infer("plain", inputs(text_input="Once", sampling_param_max_tokens=2), headers=KEY))
