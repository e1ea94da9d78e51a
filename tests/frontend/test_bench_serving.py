"""The live load generator against an in-process server on fake runners: every arrival accounted for."""
import json

from dilaserve_jax.bench import serving


def test_load_generator_reports_every_call(fake_server, tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    code = serving.main(["--target", fake_server.target, "--trace", "poisson:15", "--duration", "2", "--seed", "1",
                         "--slo", "idle:2,6", "--max-concurrency", "8", "--records", str(records), "--json",
                         "--no-progress"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert report["requests"] == len(lines) > 10
    assert sum(report["status_codes"].values()) == len(lines)
    ok = [r for r in lines if r["status"] == "OK"]
    assert ok and report["completed"] == len(ok)
    # every answered call of the tiny task suite is graded; the fake runner's answers are not valid ones
    assert report["graded"] == len(ok) and report["accuracy"] == 0.0
    assert all(r["latency"] >= r["client_wait"] >= 0 and r["slo"] > 0 for r in ok)
    assert all(r["met"] == (r["latency"] <= r["slo"]) for r in ok)
    assert 0 <= report["slo_attainment"] <= 1 and report["p99_latency"] >= report["p50_latency"]


def test_load_generator_refuses_bad_input(fake_server, capsys):
    assert serving.main(["--target", fake_server.target, "--trace", "poisson:0", "--duration", "1"]) == 2
    assert "positive rate" in capsys.readouterr().err
    assert serving.main(["--target", fake_server.target, "--trace", "/nonexistent.csv"]) == 2


def test_load_generator_waits_for_a_serving_health_check(fake_server, capsys):
    from dilaserve_jax.frontend.client import DiLaServeClient

    with DiLaServeClient(fake_server.target) as client:
        assert client.wait_ready(timeout_s=30) < 30
    # nothing listens on port 1: the wait gives up with the last status, and the command says so
    assert serving.main(["--target", "127.0.0.1:1", "--trace", "poisson:5", "--duration", "1",
                         "--wait-ready-s", "1.5", "--no-progress"]) == 2
    assert "not SERVING after 1.5 s (last: UNAVAILABLE)" in capsys.readouterr().err
