"""Scheduling policies at the same offered load: SGLang's fcfs / lpm / hrrn vs the entropic macro loop.

Claim tested (issue: entropy-aware scheduling; the paper): ordering the waiting queue (and the
retraction order) by pi = E[dH] / (alpha C + beta M + gamma L) with aging cuts mean end-to-end
latency by 10-15 % and raises throughput by 12-18 % compared with the baseline policies.

One server per policy, started one at a time with identical flags (same model, dtype, KV pool,
chat template and --max-running-requests):
  baselines  `sgl_entropic.launch_server --entropic off --schedule-policy {fcfs|lpm|hrrn}`: our
             launcher with every loop off, i.e. stock SGLang's runtime plus the signal recording;
  entropic   `sgl_entropic.launch_server --entropic scheduling` (SGLang's fcfs underneath, the macro
             loop re-orders the waiting queue and the decode retraction order);
  entropic-budget  the same plus `scheduling.decode_budget` (--decode-budget, default half of
             --max-running-requests): only the top-pi running requests decode each step, every
             request at least once per max_skip_steps steps (token-level preemption).
With --rounds N the whole comparison repeats N times, the policy order rotated by one each round;
latency and TTFT are pooled over the rounds, throughput is the mean of the rounds.
`GET /server_info` is checked: `entropic.active_loops` has "scheduling" for entropic only, and
`schedule_policy` / `max_running_requests` are what was asked.

Workload, built once from --seed and replayed unchanged against every policy: --requests chat
requests, half short questions and half "read this document" prompts with --doc-tokens of filler
(taken from four shared documents, so prompts on the same document share a cached prefix, which
is what lpm exploits), max_new_tokens drawn from --max-new-tokens, half greedy and half sampled
at --temperature. Open-loop Poisson arrivals (seeded exponential gaps, --rate requests/s), the
same arrival times for every policy; each request is sent at its arrival time from its own
thread, with "stream": true. --max-running-requests is kept small so that a waiting queue forms
on a small machine; without a queue every policy schedules identically (the script reports the
peak number of requests in flight, which must exceed --max-running-requests).

By default requests run with ignore_eos, so each policy decodes exactly the same number of tokens
(sampled requests cannot be seeded on CPU, and batch composition changes bf16 numerics, so EOS
would otherwise make the work itself differ between policies); --eos stop lets them stop.

Per policy: completed/failed, end-to-end latency (send -> last SSE chunk) and TTFT (send -> first
SSE chunk carrying a generated token) as mean / p50 / p99 (linear interpolation; with 48 requests
p99 is close to the maximum), and throughput = completion tokens / (last finish - first send).
Then entropic's relative change against each baseline, and where it loses.

    .venv/bin/python benchmarks/scheduling_policies.py --rounds 2       # 48 requests, 5 policies, twice
    .venv/bin/python benchmarks/scheduling_policies.py --quick          # tiny smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    _session,
    bundled_model,
    chat,
    default_device,
    environment,
    free_port,
    generate,
    log_line,
    markdown_table,
    mean,
    ours_command,
    percentile,
    server_env,
    sglang_common_args,
    start_server,
    stream_one,
    write_json,
)

ENTROPIC = "entropic"
ENTROPIC_BUDGET = "entropic-budget"  # the macro loop plus the token-level decode budget
VARIANTS = (ENTROPIC, ENTROPIC_BUDGET)
# SGLang 0.5.23's --schedule-policy choices, plus ours (the macro loop over fcfs)
POLICIES = ("fcfs", "lpm", "hrrn", "dfs-weight", "shortest-prefill-first", "lof", "random", *VARIANTS)
RETRACT_LOG = "KV cache pool is full. Retract requests."

QUESTIONS = [
    "Why is the sky blue? Explain briefly.",
    "What is the capital of Australia?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is.",
    "How do I boil an egg?",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Name five animals that live in the ocean.",
    "What causes the seasons on Earth?",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small coffee shop.",
    "What is photosynthesis?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "Explain what inflation is in one paragraph.",
    "What should I pack for a weekend hiking trip?",
]

DOC_QUESTIONS = [
    "Summarize the document in three sentences.",
    "What is the main topic of the document?",
    "List the most important facts mentioned in the document.",
    "Write a short title for the document.",
    "Which part of the document did you find most surprising, and why?",
    "Explain the document to a ten-year-old.",
]

# Plain prose for the long prompts. Four documents are rotations of these paragraphs (distinct first
# paragraphs), truncated to each request's token budget.
PARAGRAPHS = [
    "The town of Harrow Bay grew up around a small natural harbour on a rocky coast. For most of its "
    "history the town lived from fishing: in the early morning the boats left the harbour, and in the "
    "afternoon the catch was sold on the quay to merchants who carried it inland on carts. The harbour "
    "was sheltered from the western storms by a long spit of sand, which shifted a little every winter "
    "and had to be watched by the harbour master, who kept records of its shape going back two centuries.",
    "In the nineteenth century a railway line reached the town, and with it came visitors from the cities. "
    "Hotels were built along the seafront, and the old net sheds were turned into shops and tea rooms. "
    "Many fishermen found that taking visitors out on pleasure trips paid better than fishing, and by the "
    "end of the century the summer season had become the most important part of the year for the local "
    "economy. The winters, by contrast, were quiet, and many houses stood empty until spring.",
    "The lighthouse on the northern headland was completed in 1852. It was built of granite blocks brought "
    "by sea from a quarry along the coast, because the road over the hills was too steep for heavy loads. "
    "The first keeper, a former sailor named Thomas Reed, kept a diary in which he recorded the weather, "
    "the ships that passed, and the small events of his daily life. His diary is now kept in the town "
    "museum, and it is one of the best sources for the history of the harbour in that period.",
    "Agriculture in the valley behind the town depended on a careful use of water. The farmers dug narrow "
    "channels that carried water from the river to the fields, and they agreed among themselves on a "
    "schedule that decided which farm could open its gate on which day. Disputes about the schedule were "
    "settled by a council of elders that met once a month in the village hall. The system worked for "
    "several hundred years and was only replaced when pumps and pipes arrived in the twentieth century.",
    "Photosynthesis is the process by which green plants use the energy of sunlight to turn water and "
    "carbon dioxide into sugar and oxygen. It takes place mainly in the leaves, inside small structures "
    "called chloroplasts, which contain the green pigment chlorophyll. The sugar made in the leaves is "
    "carried to the rest of the plant, where it is used for growth or stored as starch. Nearly all the "
    "oxygen in the air we breathe was produced by photosynthesis over millions of years.",
    "A computer program is a list of instructions that a computer follows one after another. Early "
    "programmers wrote instructions directly in the numeric language of the machine, which was slow and "
    "error-prone. Later, programming languages were invented that let people write instructions in a form "
    "closer to ordinary language, and special programs called compilers translated them into machine code. "
    "Today most software is written in such languages, and programmers rarely see the machine code at all.",
    "The annual festival takes place on the first weekend of August. It begins on Friday evening with a "
    "procession of decorated boats around the harbour, followed by music on the quay until late at night. "
    "On Saturday there is a market with local food and crafts, a swimming race across the bay, and a "
    "competition for the best fish soup. On Sunday the festival ends with a service in the old chapel "
    "and a shared lunch at long tables set up along the seafront, to which everyone in the town is invited.",
    "Bees are important pollinators for many crops and wild plants. A honeybee colony can contain tens of "
    "thousands of workers, a single queen, and a few hundred drones in summer. The workers collect nectar "
    "and pollen, build the wax comb, care for the young and defend the hive. They communicate the location "
    "of flowers to one another with a movement known as the waggle dance, in which the angle of the dance "
    "shows the direction of the food and its duration shows the distance.",
    "Good sleep depends on regular habits. Experts recommend going to bed and getting up at the same time "
    "every day, keeping the bedroom dark, quiet and cool, and avoiding large meals, coffee and bright "
    "screens in the hour before sleep. Physical activity during the day helps, as long as it does not "
    "happen too close to bedtime. Adults usually need between seven and nine hours of sleep a night, "
    "although the exact amount varies from person to person and changes with age.",
    "The museum reopened last spring after two years of renovation. The new building has a glass roof over "
    "the central hall, where the skeleton of a whale found on the beach in 1903 now hangs from the ceiling. "
    "The galleries on the upper floor tell the story of the town through objects donated by local families: "
    "fishing gear, photographs, letters, tools and clothes. A small room at the end is set aside for "
    "temporary exhibitions, and schools from the whole region visit the museum during the term.",
]
N_DOCS = 4


# ---------------------------------------------------------------------------- workload


def balanced(rng: random.Random, n: int, frac: float) -> list[bool]:
    """n flags with round(frac * n) True, in a seeded order: the mix is exact even for small n."""
    k = round(frac * n)
    flags = [True] * k + [False] * (n - k)
    rng.shuffle(flags)
    return flags


def build_workload(args, tokenizer) -> list[dict]:
    """The seeded request list and arrival times; identical for every policy."""
    rng = random.Random(args.seed)
    n = args.requests
    long_flags = balanced(rng, n, args.long_frac)
    sampled_flags = balanced(rng, n, args.sampled_frac)
    docs = [" ".join(PARAGRAPHS[2 * d:] + PARAGRAPHS[:2 * d]) for d in range(N_DOCS)]
    doc_ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    lo, hi = args.doc_tokens
    arrivals_rng = random.Random(args.seed + 1_000_003)  # its own stream: same gaps whatever the mix
    t, out = 0.0, []
    for i in range(n):
        max_new = rng.choice(args.max_new_tokens)
        if long_flags[i]:
            d = rng.randrange(N_DOCS)
            k = rng.randint(lo, hi)
            ids = doc_ids[d]
            ids = (ids * (k // len(ids) + 1))[:k]  # repeat a document if a budget exceeds it
            text = chat(f"Read the following document.\n\n{tokenizer.decode(ids)}\n\n{rng.choice(DOC_QUESTIONS)}")
            kind, filler = "long", k
        else:
            d, text, kind, filler = None, chat(rng.choice(QUESTIONS)), "short", 0
        sp = {"max_new_tokens": max_new, "temperature": args.temperature if sampled_flags[i] else 0.0,
              "ignore_eos": args.eos == "ignore"}
        if sampled_flags[i]:
            sp["sampling_seed"] = args.seed + i  # enforced only under deterministic inference (not used here)
        out.append({
            "index": i,
            "kind": kind,
            "doc": d,
            "filler_tokens": filler,
            "sampled": sampled_flags[i],
            "arrival_s": t,
            "payload": {"text": text, "sampling_params": sp, "stream": True},
        })
        t += arrivals_rng.expovariate(args.rate)
    return out


# ---------------------------------------------------------------------------- client


def replay(url: str, workload: list[dict], timeout_s: float) -> list[dict]:
    """Open loop: every request from its own thread, sent at t0 + its arrival time."""
    t0 = time.perf_counter() + 0.5  # every thread is up before the first arrival
    with ThreadPoolExecutor(max_workers=len(workload)) as pool:
        futures = [pool.submit(stream_one, url, w["payload"], t0 + w["arrival_s"], timeout_s) for w in workload]
        recs = [f.result() for f in futures]
    for w, r in zip(workload, recs):
        r.update(index=w["index"], kind=w["kind"], sampled=w["sampled"], arrival_s=w["arrival_s"],
                 send_lag_s=r["send"] - (t0 + w["arrival_s"]),
                 max_new_tokens=w["payload"]["sampling_params"]["max_new_tokens"],
                 latency_s=r["finish"] - r["send"],
                 ttft_s=(r["first"] - r["send"]) if r["first"] is not None else None)
    return recs


# ---------------------------------------------------------------------------- statistics


def dist(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    return {"mean": mean(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=float("nan"))}


def peak_in_flight(recs: list[dict]) -> int:
    events = sorted([(r["send"], 1) for r in recs] + [(r["finish"], -1) for r in recs], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def policy_stats(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["error"] is None]
    first_send = min(r["send"] for r in recs)
    last_finish = max((r["finish"] for r in ok), default=first_send)
    span = last_finish - first_send
    tokens = sum(r["completion_tokens"] for r in ok)
    by_kind = {}
    for kind in ("short", "long"):
        ks = [r for r in ok if r["kind"] == kind]
        by_kind[kind] = {"n": len(ks), "latency": dist([r["latency_s"] for r in ks]),
                         "ttft": dist([r["ttft_s"] for r in ks])}
    return {
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "errors": [r["error"] for r in recs if r["error"] is not None][:5],
        "latency": dist([r["latency_s"] for r in ok]),
        "ttft": dist([r["ttft_s"] for r in ok]),
        "completion_tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "span_s": span,
        "throughput_tok_s": tokens / span if span > 0 else float("nan"),
        "peak_in_flight": peak_in_flight(recs),
        "max_send_lag_s": max(r["send_lag_s"] for r in recs),
        "by_kind": by_kind,
    }


def pooled(runs: list[dict]) -> dict:
    """One policy over several rounds: latency and TTFT over all requests pooled; throughput the
    mean of the rounds (each round has its own time span), with the per-round values kept."""
    if len(runs) == 1:
        return runs[0]
    out = policy_stats([r for run in runs for r in run["requests"]])
    out.update(
        throughput_tok_s=mean([run["throughput_tok_s"] for run in runs]),
        throughput_rounds=[run["throughput_tok_s"] for run in runs],
        span_s=mean([run["span_s"] for run in runs]),
        peak_in_flight=max(run["peak_in_flight"] for run in runs),
        retractions_logged=sum(run["retractions_logged"] for run in runs),
        server=runs[0]["server"], server_command=runs[0]["server_command"],
        startup_s=[run["startup_s"] for run in runs], requests=[r for run in runs for r in run["requests"]],
    )
    return out


def round_spread(rounds: list[dict], policies: list[str]) -> str:
    """Each metric computed per round, as median (min-max) over the rounds."""
    rows = []
    for p in policies:
        cells = []
        for _, get, _ in METRICS:
            vals = [get(rd[p]) for rd in rounds]
            cells.append(f"{statistics.median(vals):.3g} ({min(vals):.3g}-{max(vals):.3g})")
        rows.append([p, *cells])
    return markdown_table(["policy", *(m[0] for m in METRICS)], rows)


def rel(x: float, ref: float) -> float:
    return x / ref - 1 if ref and ref == ref and x == x else float("nan")


METRICS = [  # (label, getter, lower is better)
    ("mean latency", lambda s: s["latency"]["mean"], True),
    ("p50 latency", lambda s: s["latency"]["p50"], True),
    ("p99 latency", lambda s: s["latency"]["p99"], True),
    ("mean TTFT", lambda s: s["ttft"]["mean"], True),
    ("p50 TTFT", lambda s: s["ttft"]["p50"], True),
    ("p99 TTFT", lambda s: s["ttft"]["p99"], True),
    ("throughput", lambda s: s["throughput_tok_s"], False),
]


def comparisons(stats: dict[str, dict]) -> dict[str, dict]:
    """Each entropic variant relative to each baseline, keyed "variant vs baseline"; `better` is
    oriented (True = the entropic variant wins that metric)."""
    out = {}
    for variant in (v for v in VARIANTS if v in stats):
        out.update({f"{variant} vs {name}": c for name, c in _compare(stats[variant], stats).items()})
    return out


def _compare(e: dict, stats: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, b in stats.items():
        if name in VARIANTS:
            continue
        rows = {}
        for label, get, lower in METRICS:
            r = rel(get(e), get(b))
            rows[label] = {"rel": r, "better": (r < 0 if lower else r > 0) if r == r else None}
        out[name] = {
            "metrics": rows,
            # the paper's claim, read as its weakest end: mean latency <= -10 % and throughput >= +12 %
            "claim_met": rows["mean latency"]["rel"] <= -0.10 and rows["throughput"]["rel"] >= 0.12,
        }
    return out


# ---------------------------------------------------------------------------- servers


def server_command(policy: str, port: int, common: list[str], decode_budget: int) -> list[str]:
    if policy == ENTROPIC:
        return ours_command(port, common, mode="scheduling")  # --schedule-policy stays SGLang's default, fcfs
    if policy == ENTROPIC_BUDGET:
        return ours_command(port, common, mode="scheduling", config={"scheduling": {"decode_budget": decode_budget}})
    return ours_command(port, common + ["--schedule-policy", policy], mode="off")


def check_server(policy: str, info: dict, max_running: int, decode_budget: int) -> dict:
    ent = info.get("entropic") or {}
    loops = ent.get("active_loops") or []
    if not ent.get("plugin_loaded_in_scheduler"):
        raise RuntimeError(f"{policy}: plugin not loaded in the scheduler: {ent!r}")
    if (policy in VARIANTS) != ("scheduling" in loops):
        raise RuntimeError(f"{policy}: entropic.active_loops = {loops!r} (scheduling must be on for entropic only)")
    budget = (ent.get("config") or {}).get("scheduling", {}).get("decode_budget")
    if budget != (decode_budget if policy == ENTROPIC_BUDGET else None):
        raise RuntimeError(f"{policy}: scheduling.decode_budget is {budget!r}")
    want = "fcfs" if policy in VARIANTS else policy
    if info.get("schedule_policy") != want:
        raise RuntimeError(f"{policy}: server runs schedule_policy {info.get('schedule_policy')!r}, wanted {want!r}")
    if info.get("max_running_requests") not in (None, max_running):
        raise RuntimeError(f"{policy}: max_running_requests {info.get('max_running_requests')!r} != {max_running}")
    return {"mode": ent.get("mode"), "active_loops": loops, "schedule_policy": info.get("schedule_policy"),
            "max_running_requests": info.get("max_running_requests"), "decode_budget": budget}


def warm_up(url: str, timeout_s: float) -> None:
    """Two requests (a short and a ~300-token prompt), discarded; then an empty radix cache."""
    filler = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    for text in (chat("Hello!"), chat(f"Repeat the last word of this text: {filler}")):
        r = generate(url, {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout_s)
        if not r.ok:
            raise RuntimeError(f"warm-up failed: {r.error}")
    r = _session().post(url + "/flush_cache", timeout=60)
    if r.status_code != 200:
        log_line(f"warning: /flush_cache answered {r.status_code}: {r.text[:200]}")


def run_policy(policy: str, args, common: list[str], workload: list[dict]) -> dict:
    port = free_port()
    cmd = server_command(policy, port, common, args.decode_budget)
    with start_server(f"sched-{policy}", cmd, port, server_env(args.device, stock=False), args.startup_timeout) as srv:
        checked = check_server(policy, srv.info(), args.max_running_requests, args.decode_budget)
        warm_up(srv.url, args.timeout)
        log_line(f"{policy}: replaying {len(workload)} requests at {args.rate:g}/s ...")
        recs = replay(srv.url, workload, args.timeout)
    log_text = srv.log.read_text(errors="replace")
    stats = policy_stats(recs)
    stats.update(server=checked, server_command=cmd, server_log=str(srv.log), startup_s=srv.startup_s,
                 retractions_logged=log_text.count(RETRACT_LOG), requests=recs)
    log_line(f"{policy}: {stats['completed']}/{len(recs)} ok, mean latency {stats['latency']['mean']:.2f}s, "
             f"mean TTFT {stats['ttft']['mean']:.2f}s, {stats['throughput_tok_s']:.1f} tok/s, "
             f"peak in flight {stats['peak_in_flight']}")
    if stats["peak_in_flight"] <= args.max_running_requests:
        log_line(f"warning: {policy}: at most {stats['peak_in_flight']} requests in flight <= "
                 f"--max-running-requests {args.max_running_requests}: no waiting queue formed, policies cannot differ")
    return stats


# ---------------------------------------------------------------------------- output


def tables(res: dict, args) -> str:
    stats, comp = res["policies"], res["comparisons"]
    main = markdown_table(
        ["policy", "ok", "failed", "mean lat (s)", "p50 lat", "p99 lat", "mean TTFT (s)", "p50 TTFT", "p99 TTFT",
         "tokens", "tok/s", "peak in flight", "retractions"],
        [[p, s["completed"], s["failed"], s["latency"]["mean"], s["latency"]["p50"], s["latency"]["p99"],
          s["ttft"]["mean"], s["ttft"]["p50"], s["ttft"]["p99"], s["completion_tokens"], s["throughput_tok_s"],
          s["peak_in_flight"], s["retractions_logged"]] for p, s in stats.items()])
    kinds = markdown_table(
        ["policy", "short: n", "mean lat", "p99 lat", "mean TTFT", "long: n", "mean lat", "p99 lat", "mean TTFT"],
        [[p] + [v for k in ("short", "long") for v in (s["by_kind"][k]["n"], s["by_kind"][k]["latency"]["mean"],
                                                        s["by_kind"][k]["latency"]["p99"], s["by_kind"][k]["ttft"]["mean"])]
         for p, s in stats.items()])
    lines = [main, "", "By request kind (latency and TTFT in s):", "", kinds]
    if comp:
        labels = [m[0] for m in METRICS]
        lines += ["", "Each entropic variant relative to each baseline (negative latency / positive throughput = "
                  "entropic better):", "",
                  markdown_table(["comparison"] + labels + ["claim met"],
                                 [[b] + [f"{c['metrics'][l]['rel']:+.1%}" for l in labels] + ["yes" if c["claim_met"] else "no"]
                                  for b, c in comp.items()]), ""]
        for b, c in comp.items():
            worse = [l for l in labels if c["metrics"][l]["better"] is False]
            better = [l for l in labels if c["metrics"][l]["better"] is True]
            lines.append(f"- {b}: loses on {', '.join(worse) or 'nothing'}; wins on {', '.join(better) or 'nothing'}.")
        lines.append("- claim (paper): mean latency -10..15 % and throughput +12..18 % vs baselines; "
                     "'claim met' = mean latency <= -10 % and throughput >= +12 %.")
    if any(s["peak_in_flight"] <= args.max_running_requests for s in stats.values()):
        lines.append("- WARNING: for some policy no waiting queue formed (peak in flight <= --max-running-requests): "
                     "raise --rate or lower --max-running-requests.")
    if not any(s["retractions_logged"] for s in stats.values()):
        lines.append("- No retraction happened in any run (the KV pool never filled), so only the waiting-queue "
                     "order was exercised, not the retraction order.")
    return "\n".join(lines)


def parse_pair(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError("need MIN,MAX with 1 <= MIN <= MAX")
    return lo, hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="number of requests (default 48; quick 6)")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, requests/s (default 1.0; quick 2.0)")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="sglang --max-running-requests for every server (default 4; quick 2): small, so a queue forms")
    ap.add_argument("--policies", default=None,
                    help=f"comma list, run in this order (default fcfs,lpm,hrrn,entropic,entropic-budget; quick "
                         f"fcfs,entropic); "
                         f"choices: {','.join(POLICIES)}")
    ap.add_argument("--seed", type=int, default=1234, help="seeds the request mix and the arrival times")
    ap.add_argument("--max-new-tokens", default=None,
                    help="comma list, each request draws one (default 16,32,64,96,128; quick 8,16)")
    ap.add_argument("--doc-tokens", type=parse_pair, default=None,
                    help="MIN,MAX filler tokens of a long prompt (default 300,800; quick 100,300)")
    ap.add_argument("--long-frac", type=float, default=0.5, help="fraction of long (document) prompts")
    ap.add_argument("--sampled-frac", type=float, default=0.5, help="fraction sampled at --temperature (rest greedy)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--eos", choices=("ignore", "stop"), default="ignore",
                    help="ignore: ignore_eos, identical decode work for every policy (default); stop: stop at EOS")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--server-arg", action="append", default=[], help="extra sglang flag for every server "
                    "(repeatable; use --server-arg=--flag --server-arg=value)")
    ap.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole comparison; each round rotates the policy order by one (server order "
                         "and machine drift then hit every policy alike)")
    ap.add_argument("--decode-budget", type=int, default=None,
                    help="scheduling.decode_budget of entropic-budget (default: half of --max-running-requests)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 6 requests, 8-16 tokens, fcfs vs entropic")
    args = ap.parse_args(argv)
    quick = {"requests": 6, "rate": 2.0, "max_running_requests": 2, "policies": "fcfs,entropic",
             "max_new_tokens": "8,16", "doc_tokens": (100, 300)}
    full = {"requests": 48, "rate": 1.0, "max_running_requests": 4, "policies": "fcfs,lpm,hrrn,entropic,entropic-budget",
            "max_new_tokens": "16,32,64,96,128", "doc_tokens": (300, 800)}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.max_new_tokens = [int(x) for x in str(args.max_new_tokens).split(",") if x.strip()]
    args.device = args.device or default_device()
    bad = [p for p in args.policies if p not in POLICIES]
    if bad or len(set(args.policies)) != len(args.policies) or not args.policies:
        ap.error(f"--policies: unknown or repeated {bad or args.policies}; choices {','.join(POLICIES)}")
    if args.decode_budget is None:
        args.decode_budget = max(1, args.max_running_requests // 2)
    if args.rounds < 1 or args.decode_budget < 1:
        ap.error("--rounds and --decode-budget must be >= 1")
    if args.requests < 1 or args.rate <= 0 or args.max_running_requests < 1 or min(args.max_new_tokens, default=0) < 1:
        ap.error("--requests, --rate, --max-running-requests and --max-new-tokens must be positive")

    from transformers import AutoTokenizer

    model = args.model_path or bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    workload = build_workload(args, tokenizer)
    common = sglang_common_args(model, args.device, args.dtype,
                                ["--max-running-requests", str(args.max_running_requests), *args.server_arg])
    log_line(f"workload: {len(workload)} requests over {workload[-1]['arrival_s']:.1f}s of arrivals, "
             f"{sum(w['kind'] == 'long' for w in workload)} long, {sum(w['sampled'] for w in workload)} sampled, "
             f"{sum(w['payload']['sampling_params']['max_new_tokens'] for w in workload)} max new tokens in all")

    rounds = []
    for r in range(args.rounds):
        order = args.policies[r % len(args.policies):] + args.policies[: r % len(args.policies)]
        log_line(f"round {r + 1}/{args.rounds}: {', '.join(order)}")
        rounds.append({p: run_policy(p, args, common, workload) for p in order})
    stats = {p: pooled([rd[p] for rd in rounds]) for p in args.policies}
    res = {"policies": stats, "comparisons": comparisons(stats),
           "rounds": [{p: {k: v for k, v in st.items() if k != "requests"} for p, st in rd.items()} for rd in rounds]}
    out = {"benchmark": "scheduling_policies", "args": vars(args), "environment": environment(),
           "workload": [{k: v for k, v in w.items() if k != "payload"} | {"sampling_params": w["payload"]["sampling_params"]}
                        for w in workload], **res}
    path = write_json("scheduling_policies", out)
    print("## Scheduling policies at the same offered load: fcfs / lpm / hrrn vs entropic\n")
    print(f"{args.requests} requests ({sum(w['kind'] == 'long' for w in workload)} with {args.doc_tokens[0]}-"
          f"{args.doc_tokens[1]} filler tokens, {sum(w['sampled'] for w in workload)} sampled at T={args.temperature:g}, "
          f"max_new_tokens in {{{','.join(map(str, args.max_new_tokens))}}}, "
          f"{'ignore_eos' if args.eos == 'ignore' else 'stop at EOS'}), Poisson arrivals at {args.rate:g}/s (seed "
          f"{args.seed}), --max-running-requests {args.max_running_requests}, entropic-budget decodes at most "
          f"{args.decode_budget} per step, {args.dtype} on {args.device}, one server per policy and round, "
          f"{args.rounds} round(s) in rotated order: differences of a few % are within run-to-run noise on a "
          f"shared CPU.\n")
    print(tables(res, args))
    if args.rounds > 1:
        print("\nPer round, then the median over rounds (min-max):\n")
        print(round_spread(rounds, args.policies))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
