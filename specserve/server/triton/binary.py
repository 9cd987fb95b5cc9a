"""The KServe v2 binary tensor data extension: an infer request body is a JSON header
(`Inference-Header-Content-Length` bytes long) followed by the raw bytes of the inputs that declare a
`binary_data_size`; outputs asked for with `binary_data` come back the same way. BYTES elements are each a
little-endian uint32 length and the bytes; numbers are little-endian.
"""

from __future__ import annotations

import math
import struct

from specserve.server.errors import InputError
from specserve.server.http import parse_json

NUMERIC = {"BOOL": "?", "INT8": "b", "UINT8": "B", "INT16": "h", "UINT16": "H", "INT32": "i", "UINT32": "I",
           "INT64": "q", "UINT64": "Q", "FP32": "f", "FP64": "d"}


def decode_binary(name: str, datatype: str, raw: bytes) -> list:
    """One input's raw bytes -> its elements (str for BYTES); KServe gRPC's raw_input_contents use the same form."""
    if datatype == "BYTES":
        return _decode_strings(name, raw)
    code = NUMERIC.get(datatype)
    if code is None:
        raise InputError(f"unsupported datatype {datatype} for input '{name}'")
    size = struct.calcsize(code)
    if len(raw) % size:
        raise InputError(f"binary data for input '{name}' is not a whole number of {datatype} elements")
    return [v for (v,) in struct.iter_unpack("<" + code, raw)]


def _decode_strings(name: str, raw: bytes) -> list[str]:
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InputError(f"malformed binary data for input '{name}'")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        chunk = raw[offset:offset + length]
        if len(chunk) != length:
            raise InputError(f"malformed binary data for input '{name}'")
        offset += length
        items.append(decode_text(name, chunk))
    return items


def decode_text(name: str, raw: bytes) -> str:
    """One BYTES element as text: the inputs read as strings are prompts, stop words and JSON."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"input '{name}' is not valid UTF-8") from None


def _flatten(data) -> list:
    if not isinstance(data, list):
        return [data]
    out = []
    for item in data:
        out.extend(_flatten(item))
    return out


def parse_infer(body: bytes, header_length: str | None) -> tuple[dict, dict]:
    """An infer request body -> (the JSON header, {input name: flat list of values})."""
    head, binary = _split(body, header_length)
    payload = parse_json(head)
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise InputError("the infer request must be a JSON object with an 'inputs' array")
    return payload, _input_values(payload["inputs"], binary)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tail) by the Inference-Header-Content-Length header; all JSON without it."""
    if header_length is None:
        return body, b""
    try:
        split = int(header_length)
    except ValueError:
        raise InputError("Inference-Header-Content-Length must be an integer") from None
    if split < 0 or split > len(body):
        raise InputError("Inference-Header-Content-Length is larger than the body")
    return body[:split], body[split:]


def tensor_parameters(tensor: dict, kind: str) -> dict:
    """An input's or output's `parameters` object ({} when absent); InputError when it is not an object."""
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InputError(f"the parameters of {kind} '{tensor.get('name')}' must be a JSON object")
    return parameters


def _input_values(tensors: list, binary: bytes) -> dict:
    values, offset = {}, 0
    for tensor in tensors:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InputError("each input must be an object with a 'name'")
        name, datatype = tensor["name"], str(tensor.get("datatype", "BYTES")).upper()
        if name in values:  # which one counts would be a guess (gRPC refuses it too)
            raise InputError(f"input '{name}' is given more than once")
        size = tensor_parameters(tensor, "input").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InputError(f"binary_data_size of input '{name}' exceeds the body")
            values[name] = decode_binary(name, datatype, binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            values[name] = _flatten(tensor["data"])
        else:
            raise InputError(f"input '{name}' has no data")
        check_shape(name, tensor.get("shape"), len(values[name]))
    return values


def check_shape(name: str, shape, elements: int) -> None:
    """A tensor's declared shape must hold exactly its elements (KServe v2 requires the shape)."""
    if shape is None:
        raise InputError(f"input '{name}' has no 'shape'")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InputError(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    if math.prod(shape) != elements:
        raise InputError(f"input '{name}': shape {shape} holds {math.prod(shape)} elements, but the data has "
                         f"{elements}")


def encode_element(datatype: str, value) -> bytes:
    """One output element in the binary form."""
    if datatype == "BYTES":
        raw = str(value).encode()
        return struct.pack("<I", len(raw)) + raw
    return struct.pack("<" + NUMERIC[datatype], value)


def output_value(datatype: str, value):
    """An output as the JSON value of its declared datatype."""
    if datatype == "BYTES":
        return str(value)
    if datatype.startswith("FP"):
        return float(value)
    if datatype == "BOOL":
        return bool(value)
    return int(value)

