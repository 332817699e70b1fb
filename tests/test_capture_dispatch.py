"""The trace writer in a dispatcher process (traces.capture.dispatch; no torch needed)."""
from __future__ import annotations

import os
import pickle
import signal
import time

import numpy as np
import pytest
from test_capture_writer import blocks, lent_bound, trace_columns, write_in_slabs

from traces.capture import dispatch as D
from traces.capture import writer as W
from traces.errors import InputError
from traces.format import TraceWriter, read_trace, recorded_content_hash


def single(tmp_path, cols, meta):
    """The file one TraceWriter makes of ``cols``, and its stored columns."""
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        stored = writer.write(**cols)
    return tmp_path / "one.parquet", stored


def assert_same_trace(one, many):
    a, b = read_trace(one), read_trace(many)
    assert a[0] == b[0]
    for name in ("seq", "pos", "phase", "experts", "gates", "logits", "nll", "lookahead_logits", "lookahead_ids"):
        np.testing.assert_array_equal(getattr(a[1], name), getattr(b[1], name), err_msg=name)
    assert recorded_content_hash(many) == recorded_content_hash(one) is not None


def test_rows_in_slabs_go_as_one_message_per_block_and_the_file_is_one_writers(tmp_path, monkeypatch):
    """Each block of rows in a lent slab reaches the dispatcher as one small message saying where
    it lies (no rows through the pipe); the file and its content hash are a single writer's; the
    tokens lent at a time stay within the bound, so a producer ahead of the encoders waits; every
    slab is back in the pool after the close, and nothing but the file is left."""
    meta, cols = trace_columns(tokens=600)
    one, stored = single(tmp_path, cols, meta)
    cols = {name: v.copy() for name, v in stored.items()}  # as moe-capture gives them
    monkeypatch.setattr(W, "_FREE_SLABS", [])  # the slabs of earlier tests' writers would be lent in turn
    sent, peak, lent = [], [0], set()
    real_send = D._Dispatcher.send
    monkeypatch.setattr(D._Dispatcher, "send", lambda self, request: (sent.append(request), real_send(self, request))[1])
    path = tmp_path / "many.parquet"
    with D.DispatchedTraceWriter(path, meta, unit_tokens=7, workers=1) as writer:
        write_in_slabs(writer, cols, lent, peak)
        assert writer.num_tokens == 600
    rows = [r for r in sent if r[0] == "rows"]
    assert len(rows) == 60 and not [r for r in sent if r[0] == "arrays"]
    assert all(len(pickle.dumps(r)) < 2000 for r in rows)  # where the rows are, not the rows
    assert peak[0] <= lent_bound(7, 1)  # 35 tokens: at most 4 blocks of 10
    assert 1 < len(lent) <= 4 and lent <= set(W._FREE_SLABS)
    assert_same_trace(one, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.parquet", "one.parquet"]


def test_rows_not_in_a_slab_are_written_too(tmp_path):
    """Plain arrays (no shared memory: ``shared_rows`` off or /dev/shm full) go through the pipe."""
    meta, cols = trace_columns()
    one, _ = single(tmp_path, cols, meta)
    with D.DispatchedTraceWriter(tmp_path / "many.parquet", meta, unit_tokens=16, workers=2) as writer:
        for piece in blocks(cols, [3, 50, 51, 200]):
            writer.write(**piece)
        writer.write(**{name: v[:0] for name, v in cols.items()})  # no tokens: nothing
    assert_same_trace(one, tmp_path / "many.parquet")


def test_the_dispatcher_s_writer_cuts_the_units_of_the_expected_last_write(tmp_path):
    """``expected_tokens`` reaches the writer in the dispatcher: the write that reaches 1,100
    tokens cuts its 700 pending tokens into one unit per encoder (350 each) instead of a whole unit
    and a rest that the close cuts (down to FINAL_UNIT_TOKENS, 256)."""
    from test_capture_writer import row_group_tokens

    meta, cols = trace_columns(tokens=1100)
    one, _ = single(tmp_path, cols, meta)
    for expected, sizes in [(None, [400, 400, 256, 44]), (1100, [400, 350, 350])]:
        path = tmp_path / f"many{expected}.parquet"
        with D.DispatchedTraceWriter(path, meta, unit_tokens=400, workers=2, expected_tokens=expected) as writer:
            for piece in blocks(cols, [100, 750]):
                writer.write(**piece)
        assert row_group_tokens(path, meta) == sizes
        assert_same_trace(one, path)
    with pytest.raises(ValueError, match="expected_tokens must be None or >= 1, got -1"):
        D.DispatchedTraceWriter(tmp_path / "t.parquet", meta, unit_tokens=400, expected_tokens=-1)


def test_a_bad_unit_fails_the_whole_file_naming_it(tmp_path):
    """The dispatcher's error reaches the capture as the same one line a single writer gives, and
    no file is left; a producer waiting for a slab is woken by it."""
    meta, cols = trace_columns()
    cols["logits"] = cols["logits"].copy()
    cols["logits"][250, 1, 3] = np.nan
    path = tmp_path / "t.parquet"
    with pytest.raises(InputError) as caught, D.DispatchedTraceWriter(path, meta, unit_tokens=16, workers=2) as writer:
        for piece in blocks(cols, list(range(10, 300, 10))):
            block = writer.block({name: (v.dtype, v.shape) for name, v in piece.items()})
            for name, v in piece.items():
                block.views[name][...] = v
            writer.write(**block.views)
    assert str(caught.value).startswith(f"{path}: column 'logits'") and "NaN" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_an_error_in_the_capture_leaves_nothing_and_the_dispatcher_is_kept(tmp_path):
    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    with pytest.raises(RuntimeError, match="stop"), D.DispatchedTraceWriter(path, meta, unit_tokens=16) as writer:
        writer.write(**blocks(cols, [100])[0])
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []
    pid = writer._child.proc.pid
    with D.DispatchedTraceWriter(path, meta, unit_tokens=16) as again:  # the same process, opened again
        again.write(**cols)
    assert again._child.proc.pid == pid and read_trace(path)[1].num_tokens == 300


def alive(group: int, wait_s: float = 10.0) -> bool:
    """Whether a process of ``group`` still runs after ``wait_s`` (the killed ones reaped by init)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def test_a_dispatcher_that_dies_fails_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    """The dispatcher killed at its third block: one error naming it, its encoders stopped, no
    file and no hidden files; the next writer starts a new dispatcher and writes."""
    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    real_send = D._Dispatcher.send
    count = [0]

    def dies(self, request):
        count[0] += request[0] == "arrays"
        if count[0] == 3 and request[0] == "arrays":
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return real_send(self, request)

    monkeypatch.setattr(D._Dispatcher, "send", dies)
    with pytest.raises(RuntimeError, match="trace dispatcher process exited"), \
            D.DispatchedTraceWriter(path, meta, unit_tokens=16, workers=2) as writer:
        for piece in blocks(cols, list(range(20, 300, 20))):
            writer.write(**piece)
    group = writer._child.proc.pid
    assert list(tmp_path.iterdir()) == []
    assert not alive(group)  # its encoders and joiner are gone with it
    monkeypatch.setattr(D._Dispatcher, "send", real_send)
    with D.DispatchedTraceWriter(path, meta, unit_tokens=16) as again:
        again.write(**cols)
    assert again._child.proc.pid != group and read_trace(path)[1].num_tokens == 300


def test_a_bad_output_is_refused_before_the_dispatcher_starts(tmp_path):
    meta, _ = trace_columns()
    with pytest.raises(InputError, match="does not exist; create it first"):
        D.DispatchedTraceWriter(tmp_path / "no" / "t.parquet", meta, unit_tokens=16)
    with pytest.raises(InputError, match="no tokens were written"):
        with D.DispatchedTraceWriter(tmp_path / "t.parquet", meta, unit_tokens=16):
            pass
    assert list(tmp_path.iterdir()) == []


def test_blocks_larger_than_the_lending_bound_do_not_wait_for_ever(tmp_path):
    """Blocks of 50 tokens against a bound of 35 (units of 7, one encoder): the tokens after the
    last whole unit stay in the dispatcher until more come, so a producer that waited for their
    slab would wait for ever; it waits only while a slab lies wholly before them."""
    import threading

    meta, cols = trace_columns()
    one, stored = single(tmp_path, cols, meta)
    cols = {name: v.copy() for name, v in stored.items()}
    path = tmp_path / "many.parquet"

    def produce():
        with D.DispatchedTraceWriter(path, meta, unit_tokens=7, workers=1) as writer:
            for piece in blocks(cols, list(range(50, 300, 50))):
                block = writer.block({name: (v.dtype, v.shape) for name, v in piece.items()})
                for name, v in piece.items():
                    block.views[name][...] = v
                writer.write(**block.views)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(timeout=120)
    assert not producer.is_alive()
    assert_same_trace(one, path)


def test_a_capture_killed_outright_leaves_no_files_and_no_shared_memory(tmp_path):
    """The capturing process killed with SIGKILL mid-file (no clean-up of its own): the dispatcher
    sees its input end, aborts without a traceback (no one to tell), removes the hidden files and
    the slabs the dead process lent; its encoders and joiner exit too."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = f"""
import sys, time
sys.path.insert(0, {str(root / 'tests')!r})
from test_capture_writer import blocks, trace_columns
from traces.capture import dispatch as D, writer as W
meta, cols = trace_columns(tokens=1100)
w = D.DispatchedTraceWriter({str(tmp_path / 't.parquet')!r}, meta, unit_tokens=64, workers=2)
for piece in blocks(cols, [100, 400, 700]):
    b = w.block({{n: (v.dtype, v.shape) for n, v in piece.items()}})
    for n, v in piece.items():
        b.views[n][...] = v
    w.write(**b.views)
print(w._child.proc.pid, *(s.path for s in W._SLABS), flush=True)
time.sleep(120)
"""
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    dispatcher, *slabs = proc.stdout.readline().split()
    assert slabs and all(Path(s).exists() for s in slabs)
    assert all(Path(s).name.startswith(f"{W.SHARED_PREFIXES[1]}{proc.pid}-") for s in slabs)
    proc.kill()
    _, err = proc.communicate(timeout=60)  # stderr's end: the dispatcher and its children have exited
    assert not alive(int(dispatcher))
    assert "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
    assert not [s for s in slabs if Path(s).exists()]


def test_only_an_input_ended_without_goodbye_makes_the_dispatcher_remove_the_slabs(tmp_path):
    """A killed process's pipes close before it is reaped, so the dispatcher may see its input end
    while the dead process is still its parent. It tells a death from a close by the goodbye
    :meth:`_Dispatcher.close` sends: here the parent lives on in every case, and the slabs the
    dispatcher was lent go only where the input ended without one."""
    import pickle
    from pathlib import Path

    meta, cols = trace_columns(tokens=300)

    def lend_and_write(path):
        w, lent = D.DispatchedTraceWriter(path, meta, unit_tokens=64, workers=1), []
        for piece in blocks(cols, [100, 200]):
            b = w.block({n: (v.dtype, v.shape) for n, v in piece.items()})
            for n, v in piece.items():
                b.views[n][...] = v
            lent.append(b.slab.path)
            w.write(**b.views)
        return w, lent

    for ending in ("goodbye", "end", "cut off"):
        path = tmp_path / f"{ending}.parquet"
        w, lent = lend_and_write(path)
        assert lent and all(Path(s).exists() for s in lent)
        if ending == "goodbye":
            w._child.send(("bye",))
        elif ending == "cut off":  # killed while it sent a message: the pickle ends in its middle
            w._child.proc.stdin.write(pickle.dumps(("arrays", cols), protocol=pickle.HIGHEST_PROTOCOL)[:1000])
        w._child.proc.stdin.close()  # mid-file: the dispatcher aborts its writer
        assert w._child.proc.wait(timeout=60) == 0
        assert list(tmp_path.iterdir()) == []
        assert [Path(s).exists() for s in lent] == [ending == "goodbye"] * len(lent)
        w.abort()  # the dispatcher has exited: its slabs are lent again here
        with W._SLAB_LOCK:  # this process lives on: forget the slabs the dispatcher removed
            for slab in [s for s in W._SLABS if not Path(s.path).exists()]:
                W._SLABS.remove(slab)
                W._FREE_SLABS.remove(slab)
                slab.close()
    w, lent = lend_and_write(tmp_path / "closed.parquet")
    w.close()
    child = w._child
    W._IDLE[D._Dispatcher].remove(child)  # given back for the next writer; closed now as at exit
    child.close()  # _Dispatcher.close says goodbye
    assert child.proc.returncode == 0 and all(Path(s).exists() for s in lent)


def test_a_dispatcher_interrupted_while_it_opens_is_closed(tmp_path, monkeypatch):
    """A Ctrl-C while the dispatcher opens the output: the dispatcher is closed (no child left
    running for the next writer) and it leaves no file."""
    started = []
    real_take = D._take

    def take(kind):
        started.append(real_take(kind))
        return started[-1]

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "_take", take)
    monkeypatch.setattr(D.DispatchedTraceWriter, "_receive", interrupted)
    meta, _ = trace_columns()
    with pytest.raises(KeyboardInterrupt):
        D.DispatchedTraceWriter(tmp_path / "t.parquet", meta, unit_tokens=16)
    child, = started
    assert child.proc.returncode == 0 and child not in W._IDLE.get(D._Dispatcher, [])
    assert list(tmp_path.iterdir()) == []


def test_the_shared_files_go_where_moe_trace_shared_dir_says_also_in_the_children(tmp_path, monkeypatch):
    """$MOE_TRACE_SHARED_DIR: this process's slabs are made there, the dispatcher and its
    encoders and joiner start with it (they make their blocks where it says), and a sweep looks
    there; the trace is written as ever, and closing the children leaves the folder empty."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setenv(W.SHARED_DIR_ENV, str(folder))
    W._close_children()  # children started from now on, with the variable
    try:
        _write_in(folder, tmp_path, monkeypatch)
    finally:
        W._close_children()  # the slabs kept for the next writer too, made in a folder that goes
    assert list(folder.iterdir()) == []


def _write_in(folder, tmp_path, monkeypatch) -> None:
    """A trace written by the dispatcher with the shared files in ``folder``, checked there."""
    from pathlib import Path

    from traces.capture.cores import descendants
    from traces.format import read_trace

    made = []
    real = W._Shared.__init__

    def spy(self, nbytes, path=None, prefix=W.SHARED_PREFIXES[0]):
        real(self, nbytes, path, prefix)
        made.append(self.path)

    monkeypatch.setattr(W._Shared, "__init__", spy)
    meta, cols = trace_columns(tokens=300)
    path = tmp_path / "t.parquet"
    with D.DispatchedTraceWriter(path, meta, unit_tokens=64, workers=2) as w:
        for piece in blocks(cols, [100, 200]):
            b = w.block({n: (v.dtype, v.shape) for n, v in piece.items()})
            for n, v in piece.items():
                b.views[n][...] = v
            w.write(**b.views)
        if Path("/proc/self/environ").exists():
            # the dispatcher, two encoders, the joiner: under load the last may still be starting
            deadline = time.monotonic() + 30
            family = [w._child.proc.pid, *descendants(w._child.proc.pid)]
            while len(family) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
                family = [w._child.proc.pid, *descendants(w._child.proc.pid)]
            assert len(family) == 4
            for pid in family:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"{W.SHARED_DIR_ENV}={folder}".encode() in env
    assert read_trace(path)[1].num_tokens == 300
    assert made and all(Path(p).parent == folder for p in made)
    dead = folder / f"{W.SHARED_PREFIXES[0]}{2**22 + 7}-x"  # above Linux's largest process id
    dead.write_bytes(b"x")
    assert W.remove_orphan_shared() == [dead]


def test_shared_files_of_processes_that_no_longer_run_are_swept(tmp_path):
    """Shared files named for a process that has exited are removed; this process's, a live
    process's and other files are kept."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    gone = int(dead.stdout)
    names = [f"{W.SHARED_PREFIXES[1]}{gone}-a", f"{W.SHARED_PREFIXES[0]}{gone}-b", f"{W.SHARED_PREFIXES[1]}{os.getpid()}-c",
             f"{W.SHARED_PREFIXES[1]}{os.getppid()}-d", f"{W.SHARED_PREFIXES[1]}x-e", "other-1-f"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = W.remove_orphan_shared(str(tmp_path))
    assert sorted(p.name for p in removed) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
