"""`specserve serve`: Triton-compatible (KServe v2 + generate) and OpenAI-compatible HTTP, Prometheus metrics.

- runner.py      one Engine behind an asyncio interface (queue, worker thread, cancellation)
- repository.py  Triton model repository (model.yaml / model.json), load / unload, served names
- triton.py      /v2 endpoints: health, metadata, config, stats, infer, generate, generate_stream, repository
- openai_api.py  /v1 endpoints: models, completions, chat/completions
- metrics.py     nv_inference_* and vllm:spec_decode_* metrics (per-app registry)
- http.py        shared request lifetime, disconnect handling, SSE
- app.py         the Starlette apps and the uvicorn servers
"""
