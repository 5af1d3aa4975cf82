"""reporting.kernels._forward: a notebook kernel's stderr reaches the runner's stderr while it runs, and is dropped
(to the debug log) once the kernel is being shut down — ipykernel can print a ZMQError traceback racing its own
shutdown, which says nothing about the notebook — or once the run is interrupted."""

import io
import logging
import threading

from moe_lab.reporting import kernels


class _Lines(io.BytesIO):
    """A pipe whose `closing` event is set once the line `mark` has been read: the shutdown beginning mid-stream."""

    def __init__(self, data: bytes, closing: threading.Event, mark: bytes):
        super().__init__(data)
        self.closing, self.mark = closing, mark

    def readline(self, *a):
        line = super().readline(*a)
        if line.startswith(self.mark):
            self.closing.set()
        return line


def test_lines_after_the_shutdown_are_dropped_to_the_debug_log(capsys, caplog):
    closing = threading.Event()
    data = (b"a warning while the cells run\n"
            b"[shutdown]\n"
            b"ERROR:tornado.general:Uncaught exception in ZMQStream callback\n"
            b"zmq.error.ZMQError: Socket operation on non-socket\n")
    with caplog.at_level(logging.DEBUG, logger=kernels.__name__):
        kernels._forward(_Lines(data, closing, b"[shutdown]"), closing)
    err = capsys.readouterr().err
    assert "a warning while the cells run" in err  # forwarded: the kernel was running
    assert "Socket operation on non-socket" not in err and "Uncaught exception" not in err
    assert "Socket operation on non-socket" in caplog.text  # kept, in the debug log


def test_without_a_shutdown_every_line_is_forwarded(capsys):
    """The control: the same lines with no shutdown under way all reach the runner's stderr."""
    data = b"one\nERROR:tornado.general:Uncaught exception in ZMQStream callback\n"
    kernels._forward(io.BytesIO(data), threading.Event())
    assert capsys.readouterr().err == data.decode()
