"""The package's console lines (``rlhf.utils.log``): the message alone on the current stdout (stderr from WARNING
on), one line however the application configured logging, capture to a file; the audit's runs keep their lines (and
their actors', forwarded by Ray) in their log files; the actors' reprs that Ray prefixes their output with."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import warnings

import pytest

from rlhf.utils import log as rlhf_log
from rlhf.utils.log import capture, get_logger

log = get_logger("rlhf.tests.log")


@pytest.fixture(autouse=True)
def _rlhf_logger_restored():
    """Whatever a test changes on the ``rlhf`` logger (handlers, level, propagation) is undone after it."""
    logger = logging.getLogger("rlhf")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def _console_handlers():
    return [h for h in logging.getLogger("rlhf").handlers if h.get_name() == "rlhf-console"]


def test_a_line_is_the_message_alone_on_stdout(capsys):
    log.info("[sft] step 1/4 loss=2.5 100% done")  # a '%' with no arguments: printed as is
    out, err = capsys.readouterr()
    assert out == "[sft] step 1/4 loss=2.5 100% done\n" and err == ""


def test_warnings_and_errors_go_to_stderr_with_their_text_alone(capsys):
    log.warning("warning: node 10.0.0.2 has torch 2.12")
    log.error("error: train.lr must be > 0")
    out, err = capsys.readouterr()
    assert out == "" and err == "warning: node 10.0.0.2 has torch 2.12\nerror: train.lr must be > 0\n"


def test_lines_go_to_the_stdout_of_the_moment_a_redirect_included(capsys):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        log.info("inside")
    log.info("outside")
    assert buffer.getvalue() == "inside\n" and capsys.readouterr().out == "outside\n"


def test_info_lines_print_under_a_root_logger_at_warning(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    log.info("shown")
    assert capsys.readouterr().out == "shown\n"


def test_no_second_line_when_the_application_configured_the_root_logger(capsys):
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root = logging.getLogger()
    handler = Collect()
    root.addHandler(handler)
    try:
        log.info("once")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out == "once\n" and seen == []


def test_use_root_handlers_hands_the_lines_to_the_application(capsys):
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root = logging.getLogger()
    handler = Collect()
    root.addHandler(handler)
    try:
        rlhf_log.use_root_handlers()
        log.info("theirs")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out == "" and seen == ["theirs"]


def test_a_module_run_as_a_script_logs_under_rlhf(capsys):
    """``python -m rlhf.cli.demo`` runs the module as ``__main__``: its logger must still reach the console."""
    script = get_logger("__main__")
    assert script.name == "rlhf.__main__" and get_logger("rlhf.hub").name == "rlhf.hub"
    script.info("from a script")
    assert capsys.readouterr().out == "from a script\n"


def test_the_console_handler_is_installed_once(capsys):
    importlib.reload(rlhf_log)  # a second import of the module (a new ConsoleHandler class) adds no second one
    rlhf_log.install_console()
    assert len(_console_handlers()) == 1
    log.info("one line")
    assert capsys.readouterr().out == "one line\n"


def test_capture_off_the_console_writes_the_file_only(tmp_path, capsys):
    path = tmp_path / "run.log"
    with capture(str(path), console=False):
        log.info("[sft] step 1")
        log.warning("warning: slow")
    log.info("after")
    out, err = capsys.readouterr()
    assert path.read_text() == "[sft] step 1\nwarning: slow\n"
    assert out == "after\n" and err == ""


def test_capture_on_the_console_writes_both(tmp_path, capsys):
    path = tmp_path / "run.log"
    with capture(str(path)):
        log.info("both")
    assert path.read_text() == "both\n" and capsys.readouterr().out == "both\n"


def test_progress_lines_go_through_the_logger_with_a_bar_drawn(tmp_path, capsys):
    """With a tqdm bar the per-step lines are still logger lines: a capture gets them (tqdm.write would not)."""
    from rlhf.utils.metrics import Progress

    progress = Progress(total=2, bar=True)
    path = tmp_path / "run.log"
    with capture(str(path)):
        progress.advance(1)
        progress.print("[sft] step 1/2")
    progress.close()
    assert path.read_text() == "[sft] step 1/2\n"
    assert capsys.readouterr().out == "[sft] step 1/2\n"  # the bar itself is on stderr


# ----------------------------------------------------------------------------------------- the audit's runs


def test_an_audit_run_keeps_its_lines_and_warnings_off_the_console(tmp_path, capsys):
    from rlhf.audit.factorizations import Factorization
    from rlhf.audit.runner import RunFailed, run_one

    def train(cfg):
        get_logger("rlhf.trainers.run").info("[sft] step 1")
        warnings.warn("a driver warning", UserWarning, stacklevel=1)
        raise RuntimeError("boom")

    path = tmp_path / "2x2x1.log"
    with pytest.raises(RunFailed) as failed:
        run_one(train, None, Factorization(2, 2, 1, "configured"), str(path))
    text = path.read_text()
    assert failed.value.log == str(path) and "[sft] step 1\n" in text and "a driver warning" in text
    assert capsys.readouterr() == ("", "")
    log.info("the audit's own line")
    assert capsys.readouterr().out == "the audit's own line\n"


def test_actor_output_forwarded_by_ray_goes_to_the_run_log(monkeypatch):
    """Ray's driver thread hands each batch of an actor's output to its dispatcher's handlers; during a run the
    console's handler (``ray_print_logs``) is swapped for the log's, and put back after."""
    ray_logging = pytest.importorskip("ray._private.ray_logging")
    from rlhf.audit.runner import _actor_output_to

    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    console = []
    monkeypatch.setattr(dispatcher, "handlers", [("ray_print_logs", console.append)])
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    batch = {
        "pid": 4242,
        "ip": "10.0.0.1",
        "localhost": "10.0.0.1",
        "lines": ["loading the model"],
        "actor_name": "policy rank 1",
        "task_name": None,
        "is_err": False,
    }
    stream = io.StringIO()
    with _actor_output_to(stream):
        dispatcher.emit(batch)
    assert stream.getvalue() == "(policy rank 1 pid=4242) loading the model\n" and console == []
    dispatcher.emit(batch)
    assert console == [batch] and [name for name, _ in dispatcher.handlers] == ["ray_print_logs"]


# ----------------------------------------------------------------------------------------- actors' reprs


def test_actors_name_their_role_and_rank_in_their_repr():
    """Ray prefixes an actor's forwarded output with its ``__repr__`` (from the end of ``__init__``)."""
    import torch

    from rlhf.distributed.worker import TrainerWorker
    from rlhf.envs.pool import _EnvActor
    from rlhf.rollout.vllm.engine import VLLMEngine

    assert repr(TrainerWorker("critic", 3, 4, num_threads=torch.get_num_threads())) == "critic rank 3"
    engine = VLLMEngine.__new__(VLLMEngine)  # __init__ starts vLLM: only the attribute __repr__ reads
    engine.index = 2
    assert repr(engine) == "vllm engine 2"
    assert repr(_EnvActor("nowhere:Env", "nowhere_such_module:Env", 1.0, index=5)) == "env actor 5"
