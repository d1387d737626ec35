"""A STAND-IN for TensorRT-LLM's `trtllm-serve`, vLLM's `vllm serve` and SGLang's launch_server,
for hosts without GPUs (CI, the demo, the virtual colo). It is not an inference engine: it
computes nothing, it only behaves like one.

    python -m fleet_agent.engine.standin <model> [trtllm-serve flags]
    python -m fleet_agent.engine.standin.vllm serve <model> [vllm serve flags]     (vllm.py)
    python -m fleet_agent.engine.standin.sglang --model-path <model> [flags]       (sglang.py)

What follows describes the trtllm-serve dialect; the other two differ in their command line,
routes, metric names, error bodies and scheduling (dialect.py, docs/engine.md "Dialects"),
over the same engine core, cost model, weights, power and lifecycle.

It takes trtllm-serve's command line (the flags the agent's EngineSupervisor passes are honoured,
the other documented ones accepted and ignored, unknown ones refused with exit status 2), speaks
trtllm-serve's HTTP API (OpenAI completions and chat completions, plain and SSE, /health,
/health_generate, /version, /v1/models, /metrics iteration stats, /prometheus/metrics), and times
every token with the continuous-batching simulation of fleet_agent/engine/core.py, whose iteration
durations come from the cost model of fleet_core/cost_model.py for the GPU it pretends to run
on. docs/engine.md says what it models and how faithfully.

Lifecycle, as trtllm-serve: the port is bound at once but listens only once the weights are
loaded (connections are refused meanwhile): a checkpoint directory's files are READ for real,
then FLEET_STANDIN_LOAD_S passes; then /health answers 200. A missing or empty checkpoint
directory is refused (exit 1). Its `fleet-standin.json`, if any, makes it a bad version
(errors, slow, wrong answers: weights.py, docs/engine.md "Weights and bad versions").
On SIGTERM or SIGINT it answers 503 to /health and to new generations, lets the requests in
flight finish (at most FLEET_STANDIN_DRAIN_S wall seconds), then exits 0.

Environment (stand-in only):
  FLEET_STANDIN_GPU        H100 | H200 | L40S (default H100)
  FLEET_STANDIN_MODEL      llama-3.1-8b | llama-3.1-70b (default: "70b" in <model> → 70B, else 8B)
  FLEET_STANDIN_PRECISION  fp8 (default) | bf16
  FLEET_STANDIN_LOAD_S     load delay in simulated seconds (default weights ÷ 7 GB/s)
  FLEET_STANDIN_SEED       seed of the generated text and lengths (default 0)
  FLEET_STANDIN_SPEEDUP    divides every simulated duration, load included (default 1.0)
  FLEET_STANDIN_DRAIN_S    wall-clock bound on the drain after SIGTERM (default 30)
  FLEET_STANDIN_READ_MB_S  cap on reading the checkpoint's files at load (default: unlimited)
  FLEET_STANDIN_MISSING_WEIGHTS  "ignore": serve an absolute model path that does not exist
                           without weights (default: refuse, as trtllm-serve would)
  FLEET_STANDIN_GPU_STATE_DIR  the simulated GPUs' shared state (the agent sets it with simulated
                           telemetry): their power limits slow the iterations down, and the
                           engine's per-GPU power goes back there (fleet_agent/telemetry/
                           sim_gpu_state.py)

Power: every iteration draws what the phase-aware power model (fleet_core/power_model.py) says,
and under a power limit takes its capped time. /prometheus/metrics adds, per GPU:
  fleet_standin_gpu_power_watts        mean over the last half second
  fleet_standin_gpu_energy_joules_total
  fleet_standin_gpu_power_limit_watts  the limit it runs under (the TDP without one)

The package: settings.py (the command line, the YAML and FLEET_STANDIN_* → Settings), vllm.py
and sglang.py (those dialects' command lines and entry points), cli_flags.py (argparse from an
EngineSpec's flag table), dialect.py (what differs per engine: version, priority, error
bodies), openai_schemas.py (the OpenAI request bodies), prometheus_metrics.py (trtllm-serve's
`trtllm_*` Prometheus metrics and the stand-in's power), dialect_metrics.py (`vllm:*`,
`sglang:*`), power.py (the power meter), weights.py (the checkpoint read at load, bad
versions), server.py (the HTTP server, the engine loop, the lifecycle, main() and run());
__main__.py runs main().
"""
