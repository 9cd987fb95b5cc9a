"""`specserve serve`: Triton-compatible (KServe v2 + generate) and OpenAI-compatible HTTP, KServe v2 gRPC,
Prometheus metrics.

- app.py         the Starlette apps (HTTP, metrics), the uvicorn servers and the gRPC server in one event loop
- triton/        /v2: schema, protocol, generate, infer, binary (tensor codec), admin (health, metadata, repository)
- openai/        /v1: protocol (request fields, bodies, errors), serving (endpoints)
- grpc/          Triton's GRPCInferenceService over triton/'s code: service (RPCs), tensors, status (codes, API key)
- request.py     what every front end does with a request: SamplingParams from its fields, submission to the
                 runner with metrics and cancel-by-id tracking (ServerContext)
- errors.py      every user-facing exception -> HTTP status and metrics failure reason
- http.py        JSON bodies, client-disconnect detection, SSE responses
- runner.py      one Engine behind an asyncio interface (queue, continuous batching, the request handle)
- compute.py     the one thread all tensor work runs on
- repository.py  Triton model repository (model.yaml / model.json), load / unload, served names
- metrics.py     nv_inference_* and vllm:spec_decode_* metrics (per-app registry)

A request: route (triton/, openai/ or a grpc/ RPC) -> protocol parses it -> request.sampling_params ->
ServerContext.submit -> Runner (its BatchEngine steps in slices on the compute thread) -> RequestHandle events ->
the protocol's response.
"""
