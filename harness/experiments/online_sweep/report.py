"""The online sweep's summary: latency tables and figures per rate, and whether a system kept up with a rate."""
from __future__ import annotations

import numpy as np

from harness.experiments.online_sweep.params import Params
from harness.experiments.online_sweep.rates import STEP_KEYS, step_split
from harness.reporting import plots, uncertainty
from harness.reporting.tables import finite, fmt
from harness.running.experiment import Run

STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]
CSV_KEYS = ["system", "client", "request_rate", "round", "burstiness", "num_prompts", "input_len", "output_len",
            "completed", "failed", "rejected", "duration", "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "total_input_tokens", "total_output_tokens", *STAT_KEYS,
            "max_output_tokens_per_s", "max_concurrent_requests", "cores_busy", "busy_threads", "cpus_allowed",
            "cpu_window", *STEP_KEYS]


SUSTAINED = ("every request done, the last within 1/0.9 of the time a queue-free run needs: the last arrival plus "
             "the system's mean E2EL at its lowest rate")


def sustains(r: dict, rows: list[dict]) -> bool:
    """The system kept up with rate r: every request completed, and the run ended within 1/0.9 of the time it would
    take with no queue (the last arrival, at num_prompts / rate, plus the system's mean E2EL at its lowest rate).

    Requests served at the pace they arrive finish one service time after the last arrival; a growing queue pushes
    the end further out. Completed ÷ duration ≥ 0.9 × rate (vLLM bench's throughput against the offered rate)
    counts that service time as lost throughput, so long requests never pass it at any rate."""
    own = [x for x in rows if x["system"] == r["system"] and x.get("mean_e2el_ms")]
    if r["completed"] != r["num_prompts"] or not own or not r.get("duration"):
        return False
    service_s = min(own, key=lambda x: x["request_rate"])["mean_e2el_ms"] / 1e3
    return r["duration"] <= (r["num_prompts"] / r["request_rate"] + service_s) / 0.9


def focus_line(rows: list[dict], focus: str, versus: list[str]) -> str | None:
    """`focus`'s mean TPOT ratio to each system of `versus`, at the highest rate versus[0] sustains."""
    base = [r for r in rows if r["system"] == versus[0] and sustains(r, rows)]
    if base:
        rate = max(r["request_rate"] for r in base)
        where = f"at {rate:g} req/s, the highest rate `{versus[0]}` sustains ({SUSTAINED})"
    else:       # still state the ratio, at the least loaded point, and say that no rate is sustained
        rate = min((r["request_rate"] for r in rows if r["system"] == versus[0]), default=None)
        if rate is None:
            return None
        where = f"`{versus[0]}` sustains none of the rates ({SUSTAINED}); at the lowest, {rate:g} req/s"
    tpot = {r["system"]: t for r in rows if r["request_rate"] == rate and (t := _tpot(r)) is not None}
    if focus not in tpot:
        return None
    # focus ÷ versus, as the per-rate lines state it: above 1× the focus system is slower
    at = {r["system"]: r for r in rows if r["request_rate"] == rate}
    parts = [f"{ratio_text(at[focus], at[v])} `{v}`'s ({tpot[v]:.0f} ms)" for v in versus if v in tpot]
    return (f"{where}, `{focus}`'s mean TPOT ({tpot[focus]:.0f} ms) is " + " and ".join(parts)
            + " (above 1×: slower).")


def versus_lines(rows: list[dict], focus: str, versus: list[str]) -> list[str]:
    """Per client and rate: `focus`'s mean TPOT and ITL against each of `versus`, with the cores each kept busy, and
    versus[0]'s TPOT against the rest of `versus` (engine-dense ÷ vLLM where the focus is a policy)."""
    out = []
    for client in dict.fromkeys(r.get("client", "harness client") for r in rows):
        at = {(r["system"], r["request_rate"]): r for r in rows if r.get("client", "harness client") == client}
        for rate in sorted({r for _, r in at}):
            f = at.get((focus, rate))
            if not f or _tpot(f) is None:
                continue
            parts = [f"`{v}` {fmt(at[(v, rate)]['mean_tpot_ms'])} / {fmt(at[(v, rate)]['mean_itl_ms'])} ms on "
                     f"{fmt(at[(v, rate)].get('cores_busy'), 2)} cores" for v in versus if (v, rate) in at]
            pairs = [(focus, v) for v in versus] + [(versus[0], v) for v in versus[1:]]
            tpot = {a: t for a in (focus, *versus) if (a, rate) in at and (t := _tpot(at[(a, rate)])) is not None}
            ratios = [f"`{a}` ÷ `{b}` {ratio_text(at[(a, rate)], at[(b, rate)])}" for a, b in pairs
                      if a in tpot and b in tpot]
            if parts:
                out.append(f"{client}, {rate:g} req/s: mean TPOT / ITL `{focus}` {fmt(f['mean_tpot_ms'])} / "
                           f"{fmt(f['mean_itl_ms'])} ms on {fmt(f.get('cores_busy'), 2)} cores; " + "; ".join(parts)
                           + (f" (TPOT ratios: {', '.join(ratios)})" if ratios else ""))
    return out


def ratio_text(a: dict, b: dict) -> str:
    """Row a's mean TPOT ÷ row b's, `1.05×`, with the 95 % bootstrap interval of the ratio of their mean request
    TPOTs (each row's requests resampled on their own, rounds pooled) where both rows kept their requests'."""
    value = f"{a['mean_tpot_ms'] / b['mean_tpot_ms']:.2f}×"
    est = uncertainty.unpaired_ratio(a.get("request_tpots_ms") or [], b.get("request_tpots_ms") or [])
    return value + (f" [{est.low:.2f}, {est.high:.2f}]" if finite(est.low) and finite(est.high) else "")


RATIO_NOTE = ("A TPOT ratio's interval is the 95 % bootstrap interval of the ratio of the two servers' mean request "
              "TPOTs, each server's requests resampled on their own (its rounds pooled). The servers ran one after "
              "the other, so a drift of the shared host between their runs is not in it.")


def step_line(rows: list[dict], focus: str, versus: list[str]) -> str | None:
    """At the highest rate: the share of each engine server's decode rows that ran beside a prompt chunk, and what
    its two kinds of step cost (a row beside a chunk waits for it)."""
    top = max(r["request_rate"] for r in rows)
    at = {r["system"]: r for r in rows if r["request_rate"] == top and r.get("decode_rows")}
    parts = [f"`{s}` {100 * at[s]['beside_prompt_share']:.0f} % of its decode rows beside a prompt chunk "
             f"({fmt(at[s]['mixed_step_ms'])} ms per such step, {fmt(at[s]['mixed_rows_per_step'])} rows; "
             f"{fmt(at[s]['decode_step_ms'])} ms per decode-only step, {fmt(at[s]['decode_rows_per_step'])} rows)"
             for s in (focus, *versus) if s in at and at[s].get("beside_prompt_share") is not None]
    if not parts:
        return None
    client = next(iter(at.values())).get("client", "harness client")
    return (f"where the decode rows ran at {top:g} req/s ({client}; a row waits for the prompt chunk its step "
            "runs beside): " + "; ".join(parts) + ".")


def _tpot(row: dict) -> float | None:
    """A row's mean TPOT where it is a measurement (None where no request completed: 0, None or NaN)."""
    value = row.get("mean_tpot_ms")
    return value if finite(value) and value > 0 else None


POOLED_MEANS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "request_throughput", "output_throughput", "cores_busy")


LATENCY_KEYS = frozenset(k for k in POOLED_MEANS if k.endswith("_ms"))


def pooled(rows: list[dict]) -> list[dict]:
    """One row per system, client and rate. Over repeated rounds: each latency, throughput and cores figure is the
    mean of the rounds' (None when a round has none: a latency of 0 means nothing completed); `completed` the fewest
    any round finished and `duration` the longest (a rate is sustained only when every round kept up);
    `round_tpots` keeps each round's per-request TPOTs apart, by round number; the step split is taken over the
    rounds' summed tallies (none unless every round has one)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r.get("client", "harness client"), r["request_rate"]), []).append(r)
    out = []
    for rs in groups.values():
        row = {**rs[0], "rounds": len(rs),
               "round_tpots": {x.get("round", 1): x.get("request_tpots_ms") or [] for x in rs}}
        if len(rs) > 1:
            for key in POOLED_MEANS:
                values = [x[key] for x in rs if finite(x.get(key)) and (x[key] > 0 or key not in LATENCY_KEYS)]
                row[key] = float(np.mean(values)) if len(values) == len(rs) else None
            row["completed"] = min(x["completed"] for x in rs)
            row["duration"] = max((x.get("duration") or 0.0) for x in rs)
            row["request_tpots_ms"] = [t for x in rs for t in x.get("request_tpots_ms") or []]
            tallies = [t for x in rs if (t := x.get("steps"))]
            # a round stored before a key was added to the tally counts 0 there
            summed = {k: sum(t.get(k, 0) for t in tallies) for k in tallies[0]} if len(tallies) == len(rs) else None
            row.update(dict.fromkeys(STEP_KEYS), **step_split(summed))
        out.append(row)
    return out


def client_agreement(rows: list[dict]) -> list[list]:
    """Per system and rate measured by both clients (pooled rows): each client's mean TPOT with its 95 % interval
    over its requests and its rounds' means, then the clients' difference. Where both completed requests in two or
    more of the same rounds, that difference is the mean of the rounds' differences with a t interval over rounds
    (uncertainty.blocked_difference): a round runs the clients back to back, so what the interval holds is how much
    the whole measurement moves from round to round. With one round it resamples the requests alone, which cannot
    see a drift of the machine between the two runs. The verdict is "—" where no interval can be drawn."""
    by = {(r["system"], r["request_rate"], r.get("client")): r for r in rows}
    out = []
    for (system, rate, client), r in by.items():
        other = by.get((system, rate, "vllm bench serve"))
        if client != "harness client" or other is None:
            continue
        a, b = _rounds(r), _rounds(other)
        both = [k for k in a if a[k] and b.get(k)]
        flat_a, flat_b = [t for x in a.values() for t in x], [t for x in b.values() for t in x]
        diff = (uncertainty.blocked_difference([float(np.mean(a[k])) for k in both],
                                               [float(np.mean(b[k])) for k in both]) if len(both) >= 2
                else uncertainty.unpaired_difference(flat_a, flat_b))
        verdict = "—" if not (finite(diff.low) and finite(diff.high)) else "no" if diff.excludes(0) else "yes"
        out.append([system, rate, uncertainty.mean(flat_a).fmt(1), _round_means(a),
                    uncertainty.mean(flat_b).fmt(1), _round_means(b),
                    diff.fmt(1) + (" rounds" if len(both) >= 2 else " requests"), verdict])
    return out


def _rounds(row: dict) -> dict[int, list[float]]:
    return row.get("round_tpots") or {row.get("round", 1): row.get("request_tpots_ms") or []}


def _round_means(rounds: dict[int, list[float]]) -> str:
    return " / ".join(fmt(float(np.mean(x))) if x else "—" for _, x in sorted(rounds.items()))


def write_summary(run: Run[Params], rows: list[dict], envs: list[dict]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    summary = run.summary(envs=envs)
    per_round, rows = rows, pooled(rows)
    repeated = any(r.get("rounds", 1) > 1 for r in rows)
    main = [r for r in rows if r.get("client", "harness client") == "harness client"] or rows
    if rows:
        top = max(r["request_rate"] for r in main)
        bullets = [line] if p.focus and p.versus and (line := focus_line(main, p.focus, p.versus)) else []
        if p.focus and p.versus:
            bullets += versus_lines(rows, p.focus, p.versus)
            bullets += [line] if (line := step_line(main, p.focus, p.versus)) else []
        summary.glance(f"at {top:g} req/s (the highest rate) mean " + "; ".join(
            f"`{r['system']}` TPOT {fmt(r['mean_tpot_ms'])} ms, TTFT {fmt(r['mean_ttft_ms'])} ms (p99 "
            f"{fmt(r['p99_ttft_ms'])}), {r['completed']}/{r['num_prompts']} completed"
            for r in main if r["request_rate"] == top) + ".", bullets)
    arrivals = p.process + (f" (burstiness {p.burstiness:g})" if p.process == "gamma" else "")
    summary.text(f"{p.num_prompts} requests per rate × ({p.input_len} prompt tokens + {p.output_len} output tokens, "
                 f"EOS ignored, greedy), {arrivals} arrivals rescaled so the last lands at N/rate, each rate capped "
                 f"at {p.max_seconds:g} s. Latencies in ms. Clients: " + ", ".join(
                     dict.fromkeys(r.get("client", "harness client") for r in rows)) + "."
                 + (f" Each rate ran {p.repeats} rounds, every client in turn within a round; the lines above and "
                    "the figures give the mean over rounds (a rate's `done` there is the fewest any round "
                    "completed), the table each round." if repeated else "")
                 + (" " + RATIO_NOTE if p.focus and p.versus else ""))
    keys = ["system", "client", "request_rate", *(["round"] if repeated else []), "completed", "failed",
            "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "max_concurrent_requests", "cores_busy", "busy_threads",
            "cpus_allowed"]
    summary.table(["system", "client", "rate req/s", *(["round"] if repeated else []), "done", "failed", "req/s",
                   "out tok/s", "mean TTFT", "median TTFT", "p99 TTFT", "mean TPOT", "median TPOT", "p99 TPOT",
                   "mean ITL", "p99 ITL", "mean E2EL", "peak concurrency", "cores busy", "busy threads", "CPUs"],
                  [[r.get(k, "harness client" if k == "client" else None) for k in keys] for r in per_round], 1)
    split = [r for r in per_round if r.get("decode_rows") and r.get("client", "harness client") == "harness client"]
    if split:
        summary.text("Where the engine servers' decode rows ran, harness client (the server's step tallies, read "
                     "before and after each measurement; `vllm bench serve` sends a test request of its own inside "
                     "that window, so its rows are in rates.csv only): in decode-only steps, or beside a prompt chunk "
                     "in a mixed step (chunked prefill: a step's token budget takes the running requests' decode "
                     "rows, then a chunk of a waiting prompt). A decode row makes one token of a running request; "
                     "a row in a mixed step waits for its chunk. Step times run from scheduling to the sampled "
                     "tokens. vLLM reports no such tally.")
        summary.table(["system", "rate req/s", *(["round"] if repeated else []), "decode rows",
                       "beside a prompt %", "mixed steps", "ms per mixed step", "rows per mixed step",
                       "decode-only steps", "ms per decode-only step", "rows per decode-only step",
                       "prompt-only steps", "ms per prompt-only step"],
                      [[r["system"], r["request_rate"], *([r.get("round", 1)] if repeated else []), r["decode_rows"],
                        100 * r["beside_prompt_share"] if r.get("beside_prompt_share") is not None else None,
                        *(r.get(k) for k in STEP_KEYS[2:])] for r in split], 1)
    agreement = client_agreement(rows)
    if agreement:
        how = ("the mean of the rounds' differences with a Student t interval over rounds (a round runs the "
               "clients back to back, so a drift of the shared host between rounds cancels and the interval holds "
               "how much the whole measurement moves from round to round; with few rounds it is wide, as it should "
               "be)" if repeated else
               "resamples both clients' requests independently; with one round per client it cannot see a drift of "
               "the shared host between the two clients' runs (exp.params.repeats)")
        summary.text("Do the two clients agree? Mean TPOT per request (ms) with its 95 % bootstrap interval over each "
                     "client's requests, and each round's mean; the difference is " + how + ". Both clients send "
                     "the same arrival offsets (each draws them from numpy's generator seeded with the run's seed "
                     "and rescales them so the last lands at N/rate) and prompts of the same lengths; the prompts "
                     "themselves differ (essay windows vs vLLM's random tokens).")
        summary.table(["system", "rate req/s", "harness client", "rounds", "vllm bench serve", "rounds",
                       "harness − vllm bench", "agree (interval holds 0)"], agreement, 1)
    summary.text("Cores busy = the server process tree's CPU seconds ÷ the time requests were in flight (from the "
                 "last /proc snapshot, taken every 0.25 s, before the rate's first request to the first after its "
                 "last response; neither the client's start-up nor the wait for the first arrival counts; rates.csv's "
                 "cpu_window names the window each row used, `client's load` where no request completed); busy "
                 "threads ran for at least 10 % of it; CPUs = the cores its processes may use (all from /proc). "
                 "Both servers get the same cores, device KV capacity (`engine.device_memory_gb`; vLLM's "
                 "kv_cache_memory_bytes), max_num_seqs and max_num_batched_tokens; vLLM runs in its default "
                 "execution mode unless `system.vllm_execution=eager`. vLLM serves HTTP from a process of its own, "
                 "the engine server from a thread beside its engine loop (measured faster on 2 cores than a process "
                 "of its own); both leave libgomp's spin-waiting at its default (an OpenMP worker spins 300,000 "
                 "iterations before it sleeps; that spinning counts as busy, on both sides).")
    summary.text("Definitions (`vllm bench serve`): TTFT = first token chunk − request start; TPOT = (E2EL − TTFT) / "
                 "(output tokens − 1) per request; ITL = gaps between consecutive token chunks pooled over requests; "
                 "E2EL = last token chunk − start; req/s and tok/s over the rate's wall time; peak concurrency = the "
                 "most requests in flight in any second. Every server streams one chunk per token.")
    if p.goodput:
        summary.text(f"Goodput SLOs (ms): {p.goodput}; see `request_goodput` in rates.csv.")
    summary.csv([{k: r.get(k) for k in CSV_KEYS} for r in per_round], "rates")
    if rows:
        clients = list(dict.fromkeys(r.get("client", "harness client") for r in rows))

        def label(r: dict) -> str:
            return r["system"] if len(clients) == 1 else f"{r['system']} ({r.get('client', 'harness client')})"
        by = {s: sorted((r for r in rows if label(r) == s), key=lambda r: r["request_rate"])
              for s in dict.fromkeys(label(r) for r in rows)}
        n = (f"n = {p.num_prompts} requests per rate" + (f" and round, mean of {p.repeats} rounds" if repeated else "")
             + f" ({p.input_len} in + {p.output_len} out)")
        summary.image("tpot_png", plots.line_plot(
            out_dir / "tpot_vs_rate.png",
            {s: [(r["request_rate"], r["mean_tpot_ms"]) for r in rs] for s, rs in by.items()},
            "request rate (requests/s)", "mean TPOT (ms)", f"Mean TPOT vs request rate ({n})", ymin=0.0,
            note=summary.figure_note(n)), "TPOT vs rate")
        summary.image("ttft_png", plots.line_plot(
            out_dir / "ttft_vs_rate.png",
            {s: [(r["request_rate"], r["mean_ttft_ms"]) for r in rs] for s, rs in by.items()},
            "request rate (requests/s)", "mean TTFT (ms)", f"Mean TTFT vs request rate ({n})",
            dashed={s: [(r["request_rate"], r["p99_ttft_ms"]) for r in rs] for s, rs in by.items()},
            dashed_label="p99 (dashed, ×)", ymin=0.0, note=summary.figure_note(n)), "TTFT vs rate")
    return summary.write(out_dir)
