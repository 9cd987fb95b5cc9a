"""KServe v2 gRPC messages <-> the values the Triton front end reads and writes.

A `ModelInferRequest` carries each input either in `raw_input_contents` (one little-endian blob per input, BYTES
elements length-prefixed: the HTTP binary extension's form, so `triton/binary.py` decodes it) or in the typed
`contents` field of its datatype; both become the {input name: flat list of values} that HTTP `infer` hands to
`triton.protocol.parse_generate`. Outputs go back in `raw_output_contents`, as Triton's gRPC endpoint sends them.
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from specserve.server.errors import InputError
from specserve.server.repository import ServedModel
from specserve.server.triton.binary import check_shape, decode_binary, decode_text, encode_element
from specserve.server.triton.infer import SEQUENCE_PARAMETERS, output_tensors

# the InferTensorContents field each datatype's typed data is in (FP16 / BF16 have none: raw only)
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
FINAL_RESPONSE = "triton_final_response"  # the response parameter Triton's streams flag their last response with


def parameter_value(parameter):
    """An InferParameter / ModelRepositoryParameter -> its Python value (None when unset)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def parameters_dict(parameters) -> dict:
    return {key: parameter_value(value) for key, value in parameters.items()}


def input_values(request: service_pb2.ModelInferRequest) -> dict[str, list]:
    """{input name: flat list of values} from the raw or typed contents; InputError says which input is wrong."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InputError(f"expected {len(request.inputs)} raw_input_contents (one per input, or none), got "
                         f"{len(raw)}")
    values = {}
    for index, tensor in enumerate(request.inputs):
        name, datatype = tensor.name, tensor.datatype.upper()
        if name in values:
            raise InputError(f"input '{name}' is given more than once")
        if raw:
            if tensor.HasField("contents"):
                raise InputError(f"input '{name}': contents and raw_input_contents cannot both be given")
            values[name] = decode_binary(name, datatype, raw[index])
        else:
            values[name] = _typed_values(name, datatype, tensor.contents)
        check_shape(name, list(tensor.shape), len(values[name]))
    return values


def _typed_values(name: str, datatype: str, contents) -> list:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InputError(f"unsupported datatype '{datatype}' for input '{name}' (raw_input_contents only)"
                         if datatype in ("FP16", "BF16") else f"unsupported datatype '{datatype}' for input '{name}'")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InputError(f"input '{name}' is {datatype}: its data belongs in contents.{field}, got "
                         f"contents.{others[0]}")
    data = list(getattr(contents, field))
    if datatype == "BYTES":
        return [decode_text(name, item) for item in data]
    return data


def requested_output_items(request: service_pb2.ModelInferRequest) -> list[dict] | None:
    """The request's `outputs` in the HTTP body's form (what `triton.infer.requested_outputs` reads); None: all."""
    return [{"name": o.name} for o in request.outputs] if request.outputs else None


def infer_response(model: ServedModel, request_id: str, outputs: dict, names,
                   final: bool | None = None) -> service_pb2.ModelInferResponse:
    """The response holding the named outputs (raw contents), the ensemble's sequence parameters and, for a
    stream's responses, `triton_final_response`."""
    response = service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    for name, datatype, shape, values in output_tensors(model, outputs, names):
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(b"".join(encode_element(datatype, value) for value in values))
    for name in SEQUENCE_PARAMETERS:
        if name in outputs:
            set_parameter(response.parameters[name], outputs[name])
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def set_parameter(parameter, value) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)
