"""`specserve profile`: a genai-perf-compatible LLM profiler over HTTP.

It sends the prompts of a genai-perf input file (`{"text": ...}` lines) to a running server -- Triton `generate` /
`generate_stream` (service kind triton, TRT-LLM or vLLM request style) or OpenAI `/v1/completions` /
`/v1/chat/completions` (service kind openai) -- at a fixed concurrency (closed loop) or request rate (open loop),
and computes genai-perf's LLM metrics from the client-side timestamps exactly as genai-perf does
(`genai_perf/profile_data_parser/llm_profile_data_parser.py`, `metrics/statistics.py`):

- request_latency = last response - request start; time_to_first_token = first response - request start;
  time_to_second_token = second response - first response
- output_sequence_length = tokens of the concatenated response texts, input_sequence_length = tokens of the prompt,
  both counted with the client-side tokenizer (no special tokens)
- inter_token_latency = (request_latency - ttft) / (OSL - 1) (more than one response and OSL > 1);
  output_token_throughput_per_user = 1 / ITL
- output_token_throughput = sum(OSL) / benchmark duration, request_throughput = requests / benchmark duration,
  benchmark duration = last response of any request - first request start
- responses without text are dropped before timing (the role chunk, the finish chunk, `[DONE]`); a request
  without any text is left out of the per-request statistics but counted in request_throughput
- statistics: avg, min, max, std, p1 ... p99 (numpy, linear interpolation); times in ms

Exports (into the artifact directory): the profile export file in perf_analyzer's schema (`experiments[].requests[]`
with `timestamp`, `request_inputs`, `response_timestamps`, `response_outputs`) plus a `specserve` block per request
(input hash, output text, token counts, server-reported perf metrics, error) and for the run (inputs hash, summary,
failed requests); `<stem>_genai_perf.json` and `<stem>_genai_perf.csv` in genai-perf's layout.

The package, one module a job: `config` (the flags and their checks), `inputs` (the input file and the planned
requests), `metrics` (genai-perf's metrics and statistics, the server's spec-decode counters), `clients` (each
service kind's request style, sending, the pre-flight checks and the tokenizer), `run` (the warm-up and the
measured run) and `exports` (the export files and the console table).
"""

from specserve.bench.profile.clients import Style, openai_style, triton_style
from specserve.bench.profile.config import ProfileConfig, ProfileError
from specserve.bench.profile.exports import console_table, export_document, metric_label, write_exports
from specserve.bench.profile.inputs import PlannedRequest, load_input_file, plan_requests
from specserve.bench.profile.metrics import Clock, RequestRecord, aggregate, perf_summary, request_metrics, statistics
from specserve.bench.profile.result import ProfileResult
from specserve.bench.profile.run import run_profile, run_requests

__all__ = ["Clock", "PlannedRequest", "ProfileConfig", "ProfileError", "ProfileResult", "RequestRecord", "Style",
           "aggregate", "console_table", "export_document", "load_input_file", "metric_label", "openai_style",
           "perf_summary", "plan_requests", "request_metrics", "run_profile", "run_requests", "statistics",
           "triton_style", "write_exports"]
