import json

import pytest

from tf_hwopt.cli import main


def test_demo_cli_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    assert main(["demo", "--samples", "1500", "--epochs", "3", "--batch-size", "128",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "no freezing" in printed and "Egeria" in printed and "speedup" in printed
    results = json.loads(out_json.read_text())
    for run in ("no_freezing", "egeria"):
        r = results["runs"][run]
        assert r["wall_time_s"] > 0 and r["cpu_time_s"] > 0
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert len(r["epoch_val_accuracy"]) == 3
    assert results["speedup_wall"] == pytest.approx(
        results["runs"]["no_freezing"]["wall_time_s"] / results["runs"]["egeria"]["wall_time_s"]
    )
    # A run this short may not repay evaluation: Egeria then steps back before building its reference.
    egeria = results["egeria"]
    assert egeria["reference_path"] == "tfmot" or "before building the reference" in (egeria["evaluation_stopped"] or "")
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["demo", "--epochs", "0"], ["demo", "--samples", "-5"], ["nope"]])
def test_cli_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err
