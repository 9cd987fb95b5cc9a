"""`specserve profile`: a running server profiled as genai-perf profiles it, and two runs compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from specserve.cli_common import fail

profile_app = typer.Typer(add_completion=False, help="Profile a running server the way genai-perf does "
                          "(`specserve profile -m MODEL ...`), or compare two runs (`specserve profile compare`).")


def _key_values(items: list[str], flag: str, parse_values: bool) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            fail(f"{flag} takes KEY:VALUE, got {item!r}")
        value = value.strip()
        if parse_values:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[key.strip()] = value
    return out


@profile_app.callback(invoke_without_command=True)
def profile(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "-m", "--model", help="The served model's name (as in the URL)."),
    service_kind: str = typer.Option("triton", "--service-kind",
                                     help="triton (generate / generate_stream) or openai (/v1)."),
    backend: str = typer.Option("tensorrtllm", "--backend",
                                help="triton request style: tensorrtllm (LLM-API / ensemble inputs) or vllm."),
    endpoint_type: Optional[str] = typer.Option(None, "--endpoint-type",
                                                help="completions or chat (openai); kserve or generate (triton)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="Custom path, e.g. v1/completions."),
    streaming: bool = typer.Option(False, "--streaming", help="Stream the responses (TTFT, ITL)."),
    input_file: Optional[Path] = typer.Option(None, "--input-file", "--input_file",
                                              help='genai-perf JSONL: one {"text": ...} a line.'),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="Tokenizer for the token counts: a directory, a specserve model "
                                                 "name, or a HF name; default: the served model's."),
    url: str = typer.Option("localhost:8000", "--url", "-u", help="HOST:PORT of the server's HTTP port."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency",
                                              help="Requests in flight (closed loop); default 1."),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Requests per second (open loop)."),
    request_distribution: str = typer.Option("constant", "--request-distribution",
                                             help="Gaps between requests at --request-rate: constant or poisson."),
    request_count: int = typer.Option(10, "--request-count", "--num-prompts", help="Measured requests."),
    warmup_request_count: int = typer.Option(2, "--warmup-request-count", help="Unmeasured requests sent first."),
    output_tokens_mean: Optional[int] = typer.Option(None, "--output-tokens-mean", "--osl",
                                                     help="max_tokens of each request."),
    output_tokens_stddev: float = typer.Option(0.0, "--output-tokens-stddev",
                                               help="Sample max_tokens from a normal distribution (seeded)."),
    output_tokens_mean_deterministic: bool = typer.Option(
        False, "--output-tokens-mean-deterministic", help="Also send min tokens = max_tokens (exact lengths)."),
    extra_inputs: list[str] = typer.Option([], "--extra-inputs", help="KEY:VALUE added to every request "
                                                                       "(repeatable), e.g. temperature:0.7."),
    header: list[str] = typer.Option([], "--header", "-H", help="HTTP header NAME:VALUE (repeatable)."),
    profile_export_file: Path = typer.Option(Path("profile_export.json"), "--profile-export-file",
                                             help="Export file name (in the artifact directory)."),
    artifact_dir: Optional[Path] = typer.Option(None, "--artifact-dir",
                                                help="Default: artifacts/<model>-<kind>-<backend>-concurrency<N>."),
    server_metrics_url: Optional[str] = typer.Option(None, "--server-metrics-url",
                                                     help="Prometheus /metrics of the server (default: the HTTP "
                                                          "port's, else port 8002)."),
    random_seed: int = typer.Option(0, "--random-seed", help="Seed of the sampled lengths and Poisson gaps."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds before a request fails."),
) -> None:
    """Profile a running server: genai-perf's LLM metrics, console table and exports."""
    if ctx.invoked_subcommand is not None:
        return
    from specserve.bench.profile import ProfileConfig, ProfileError, console_table, run_profile

    if model is None:
        typer.echo(ctx.get_help())
        fail("give the model to profile with -m/--model")
    if input_file is None:
        fail("give the prompts with --input-file (genai-perf JSONL; `specserve convert-dataset` makes one from "
             "EAGLE's question.jsonl)")
    config = ProfileConfig(
        model=model, input_file=input_file, service_kind=service_kind, backend=backend, endpoint_type=endpoint_type,
        endpoint=("/" + endpoint.lstrip("/")) if endpoint else None, streaming=streaming, tokenizer=tokenizer,
        url=url, concurrency=concurrency, request_rate=request_rate, request_distribution=request_distribution,
        request_count=request_count, warmup_request_count=warmup_request_count,
        output_tokens_mean=output_tokens_mean, output_tokens_stddev=output_tokens_stddev,
        output_tokens_mean_deterministic=output_tokens_mean_deterministic,
        extra_inputs=_key_values(extra_inputs, "--extra-inputs", True),
        headers=_key_values(header, "--header", False), profile_export_file=profile_export_file,
        artifact_dir=artifact_dir, server_metrics_url=server_metrics_url, random_seed=random_seed,
        request_timeout=request_timeout, progress=sys.stderr.isatty())
    try:
        result = run_profile(config, echo=lambda line: typer.echo(line, err=True))
    except ProfileError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted")
    typer.echo(console_table(result))
    typer.echo(f"Exported: {result.export_file}, {result.genai_perf_json}, {result.genai_perf_csv}")
    failed = result.failed
    if failed:
        indexes = ", ".join(str(r.index) for r in failed[:10]) + (" ..." if len(failed) > 10 else "")
        typer.echo(f"error: {len(failed)} of {len(result.records)} requests failed (indexes {indexes}); first error: "
                   f"{failed[0].error}. The export is partial: its specserve.failed_requests lists them.", err=True)
        raise typer.Exit(1)


@profile_app.command("compare")
def profile_compare(
    base: Path = typer.Argument(..., help="The base model's profile export (JSON written by specserve profile)."),
    spec: Path = typer.Argument(..., help="The speculative model's profile export, same inputs."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: latency distribution and throughput."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Write the comparison as JSON."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when the outputs are not identical."),
) -> None:
    """Compare two runs over the same inputs: speedups, acceptance, identical outputs, a plot."""
    from specserve.bench.compare import CompareError, compare_runs, format_report, load_run
    from specserve.bench.compare import plot as make_plot

    try:
        base_run, spec_run = load_run(base), load_run(spec)
        report = compare_runs(base_run, spec_run)
        typer.echo(format_report(report))
        if plot:
            report["plot"] = str(make_plot(base_run, spec_run, report, plot))
            typer.echo(f"plot: {plot}")
        if json_file:
            json_file.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    except CompareError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {json_file}: {exc}")
    if strict and not report["outputs"]["all_identical"]:
        raise typer.Exit(1)
