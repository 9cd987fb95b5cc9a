"""`specserve profile`'s run: the warm-up and the measured requests at a fixed concurrency or request rate, then the
metrics and the exports."""

from __future__ import annotations

import asyncio
import random
import sys
from typing import Callable
from urllib.parse import urlsplit

import httpx

from specserve.bench.profile.clients import ServerGone, Style, check_server, load_tokenizer, make_record, send_request
from specserve.bench.profile.config import ProfileConfig, ProfileError
from specserve.bench.profile.exports import write_exports
from specserve.bench.profile.inputs import load_input_file, plan_requests
from specserve.bench.profile.metrics import (Clock, RequestRecord, aggregate, perf_summary, request_metrics, scrape,
                                             spec_delta)
from specserve.bench.profile.result import ProfileResult


def run_profile(config: ProfileConfig, echo: Callable[[str], None] = lambda s: None) -> ProfileResult:
    """The whole run: inputs, pre-flight, warm-up, measurement, metrics, exports. Raises ProfileError before the
    measurement; a measurement with failed requests returns a result whose `failed` is non-empty (the exports say
    which)."""
    config.normalize()
    prompts = load_input_file(config.input_file)
    return asyncio.run(_run(config, prompts, echo))


async def _run(config: ProfileConfig, prompts: list[str], echo) -> ProfileResult:
    base = config.base_url()
    directory, export_file = config.artifact_paths()
    limits = httpx.Limits(max_connections=max(config.concurrency or 0, 64), max_keepalive_connections=64)
    timeout = httpx.Timeout(config.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits, headers=config.headers) as client:
        style, parameters = await check_server(client, config, base)
        tokenizer, tokenizer_name = await asyncio.to_thread(load_tokenizer, config.tokenizer, parameters,
                                                            config.model)
        warmup, measured = plan_requests(prompts, config)
        clock = Clock()
        if warmup:
            echo(f"warm-up: {len(warmup)} request(s)")
            records = [make_record(r, style, config) for r in warmup]
            await run_requests(client, style, records, config, clock, concurrency=config.concurrency or 1)
            bad = [r for r in records if r.error]
            if len(bad) == len(records):
                raise ProfileError(f"the warm-up request failed, so the run was not started: {bad[0].error}")
        metrics_urls = ([config.server_metrics_url] if config.server_metrics_url else
                        [f"{base}/metrics", f"{urlsplit(base).scheme}://{urlsplit(base).hostname}:8002/metrics"])
        metrics_url, before = await scrape(client, metrics_urls, config.model)
        records = [make_record(r, style, config) for r in measured]
        bar = None
        if config.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records), desc="Profiling", unit="req", file=sys.stderr, leave=False)
        mode, value = config.load_mode
        try:
            await run_requests(client, style, records, config, clock,
                               on_done=(lambda r: bar.update(1)) if bar else None,
                               concurrency=config.concurrency, rate=config.request_rate)
        finally:
            if bar:
                bar.close()
        window = (min(r.timestamp for r in records if r.timestamp) if any(r.timestamp for r in records) else 0,
                  clock.now())
        after = (await scrape(client, [metrics_url], config.model))[1] if metrics_url else {}
    server_spec = spec_delta(before, after)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    per_request, input_tokens, output_tokens = [], [], []
    for record in records:
        input_tokens.append(count(record.prompt))
        metrics = None
        if not record.error:
            metrics = request_metrics(record.timestamp, record.response_timestamps, record.texts, input_tokens[-1],
                                      count)
        per_request.append(metrics)
        output_tokens.append(metrics["output_sequence_length"] if metrics else (0 if not record.error else None))
    ok = [r for r, m in zip(records, per_request) if m]
    first = min((r.timestamp for r in ok), default=None)
    last = max((r.response_timestamps[-1] for r in ok), default=None)
    succeeded = sum(1 for r in records if not r.error)
    stats = aggregate(per_request, succeeded, first, last)
    result = ProfileResult(config, records, stats, per_request, input_tokens, output_tokens, server_spec,
                           perf_summary(records), export_file, directory / f"{export_file.stem}_genai_perf.json",
                           directory / f"{export_file.stem}_genai_perf.csv", style, tokenizer_name, window)
    write_exports(result)
    return result


async def run_requests(client: httpx.AsyncClient, style: Style, records: list[RequestRecord], config: ProfileConfig,
                       clock: Clock, on_done: Callable[[RequestRecord], None] | None = None,
                       concurrency: int | None = None, rate: float | None = None) -> None:
    """Closed loop (`concurrency` workers, each sending its next request when the last one finished) or open loop
    (`rate` requests per second, constant or Poisson gaps). Once the server is unreachable the remaining requests are
    not sent."""
    gone: list[str] = []

    async def one(record: RequestRecord) -> None:
        if gone:
            record.error = f"not sent: the server became unreachable ({gone[0]})"
        else:
            try:
                await send_request(client, style, record, clock)
            except ServerGone as exc:
                gone.append(str(exc))
        if on_done:
            on_done(record)

    if rate is None:
        pending = iter(records)

        async def worker() -> None:
            for record in pending:
                await one(record)

        await asyncio.gather(*(worker() for _ in range(min(concurrency or 1, len(records)))))
        return
    rng = random.Random(config.random_seed)
    loop = asyncio.get_running_loop()
    start = loop.time()
    offset = 0.0
    tasks = []
    for record in records:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(record)))
        offset += rng.expovariate(rate) if config.request_distribution == "poisson" else 1.0 / rate
    await asyncio.gather(*tasks)
