"""Load tests against Outrider's public API: a load generator and a report builder.

    python -m load_tests run --url http://127.0.0.1:8000 --concurrency 1,2,4 --out DIR
    python -m load_tests report DIR [DIR ...]

`run` sends a workload (a JSONL file of chat and completion requests; `workloads/mixed.jsonl`
by default, or synthetic prompts of random token ids of set lengths) over the HTTP API
(streaming, as the OpenAI client does) or the gRPC API, at each load level in turn: a fixed
number of users sending back to back (closed loop), or an arrival rate (open loop; Poisson, or
gamma gaps for bursts). It records every request (`results.jsonl`), polls the server's
`/metrics` during each level, and writes `summary.json` and `report.md`. `report` rebuilds the
report from those files.
"""
