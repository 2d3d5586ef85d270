"""Shared pieces of the benchmarks: server subprocesses, a bounded concurrent client, timing, output.

Everything talks to 127.0.0.1 only. A server runs in its own process group (its scheduler and
detokenizer are children) and the whole group is killed on stop, on normal exit, on Ctrl-C and
on SIGTERM. Logs go to a file under benchmarks/results/logs/.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import requests

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS_DATA = ROOT / "docs" / "data"  # what the docs and benchmarks/figures.py read
LOG_DIR = RESULTS_DIR / "logs"
HOST = "127.0.0.1"
CONFIG_ENV = "SGLANG_ENTROPIC_CONFIG"  # = sgl_entropic.config.CONFIG_ENV (not imported: keeps this light)

# ---------------------------------------------------------------------------- chat prompts


def chat(question: str) -> str:
    """The chatml wrapping the bundled model was tuned on."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def bundled_model() -> str:
    from sgl_entropic.model import prepare_bundled_model

    return str(prepare_bundled_model())


def data_name(name: str, model: str) -> str:
    """The published data's name for a shipped model: the bundled one's is `name`, another's `name_<model>`."""
    from sgl_entropic.model import BUNDLED

    return name if model == BUNDLED else f"{name}_{model}"


def model_dims(model_path: str, dtype: str):
    """The served model's shape, for the cost formulas (sgl_entropic.costs), from its own config."""
    from transformers import AutoConfig

    from sgl_entropic.costs import ModelDims

    bytes_per_element = {"float32": 4, "fp32": 4}.get(dtype, 2)
    return ModelDims.from_hf_config(AutoConfig.from_pretrained(model_path), kv_bytes_per_element=bytes_per_element)


def sglang_common_args(model_path: str, device: str, dtype: str, extra: Sequence[str] = ()) -> list[str]:
    """The flags both servers get, spelled out so that stock and ours run the same settings."""
    args = ["--model-path", model_path, "--device", device, "--dtype", dtype, "--host", HOST]
    from sgl_entropic.model import bundled_model_path

    if "--max-total-tokens" not in extra:  # SGLang's CPU default sizes the pool from the machine's memory
        args += ["--max-total-tokens", "65536"]
    if Path(model_path) == bundled_model_path():
        args += ["--chat-template", "chatml"]
    return args + list(extra)


def stock_command(port: int, common_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--port", str(port), *common_args]


def ours_command(port: int, common_args: Sequence[str], mode: str, config: Optional[dict] = None) -> list[str]:
    cmd = [sys.executable, "-m", "sgl_entropic.launch_server", "--port", str(port), "--entropic", mode]
    if config:
        cmd += ["--entropic-config", json.dumps(config)]
    return cmd + list(common_args)


def server_env(device: str, stock: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Stock must not see our config: without it the plugin registers nothing (truly stock SGLang).
    env.pop(CONFIG_ENV, None)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # ours sets this itself; set for both, same environment
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(var, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


_live: dict[int, subprocess.Popen] = {}


def _kill_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The launcher may be gone while children of its group linger: always sweep the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a server started here: its whole process group, and forget it. A short grace: on SIGTERM SGLang
    sees its scheduler die and sleeps 5 s for crash diagnostics, which a stopped server does not need."""
    _kill_group(proc, grace_s=2.0)
    _live.pop(proc.pid, None)


def _kill_all_live() -> None:
    for proc in list(_live.values()):
        _kill_group(proc, grace_s=10.0)
    _live.clear()


def _on_signal(signum, frame):
    _kill_all_live()
    raise SystemExit(128 + signum)


atexit.register(_kill_all_live)
signal.signal(signal.SIGTERM, _on_signal)


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    startup_s: float = 0.0

    def stop(self) -> None:
        stop_process(self.proc)

    def info(self) -> dict:
        try:
            r = _session().get(self.url + "/server_info", timeout=30)
            return r.json() if r.ok else {}
        except requests.RequestException:
            return {}

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    name: str, cmd: list[str], port: int, env: dict[str, str], timeout_s: float = 600, log: Optional[Path] = None
) -> Server:
    """Start `cmd` in its own process group, wait for GET /health == 200, return the Server (the one harness of
    the benchmarks and the tests, tests/conftest.py; its log in `log`, by default under benchmarks/results/logs)."""
    if log is None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = LOG_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"
    out = open(log, "w")
    out.write("$ " + " ".join(cmd) + "\n")
    out.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    _live[proc.pid] = proc
    url = f"http://{HOST}:{port}"
    server = Server(name, url, proc, log)
    sess = _session()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{name}: server exited with {proc.returncode}; log {log}:\n{_tail(log)}")
        try:
            if sess.get(url + "/health", timeout=5).status_code == 200:
                server.startup_s = time.monotonic() - t0
                log_line(f"{name}: ready on {url} after {server.startup_s:.0f}s (log {log})")
                return server
        except requests.RequestException:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"{name}: not ready after {timeout_s:.0f}s; log {log}:\n{_tail(log)}")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------- client


def bench_client(
    url: str, model: str, args: Sequence[str], out: Path, device: str = "cpu", timeout_s: float = 7200
) -> dict:
    """One run of SGLang's bench client (`python -m sglang.benchmark.serving`) against `url` with `args` (dataset,
    load, backend): the JSON line it writes last to `out`, with its command under "client_command"; its output in
    `out` with suffix .log. A client that fails or writes nothing is an error carrying its output's tail."""
    cmd = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--output-file",
        str(out),
        *args,
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=server_env(device, stock=True), timeout=timeout_s
        )
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench client failed ({proc.returncode}); log {log}:\n{_tail(log, 3000)}")
    result = json.loads(out.read_text().strip().splitlines()[-1])
    result["client_command"] = cmd
    return result


def _session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # loopback: never through a proxy from the environment
    return s


@dataclass
class Result:
    """One /generate call: the response JSON (or the error) and the client-side latency."""

    payload: dict
    latency_s: float
    response: Optional[dict] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.response is not None

    @property
    def meta(self) -> dict:
        return (self.response or {}).get("meta_info", {})

    @property
    def output_ids(self) -> list[int]:
        return list((self.response or {}).get("output_ids") or [])

    @property
    def completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens", 0))


def generate(url: str, payload: dict, timeout_s: float = 600, session: Optional[requests.Session] = None) -> Result:
    sess = session or _session()
    t0 = time.perf_counter()
    try:
        r = sess.post(url + "/generate", json=payload, timeout=timeout_s)
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            return Result(payload, latency, error=f"HTTP {r.status_code}: {r.text[:500]}")
        return Result(payload, latency, response=r.json())
    except requests.RequestException as err:
        return Result(payload, time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")


@dataclass
class Batch:
    results: list[Result]
    wall_s: float

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.results if not r.ok]

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results if r.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def run_batch(url: str, payloads: Sequence[dict], concurrency: int, timeout_s: float = 600) -> Batch:
    """Send all payloads with at most `concurrency` in flight; results keep the input order."""
    concurrency = max(1, min(concurrency, len(payloads)))
    sessions = [_session() for _ in range(concurrency)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(generate, url, p, timeout_s, sessions[i % concurrency]) for i, p in enumerate(payloads)]
        results = [f.result() for f in futures]
    return Batch(results, time.perf_counter() - t0)


def require_ok(batch: Batch, what: str) -> Batch:
    if batch.errors:
        raise RuntimeError(
            f"{what}: {len(batch.errors)}/{len(batch.results)} requests failed, first: {batch.errors[0]}"
        )
    return batch


def stream_one(url: str, payload: dict, t_send_target: float, timeout_s: float) -> dict:
    """Wait until the arrival time, POST /generate with stream, time the first token and the end."""
    delay = t_send_target - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    sess = _session()
    t0 = time.perf_counter()
    rec = {
        "send": t0,
        "first": None,
        "finish": None,
        "error": None,
        "completion_tokens": 0,
        "prompt_tokens": None,
        "cached_tokens": None,
        "finish_reason": None,
        "chunks": 0,
    }
    try:
        with sess.post(url + "/generate", json=payload, stream=True, timeout=(10, timeout_s)) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
            else:
                last = None
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        break
                    chunk = json.loads(body)
                    if "error" in chunk:
                        rec["error"] = f"stream error: {str(chunk['error'])[:300]}"
                        break
                    rec["chunks"] += 1
                    meta = chunk.get("meta_info") or {}
                    if rec["first"] is None and (chunk.get("text") or meta.get("completion_tokens", 0) >= 1):
                        rec["first"] = time.perf_counter()
                    last = chunk
                    if time.perf_counter() - t0 > timeout_s:
                        rec["error"] = f"timeout after {timeout_s:.0f}s"
                        break
                if rec["error"] is None:
                    if last is None:
                        rec["error"] = "empty stream"
                    else:
                        meta = last.get("meta_info") or {}
                        finish = meta.get("finish_reason")
                        rec.update(meta=meta, text=last.get("text"), output_ids=last.get("output_ids"))
                        rec.update(
                            completion_tokens=int(meta.get("completion_tokens", 0)),
                            prompt_tokens=meta.get("prompt_tokens"),
                            cached_tokens=meta.get("cached_tokens"),
                            finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
                        )
                        if isinstance(finish, dict) and finish.get("type") == "abort":
                            rec["error"] = f"aborted: {finish.get('message')}"
    except (requests.RequestException, ValueError) as err:
        rec["error"] = f"{type(err).__name__}: {err}"
    rec["finish"] = time.perf_counter()
    return rec


# ---------------------------------------------------------------------------- timing and stats


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(x for x in xs if x is not None and x == x)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0


def median(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def pvariance(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.pvariance(xs) if len(xs) > 1 else float("nan")


# ---------------------------------------------------------------------------- output


def log_line(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> dict[str, Any]:
    """The CPU and its bf16 support: bf16 matmuls without AVX512-BF16/AMX run several times slower than fp32."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return {
        "cpu_model": name,
        "cpu_bf16_flags": sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512f")),
    }


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
        **cpu_model(),
    }
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        info["git_dirty"] = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        pass
    for mod in ("sglang", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - best effort
            pass
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "n/a"
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, data: dict, publish: Optional[str] = None, unpublished: tuple[str, ...] = ()) -> Path:
    """A timestamped copy in benchmarks/results/; with `publish`, also docs/data/<publish>.json, the data
    the docs and figures read, with the command and the commit (environment) that produced it, less the
    `unpublished` keys (per-request records: the summaries are what the docs read)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(_clean(data), indent=2, allow_nan=False) + "\n")
    if publish:
        head = {"command": " ".join(["python", *sys.argv])}
        if "environment" not in data:  # most benchmarks record it already
            head["environment"] = environment()
        data = {**head, **{k: v for k, v in data.items() if k not in unpublished}}
        (DOCS_DATA / f"{publish}.json").write_text(json.dumps(_clean(data), indent=1, allow_nan=False) + "\n")
    return path


def _clean(o: Any) -> Any:
    """Strict JSON: NaN/inf become null, paths become strings."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and (o != o or o in (float("inf"), float("-inf"))):
        return None
    if isinstance(o, Path):
        return str(o)
    return o
