"""The model inputs and outputs each Triton backend declares (its config.pbtxt), and the metadata and config
documents built from them. Used by `/v2/models/<m>`, `/v2/models/<m>/config` and `infer` (output datatypes).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.server.repository import ENSEMBLE, LLMAPI, VLLM, ServedModel


@dataclass(frozen=True)
class Tensor:
    """One declared input or output."""

    name: str
    datatype: str  # KServe datatype: BYTES, BOOL, INT32, UINT64, FP32, ...
    dims: tuple[int, ...] = (1,)
    optional: bool = True


def _t(name, datatype, dims=(1,), optional=True):
    """Shorthand that keeps the tables below one tensor per item."""
    return Tensor(name, datatype, tuple(dims), optional)


PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
INPUTS = {
    LLMAPI: [_t("text_input", "BYTES", (-1,), False), _t("streaming", "BOOL"),
             _t("sampling_param_best_of", "INT32"), _t("sampling_param_temperature", "FP32"),
             _t("sampling_param_top_k", "INT32"), _t("sampling_param_top_p", "FP32"),
             _t("sampling_param_frequency_penalty", "FP32"), _t("sampling_param_presence_penalty", "FP32"),
             _t("sampling_param_max_tokens", "INT32"), _t("sampling_param_stop", "BYTES", (-1,)),
             _t("sampling_param_seed", "UINT64"), _t("sampling_param_exclude_input_from_output", "BOOL"),
             _t("sampling_param_return_perf_metrics", "BOOL"), _t("return_finish_reason", "BOOL"),
             _t("return_stop_reason", "BOOL"), _t("return_cumulative_logprob", "BOOL"), _t("stop", "BOOL"),
             # aliases genai-perf's tensorrtllm payloads use (max_tokens, exclude_input_in_output, stream)
             _t("max_tokens", "INT32"), _t("exclude_input_in_output", "BOOL"), _t("stream", "BOOL"),
             _t("min_length", "INT32")],
    VLLM: [_t("text_input", "BYTES", (1,), False), _t("image", "BYTES", (-1,)), _t("stream", "BOOL"),
           _t("sampling_parameters", "BYTES"), _t("exclude_input_in_output", "BOOL"),
           _t("return_finish_reason", "BOOL"), _t("return_cumulative_logprob", "BOOL"),
           _t("return_logprobs", "BOOL"), _t("return_num_input_tokens", "BOOL"),
           _t("return_num_output_tokens", "BOOL")],
    ENSEMBLE: [_t("text_input", "BYTES", (1,), False), _t("max_tokens", "INT32", (1,), False),
               _t("bad_words", "BYTES", (-1,)), _t("stop_words", "BYTES", (-1,)),
               _t("exclude_input_in_output", "BOOL"), _t("end_id", "INT32"), _t("pad_id", "INT32"),
               _t("top_k", "INT32"), _t("top_p", "FP32"), _t("temperature", "FP32"),
               _t("length_penalty", "FP32"), _t("repetition_penalty", "FP32"), _t("min_tokens", "INT32"),
               _t("presence_penalty", "FP32"), _t("frequency_penalty", "FP32"), _t("seed", "UINT64"),
               _t("return_log_probs", "BOOL"), _t("return_context_logits", "BOOL"),
               _t("return_generation_logits", "BOOL"), _t("return_perf_metrics", "BOOL"),
               _t("return_num_input_tokens", "BOOL"), _t("return_num_output_tokens", "BOOL"),
               _t("beam_width", "INT32"), _t("num_return_sequences", "INT32"), _t("stream", "BOOL")],
}
OUTPUTS = {
    LLMAPI: [_t("text_output", "BYTES", (-1,)), _t("finish_reason", "BYTES", (-1,)),
             _t("stop_reason", "BYTES", (-1,)), _t("cumulative_logprob", "BYTES", (-1,))]
            + [_t(n, "BYTES", (-1,)) for n in PERF_OUTPUTS],
    VLLM: [_t("text_output", "BYTES", (-1,)), _t("finish_reason", "BYTES", (-1,)),
           _t("cumulative_logprob", "FP32", (-1,)), _t("logprobs", "BYTES", (-1,)),
           _t("num_input_tokens", "UINT32", (1,)), _t("num_output_tokens", "UINT32", (-1,))],
    ENSEMBLE: [_t("text_output", "BYTES", (-1,)), _t("cum_log_probs", "FP32", (-1,)),
               _t("output_log_probs", "FP32", (-1, -1)), _t("batch_index", "INT32"),
               _t("sequence_index", "INT32")]
              + [_t(n, "INT64") for n in PERF_OUTPUTS[:4]]
              + [_t("acceptance_rate", "FP32"), _t("total_accepted_draft_tokens", "INT32"),
                 _t("total_draft_tokens", "INT32"), _t("num_input_tokens", "INT32"),
                 _t("num_output_tokens", "INT32")],
}
CONFIG_TYPES = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64"}


def model_metadata(model: ServedModel) -> dict:
    batch = (-1,) if model.source.max_batch_size > 0 else ()

    def tensors(items):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(batch + t.dims)} for t in items]

    return {"name": model.name, "versions": [model.version], "platform": model.source.platform,
            "inputs": tensors(INPUTS[model.kind]), "outputs": tensors(OUTPUTS[model.kind])}


def model_config(model: ServedModel) -> dict:
    source, engine = model.source, model.engine
    config = source.config
    parameters = {"speculative_method": engine.method_name, "max_draft_len": str(engine.max_draft_len),
                  "model": str(config.model.source), "max_model_len": str(engine.max_model_len)}
    if config.speculative.model:
        parameters["speculative_model"] = str(config.speculative.model)
    return {
        "name": model.name, "platform": source.platform, "backend": source.backend,
        "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": source.max_batch_size,
        "input": [{"name": t.name, "data_type": CONFIG_TYPES[t.datatype], "format": "FORMAT_NONE",
                   "dims": list(t.dims), "is_shape_tensor": False, "allow_ragged_batch": False,
                   "optional": t.optional} for t in INPUTS[model.kind]],
        "output": [{"name": t.name, "data_type": CONFIG_TYPES[t.datatype], "dims": list(t.dims),
                    "label_filename": "", "is_shape_tensor": False} for t in OUTPUTS[model.kind]],
        "instance_group": [{"name": f"{model.name}_0", "kind": "KIND_CPU", "count": 1, "gpus": []}],
        "dynamic_batching": {"default_queue_policy": {"max_queue_size": str(source.max_queue_size)}},
        "model_transaction_policy": {"decoupled": source.decoupled},
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }


