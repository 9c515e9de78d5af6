"""The bench scripts' baseline plumbing that needs neither vLLM nor a model: the command lines they build,
the vLLM environment, the check of output lengths and the tables (vLLM itself runs only in the scripts)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.paths import load_script

bench_serving = load_script("bench_serving")
plot_itl = load_script("plot_itl")
bench_throughput = load_script("bench_throughput")
baselines = bench_serving.baselines  # the module the scripts call (loading it again would make a second copy)


def client_result(output_lens: list[int], throughput: float, ttft: float) -> dict:
    """The fields `vllm bench serve --save-result --save-detailed` writes that the table reads."""
    return {"completed": sum(1 for n in output_lens if n), "failed": sum(1 for n in output_lens if not n),
            "output_throughput": throughput, "output_lens": output_lens,
            "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": 10.0,
            "mean_itl_ms": 10.0, "p99_itl_ms": 20.0}


def test_serving_table_rows_and_ratios():
    jax = bench_serving.summarize_client_result("jaxserve", client_result([16, 16, 16], 300.0, 50.0), 16)
    vllm = bench_serving.summarize_client_result("vllm", client_result([16, 16, 0], 100.0, 100.0), 16)
    assert (jax["completed"], jax["failed"], jax["wrong_length"]) == (3, 0, 0)
    assert (vllm["completed"], vllm["failed"], vllm["wrong_length"]) == (2, 1, 1)
    lines = bench_serving.comparison_table([jax, vllm]).splitlines()
    assert lines[0].startswith("| server | ok / failed / wrong length | output tok/s | mean TTFT ms")
    assert lines[2] == "| jaxserve | 3 / 0 / 0 | 300.0 | 50.0 | 50.0 | 100.0 | 10.0 | 10.0 | 20.0 |"
    assert lines[4] == "| jaxserve / vllm | | 3.00x | 0.50x | 0.50x | 0.50x | 1.00x | 1.00x | 1.00x |"
    assert len(bench_serving.comparison_table([jax]).splitlines()) == 3  # one server: no ratio row


def test_client_command_matches_the_served_name(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()  # a vLLM virtualenv as the install script leaves it
    monkeypatch.setattr(baselines, "VLLM_VENV", tmp_path)
    args = argparse.Namespace(random_input_len=256, random_output_len=128, num_prompts=64, request_rate=2.0,
                              seed=0, max_concurrency=None, temperature=0.0, top_p=None)
    cmd = bench_serving.client_command(args, 1234, Path("/tmp/results"), "vllm.json")
    assert cmd[:3] == [str(tmp_path / "bin" / "vllm"), "bench", "serve"]
    flag = dict(zip(cmd[3:], cmd[4:], strict=False))
    assert flag["--base-url"] == "http://127.0.0.1:1234"
    assert flag["--model"] == bench_serving.SERVED_MODEL_NAME
    assert (flag["--random-output-len"], flag["--request-rate"], flag["--num-prompts"]) == ("128", "2.0", "64")
    assert "--ignore-eos" in cmd and "--save-detailed" in cmd and "--max-concurrency" not in cmd
    assert flag["--temperature"] == "0.0" and "--top-p" not in cmd
    sampled = bench_serving.client_command(argparse.Namespace(**{**vars(args), "temperature": 1.0, "top_p": 0.95}),
                                           1234, Path("/tmp/results"), "vllm.json")
    sampled_flag = dict(zip(sampled[3:], sampled[4:], strict=False))
    assert (sampled_flag["--temperature"], sampled_flag["--top-p"]) == ("1.0", "0.95")
    assert bench_serving.sampling_fields(argparse.Namespace(temperature=1.0, top_p=0.95)) == {
        "temperature": 1.0, "top_p": 0.95}
    server, _ = bench_serving.server_command(argparse.Namespace(max_model_len=2048, dtype="float32"), "jaxserve", 1)
    assert server[server.index("--served-model-name") + 1] == bench_serving.SERVED_MODEL_NAME


def test_the_prefill_or_decode_server_runs_the_shipped_cpu_grid_without_its_mixed_table(tmp_path):
    from jaxserve.core.buckets import BucketSpec, load_bucket_spec

    args = argparse.Namespace(max_model_len=2048, dtype="auto", result_dir=str(tmp_path), jaxserve_args="--seed 3")
    server, _ = bench_serving.server_command(args, bench_serving.PREFILL_OR_DECODE, 1)
    assert server[-2:] == ["--seed", "3"]
    spec = BucketSpec.from_toml(server[server.index("--buckets") + 1])
    shipped = load_bucket_spec("cpu")
    assert shipped.mixed_token_counts and not spec.mixed_token_counts and not spec.mixed_batch_sizes
    assert spec.replace(source="") == shipped.replace(source="", mixed_batch_sizes=(), mixed_token_counts=(),
                                                      mixed_token_budget=None)


def test_itl_points_put_every_gap_at_its_token_arrival():
    result = {"start_times": [10.0, 10.5], "ttfts": [0.2, 0.1], "itls": [[0.05, 0.03], [0.04]]}
    times, gaps = plot_itl.itl_points(result)
    assert times.tolist() == pytest.approx([0.25, 0.28, 0.64])
    assert gaps.tolist() == pytest.approx([50.0, 30.0, 40.0])
    seconds, largest, mean = plot_itl.per_second(times + [0.0, 0.0, 1.0], gaps)  # seconds 0, 0 and 1
    assert seconds.tolist() == [0.5, 1.5] and largest.tolist() == [50.0, 40.0] and mean.tolist() == [40.0, 40.0]
    svg = plot_itl.itl_svg("t", [("jaxserve", times, gaps)])
    assert svg.count("<polyline") == 2 and "mean 40 ms, P99 50 ms" in svg  # largest and mean per second


def test_vllm_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = baselines.vllm_env(kv_cache_gib=3, omp_threads_bind="0-1", reserved_cpus=0)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "PYTHONPATH" not in env  # jaxserve's path is not for the vLLM virtualenv
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in baselines.vllm_env(reserved_cpus=None)


def test_token_count_check_and_throughput_table():
    requests = [([1, 2], 3), ([4], 5)]
    bench_throughput.check_token_counts("x", [3, 5], requests)
    with pytest.raises(AssertionError, match=r"\(1, 4, 5\)"):
        bench_throughput.check_token_counts("x", [3, 4], requests)
    results = [
        {"engine": "jaxserve", "seconds": 2.0, "output_tokens": 8, "startup_s": 1.0, "padding_per_real_token": 0.1,
         "peak_kv_usage": 0.5, "preemptions": 0, "weight_bytes": 325_653_120, "kv_blocks": 2048, "num_executables": 22},
        {"engine": "vllm bfloat16", "seconds": 1.0, "output_tokens": 8, "requests": 2, "startup_s": 3.0},
    ]
    table = bench_throughput.report(results, 2)
    assert "| jaxserve | 2.0 | 4.0 | 1.00 | 1.00x | 0.100 |" in table
    assert "| vllm bfloat16 | 1.0 | 8.0 | 2.00 | 0.50x | n/a |" in table
    assert "vllm bfloat16: start-up" in table
    assert ("jaxserve: start-up (load + warm-up) 1.0s, 22 step executables, weights 325.7 MB, KV pool 2048 blocks, "
            "peak KV usage 50.0%, preemptions 0") in table


def test_a_missing_vllm_names_its_install_script(tmp_path, monkeypatch):
    monkeypatch.setattr(baselines, "VLLM_VENV", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"vLLM's CPU build is not installed at .*absent; run: bash .*"
                                                r"install_vllm_cpu\.sh"):
        baselines.vllm_bin()


def test_a_load_sweep_reports_a_table_per_rate_and_plots_both_metrics(tmp_path, capsys):
    assert bench_serving.parse_rates("0.5,1,inf") == [0.5, 1.0, float("inf")]
    with pytest.raises(SystemExit, match="--request-rates"):
        bench_serving.parse_rates("1,0")
    rows = []
    for rate, (ttft_j, ttft_v) in zip([0.5, float("inf")], [(50.0, 100.0), (400.0, 200.0)], strict=True):
        for server, ttft in (("jaxserve", ttft_j), ("vllm", ttft_v)):
            row = bench_serving.summarize_client_result(server, client_result([16, 16], 100.0, ttft), 16)
            rows.append({**row, "rate": rate})
    args = argparse.Namespace(sweep_plot=None, workload=None, num_prompts=2, random_input_len=320,
                              random_output_len=16, temperature=1.0, top_p=0.95)
    bench_serving.report_sweep(args, rows, tmp_path)
    out = capsys.readouterr().out
    assert "### 0.5 requests/s" in out and "### inf requests/s" in out
    assert "| jaxserve / vllm | | 1.00x | 0.50x |" in out and "| jaxserve / vllm | | 1.00x | 2.00x |" in out
    svg = (tmp_path / "load_sweep.svg").read_text()
    assert "mean TTFT (ms)" in svg and "P99 ITL (ms)" in svg and svg.count("<polyline") == 4
    assert '>inf</text>' in svg and '>0.5</text>' in svg
    assert "2 x 320 -&gt; 16 tokens, temperature 1, top_p 0.95: latency against load" in svg
    assert bench_serving.sampling_description(argparse.Namespace(temperature=0.0, top_p=None)) == "greedy"
    assert bench_serving.file_stem("jaxserve[--buckets /tmp/b.toml]") == "jaxserve[--buckets_tmp_b.toml]"


def test_a_jaxserve_variant_runs_with_its_flags_and_is_compared_with_vllm():
    args = argparse.Namespace(max_model_len=2048, dtype="auto", jaxserve_args="")
    server, _ = bench_serving.server_command(args, "jaxserve[--max-itl-ms 400]", 1)
    assert server[-2:] == ["--max-itl-ms", "400"] and server[:3] == [bench_serving.sys.executable, "-m",
                                                                        "jaxserve.entrypoints.cli"]
    with pytest.raises(ValueError, match="a server variant is a jaxserve server with flags in brackets"):
        bench_serving.server_command(args, "vllm[--seed 1]", 1)
    rows = [bench_serving.summarize_client_result(name, client_result([16], tput, 100.0), 16)
            for name, tput in (("jaxserve", 100.0), ("jaxserve[--max-itl-ms 400]", 150.0), ("vllm", 50.0))]
    lines = bench_serving.comparison_table(rows).splitlines()
    assert lines[-2].startswith("| jaxserve / vllm | | 2.00x") and lines[-1].startswith(
        "| jaxserve[--max-itl-ms 400] / vllm | | 3.00x")


def test_throughput_async_scheduling_runs_in_order():
    """`--async-scheduling on,off,on,off`: one more jaxserve run each, alternating as given; other values refused."""
    assert bench_throughput.async_scheduling_runs("on,off,on,off") == [True, False, True, False]
    assert bench_throughput.async_scheduling_runs("") == []
    with pytest.raises(ValueError, match=r"takes on and off, comma-separated; got \['true'\]"):
        bench_throughput.async_scheduling_runs("on,true")


def test_a_busy_start_is_compared_with_the_quiet_start_of_the_same_server():
    rows = [bench_serving.summarize_client_result(name, client_result([16], tput, ttft), 16)
            for name, tput, ttft in [("jaxserve", 100.0, 1000.0), ("jaxserve (busy start)", 89.0, 1150.0),
                                     ("vllm", 50.0, 500.0)]]
    assert bench_serving.busy_start_lines(rows) == [
        "jaxserve (busy start) / quiet start: output tok/s 0.89x (outside 10%), mean TTFT 1.15x (within 20%)"]
    assert bench_serving.busy_start_lines(rows[:1] + rows[2:]) == []


def test_a_busy_core_runs_until_it_is_stopped():
    spinner = bench_serving.start_busy_core()
    try:
        assert spinner.poll() is None
    finally:
        bench_serving.stop_busy_core(spinner)
    assert spinner.returncode is not None
    bench_serving.stop_busy_core(None)  # a quiet start has none
