"""The KServe binary tensor codec on its own: a JSON header, then each input's raw little-endian bytes."""

from __future__ import annotations

import json
import struct

import pytest

from specserve.server.errors import InputError
from specserve.server.triton.binary import encode_element, output_value, parse_infer


def body(inputs: list[dict], blobs: list[bytes]) -> tuple[bytes, str]:
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(blobs), str(len(head))


def test_binary_and_json_inputs_decode():
    text = encode_element("BYTES", "héllo")
    data, header_length = body([
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(text)}},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1], "parameters": {"binary_data_size": 4}},
        {"name": "temperature", "datatype": "FP32", "shape": [1, 1], "data": [[0.5]]}],
        [text, struct.pack("<i", 7)])
    payload, values = parse_infer(data, header_length)
    assert values == {"text_input": ["héllo"], "max_tokens": [7], "temperature": [0.5]}
    assert len(payload["inputs"]) == 3


@pytest.mark.parametrize("inputs,blobs,header,fragment", [
    ([{"name": "a", "datatype": "INT32", "parameters": {"binary_data_size": 3}}], [b"\0\0\0"], None,
     "not a whole number"),
    ([{"name": "a", "datatype": "BYTES", "parameters": {"binary_data_size": 8}}], [b"\x09\0\0\0abcd"], None,
     "malformed"),
    ([{"name": "a", "datatype": "INT32", "parameters": {"binary_data_size": 8}}], [b"\0\0\0\0"], None, "exceeds"),
    ([{"name": "a", "datatype": "BYTES"}], [], None, "no data"),
    ([], [], "99999", "larger than the body"),
])
def test_malformed_bodies_are_refused(inputs, blobs, header, fragment):
    data, header_length = body(inputs, blobs)
    with pytest.raises(InputError, match=fragment):
        parse_infer(data, header or header_length)


def test_output_values_follow_the_declared_datatype():
    assert output_value("BYTES", 3) == "3" and output_value("FP32", 1) == 1.0 and output_value("INT32", "4") == 4
    assert encode_element("INT64", 5) == struct.pack("<q", 5)
    assert encode_element("BYTES", "ab") == b"\x02\0\0\0ab"
