"""exp.params of the online sweep: rates, arrival process, request shape, time limits, SLOs, the glance's focus."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from harness.running.params import GridParams


@dataclass
class Params(GridParams):
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])   # requests/s; .inf sends all at t=0
    process: str = "poisson"              # poisson | gamma (uses burstiness) | constant
    burstiness: float = 1.0
    num_prompts: int = 16
    max_seconds: float = 300              # per rate: later arrivals are not sent, requests in flight are cancelled
    input_len: int = 512
    output_len: int = 64
    warmups: int = 1
    endpoint: str = "completions"
    max_concurrency: Optional[int] = None
    goodput: dict[str, float] = field(default_factory=dict)   # SLOs in ms, e.g. {ttft: 2000, tpot: 200}
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    max_queue: int = 1024                 # engine server: waiting requests beyond its running slots before 503
    # load clients per rate: harness (measuring/loadgen.py, essay prompts sent as token ids) and/or vllm_bench
    # (`vllm bench serve`, its random dataset: the same random-token prompts for every server at a given seed)
    clients: list[str] = field(default_factory=lambda: ["harness"])
    startup_timeout_s: float = 600
    # rounds per rate: each round runs every client in turn, so the clients' agreement is judged against how far one
    # client's own figures move between rounds on the same server (run-to-run noise), not its requests' spread alone
    repeats: int = 1
    # the at-a-glance comparison: `focus`'s TPOT against each of `versus` at the highest rate versus[0] sustains
    focus: Optional[str] = None
    versus: list[str] = field(default_factory=list)
