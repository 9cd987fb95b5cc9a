"""KServe v2 `infer` on a generation model: the inputs (JSON or binary tensors) are read as a generate request,
the request runs to the end, and the outputs asked for come back as tensors (binary with `binary_data`).
The gRPC front end (`server/grpc/`) shares the request reading and the output tensors."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from specserve.server.errors import InputError
from specserve.server.http import read_body, with_disconnect
from specserve.server.repository import ServedModel
from specserve.server.request import ServerContext
from specserve.server.triton.binary import encode_element, output_value, parse_infer, tensor_parameters
from specserve.server.triton.generate import cancel_by_id, complete
from specserve.server.triton.protocol import (GenerateRequest, as_bool, error_response, parse_generate, request_id,
                                              resolve_model)
from specserve.server.triton.schema import OUTPUTS, Tensor

SEQUENCE_PARAMETERS = ("sequence_end", "sequence_id", "sequence_start")  # ensemble outputs sent as parameters


async def infer(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model = None
    try:
        model = resolve_model(request)
        payload, values = parse_infer(await read_body(request), request.headers.get("inference-header-content-length"))
        rid = request_id(payload)
        parameters = payload.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InputError("'parameters' must be a JSON object")
        req = infer_request(model, parameters, values, rid)
        if req.cancel:
            return cancel_by_id(ctx, req)
        if req.stream:
            raise InputError("HTTP end point doesn't support streaming responses; use generate_stream")
        binary_default = as_bool("binary_data_output", parameters.get("binary_data_output", False))
        wanted = requested_outputs(payload.get("outputs"), model, binary_default)
        outputs = await with_disconnect(request, complete(ctx, model, req))
    except Exception as exc:  # noqa: BLE001 - the server stays up
        ctx.refused(model, exc)
        return error_response(model, exc)
    if wanted is None:
        wanted = {name: binary_default for name in outputs if name in declared_outputs(model)}
    return _response(model, rid, outputs, wanted)


def infer_request(model: ServedModel, parameters: dict, values: dict, rid: str) -> GenerateRequest:
    """A KServe infer request (request parameters and {input name: flat values}) -> GenerateRequest: the inputs
    win over parameters of the same name."""
    return parse_generate({**parameters, **values}, model, rid)


def requested_outputs(requested, model: ServedModel, binary_default: bool) -> dict[str, bool] | None:
    """{output name: as binary} for the `outputs` the request names; None: every output the model produces."""
    if requested is None:
        return None
    if not isinstance(requested, list):
        raise InputError("'outputs' must be an array")
    declared = declared_outputs(model)
    wanted = {}
    for item in requested:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in declared:
            raise InputError(f"unexpected inference output '{name}' for model '{model.name}'")
        wanted[name] = as_bool("binary_data", tensor_parameters(item, "output").get("binary_data", binary_default))
    return wanted


def declared_outputs(model: ServedModel) -> dict[str, Tensor]:
    return {t.name: t for t in OUTPUTS[model.kind]}


def _response(model: ServedModel, rid: str, outputs: dict, wanted: dict[str, bool]) -> Response:
    tensors, blobs = _tensors(model, outputs, wanted)
    response = {"model_name": model.name, "model_version": model.version, "outputs": tensors}
    if rid:
        response["id"] = rid
    sequence = {name: outputs[name] for name in SEQUENCE_PARAMETERS if name in outputs}
    if sequence:
        response["parameters"] = sequence
    head = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


def _tensors(model: ServedModel, outputs: dict, wanted: dict[str, bool]) -> tuple[list[dict], list[bytes]]:
    """The output tensors of the response header and, in order, the binary blobs that follow it."""
    tensors, blobs = [], []
    for name, datatype, shape, values in output_tensors(model, outputs, wanted):
        tensor = {"name": name, "datatype": datatype, "shape": shape}
        if wanted[name]:
            blob = b"".join(encode_element(datatype, value) for value in values)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = values
        tensors.append(tensor)
    return tensors, blobs


def output_tensors(model: ServedModel, outputs: dict, names) -> list[tuple[str, str, list[int], list]]:
    """(name, datatype, shape, values) of each named output the model declares and the response has, in the
    batch dimension the model declares: one element, or a list's elements along the last declared dimension
    (the ensemble's output_log_probs: [batch, beam, tokens])."""
    declared = declared_outputs(model)
    batch = [1] if model.source.max_batch_size > 0 else []
    out = []
    for name in names:
        if name not in outputs or name not in declared:
            continue
        tensor, value = declared[name], outputs[name]
        values = value if isinstance(value, list) else [value]
        shape = batch + [1] * (len(tensor.dims) - 1) + [len(values)]
        out.append((name, tensor.datatype, shape, [output_value(tensor.datatype, v) for v in values]))
    return out
