"""reporting.kernels: a notebook's kernel talks to the runner over Unix sockets in a private folder, so no other
process can take its address between jupyter_client choosing it and the kernel binding it (over loopback TCP the
kernel then dies on "Address already in use" and papermill waits 60 s for it). Each test takes the kernel's
addresses away the way another process would, right after they are chosen: the control (jupyter_client's own TCP
kernel) dies of it, the run's kernel does not."""

import asyncio
import json
import os
import socket
import subprocess
import time

import pytest

import jupyter_client.connect as connect
from jupyter_client.manager import AsyncKernelManager

from moe_lab.reporting import kernels


@pytest.fixture
def ports_taken_once_chosen(monkeypatch):
    """Every TCP port written into a kernel's connection file is bound by someone else before the kernel starts."""
    held: list[socket.socket] = []
    write = connect.write_connection_file

    def write_then_take(*a, **kw):
        fname, cfg = write(*a, **kw)
        if cfg["transport"] == "tcp":
            for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"):
                s = socket.socket()
                s.bind((cfg["ip"], cfg[name]))
                s.listen()
                held.append(s)
        return fname, cfg

    monkeypatch.setattr(connect, "write_connection_file", write_then_take)
    yield held
    for s in held:
        s.close()


async def _start_and_run(km) -> tuple[str, str]:
    """Start `km`'s kernel and run one cell → (the cell's stdout, the connection file's transport)."""
    await km.start_kernel()
    transport = json.load(open(km.connection_file))["transport"]
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=30)
        out: list[str] = []
        reply = await kc.execute_interactive("print(6 * 7)", timeout=30,
                                             output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok"
        return "".join(out), transport
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


def test_the_runs_kernel_starts_though_every_port_it_might_have_chosen_is_taken(ports_taken_once_chosen):
    km = kernels.RunKernelManager(kernel_name="python3")
    out, transport = asyncio.run(_start_and_run(km))
    assert out.strip() == "42" and transport == "ipc"
    assert not ports_taken_once_chosen  # no TCP port was chosen for it at all
    assert km.socket_folder and not os.path.exists(km.socket_folder)  # its sockets' folder is gone with it


def test_control_a_tcp_kernel_whose_ports_are_taken_dies_of_it(ports_taken_once_chosen):
    """The check above can fail: jupyter_client's own kernel, given the same interference, exits on the bind."""

    async def start():
        km = AsyncKernelManager(kernel_name="python3")
        await km.start_kernel(stderr=subprocess.PIPE)
        proc = km.provisioner.process
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        code = proc.poll()
        err = proc.stderr.read().decode(errors="replace") if code is not None else ""
        await km.shutdown_kernel(now=True)
        return code, err

    code, err = asyncio.run(start())
    assert ports_taken_once_chosen
    assert code not in (None, 0) and "Address already in use" in err


def test_where_the_temporary_folders_path_is_too_long_for_a_socket_the_kernel_uses_tcp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(kernels.tempfile, "tempdir", str(deep))
    assert kernels.new_socket_folder() is None
    assert list(deep.iterdir()) == []  # the folder it tried is not left behind
    km = kernels.RunKernelManager(kernel_name="python3")
    out, transport = asyncio.run(_start_and_run(km))
    assert out.strip() == "42" and transport == "tcp"
