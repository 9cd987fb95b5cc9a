"""`specserve serve`: Triton-compatible (KServe v2 + generate) and OpenAI-compatible HTTP, Prometheus metrics.

- app.py         the Starlette apps (HTTP, metrics) and the uvicorn servers
- triton/        /v2: schema, protocol, generate, infer, binary (tensor codec), admin (health, metadata, repository)
- openai/        /v1: protocol (request fields, bodies, errors), serving (endpoints)
- request.py     what every front end does with a request: SamplingParams from its fields, submission to the
                 runner with metrics and cancel-by-id tracking (ServerContext)
- errors.py      every user-facing exception -> HTTP status and metrics failure reason
- http.py        JSON bodies, client-disconnect detection, SSE responses
- runner.py      one Engine behind an asyncio interface (queue, continuous batching, the request handle)
- compute.py     the one thread all tensor work runs on
- repository.py  Triton model repository (model.yaml / model.json), load / unload, served names
- metrics.py     nv_inference_* and vllm:spec_decode_* metrics (per-app registry)

A request: route (triton/ or openai/) -> protocol parses it -> request.sampling_params -> ServerContext.submit ->
Runner (worker thread, BatchEngine steps on the compute thread) -> RequestHandle events -> the protocol's response.
"""
