"""The SGLang adapter's overhead per update, against the same update's transport time.

    python engines/bench_sglang_overhead.py [--engines 8] [--tp 8] [--updates 5] [--json]

Runs the product's path on this machine: the gateway (``awex-cli serve``), ``--engines``
stand-in SGLang servers (``engines/sglang_standin.py --mode numpy``: SGLang 0.5.23's HTTP
routes and update session, one process per TP rank, each calling the real
``awex.sglang.receive`` on float32 parameters with SGLang's names and shapes), and one training
rank (``awex.Writer``, FSDP ``dp=1``, shm) sending a Qwen3-shaped model (28 layers, 311 tensors
per rank by default, small hidden size so that 64 ranks fit a small machine).

Per update it prints, from the engines' own clocks (the stand-ins log each call's arrival and
answer, the loader keeps its timings in ``awex.sglang.last_call``):

- ``total``: from the controller's ``update`` call until the last engine answered
  ``continue_generation`` (it serves again);
- ``transfer``: the slowest rank's transport time (``Reader.update``'s ``seconds``: its bytes
  moving, including waiting for the writer's data);
- ``overhead`` = total - transfer: the gateway's session calls (pause, begin, the trigger, end,
  continue) and the loader's entry and exit;
- where the overhead goes: ``pause+begin`` (controller call until the slowest engine's begin
  answered), ``to-trigger`` (until the last trigger arrived), ``entry`` / ``exit`` (slowest
  loader, before / after its receive; ``status`` / ``check``: the slowest rank's question to
  the gateway and parameter check within its entry), ``wait`` (the slowest rank's ``Reader.update`` minus
  its transfer: fetching the event, reporting), ``to-end`` (the last trigger answered until the
  last ``end_weight_update`` answered: every rank's report, the gateway's settle),
  ``to-continue`` (until the last ``continue_generation`` answered: commit, resume);
- ``floor``: the same five session calls on every stand-in without the gateway, the trigger
  carrying the warm-up's empty payload (each loader is called and returns at once): the
  stand-ins' own HTTP and process dispatch and the loader calls waking, on this machine;
- ``rank_cpu`` / ``loader_cpu``: CPU time the loaders spent outside their receive (entry and
  exit), the most one rank spent and all ranks together. With fewer cores than ranks (64 ranks
  here on a small machine) the ranks' entries queue for the cores: ``loader_cpu / cores`` is
  then a floor under the entry, which a server with a core per rank does not pay.

The gateway binary is ``$AWEX_CLI``, else ``target/release/awex-cli``, else
``target/debug/awex-cli``; the Python package is whatever ``import awex`` finds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STANDIN = os.path.join(HERE, "sglang_standin.py")
LOADER = "awex.sglang.receive"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 60) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def awex_cli() -> str:
    for c in (os.environ.get("AWEX_CLI"), f"{ROOT}/target/release/awex-cli", f"{ROOT}/target/debug/awex-cli",
              shutil.which("awex-cli")):
        if c and os.path.exists(c):
            return c
    sys.exit("no awex-cli binary (cargo build --release -p awex-cli, or set AWEX_CLI)")


def write_config(path: str, args: argparse.Namespace) -> str:
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": args.hidden,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": args.hidden // 8,
        "intermediate_size": args.hidden * 2, "num_hidden_layers": args.layers, "vocab_size": args.vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


class Standins:
    """``n`` stand-in servers, started at once."""

    def __init__(self, n: int, tp: int, model: str, gateway: str, pair: str) -> None:
        self.procs = []
        for e in range(n):
            env = dict(os.environ, AWEX_GATEWAY=gateway, AWEX_PAIR=pair, AWEX_ENGINE=str(e))
            self.procs.append(subprocess.Popen(
                [sys.executable, STANDIN, "--model-path", model, "--tp", str(tp), "--mode", "numpy",
                 "--custom-weight-loader", LOADER], stdout=subprocess.PIPE, env=env, text=True))
        self.urls = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"a stand-in exited with {p.wait()}")
            self.urls.append(json.loads(line)["url"])

    def states(self) -> list[dict[str, Any]]:
        return [get(u + "/standin/state") for u in self.urls]

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def one_update(ctl: Any, w: Any, s: Standins, version: int, marks: list[int]) -> dict[str, float]:
    """Runs ``version`` and measures it from the engines' logs (entries after ``marks``)."""
    out: dict[str, Any] = {}

    def send() -> None:
        try:
            out["writer"] = w.update(version, timeout=300)
        except Exception as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t0 = time.time()
    st = ctl.update(version, timeout=300)
    t.join(300)
    if "error" in out or st["state"] != "committed":
        raise RuntimeError(f"version {version} did not commit: {st} {out.get('error')}")
    # the engines answer continue_generation after the commit: wait for every one
    for _ in range(500):
        states = s.states()
        if all(any(e["route"] == "/continue_generation" and "done" in e for e in st_["log"][m:])
               for st_, m in zip(states, marks)):
            break
        time.sleep(0.01)
    else:
        raise RuntimeError(f"not every engine was resumed after version {version}")
    calls: dict[str, list[dict[str, Any]]] = {}
    timings: list[dict[str, Any]] = []
    for i, (state, m) in enumerate(zip(states, marks)):
        for e in state["log"][m:]:
            calls.setdefault(e["route"], []).append(e)
        marks[i] = len(state["log"])
        for lt in state["loader_timings"]:
            if lt["weight_version"] == str(version):
                timings += [r for r in lt["ranks"] if r]
    if len(timings) != sum(len(lt_["ranks"]) for st_ in states for lt_ in st_["loader_timings"]
                           if lt_["weight_version"] == str(version)):
        raise RuntimeError("a rank's loader kept no timings (is this awex.sglang.receive?)")

    def last(route: str, key: str) -> float:
        return max(e[key] for e in calls[route])

    total = last("/continue_generation", "done") - t0
    transfer = max(r["transfer_s"] for r in timings)
    waits = max(r["receive_s"] - r["transfer_s"] for r in timings)
    ms = 1e3
    return {
        "version": version,
        "total_ms": total * ms,
        "transfer_ms": transfer * ms,
        "overhead_ms": (total - transfer) * ms,
        "pause_begin_ms": (last("/begin_weight_update", "done") - t0) * ms,
        "to_trigger_ms": (last("/update_weights_from_tensor", "t") - last("/begin_weight_update", "done")) * ms,
        "entry_ms": max(r["entry_s"] for r in timings) * ms,
        "status_ms": max(r.get("status_s", 0.0) for r in timings) * ms,
        "check_ms": max(r.get("check_s", 0.0) for r in timings) * ms,
        "wait_ms": waits * ms,
        "exit_ms": max(r["exit_s"] for r in timings) * ms,
        "to_end_ms": (last("/end_weight_update", "done") - last("/update_weights_from_tensor", "done")) * ms,
        "to_continue_ms": (last("/continue_generation", "done") - last("/end_weight_update", "done")) * ms,
        # CPU seconds every loader spent outside its receive, all ranks together, and the most
        # one rank spent: on a machine with fewer cores than ranks, the sum / cores bounds the
        # entry and exit from below
        "loader_cpu_ms": sum(r.get("entry_cpu_s", 0.0) + r.get("exit_cpu_s", 0.0) for r in timings) * ms,
        "rank_cpu_ms": max(r.get("entry_cpu_s", 0.0) + r.get("exit_cpu_s", 0.0) for r in timings) * ms,
        "ranks": len(timings),
        "bytes_per_rank": statistics.mean(r["bytes"] for r in timings),
    }


def post(url: str, body: dict[str, Any], timeout: float = 120) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def session_floor(urls: list[str], tp: int) -> float:
    """The floor under the adapter's overhead on this machine, in ms: the same five session calls
    on every stand-in at once (one thread per server, as the gateway calls them concurrently),
    whose trigger carries the warm-up's empty payload, so that every TP process's loader is
    called and returns without receiving anything (its Reader is joined). What remains is the
    stand-ins' HTTP and process dispatch and 64 loader calls waking on this machine's cores:
    no gateway, no awex update, no bytes."""
    sys.path.insert(0, HERE)
    from sglang_standin import EMPTY_PAYLOAD_B64

    def session(url: str) -> None:
        post(url + "/pause_generation", {"mode": "retract"})
        post(url + "/begin_weight_update", {"selector": "target"})
        post(url + "/update_weights_from_tensor", {"serialized_named_tensors": [EMPTY_PAYLOAD_B64] * tp,
                                                   "load_format": LOADER, "flush_cache": True,
                                                   "selector": "target"})
        post(url + "/end_weight_update", {})
        post(url + "/continue_generation", {})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3


COLUMNS = ["version", "total_ms", "transfer_ms", "overhead_ms", "pause_begin_ms", "to_trigger_ms", "entry_ms",
           "status_ms", "check_ms", "wait_ms", "exit_ms", "to_end_ms", "to_continue_ms", "rank_cpu_ms",
           "loader_cpu_ms"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--updates", type=int, default=5, help="measured updates (after one unmeasured)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--join-deadline-s", type=float, default=120.0,
                   help="the pair's join deadline: a rank that cannot join fails the run then")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)

    import awex

    work = tempfile.mkdtemp(prefix="awex-bench-sglang-")
    model = write_config(os.path.join(work, "model"), args)
    port = free_port()
    gw = f"http://127.0.0.1:{port}"
    cli = awex_cli()
    gateway = subprocess.Popen([cli, "serve", "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    s = w = None
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(gw + "/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        pair = f"bench-{os.getpid()}"
        t_start = time.monotonic()
        s = Standins(args.engines, args.tp, model, gw, pair)
        t_servers = time.monotonic() - t_start
        ctl = awex.Controller(gw)
        ctl.connect(pair, model=model, train="fsdp:dp=1", infer=f"sglang:tp={args.tp},engines={args.engines}",
                    transport="shm", urls=s.urls, join_deadline_s=args.join_deadline_s, update_deadline_s=300)
        w = awex.Writer(gw, pair, 0)
        w.register([(t["name"], np.zeros(t["shape"], np.float32)) for t in w.layout()])
        w.join(timeout=args.join_deadline_s + 10)
        t_joined = time.monotonic() - t_start
        marks = [len(st["log"]) for st in s.states()]
        warm = one_update(ctl, w, s, 1, marks)
        rows = [one_update(ctl, w, s, v, marks) for v in range(2, args.updates + 2)]
        floors = [session_floor(s.urls, args.tp) for _ in range(args.updates)]
    finally:
        if w is not None:
            w.close()
        if s is not None:
            s.close()
        gateway.terminate()
        gateway.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in COLUMNS[1:]}
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    result = {
        "engines": args.engines, "tp": args.tp, "ranks": rows[0]["ranks"], "bytes_per_rank": rows[0]["bytes_per_rank"], "gateway": cli, "awex": awex.__file__,
        "cores": cores, "servers_ready_s": t_servers, "joined_s": t_joined, "load_average": load, "first": warm,
        "updates": rows, "median": med, "goal_overhead_ms": 5.0, "goal_met": med["overhead_ms"] <= 5.0,
        "floor_ms": floors, "floor_median_ms": statistics.median(floors),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.engines} engines x tp {args.tp} = {rows[0]['ranks']} loader calls per update, "
          f"{rows[0]['bytes_per_rank'] / 2**20:.2f} MiB per rank; gateway {cli}; awex {awex.__file__}")
    print(f"servers ready in {t_servers:.1f} s, pair joined at {t_joined:.1f} s; {cores} cores, load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("  ".join(f"{c.replace('_ms', ''):>10}" for c in COLUMNS))
    for r in [warm, *rows]:
        print("  ".join(f"{r[c]:>10.1f}" if c != "version" else f"{r[c]:>10d}" for c in COLUMNS)
              + ("   (first, not counted)" if r is warm else ""))
    print("  ".join([f"{'median':>10}"] + [f"{med[c]:>10.1f}" for c in COLUMNS[1:]]))
    fl = result["floor_median_ms"]
    print(f"floor: the stand-ins' session with loader calls that receive nothing, no gateway: median {fl:.1f} ms "
          f"({', '.join(f'{f:.1f}' for f in floors)})")
    print(f"overhead per update (median) {med['overhead_ms']:.1f} ms against a goal of <= 5 ms: "
          f"{'met' if result['goal_met'] else 'NOT met'}; the floor alone is {fl:.1f} ms on this machine"
          + (" (the goal is below what the stand-ins' session costs here)" if fl > 5.0 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
