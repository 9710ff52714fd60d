"""The live fixtures' own helpers (``serve.py``, ``ports.py``): no server packages needed.

On 2026-12-03 the live SGLang server's uvicorn found the port the fixture had picked taken
("[Errno 98] ... address already in use"): the port came from ``bind(0)``, inside the kernel's
ephemeral range, and something took it while the server's TP ranks started; the server stayed up
without listening and the fixture waited its whole start-up limit (780 s) before failing.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import serve

sys.path.insert(0, os.path.dirname(serve.HERE))
import ports  # noqa: E402


def test_free_port_lies_outside_the_kernels_ephemeral_range_binds_and_is_never_given_twice() -> None:
    low, high = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(64)]
    assert len(set(got)) == len(got), f"a port given twice: {sorted(got)}"
    for port in got:
        assert not low <= port <= high, f"port {port} lies inside the ephemeral range [{low}, {high}]"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_range_reads_the_kernels_file_and_falls_back_to_linuxs_default(tmp_path) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


#: a stand-in HTTP server: the first start logs uvicorn's bind failure and stays up without
#: listening (what the SGLang server did), every later start answers /health on its port
FLAKY = textwrap.dedent("""
    import http.server, os, sys, time
    port, marker = int(sys.argv[1]), sys.argv[2]
    if not os.path.exists(marker):
        open(marker, "w").close()
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        while True:
            time.sleep(60)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_a_server_whose_port_was_taken_is_stopped_and_started_again_on_another_port(tmp_path) -> None:
    script, marker = tmp_path / "flaky.py", tmp_path / "started-once"
    script.write_text(FLAKY)
    procs: list[serve.Proc] = []
    try:
        # a deadline the first attempt would run out: only the log's bind failure ends it early
        proc, url, _ = serve.start_http("the flaky server", lambda port: [sys.executable, str(script), str(port), str(marker)],
                                        str(tmp_path / "flaky.log"), "/health", 240, procs)
        assert len(procs) == 2 and procs[1] is proc
        assert not procs[0].alive(), "the server whose port was taken still runs"
        assert os.path.exists(tmp_path / "flaky.log") and proc.log == str(tmp_path / "flaky-2.log")
        assert serve.http(url + "/health", timeout=30)[0] == 200
        assert "address already in use" in serve.tail(procs[0].log)
    finally:
        for p in reversed(procs):
            p.stop(grace_s=5)


def test_a_port_taken_on_every_attempt_fails_naming_the_server_and_its_log(tmp_path) -> None:
    script = tmp_path / "taken.py"
    script.write_text("import time\nprint('OSError: [Errno 98] Address already in use', flush=True)\ntime.sleep(600)\n")
    procs: list[serve.Proc] = []
    try:
        try:
            serve.start_http("the unlucky server", lambda port: [sys.executable, str(script)],
                             str(tmp_path / "s.log"), "/health", 240, procs, attempts=2)
        except serve.PortTaken as e:
            assert "the unlucky server" in str(e) and "s-2.log" in str(e)
        else:
            raise AssertionError("start_http returned though every attempt's port was taken")
        assert len(procs) == 2 and not any(p.alive() for p in procs)
    finally:
        for p in procs:
            p.stop(grace_s=5)


# --- the docs' server commands, which the live tests read and run (serve.shell_command) ---

#: what each live test sets for its docs command (the names the blocks may use)
VLLM_VALUES = dict(GATEWAY="http://127.0.0.1:1", PAIR="p", MODEL="/m", PORT="{port}", VLLM_VENV="/vv", PATH="/bin")
SGLANG_VALUES = dict(GATEWAY="http://127.0.0.1:1", PAIR="p", MODEL="/m", PORT="{port}", VENV="/v", SGLANG_PKGS="/s",
                     PWD="/r")


def test_shell_command_runs_what_bash_runs(tmp_path) -> None:
    # the block's program replaced by one that prints its arguments and environment: bash and
    # the parser must agree on every word (quotes, `$` inside and outside quotes, backslashes)
    printer = tmp_path / "printer"
    printer.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                       "print(json.dumps([sys.argv[1:], {k: os.environ[k] for k in ('A', 'B', 'C')}]))\n")
    printer.chmod(0o755)
    block = ("# a comment\n"
             "env A='0|1' B=\"$X/y:$Z\" C=plain \\\n"
             f"  {printer} serve \"$M\" --port \"$PORT\" --cfg '{{\"backend\": \"awex\"}}' \\\n"
             "  --path \"${X}/z\" last\n")
    values = dict(X="/x x", Z="/z", M="/models/m", PORT="8000")
    got_env, got_argv = serve.shell_command(block, values)
    import json
    import subprocess

    out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **values)).stdout
    argv, env = json.loads(out)
    assert got_argv == [str(printer)] + argv
    assert got_env == env


def test_shell_command_refuses_a_variable_the_test_does_not_set_and_two_commands() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"uses \$NEW, which the test does not set"):
        serve.shell_command('env A="$NEW" prog\n', {})
    with pytest.raises(ValueError, match="must hold one command, not 2"):
        serve.shell_command("prog a\nprog b\n", {})
    with pytest.raises(ValueError, match=r"an unquoted \$: \$X/y"):
        serve.shell_command("prog $X/y\n", {"X": "x"})
    with pytest.raises(ValueError, match="mixes single quotes and"):
        serve.shell_command("prog '$X'\n", {"X": "x"})


def test_the_vllm_pages_cpu_command_sets_what_the_cpu_build_needs() -> None:
    env, argv = serve.shell_command(serve.doc_block("docs/vllm.md", "vllm-cpu"), VLLM_VALUES)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["AWEX_GATEWAY"] == VLLM_VALUES["GATEWAY"]
    assert env["PATH"].startswith("/vv/bin:")
    assert argv[:3] == ["/vv/bin/vllm", "serve", "/m"]
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "awex"}'
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    env1, argv1 = serve.with_tp(env, argv, 1)
    assert env1["VLLM_CPU_OMP_THREADS_BIND"] == "0" and argv1[argv1.index("--tensor-parallel-size") + 1] == "1"
    # a bf16 model (the live Qwen3.5: vLLM's CPU Gated DeltaNet runs in bf16 only) takes its dtype
    assert argv[argv.index("--dtype") + 1] == "float32"
    bf16 = serve.with_flag(argv, "--dtype", "bfloat16")
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16" and len(bf16) == len(argv)
    assert argv[argv.index("--dtype") + 1] == "float32"  # the command itself is left as it was
    import pytest

    with pytest.raises(ValueError, match="has no --no-such-flag"):
        serve.with_flag(argv, "--no-such-flag", "x")


def test_the_sglang_pages_cpu_command_sets_what_the_cpu_engine_needs() -> None:
    env, argv = serve.shell_command(serve.doc_block("docs/sglang.md", "sglang-cpu"), SGLANG_VALUES)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert not os.path.exists(env["SGLANG_NCCL_SO_PATH"])
    assert env["PYTHONPATH"].split(":") == ["/r/engines/tests/live/cpu_kernels", "/s"]
    assert os.path.isdir(os.path.join(serve.ROOT, "engines/tests/live/cpu_kernels/sgl_kernel"))
    assert argv[:3] == ["/v/bin/python", "-m", "sglang.launch_server"]
    for flag, value in (("--max-total-tokens", "4096"), ("--device", "cpu"), ("--tp", "2"),
                        ("--custom-weight-loader", "awex.sglang.receive")):
        assert argv[argv.index(flag) + 1] == value, flag


def test_the_gpu_commands_carry_the_cpu_commands_awex_settings() -> None:
    # the GPU command users run is not run here: it must at least hold every awex setting of
    # the CPU command the live tests run
    for doc, cpu, gpu, values in (("docs/vllm.md", "vllm-cpu", "vllm-gpu", VLLM_VALUES),
                                  ("docs/sglang.md", "sglang-cpu", "sglang-gpu", SGLANG_VALUES)):
        cpu_env, cpu_argv = serve.shell_command(serve.doc_block(doc, cpu), values)
        cmds = serve.commands(serve.doc_block(doc, gpu))
        assert cmds[0].startswith("pip install awex-"), (doc, cmds[0])
        gpu_env, gpu_argv = serve.shell_command(cmds[-1], {})
        awex_keys = {k for k in cpu_env if k.startswith("AWEX_")} | {"VLLM_SERVER_DEV_MODE"} & set(cpu_env)
        assert awex_keys <= set(gpu_env), (doc, awex_keys - set(gpu_env))
        for flag in ("--weight-transfer-config", "--custom-weight-loader"):
            if flag in cpu_argv:
                assert gpu_argv[gpu_argv.index(flag) + 1] == cpu_argv[cpu_argv.index(flag) + 1], (doc, flag)
