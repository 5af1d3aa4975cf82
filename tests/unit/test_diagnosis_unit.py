"""The blame rule of a failed or hung collective, as a pure function: `diagnosis.blame` names a rank only if it
is the cause — it returned without calling the collective, it is busy outside any collective, or its stack cannot be
read — and never a victim (a rank that reported the collective's failure, or that waits in it)."""

from moe_lab.controller.diagnosis import blame

WAITING = ("all_reduce", "waiting in all_reduce (_all_reduce at faults.py:17)")
BUSY = (None, "in sleep_on at faults.py:27")


def test_a_rank_that_returned_is_named_and_the_victims_that_timed_out_are_not():
    """skip_collective_on(2) at 4 ranks: rank 2 returns at once, ranks 0, 1, 3 report the all-reduce's timeout."""
    culprits, notes = blame([0, 1, 2, 3], returned={2}, errored={0, 1, 3}, pending={})
    assert culprits == [2]
    assert notes == ["rank 2 returned without calling it"]


def test_pending_ranks_waiting_in_a_collective_are_never_named():
    """Victims still inside the collective when the call gives up (their own timeout not reported yet)."""
    culprits, notes = blame([0, 1, 2, 3], returned={1}, errored={0}, pending={2: WAITING, 3: WAITING})
    assert culprits == [1] and notes == ["rank 1 returned without calling it"]


def test_a_pending_rank_busy_outside_any_collective_is_named():
    """sleep_on(3, 60): rank 3 sleeps in Python while the others time out in the all-reduce it never joins."""
    culprits, notes = blame([0, 1, 2, 3], returned=set(), errored={0, 1, 2}, pending={3: BUSY})
    assert culprits == [3]
    assert notes == ["rank 3 is still busy in sleep_on at faults.py:27"]


def test_a_hung_collective_with_nobody_errored_yet_names_only_the_busy_rank():
    """The call's own timeout came first: every rank is pending, three wait in the all-reduce, one is busy."""
    culprits, _ = blame([0, 1, 2, 3], returned=set(), errored=set(),
                        pending={0: WAITING, 1: BUSY, 2: WAITING, 3: WAITING})
    assert culprits == [1]


def test_a_pending_rank_whose_stack_cannot_be_read_is_named():
    """No stack (another host): nothing shows it is in the collective, so it cannot be cleared."""
    culprits, notes = blame([0, 1], returned=set(), errored={0}, pending={1: None})
    assert culprits == [1]
    assert notes == ["rank 1 is still busy (its stack cannot be read from this host)"]


def test_errored_victims_are_never_named_whatever_else_is_known_about_them():
    """A rank that reported the collective's failure is a victim, even if it is also listed as pending and busy."""
    culprits, _ = blame([0, 1, 2, 3], returned=set(), errored={0, 1, 2, 3}, pending={})
    assert culprits == []
    culprits, _ = blame([0, 1], returned=set(), errored={0, 1}, pending={1: BUSY, 0: None})
    assert culprits == []


def test_ranks_are_named_in_rank_order_with_one_note_each():
    culprits, notes = blame([0, 1, 2, 3, 4, 5, 6, 7], returned={5}, errored={0, 2, 4, 6},
                            pending={1: WAITING, 3: BUSY, 7: None})
    assert culprits == [3, 5, 7]
    assert [n.split()[1] for n in notes] == ["3", "5", "7"]


def test_a_stopped_local_process_is_named_with_its_state_and_a_running_one_is_not():
    """A SIGSTOPped engine cannot dump its stack; `where` says it is stopped (process state), not that its stack
    'cannot be read from this host', and blame names it so. The control: the same process running reads as busy in
    its own code (its dump arrives), and a rank on another host is left to blame's 'cannot be read' note."""
    import platform
    import signal
    import subprocess
    import sys
    import time

    from moe_lab.controller.diagnosis import process_state, where

    code = ("import faulthandler, signal, sys, threading, time; f = open(sys.argv[1], 'w'); "
            "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True); print(threading.main_thread().ident, "
            "flush=True)\nwhile True: time.sleep(0.05)")
    import tempfile

    stack = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
    p = subprocess.Popen([sys.executable, "-c", code, stack], stdout=subprocess.PIPE, text=True)
    try:
        main = int(p.stdout.readline())
        procs = [{"pid": p.pid, "node": platform.node(), "main_thread": main, "stack_file": stack},
                 {"pid": p.pid, "node": "another-host", "main_thread": main, "stack_file": stack}]
        assert process_state(p.pid) is None
        running = where(procs, [0, 1], wait_s=3.0)
        assert list(running) == [0] and running[0][0] is None and running[0][1].startswith("in "), running
        p.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        stopped = where(procs, [0, 1], wait_s=1.0)
        assert stopped == {0: (None, "stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger)")}
        culprits, notes = blame([0, 1], returned=set(), errored=set(), pending={0: stopped[0], 1: stopped.get(1)})
        assert culprits == [0, 1]
        assert notes == ["rank 0 is stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger)",
                         "rank 1 is still busy (its stack cannot be read from this host)"]
        p.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        assert process_state(p.pid) is None
    finally:
        p.kill()
        p.wait()


def test_an_engine_that_ended_before_registering_is_said_with_the_last_line_of_its_log():
    """An engine reaped by ipyparallel (its launcher gone, its exit in the engine set's stop_data): its pid, exit
    code and the last line its log holds; one that wrote nothing gets no log words (the control), and a long line is
    shortened."""
    from types import SimpleNamespace

    from moe_lab.controller import diagnosis

    es = SimpleNamespace(launchers={}, stop_data={"engines": {
        "e0": {"pid": 4242, "exit_code": 1, "identifier": "e0"},
        "e1": {"pid": 4343, "exit_code": 7, "identifier": "e1"},
        "e2": {"pid": 4444, "exit_code": 1, "identifier": "e2"}}},
        outputs={"e0": "starting\nTraceback (most recent call last):\nTimeoutError: registration timed out\n\n",
                 "e1": "", "e2": "x" * 500})
    cluster = SimpleNamespace(engine_sets=lambda: ([es], es))
    said = diagnosis.ended_engines(cluster)
    assert said[0] == "pid 4242: exit code 1; its log ends: 'TimeoutError: registration timed out'"
    assert said[1] == "pid 4343: exit code 7"
    assert said[2] == f"pid 4444: exit code 1; its log ends: {'x' * diagnosis.LOG_END_CHARS!r}"
