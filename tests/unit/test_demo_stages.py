"""aligner.demo.stages: the demo's stages as a dependency graph, several at a time."""
from __future__ import annotations

import sys
import threading
import time

import psutil
import pytest

from aligner.demo import stages
from aligner.demo.stages import StageGraph


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stages_start_after_what_they_read_and_at_most_jobs_at_a_time(tmp_path):
    lock, running, most, events = threading.Lock(), [0], [0], []

    def stage(name: str, seconds: float):
        def body():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                events.append(("start", name))
            time.sleep(seconds)
            with lock:
                running[0] -= 1
                events.append(("end", name))
        return body

    # a -> b -> d, a -> c; e needs nothing; "x" is not chosen: taken as done (its artefacts are on disk)
    chosen = {"a": stage("a", 0.3), "e": stage("e", 0.6), "b": stage("b", 0.2), "c": stage("c", 0.2),
              "d": stage("d", 0.1)}
    depends = {"b": ("a",), "c": ("a", "x"), "d": ("b",)}
    timings = StageGraph(chosen, depends, jobs=2, threads=1, log_dir=tmp_path / "logs").run()
    assert set(timings) == set(chosen) and all(seconds > 0 for seconds in timings.values())
    assert most[0] == 2
    order = {event: index for index, event in enumerate(events)}
    for name, needs in depends.items():
        for need in needs:
            if need in chosen:
                assert order[("end", need)] < order[("start", name)]
    assert order[("start", "e")] < order[("end", "a")]  # e beside a: it needs nothing


def test_a_stage_s_commands_get_its_threads_and_write_to_its_log(tmp_path, capfd):
    def stage():
        stages.run("threads", _python("import os; print('threads', os.environ['OMP_NUM_THREADS'])"), tmp_path)

    StageGraph({"one": stage, "two": stage}, {}, jobs=2, threads=3, log_dir=tmp_path / "logs").run()
    for name in ("one", "two"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "threads 3" in log and "=== threads done in" in log
    out = capfd.readouterr().out
    assert out.count("threads 3") == 2  # each log printed once, when its stage ended
    assert "=== stage one done in" in out and "=== stage two done in" in out


def test_one_job_runs_in_order_on_the_console(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    seen = []

    def stage(name):
        def body():
            seen.append(name)
            stages.run(name, _python("import os; print('threads', os.environ['OMP_NUM_THREADS'])"), tmp_path)
        return body

    StageGraph({"a": stage("a"), "b": stage("b")}, {"a": ("b",)}, jobs=1, threads=1, log_dir=tmp_path / "logs").run()
    assert seen == ["b", "a"]  # one job: one after the other, each after what it reads
    assert capfd.readouterr().out.count("threads 5") == 2  # the environment's threads, on the console
    assert not (tmp_path / "logs").exists()


def test_a_failed_stage_stops_the_others_and_names_its_log(tmp_path):
    started = []

    def sleeper():
        stages.run("sleeper", _python("import time; time.sleep(120)"), tmp_path)

    def failing():
        time.sleep(1.0)  # the sleeper's command is running by now
        stages.run("failing", _python("import sys; print('bad input'); sys.exit(3)"), tmp_path)

    def later():
        started.append("later")

    begun = time.monotonic()
    graph = StageGraph({"sleeper": sleeper, "failing": failing, "later": later}, {"later": ("failing",)}, jobs=2,
                       threads=1, log_dir=tmp_path / "logs")
    with pytest.raises(SystemExit) as failed:
        graph.run()
    assert time.monotonic() - begun < 30
    message = str(failed.value.code)
    assert "demo stage 'failing' failed with exit code 3" in message
    assert str(tmp_path / "logs" / "failing.log") in message
    assert "bad input" in (tmp_path / "logs" / "failing.log").read_text()
    assert started == []  # nothing starts after a failure
    sleepers = [proc for proc in psutil.Process().children(recursive=True)
                if "time.sleep(120)" in " ".join(proc.cmdline())]
    assert sleepers == []
    stages.run("after", _python("print('runs again')"), tmp_path)  # the stop ended with the graph


def test_stages_that_wait_on_each_other_are_refused():
    with pytest.raises(ValueError, match="stages a, b wait on each other"):
        StageGraph({"a": lambda: None, "b": lambda: None}, {"a": ("b",), "b": ("a",)}, jobs=1, threads=1,
                   log_dir=None)
