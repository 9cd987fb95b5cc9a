"""The `specserve` command: generate, bench, serve."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from specserve.cli_common import check_output_file, fail
from specserve.cli_profile import profile_app
from specserve.config import (ConfigError, DeploymentConfig, ModelConfig, build_engine, load_model_yaml,
                              resolve_tensor_parallel_size)
from specserve.engine.engine import RequestError
from specserve.models import cpu_kernels
from specserve.models.chat_template import ChatTemplateError, read_template_file
from specserve.models.loader import DEFAULT_MODEL, ModelLoadError, load_model
from specserve.settings import check_environment
from specserve.speculative import registry
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.suffix import SCOPES as SUFFIX_SCOPES

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Speculative decoding inference: generate, bench, serve.")
USER_ERRORS = (ConfigError, ModelLoadError, RequestError, ChatTemplateError, cpu_kernels.KernelsUnavailable)
KERNELS_HELP = ("CPU kernels: auto (the fastest variant this CPU runs), scalar, avx2, avx512, amx, or off (PyTorch's "
                "own ops: slower, and not row-invariant, so speculation is no longer exactly lossless). Also "
                f"${cpu_kernels.ENV}.")


@app.callback()
def options(kernels: Optional[str] = typer.Option(None, "--kernels", help=KERNELS_HELP)) -> None:
    """Speculative decoding inference: generate, bench, serve."""
    try:
        check_environment()
    except ConfigError as exc:
        fail(str(exc))
    if kernels is not None:
        try:
            os.environ[cpu_kernels.ENV] = cpu_kernels.parse_mode(kernels, "--kernels")  # TP ranks inherit it
        except cpu_kernels.KernelsUnavailable as exc:
            fail(str(exc))


def deployment_config(model: str | None, method: str | None, draft_model: str | None, max_draft_len: int | None,
                      prompt_lookup_min: int | None, prompt_lookup_max: int | None,
                      dtype: str | None, quantization: str | None = None) -> DeploymentConfig:
    """A model.yaml (if --model names one) with the command-line flags on top."""
    if model and model.endswith((".yaml", ".yml")):
        config = load_model_yaml(Path(model))
    else:
        config = DeploymentConfig(ModelConfig(model or DEFAULT_MODEL))
    spec = config.speculative
    if method:
        spec = config.speculative = spec.with_method(method)
    for key, value in {"prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}.items():
        if value is not None:
            spec.settings[key] = value
    spec.model = draft_model or spec.model
    spec.max_draft_len = max_draft_len if max_draft_len is not None else spec.max_draft_len
    config.model.dtype = dtype or config.model.dtype
    config.model.quantization = quantization or config.model.quantization
    spec.check()
    return config


MODEL_HELP = f"{DEFAULT_MODEL} (embedded default), a checkpoint directory, a .gguf file or a model.yaml"
METHOD_HELP = f"{registry.method_help()}; default: the model.yaml's, else {registry.PLAIN}"
QUANT_HELP = ("Weight storage: gguf (a GGUF's own quantized blocks; the default for GGUF models), none (dequantized "
              "to --dtype), int8 or int4 (weight-only, per block of 32, any checkpoint).")
DRAFT_HELP = registry.model_help()
BENCH_METHODS_HELP = (f"Comma-separated: {', '.join(registry.method_names())}, hf, hf-pld, llamacpp-native "
                      "(llama.cpp's llama-server built natively: python -m specserve.bench.native_llamacpp), "
                      "llamacpp, llamacpp-pld (through llama-cpp-python: pip install 'specserve\\[llamacpp]'); "
                      f"{registry.combination_hint()}.")
TP_HELP = ("Shard the model over N ranks (tensor parallelism; the model.yaml's tensor_parallel_size otherwise). "
           "specserve starts the ranks on this host; under torchrun, every host runs the same command and the "
           "default is torchrun's WORLD_SIZE (docs/tensor-parallel.md).")


def worker_rank_or_none() -> None:
    """Under torchrun, a rank other than 0 serves no requests: it joins rank 0 and runs its shard of the model
    until rank 0 exits (same command line on every host)."""
    from specserve.parallel.group import Rendezvous, TensorParallelError, env_rank
    from specserve.parallel.worker import run_worker

    try:
        rank = env_rank()
    except TensorParallelError as exc:
        fail(str(exc))
    if rank:
        raise typer.Exit(run_worker(Rendezvous.from_env(), rank))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[str] = typer.Option(None, help=MODEL_HELP),
    method: Optional[str] = typer.Option(None, help=METHOD_HELP),
    draft_model: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    max_draft_len: Optional[int] = typer.Option(None, help="Draft tokens per step (default 4; trees: depth)."),
    prompt_lookup_min: Optional[int] = typer.Option(None, help="Prompt lookup: smallest n-gram to match."),
    prompt_lookup_max: Optional[int] = typer.Option(None, help="Prompt lookup: largest n-gram to match."),
    max_tokens: int = typer.Option(128, help="Maximum tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = no top-k."),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past end-of-sequence."),
    dtype: Optional[str] = typer.Option(None, help="auto, bfloat16 or float32."),
    quantization: Optional[str] = typer.Option(None, help=QUANT_HELP),
    tp_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", help=TP_HELP),
    json_output: bool = typer.Option(False, "--json", help='Print {"text": ..., "metrics": {...}}.'),
    chat: bool = typer.Option(False, "--chat", help="Ask the prompt as a user's message in the model's chat "
                              "template, as /v1/chat/completions does; without it the prompt is continued."),
) -> None:
    """Generate text for one prompt."""
    worker_rank_or_none()
    try:
        config = deployment_config(model, method, draft_model, max_draft_len, prompt_lookup_min,
                                   prompt_lookup_max, dtype, quantization)
        config.model.tensor_parallel_size = resolve_tensor_parallel_size(tp_size, config.model.tensor_parallel_size)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos)
        params.validate()
        engine = build_engine(config)
        if chat:
            prompt, params.stop = chat_turn(engine, prompt), [*params.stop, *engine.target.chat_stop]
        if not engine.lossless and not params.greedy:
            typer.echo("warning: typical acceptance is on: sampled output does not follow the target's "
                       "distribution exactly (not lossless)", err=True)
        if json_output:
            result = engine.generate(prompt, params)
            payload = {"text": result.text, "finish_reason": result.finish_reason, "method": engine.method_name,
                       "lossless": engine.lossless, "metrics": result.metrics.to_dict()}
            typer.echo(json.dumps(payload, ensure_ascii=False))
            return
        for event in engine.stream(prompt, params):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        m = event.result.metrics
        typer.echo(f"\n[{engine.method_name}] {m.output_tokens} tokens, {m.tokens_per_s:.1f} tok/s, "
                   f"tau {m.acceptance_length:.2f}, acceptance {m.acceptance_rate:.2f}", err=True)
    except USER_ERRORS as exc:
        fail(str(exc))
    except ValueError as exc:  # SamplingParams.validate
        fail(str(exc))


def chat_turn(engine, text: str) -> list[int]:
    """The prompt ids of `text` asked as one user message, through the model's chat template."""
    from specserve.server.openai.messages import chat_prompt

    if not getattr(engine.tokenizer, "chat_template", None):
        fail("this model has no chat template: drop --chat to have the prompt continued as text")
    return chat_prompt({"messages": [{"role": "user", "content": text}]}, engine, max_messages=1)


@app.command()
def bench(
    dataset: Path = typer.Option(..., help="question.jsonl (EAGLE/MT-bench) or genai-perf JSONL with 'text'."),
    methods: str = typer.Option(f"{registry.PLAIN},{registry.DEFAULT_METHOD},hf,hf-pld", help=BENCH_METHODS_HELP),
    num_prompts: Optional[int] = typer.Option(None, help="Use the first N prompts (default: all)."),
    max_tokens: int = typer.Option(128),
    repeat: int = typer.Option(1, min=1, help="Ask each prompt this many times in a row (a retry workload)."),
    chat: bool = typer.Option(False, "--chat", help="Ask each prompt as a user's message through the model's chat "
                                                    "template (as /v1/chat/completions does), for every method."),
    model: Optional[str] = typer.Option(None, help=MODEL_HELP),
    draft_model: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    head: list[str] = typer.Option([], help="METHOD=DIR: the head (or draft model) of one method, e.g. "
                                            "eagle3=./heads/eagle3 (repeatable; overrides --draft-model)."),
    max_draft_len: Optional[int] = typer.Option(None, help="Draft tokens per step (also hf-pld's lookup length)."),
    prompt_lookup_min: Optional[int] = typer.Option(None),
    prompt_lookup_max: Optional[int] = typer.Option(None),
    dtype: Optional[str] = typer.Option(None, help="auto, bfloat16 or float32 (hf uses the same)."),
    quantization: Optional[str] = typer.Option(None, help=QUANT_HELP),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    step_costs: bool = typer.Option(False, "--step-costs",
                                    help="Also time one target forward of 1..64 tokens (the price of verifying)."),
    tree_costs: bool = typer.Option(False, "--tree-costs",
                                    help="Also time a decoding step with EAGLE trees of 1..64 nodes drafted 1, 3 and 6 "
                                         "levels deep (drafting + verification) for each method run that sizes its "
                                         "trees, next to a plain step."),
) -> None:
    """Compare methods with plain decoding and HF transformers on one prompt set (concurrency 1, greedy)."""
    from specserve.bench.offline import PEER_METHODS, format_table, load_prompts, run_bench
    from specserve.models.chat_template import chat_texts

    check_output_file(json_file)
    try:
        names = [m.strip() for m in methods.split(",") if m.strip()]
        names = [m if m in PEER_METHODS else registry.label(m) for m in names]
        plain = registry.PLAIN  # every ratio is against plain decoding
        names = [plain] + [m for m in dict.fromkeys(names) if m != plain]
        config = deployment_config(model, None, draft_model, max_draft_len, prompt_lookup_min, prompt_lookup_max,
                                   dtype, quantization)
        heads = {}
        for item in head:
            name, sep, directory = item.partition("=")
            if not sep or not name.strip() or not directory.strip():
                fail(f"--head takes METHOD=DIR, got {item!r}")
            heads[registry.label(name)] = directory.strip()
        prompts = [prompt for prompt in load_prompts(dataset, num_prompts) for _ in range(repeat)]
        target = config.model.load()
        if chat:
            prompts = chat_texts(target.tokenizer, prompts)
        results = run_bench(config, target, prompts, names, max_tokens, heads)
    except USER_ERRORS as exc:
        fail(str(exc))
    typer.echo(format_table(results))
    for name, result in results.items():
        if "cache_bytes" in result:  # a method that keeps what it learns across requests
            typer.echo(f"{name} shared cache at the end: {result['cached_requests']} responses, "
                       f"{result['cached_tokens']} tokens, {result['cache_bytes'] / 2**20:.2f} MiB")
    costs = measure_step_costs(target) if step_costs else None
    floor = None
    if costs:
        from specserve.bench.offline import compute_rates, roofline
        typer.echo("forward ms by tokens: " + ", ".join(f"{n}: {ms:.1f}" for n, ms in costs.items()))
        rates = compute_rates(target.model, costs)
        shares = rates["share_of_peak_by_tokens"]
        typer.echo(f"multiply-adds/s by tokens (G; share of the {rates['isa']} int8 peak, "
                   f"{rates['int8_peak_gmacs']:.0f} G measured): " + ", ".join(
                       f"{n}: {g:.0f}" + (f" ({shares[n]:.0%})" if shares else "")
                       for n, g in rates["gmacs_by_tokens"].items()))
        floor = roofline(target.model)
        low, high = floor["ratio_range"]
        typer.echo(f"plain step {floor['plain_step_ms']:.1f} ms; its weights, {floor['weights_mb']:.0f} MB read "
                   f"once at {floor['read_gb_per_s']:.1f} GB/s (measured right after): {floor['roofline_ms']:.1f} ms "
                   f"(step / roofline {floor['step_over_roofline']:.2f}x, the median of {floor['rounds']} pairs; "
                   f"{low:.2f}x to {high:.2f}x)")
    trees = {}
    if tree_costs:
        from specserve.bench.offline import tree_step_costs
        for name in (n for n in names if n in registry.sized_tree_methods()):  # trees alone, no lookup branch
            trees[name] = tree_step_costs(config, target, name, heads.get(name, config.speculative.model),
                                          prompts[0])
            typer.echo(f"{name} step ms by tree nodes (plain step {trees[name]['plain']}): " + "; ".join(
                f"{depth} level{'s' * (depth > 1)} deep: " + ", ".join(f"{n}: {ms}" for n, ms in row.items())
                for depth, row in trees[name]["levels"].items()))
    if json_file:
        report = {"model": target.name, "dtype": str(target.model.dtype).removeprefix("torch."),
                  "quantization": target.model.quantization,
                  "dataset": str(dataset), "num_prompts": len(prompts), "repeat": repeat, "max_tokens": max_tokens,
                  "max_draft_len": config.speculative.draft_len, "methods": results}
        if costs:
            report["forward_ms_by_tokens"] = costs
            report["compute"] = rates
            report["roofline"] = floor
        if trees:
            report["step_ms_by_tree_nodes"] = trees
        json_file.write_text(json.dumps(report, indent=2))


BOOLEAN_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                 "off": False}


@app.command()
def serve(
    model_repository: Optional[Path] = typer.Option(
        None, "--model-repository", help="Triton model repository: <dir>/<name>/1/model.yaml (TRT-LLM LLM API) or "
                                         "<dir>/<name>/1/model.json (vLLM backend)."),
    model: Optional[str] = typer.Option(
        None, "--model", help=f"Serve one model: {MODEL_HELP}, or a vLLM model.json. Default: {DEFAULT_MODEL} with "
                              "n-gram speculation, as tensorrt_llm, ensemble, vllm_model, eagle_model and "
                              f"{DEFAULT_MODEL}."),
    http_port: int = typer.Option(8000, "--http-port", help="Triton HTTP (v2, generate) and OpenAI (/v1) port."),
    metrics_port: int = typer.Option(8002, "--metrics-port", help="Prometheus /metrics port."),
    grpc_port: int = typer.Option(8001, "--grpc-port", help="KServe v2 gRPC (Triton's GRPCInferenceService) port."),
    allow_grpc: str = typer.Option("true", "--allow-grpc", metavar="BOOL",
                                   help="false: no gRPC server (as Triton's --allow-grpc false)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    max_queue_size: int = typer.Option(64, "--max-queue-size", help="Waiting requests per model before 503."),
    model_control_mode: str = typer.Option("none", "--model-control-mode",
                                           help="none: load every model at start, refuse load/unload requests; "
                                                "explicit: only --load-model, then load/unload on request."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECSERVE_API_KEY",
                                          help="Require 'Authorization: Bearer <key>' (HTTP header, gRPC "
                                               "metadata) on every route but health and metrics."),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes",
                                                 help="Largest request body (413 above it; default 8 MiB)."),
    max_messages: Optional[int] = typer.Option(None, "--max-messages",
                                               help="Most messages in one chat request (400 above; default 1024)."),
    load_model_names: list[str] = typer.Option([], "--load-model", help="explicit mode: model to load "
                                                                         "(repeatable)."),
    chat_template: Optional[Path] = typer.Option(
        None, "--chat-template", help="Jinja chat template for /v1/chat/completions, instead of each model's own "
                                      "(checkpoint or GGUF; the embedded default has a question-and-answer format)."),
    tool_call_parser: Optional[str] = typer.Option(
        None, "--tool-call-parser", help="The models' tool-call format for tool_choice 'auto': hermes, llama3_json "
                                         "or mistral (default: the one each chat template teaches)."),
    suffix_cache_scope: Optional[str] = typer.Option(
        None, "--suffix-cache-scope", help="suffix method: model (default: requests draft from each other's "
                                           "responses) or request (a request's text is never drafted for another)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    tp_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", help=TP_HELP),
) -> None:
    """Serve models: Triton v2 + generate and OpenAI /v1 over HTTP (8000), KServe v2 gRPC (8001), Prometheus
    metrics (8002)."""
    import logging

    worker_rank_or_none()

    from specserve.server.app import SpecServer, build_repository
    from specserve.server.openai.tool_calls import MODEL_FORMATS
    from specserve.server.request import RequestLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if model_control_mode not in ("none", "explicit"):
        fail(f"--model-control-mode must be none or explicit, got {model_control_mode!r}")
    grpc_on = BOOLEAN_WORDS.get(allow_grpc.strip().lower())
    if grpc_on is None:
        fail(f"--allow-grpc must be true or false, got {allow_grpc!r}")
    if max_queue_size < 1:
        fail(f"--max-queue-size must be >= 1, got {max_queue_size}")
    given = {"max_body_bytes": max_body_bytes, "max_messages": max_messages}
    limits = RequestLimits(**{name: value for name, value in given.items() if value is not None})
    if limits.max_body_bytes < 1 or limits.max_messages < 1:
        fail("--max-body-bytes and --max-messages must be >= 1")
    if tool_call_parser not in (None, *MODEL_FORMATS):
        fail(f"--tool-call-parser must be one of {', '.join(MODEL_FORMATS)}, got {tool_call_parser!r}")
    if suffix_cache_scope not in (None, *SUFFIX_SCOPES):
        fail(f"--suffix-cache-scope must be {' or '.join(SUFFIX_SCOPES)}, got {suffix_cache_scope!r}")
    flags = {"suffix_cache_scope": suffix_cache_scope} if suffix_cache_scope else {}
    try:
        template = read_template_file(chat_template) if chat_template else None
        repository = build_repository(model_repository, model, max_queue_size, method_settings=flags,
                                      tensor_parallel_size=tp_size)
        names = list(load_model_names) if model_control_mode == "explicit" else None
        unknown = [n for n in names or [] if n not in repository.models]
        if unknown:
            fail(f"--load-model {unknown[0]!r}: no such model in the repository")
        errors = repository.load_all(names)
        if errors:
            repository.close()
            fail("; ".join(errors.values()))
        if not repository.ready_models() and model_control_mode == "none":
            fail(f"no model to serve in {model_repository}: expected <name>/1/model.yaml or <name>/1/model.json")
        server = SpecServer(repository, host=host, http_port=http_port, metrics_port=metrics_port,
                            log_level=log_level, model_control_mode=model_control_mode, api_key=api_key or None,
                            limits=limits, chat_template=template, tool_call_parser=tool_call_parser,
                            grpc_port=grpc_port if grpc_on else None)
    except USER_ERRORS as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot listen on {host}: {exc}")
    for served in repository.ready_models():
        typer.echo(f"model {served.name} ({served.kind}, {served.engine.method_name}) READY", err=True)
    typer.echo(f"Started HTTPService at {host}:{server.http_port} (Triton v2 + OpenAI /v1)", err=True)
    if grpc_on:
        typer.echo(f"Started GRPCInferenceService at {host}:{grpc_port}", err=True)
    typer.echo(f"Started Metrics Service at {host}:{server.metrics_port}", err=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass


@app.command("convert")
def convert_command(
    out: Path = typer.Argument(..., help="The HF checkpoint directory to write (must not exist)."),
    model: Optional[str] = typer.Option(None, help=MODEL_HELP.removesuffix(" or a model.yaml")),
    dtype: str = typer.Option("float32", help="Dtype of the written weights: float32, bfloat16 or float16."),
) -> None:
    """Write a model (a GGUF file's weights dequantized) as a full HF checkpoint directory, for other tools:
    specserve itself runs a GGUF from the file."""
    from specserve.models.loader import export_hf_checkpoint, parse_dtype

    if out.exists():
        fail(f"{out} exists: give a new directory")
    try:
        written = export_hf_checkpoint(model or DEFAULT_MODEL, out, parse_dtype(dtype))
    except USER_ERRORS as exc:
        fail(str(exc))
    typer.echo(f"Wrote {written}")


@app.command("convert-dataset")
def convert_dataset_command(
    input_file: Path = typer.Option(..., "--input_file", "--input-file", "-i",
                                    help="EAGLE / MT-bench question.jsonl (one question a line, with a 'turns' list)."),
    output_file: Path = typer.Option(..., "--output_file", "--output-file", "-o",
                                     help='genai-perf input JSONL to write: one {"text": turn} line per turn.'),
) -> None:
    """Convert EAGLE's question.jsonl into genai-perf's input format (the tutorials' dataset-converter.py)."""
    from specserve.bench.convert import ConvertError, convert_dataset

    try:
        count = convert_dataset(input_file, output_file)
    except ConvertError as exc:
        fail(str(exc))
    typer.echo(f"Converted dataset {input_file} and saved to {output_file} ({count} prompts)")


@app.command("distill")
def distill_command(
    out: Path = typer.Option(..., help="Token data directory (prompt + response ids; small enough to keep)."),
    features: Path = typer.Option(..., help="Where the target's features go (kilobytes per token)."),
    target: str = typer.Option(DEFAULT_MODEL, help=MODEL_HELP.removesuffix(" or a model.yaml")),
    prompts: list[Path] = typer.Option([], help="Prompt files (JSONL with text or turns, or .txt paragraphs) added "
                                                "to specserve's own general and code prompts; repeatable."),
    held_out: list[Path] = typer.Option([], help="Evaluation prompt files that no training prompt may overlap."),
    num_prompts: Optional[int] = typer.Option(None, help="Use the first N prompts of the shuffled set."),
    skip_distilled: list[Path] = typer.Option([], help="Earlier distill directories whose prompts this run skips."),
    max_tokens: int = typer.Option(128, help="Response tokens the target generates per prompt."),
    batch_size: int = typer.Option(16, help="Requests decoded together."),
    chat: bool = typer.Option(False, "--chat", help="Ask each prompt as a user's message through the target's chat "
                                                    "template: data for a head that drafts chat answers."),
) -> None:
    """Self-distillation data for head training: the target's greedy responses and its features (resumable)."""
    from specserve.train.distill import distill_tokens, saved_prompts, unseen_prompts
    from specserve.train.prompt_files import check_held_out, read_prompt_file
    from specserve.train.prompt_set import distill_prompt_set

    try:
        train_prompts = saved_prompts(out)
        if train_prompts is not None:
            typer.echo(f"resuming the prompt list saved in {out}", err=True)
        else:
            train_prompts = unseen_prompts(distill_prompt_set(list(prompts)), skip_distilled)[:num_prompts]
        check_held_out(train_prompts, [p for path in held_out for p in read_prompt_file(path)])
        model = load_model(target)
        report = distill_tokens(model, Path(target).name, train_prompts, out, features, max_tokens=max_tokens,
                                batch_size=batch_size, chat=chat)
    except (*USER_ERRORS, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(report))


@app.command("train")
def train_command(
    kind: str = typer.Argument(..., help=" or ".join(registry.train_kinds()) + "."),
    target: str = typer.Option(DEFAULT_MODEL, help=MODEL_HELP.removesuffix(" or a model.yaml")),
    prompts: Optional[Path] = typer.Option(None, help="Training prompts (JSONL with text or turns, or .txt "
                                                       "paragraphs); default: specserve's built-in set."),
    out: Path = typer.Option(..., help="Output directory: the head in its published layout, checkpoint, report."),
    data: Optional[Path] = typer.Option(None, help="Self-distillation data directory (default OUT/data); "
                                                   "reusable across methods for one target."),
    distilled: list[Path] = typer.Option([], help="Train on `specserve distill` token data (repeatable)."),
    features: list[Path] = typer.Option([], help="Each --distilled's features, in order (recomputed if missing)."),
    num_prompts: Optional[int] = typer.Option(None, help="Use the first N training prompts."),
    eval_prompts: Optional[Path] = typer.Option(None, help="Held-out evaluation prompts (default: the last 5% of "
                                                           "the training prompts, at most 20, kept out of training)."),
    max_tokens: int = typer.Option(128, help="Response tokens the target generates per prompt."),
    temperature: float = typer.Option(0.0, help="The target's sampling temperature for the responses."),
    steps: int = typer.Option(1000),
    lr: float = typer.Option(3e-4),
    batch_size: int = typer.Option(4, help="Windows per micro-batch."),
    grad_accum: int = typer.Option(1),
    seq_len: int = typer.Option(256),
    ttt_steps: int = typer.Option(3, help="EAGLE: drafting steps simulated in training (training-time test)."),
    draft_vocab_size: int = typer.Option(16384, help="The draft vocabulary (the most frequent tokens in the "
                                                     "data); EAGLE-1 scores its drafts over it at inference."),
    medusa_heads: int = typer.Option(4),
    vocab_rows_only: bool = typer.Option(False, help="medusa: write only the draft vocabulary's rows of each "
                                                     "lm_head (compact; other Medusa tools read only the full "
                                                     "published form)."),
    draft_layers: int = typer.Option(2, help="draft: decoder layers of the small draft model; dflash: of the "
                                             "block drafter."),
    block_size: int = typer.Option(8, help="dflash: the block (its given first token and the tokens drafted)."),
    anchors: int = typer.Option(16, help="dflash: blocks drawn per training window."),
    seed: int = typer.Option(0),
    dtype: Optional[str] = typer.Option(None, help="The target's dtype: auto, bfloat16 or float32."),
) -> None:
    """Train a draft head (or a small draft model) for a target by self-distillation."""
    from specserve.train.heads import TrainSettings
    from specserve.train.prompt_files import read_prompt_file
    from specserve.train.prompt_set import build_prompt_set
    from specserve.train.run import run_training, train_distilled

    if kind not in registry.train_kinds():
        fail(f"unknown head kind {kind!r}; choose {', '.join(registry.train_kinds())}")
    try:
        train_prompts = read_prompt_file(prompts) if prompts else build_prompt_set()
        held_out = read_prompt_file(eval_prompts) if eval_prompts else None
        if num_prompts:
            train_prompts = train_prompts[:num_prompts]
        settings = TrainSettings(kind=kind, steps=steps, lr=lr, batch_size=batch_size, grad_accum=grad_accum,
                                 seq_len=seq_len, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size,
                                 medusa_heads=medusa_heads, draft_layers=draft_layers, block_size=block_size,
                                 anchors=anchors, seed=seed,
                                 vocab_rows_only=vocab_rows_only)
        # the trainers read the target's embedding and lm_head as dense tables: train on the dequantized weights
        model = load_model(target, dtype=dtype, quantization="none")
        if distilled:
            if not features or held_out is None:
                fail("--distilled needs --features and --eval-prompts")
            report = train_distilled(model, load_model(target, dtype=dtype), kind, distilled, features, out,
                                     held_out, settings, max_tokens, echo=lambda text: typer.echo(text, err=True))
        else:
            report = run_training(model, kind, train_prompts, out, data, held_out, max_tokens, temperature,
                                  settings, echo=lambda text: typer.echo(text, err=True))
    except (*USER_ERRORS, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc} (nothing half-written is kept: run the same command again to resume)")
    typer.echo(json.dumps({k: report[k] for k in ("kind", "train_prompts", "train_tokens", "data_seconds",
                                                  "train_seconds") if k in report} | {"eval": report.get("eval")}))


app.add_typer(profile_app, name="profile")


def measure_step_costs(target) -> dict[int, float]:
    """Milliseconds of one target forward of n new tokens (all with logits) in one row, empty context."""
    from specserve.models.step_costs import StepCosts

    costs = StepCosts(target.model, rows=1)
    return {size: round(seconds * 1e3, 2) for size, seconds in zip(costs.sizes, costs.seconds)}


def main() -> None:
    app()


if __name__ == "__main__":
    main()
