from jonebit import demo


def test_demo_runs_and_compresses(capsys):
    result = demo.main(["--steps", "6", "--freeze-step", "3", "--devices", "4", "--batch-per-device", "2"])
    adam, onebit = result["rows"]
    assert adam["warm"] == adam["comp"]
    # The per-step ratio is ~32x on the momentum buffer; the 4-byte loss all-reduce is in both programs.
    assert adam["comp"] / onebit["comp"] > 25
    assert onebit["val_loss"] < 5.0 and adam["val_loss"] < 5.0
    assert "| optimizer |" in capsys.readouterr().out
