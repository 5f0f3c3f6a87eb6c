"""Progress off a terminal: plain lines (one per evaluation, a heartbeat at most every 30 s), no '\\r'."""

import io

import pytest

from raydp.runner.progress import Progress, progress_mode


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _row(step, ppl, public=None):
    return {"step": step, "epoch": step / 10, "perplexity": ppl, "public_perplexity": public}


def test_a_log_gets_one_line_per_evaluation_and_sparse_heartbeats(monkeypatch):
    monkeypatch.delenv("RAYDP_PROGRESS", raising=False)
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(40, desc="fine-tuning (static)", stream=stream, clock=clock)
    assert progress.mode == "lines"  # a StringIO is not a terminal
    progress.evaluation(_row(0, 50.0, 60.0))
    for step in range(1, 41):
        clock.now += 2.0  # 80 s of training in all: two heartbeats due (30 s and 60 s after the last line)
        metrics = {"step": step, "epoch": step / 10, "loss": 3.0, "sigma": 0.9}
        if step == 20:
            progress.evaluation(_row(20, 30.5, 40.25), metrics)
        progress.step(metrics)
    progress.evaluation(_row(40, 20.0, 25.0), metrics)
    progress.note("stopped early after step 40: budget")
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "fine-tuning (static): step 0/40 epoch 0.00 public_ppl 60.000 eval_ppl 50.000 elapsed 0:00:00"
    assert lines[1].startswith("fine-tuning (static): step 15/40 epoch 1.50 public_ppl 60.000 loss 3.000 sigma 0.900")
    assert lines[2] == ("fine-tuning (static): step 20/40 epoch 2.00 public_ppl 40.250 eval_ppl 30.500 sigma 0.900 "
                        "elapsed 0:00:40")
    assert lines[3].startswith("fine-tuning (static): step 35/40") and lines[3].endswith("elapsed 0:01:10")
    assert lines[4].startswith("fine-tuning (static): step 40/40") and "public_ppl 25.000" in lines[4]
    assert lines[5] == "fine-tuning (static): stopped early after step 40: budget elapsed 0:01:20"
    assert len(lines) == 6


def test_modes(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("RAYDP_PROGRESS", raising=False)
    assert progress_mode(True, Terminal()) == "bar" and progress_mode("auto", io.StringIO()) == "lines"
    assert progress_mode(False, Terminal()) == "off" and progress_mode("lines", Terminal()) == "lines"
    monkeypatch.setenv("RAYDP_PROGRESS", "lines")
    assert progress_mode(True, Terminal()) == "lines" and progress_mode("bar", io.StringIO()) == "bar"
    with pytest.raises(ValueError, match="progress must be"):
        progress_mode("loud", io.StringIO())


def test_off_prints_nothing():
    stream = io.StringIO()
    progress = Progress(4, mode=False, stream=stream)
    progress.evaluation(_row(0, 5.0))
    progress.step({"step": 1, "loss": 1.0})
    progress.note("done")
    progress.close()
    assert stream.getvalue() == ""


def test_log_level_flag_sets_one_level_for_raydp_and_the_libraries(tmp_path, monkeypatch, capsys):
    import logging

    from raydp.cli import main

    monkeypatch.chdir(tmp_path)
    for name in ("raydp", "ray", "ray.tune", "ray.rllib", "transformers", "wandb"):  # restored after the test
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    assert main(["--log-level", "error", "policy", "list"]) == 0
    assert all(logging.getLogger(name).level == logging.ERROR for name in ("raydp", "ray", "transformers", "wandb"))
    assert main(["--log-level", "info", "policy", "list"]) == 0
    assert logging.getLogger("ray.tune").level == logging.INFO
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "policy", "list"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err
