"""The trtllm-serve stand-in in real time vs the cost model vs TensorRT-LLM's published figures.

    .venv/bin/python bench/engine.py [--seconds 10] [--warmup 2] [--trace conv]

Cases: Llama-3.1-8B FP8 on one H100 and on one L40S, at 1, 8 and 64 concurrent streams; one
stand-in process per case (python -m fleet_agent.engine.standin, speed-up 1.0: real time, load delay
0.2 s instead of the modelled 1.1 s to keep the run short), closed loop: each stream sends its
next request as soon as the last one ends.

Requests: sizes from the real Azure conversation trace (fleet/data/traces/, CC BY 4.0, Patel et al.,
Splitwise, ISCA 2024) read by fleet.traces, in trace order, each stream starting at its own
offset; the arrival times are not replayed (closed loop at a fixed concurrency). The trace has
lengths, not text: each prompt is filler text of the trace's prompt length (4 characters per
token, the stand-in's tokenizer) with a unique head so that no prefix blocks are reused, sent
with max_tokens = the trace's output length and ignore_eos, so each answer has the trace's
output length. `--trace synthetic` uses 128/128 instead. Chunked prefill is on (one conv prompt
is longer than max_num_tokens 8192).

Client: raw asyncio streams, HTTP/1.1 keep-alive, one connection per stream, SSE events
timestamped as their HTTP chunk is read; the client's CPU time per event is printed so that its
overhead can be judged, and so is the stand-in's CPU use (from /proc) — if the server nears one
core, the figures measure Python, not the model.

Measured: output tokens/s over the window (tokens whose event arrived in it), inter-token
latency p50/p95 (gaps between consecutive events of one request, both in the window), TTFT p50
(requests sent in the window). Model: fleet_core.cost_model steady state for the same mix
(effective_lengths). Published (docs/hardware.md; perf-overview.md, v0.17): shown beside the nearest
case, with what it was measured on. Never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from measure import cpu_seconds, free_port, pct  # run as a script: bench/ is on sys.path

from fleet_core import cost_model as cm

REPO = Path(__file__).resolve().parent.parent
GPUS = ("H100", "L40S")
CONCURRENCY = (1, 8, 64)
MODEL = "llama-3.1-8b"

# docs/hardware.md, from TensorRT-LLM perf-overview.md (v0.17): FP8 max-throughput output tokens/s
# per GPU, by input/output length; and latency under load (Triton backend, BF16, 467 in / 256
# out) for 8B on H100: mean TTFT 23 / 30 ms and ITL 8 / 11 ms at 2 / 16 requests/s, which by
# Little's law is about 4 / 45 requests in flight.
PUBLISHED_TPUT = {
    "H100": {(128, 128): 28_837, (128, 2048): 21_109, (2048, 128): 3_557, (1000, 1000): 15_245},
    "H200": {(128, 128): 29_526, (128, 2048): 25_399, (2048, 128): 3_794, (1000, 1000): 17_538},
    "L40S": {(128, 128): 9_105, (128, 2048): 5_366, (2048, 128): 1_067, (1000, 1000): 4_055},
}
PUBLISHED_LATENCY = {  # (GPU, streams) → (TTFT s, ITL s), 8B BF16 467/256
    ("H100", 4): (0.023, 0.008),
    ("H100", 45): (0.030, 0.011),
}
NEAREST_PUBLISHED = {("H100", 8): ("H100", 4), ("H100", 64): ("H100", 45)}


def shape_for(gpu: str, precision: cm.Precision = "fp8") -> cm.EngineShape:
    return cm.EngineShape(gpu=cm.gpu_spec(gpu), model=cm.model_spec(MODEL), precision=precision)


# --- workload -----------------------------------------------------------------------------------


def workload(trace: str) -> list[tuple[int, int]]:
    if trace == "synthetic":
        return [(128, 128)] * 1000
    from fleet.traces import load_trace

    return [(r.prompt_tokens, max(1, r.output_tokens)) for r in load_trace(trace)]


_FILLER = ("the quick brown fox jumps over the lazy dog and " * 4000)[: 4 * 20_000]


def prompt_text(serial: int, tokens: int) -> str:
    head = f"{serial:09d} "  # unique: no prefix block is shared with another request
    return (head + _FILLER)[: 4 * tokens]


# --- the client -----------------------------------------------------------------------------------


@dataclass
class Stream:
    sent: float
    size: tuple[int, int]
    events: list[float] = field(default_factory=list)


async def one_request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    port: int,
    serial: int,
    size: tuple[int, int],
) -> Stream:
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt_text(serial, size[0]),
            "max_tokens": size[1],
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    stream = Stream(sent=time.perf_counter(), size=size)
    writer.write(head + body)
    status_head = await reader.readuntil(b"\r\n\r\n")
    if not status_head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stand-in answered {status_head[:200]!r}")
    events = stream.events
    while True:  # chunked transfer encoding: one chunk per SSE event (or a few)
        size_line = await reader.readuntil(b"\r\n")
        n = int(size_line[:-2], 16)
        if n == 0:
            await reader.readuntil(b"\r\n")
            return stream
        data = await reader.readexactly(n + 2)
        now = time.perf_counter()
        count = data.count(b"data: ")
        if b"[DONE]" in data:
            count -= 1
        events.extend([now] * count)


async def closed_loop(
    port: int, streams: int, sizes: Sequence[tuple[int, int]], until: float
) -> list[Stream]:
    done: list[Stream] = []
    serials = itertools.count()

    async def worker(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        offset = k * len(sizes) // streams
        try:
            for i in itertools.count():
                if time.perf_counter() >= until:
                    return
                size = sizes[(offset + i) % len(sizes)]
                done.append(await one_request(reader, writer, port, next(serials), size))
        finally:
            writer.close()

    await asyncio.gather(*(worker(k) for k in range(streams)))
    return done


# --- one case -------------------------------------------------------------------------------------


@dataclass
class Result:
    gpu: str
    streams: int
    tokens_per_s: float
    itl_mean: float
    itl_p50: float
    itl_p95: float
    ttft_p50: float
    requests: int
    client_us_per_event: float
    client_cpu: float  # share of one core
    server_cpu: float
    sizes: list[tuple[int, int]]  # (prompt, output) of the requests sent in the window


@contextmanager
def standin(gpu: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_STANDIN_")}
    env |= {"FLEET_STANDIN_GPU": gpu, "FLEET_STANDIN_MODEL": MODEL, "FLEET_STANDIN_LOAD_S": "0.2"}
    argv = [sys.executable, "-m", "fleet_agent.engine.standin", f"/models/bench/{MODEL}"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--enable_chunked_prefill"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"stand-in exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("stand-in did not start listening in 30 s") from None
                time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def run_case(
    gpu: str, streams: int, sizes: Sequence[tuple[int, int]], warmup: float, seconds: float
) -> Result:
    port = free_port()
    with standin(gpu, port) as proc:
        start = time.perf_counter()
        window = (start + warmup, start + warmup + seconds)
        cpu_marks: list[tuple[float, float]] = []

        async def main() -> list[Stream]:
            async def mark() -> None:
                await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
                cpu_marks.append((time.process_time(), cpu_seconds(proc.pid)))
                await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
                cpu_marks.append((time.process_time(), cpu_seconds(proc.pid)))

            marker = asyncio.create_task(mark())
            done = await closed_loop(port, streams, sizes, until=window[1])
            await marker
            return done

        streams_done = asyncio.run(main())
    lo, hi = window
    events = [t for s in streams_done for t in s.events if lo <= t < hi]
    gaps = [
        b - a for s in streams_done for a, b in itertools.pairwise(s.events) if lo <= a and b < hi
    ]
    ttft = [s.events[0] - s.sent for s in streams_done if s.events and lo <= s.sent < hi]
    client_cpu = cpu_marks[1][0] - cpu_marks[0][0]
    server_cpu = cpu_marks[1][1] - cpu_marks[0][1]
    return Result(
        gpu=gpu,
        streams=streams,
        tokens_per_s=len(events) / seconds,
        itl_mean=statistics.fmean(gaps) if gaps else float("nan"),
        itl_p50=pct(gaps, 0.50),
        itl_p95=pct(gaps, 0.95),
        ttft_p50=pct(ttft, 0.50),
        requests=sum(1 for s in streams_done if lo <= s.sent < hi),
        client_us_per_event=client_cpu / max(1, len(events)) * 1e6,
        client_cpu=client_cpu / seconds,
        server_cpu=server_cpu / seconds,
        sizes=[s.size for s in streams_done if lo <= s.sent < hi],
    )


# --- report ---------------------------------------------------------------------------------------


def ms(x: float) -> str:
    return "—" if x != x else f"{x * 1e3:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per case")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds before the window")
    ap.add_argument("--trace", default="conv", help="conv | code | synthetic (128/128)")
    args = ap.parse_args(argv)

    sizes = workload(args.trace)
    in_eff, out_eff = cm.effective_lengths(sizes)
    mean_in = statistics.mean(i for i, _ in sizes)
    mean_out = statistics.mean(o for _, o in sizes)
    print(
        f"workload: {args.trace} ({len(sizes)} requests; mean prompt {mean_in:.0f}, mean output "
        f"{mean_out:.0f} tokens; steady-state equivalent {in_eff:.0f}/{out_eff:.0f}); "
        f"{args.warmup:.0f} s warm-up + {args.seconds:.0f} s per case, speed-up 1.0"
    )

    results: list[Result] = []
    for gpu in GPUS:
        for streams in CONCURRENCY:
            # All streams start at once; warm up for at least one modelled request lifetime so
            # that the window sees the steady state, not the first wave of prefills.
            lifetime = out_eff * cm.predicted_itl_s(shape_for(gpu), streams, in_eff, out_eff)
            r = run_case(gpu, streams, sizes, max(args.warmup, lifetime), args.seconds)
            results.append(r)
            print(
                f"  {gpu} × {streams:>2}: {r.tokens_per_s:8.0f} tok/s, "
                f"ITL mean {ms(r.itl_mean)} ms, {r.requests} requests",
                flush=True,
            )

    print()
    print(
        "Llama-3.1-8B FP8, one GPU: stand-in (measured) | cost model | published (docs/hardware.md)"
    )
    header = (
        f"{'case':<11} {'tok/s meas':>10} {'model':>8} {'ratio':>6} | "
        f"{'ITL mean':>8} {'p50':>5} {'p95':>6} {'model':>6} | {'TTFT p50':>8} | "
        f"{'srv CPU':>7} {'cli CPU':>7} {'cli µs/ev':>9} | published"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        shape = shape_for(r.gpu)
        # The model sees the mix this case actually sent (a sample of the trace).
        case_in, case_out = cm.effective_lengths(r.sizes) if r.sizes else (in_eff, out_eff)
        model_tps = cm.predicted_decode_tokens_per_s(shape, r.streams, case_in, case_out)
        model_itl = cm.predicted_itl_s(shape, r.streams, case_in, case_out)
        ref = NEAREST_PUBLISHED.get((r.gpu, r.streams))
        published = "—"
        if ref is not None:
            ttft, itl = PUBLISHED_LATENCY[ref]
            published = (
                f"ITL {itl * 1e3:.0f} ms, TTFT {ttft * 1e3:.0f} ms at ~{ref[1]} streams "
                "(BF16 467/256)"
            )
        print(
            f"{r.gpu + ' × ' + str(r.streams):<11} {r.tokens_per_s:>10.0f} {model_tps:>8.0f} "
            f"{r.tokens_per_s / model_tps:>6.2f} | {ms(r.itl_mean):>8} {ms(r.itl_p50):>5} "
            f"{ms(r.itl_p95):>6} "
            f"{ms(model_itl):>6} | {ms(r.ttft_p50):>8} | {r.server_cpu:>7.0%} "
            f"{r.client_cpu:>7.0%} {r.client_us_per_event:>9.0f} | {published}"
        )
    # The same model at the published configurations (no process: the formula alone).
    for gpu, streams in PUBLISHED_LATENCY:
        shape = shape_for(gpu, "bf16")
        ttft, itl = PUBLISHED_LATENCY[(gpu, streams)]
        model_itl = cm.predicted_itl_s(shape, streams, 467, 256)
        print(
            f"{gpu + ' × ' + str(streams):<11} {'':>10} "
            f"{cm.predicted_decode_tokens_per_s(shape, streams, 467, 256):>8.0f} {'':>6} | "
            f"{'':>8} {'':>5} {'':>6} {ms(model_itl):>6} | {'':>8} | {'':>7} {'':>7} {'':>9} | "
            f"ITL {itl * 1e3:.0f} ms at ~{streams} streams (BF16 467/256; model BF16 too)"
        )
    for gpu, table in PUBLISHED_TPUT.items():
        shape = shape_for(gpu)
        cells = []
        for (i, o), tps in table.items():
            model = cm.predicted_decode_tokens_per_s(shape, None, i, o)
            cells.append(f"{i}/{o} {model / 1e3:.1f}k vs {tps / 1e3:.1f}k")
        print(f"{gpu + ' max':<11} model vs published max-throughput tok/s: " + ", ".join(cells))
    print()
    print(
        "Notes: the model column is the cost model's steady state for the mix each case sent "
        "(effective_lengths).\nIts ITL is a mean: it spreads prefill over every iteration. The "
        "stand-in's iterations are either\npure decode (near p50) or also carry a prompt chunk "
        "(the trace's prompts average ~1,150 tokens,\nup to 8,192 per iteration), hence p50 "
        "under and p95 over the model; asyncio's ~1 ms timer adds\njitter to single gaps, not to "
        "the mean. Published latencies are BF16, Triton backend, 467/256\nrequests: compare "
        "them with the model rows at that configuration, not with the FP8 trace cases."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
