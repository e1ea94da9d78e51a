"""`serve --devices/--kv-memory-gb/--watch-checkpoints`: the options exist and bad shares are clear errors."""
import pytest

from dilaserve_jax.serve import build_parser, main, present_cpu_devices

BASE = ["--port", "0", "--metrics-port", "-1", "--compile-cache", "none"]


def test_help_lists_the_sharing_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for option in ("--devices", "--device-ids", "--kv-memory-gb", "--watch-checkpoints", "--watch-interval-s"):
        assert option in out
    assert build_parser().parse_args(["--device-ids", "4,5"]).devices == "4,5"


@pytest.mark.parametrize("argv, message", [
    (["--devices", "4-7", "--mesh", "2x4"], "mesh 2x4 uses 8 device(s) but the device share [4, 5, 6, 7] has 4"),
    (["--devices", "6-9", "--mesh", "2x2"], "device id(s) [8, 9] are not visible"),
    (["--devices", "4-x", "--mesh", "2x2"], "cannot parse '4-x'"),
    (["--devices", "4-7", "--mesh", "2x2", "--kv-memory-gb", "1e-9"], "holds no slot"),
    (["--mesh", "2x4", "--kv-memory-gb", "-1"], "KV memory budget must be positive"),
    (["--mesh", "2x4", "--watch-checkpoints", "/tmp", "--watch-interval-s", "0"],
     "--watch-interval-s must be positive"),
])
def test_bad_shares_exit_2_with_the_reason(argv, message, capsys):
    assert main(BASE + argv) == 2
    assert "error: " in (err := capsys.readouterr().err) and message in err


def test_cpu_devices_cover_the_highest_id_of_the_share(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    assert present_cpu_devices("2x2", 1, (4, 5, 6, 7)) == 8
    monkeypatch.setenv("XLA_FLAGS", "")
    assert present_cpu_devices("2x2", 1, None) == 4
