"""The CPU kernels' thread count follows the cores other processes leave free (templates/cpu.py's
available_threads): measured from /proc/stat, less this process's own CPU time; KVCOMPILE_THREADS fixes it."""
import subprocess
import sys
import time

import pytest
import torch

from kvcompile.templates import cpu


class Clock:
    """Stands in for the time module in templates/cpu.py: wall and own-CPU time set by the test."""

    def __init__(self):
        self.wall = 100.0
        self.own = 5.0

    def monotonic(self):
        return self.wall

    def process_time(self):
        return self.own


def proc_stat(path, busy_ticks: dict, nice_ticks: dict | None = None):
    """A /proc/stat with cpu<N> lines whose user time is ``busy_ticks[N]``, nice time ``nice_ticks[N]`` (and
    1000 idle ticks each)."""
    nice_ticks = nice_ticks or {}
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{c} {t} {nice_ticks.get(c, 0)} 0 1000 0 0 0 0 0 0" for c, t in sorted(busy_ticks.items())]
    path.write_text("\n".join(lines + ["intr 0", "procs_running 1"]) + "\n")


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """templates/cpu.py on a fake two-core machine (cores 0 and 1 ours, core 2 not), torch at 2 threads."""
    clock = Clock()
    stat = tmp_path / "stat"
    monkeypatch.setattr(cpu, "PROC_STAT", str(stat))
    monkeypatch.setattr(cpu, "time", clock)
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu, "_load", {"t": None, "busy": 0.0, "own": 0.0, "cpus": (), "free": None, "cap": None})
    monkeypatch.setattr(cpu, "FIXED_THREADS", None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    tick = cpu.os.sysconf("SC_CLK_TCK")
    return clock, stat, tick


def test_a_core_kept_busy_by_another_process_is_not_used(fake_machine):
    clock, stat, tick = fake_machine
    proc_stat(stat, {0: 500, 1: 500, 2: 0})
    assert cpu.available_threads() == 2 and cpu.free_cores() is None  # one sample: nothing known yet
    # one second later: core 0 was busy all along (someone else), core 1 a fifth of it (this process's own
    # CPU time, which is not load), core 2 (not ours) all along
    clock.wall += 1.0
    clock.own += 0.2
    proc_stat(stat, {0: 500 + tick, 1: 500 + tick // 5, 2: tick})
    assert cpu.free_cores() == pytest.approx(1.0, abs=0.02)
    assert cpu.available_threads() == 1
    # the next half second both cores are ours alone: back to torch's two threads
    clock.wall += 0.5
    clock.own += 0.9
    proc_stat(stat, {0: 500 + tick + int(0.45 * tick), 1: 500 + tick // 5 + int(0.45 * tick), 2: 2 * tick})
    assert cpu.free_cores() == pytest.approx(2.0, abs=0.05)
    assert cpu.available_threads() == 2


def test_the_load_is_measured_at_most_every_window(fake_machine):
    clock, stat, tick = fake_machine
    proc_stat(stat, {0: 0, 1: 0})
    cpu.available_threads()
    clock.wall += 1.0
    proc_stat(stat, {0: 2 * tick // 3, 1: 2 * tick // 3})  # others: 1.33 cores busy, 0.67 free: one thread
    assert cpu.available_threads() == 1
    clock.wall += cpu.LOAD_WINDOW_S / 2
    proc_stat(stat, {0: 2 * tick // 3, 1: 2 * tick // 3})  # idle since, but within the window: not re-read
    assert cpu.available_threads() == 1
    clock.wall += cpu.LOAD_WINDOW_S
    assert cpu.available_threads() == 2


def test_light_background_load_rounds_to_the_nearest_core(fake_machine):
    """0.3 of a core busy elsewhere leaves 1.7 free: two threads; 0.7 busy leaves 1.3: one."""
    clock, stat, tick = fake_machine
    for busy, threads in ((0.3, 2), (0.7, 1)):
        proc_stat(stat, {0: 0, 1: 0})
        cpu._load["t"] = None
        cpu.available_threads()
        clock.wall += 1.0
        proc_stat(stat, {0: int(busy * tick), 1: 0})
        assert cpu.available_threads() == threads, busy


def test_processes_at_a_positive_nice_value_leave_the_cores_free(fake_machine):
    """A niced batch job filling both cores yields them to the kernels' threads: its time is not load."""
    clock, stat, tick = fake_machine
    proc_stat(stat, {0: 0, 1: 0}, {0: 0, 1: 0})
    cpu.available_threads()
    clock.wall += 1.0
    proc_stat(stat, {0: 0, 1: 0}, {0: tick, 1: tick})
    assert cpu.free_cores() == pytest.approx(2.0) and cpu.available_threads() == 2


def test_without_proc_stat_the_cores_and_torch_decide(fake_machine, tmp_path, monkeypatch):
    clock, stat, tick = fake_machine
    monkeypatch.setattr(cpu, "PROC_STAT", str(tmp_path / "missing"))
    cpu.available_threads()
    clock.wall += 1.0
    assert cpu.free_cores() is None and cpu.available_threads() == 2
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {1})  # taskset to one core
    clock.wall += 1.0
    assert cpu.available_threads() == 1


def test_fixed_threads(fake_machine, monkeypatch):
    clock, stat, tick = fake_machine
    monkeypatch.setattr(cpu, "FIXED_THREADS", 3)
    assert cpu.available_threads() == 3  # whatever the load and torch's count
    long = torch.tensor([8192] * 4, dtype=torch.int32)
    assert cpu.threads_for(long, 3) == 3
    assert cpu.threads_for(torch.tensor([160], dtype=torch.int32), 2) == 1  # still no more than the work needs
    for env, want in (("4", 4), ("auto", None), ("", None)):
        monkeypatch.setenv("KVCOMPILE_THREADS", env)
        assert cpu._threads_from_env() == want
    for env in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("KVCOMPILE_THREADS", env)
        with pytest.raises(ValueError, match=rf"KVCOMPILE_THREADS='{env}': expected a whole number of threads "
                                             r">= 1, or 'auto'"):
            cpu._threads_from_env()


def test_real_competitors_take_the_kernels_down_to_one_thread(monkeypatch):
    """One busy process per core of this process's affinity, for real: after a window, the kernels see no
    core free and use one thread. (On a one-core machine one thread is all there is anyway.)"""
    monkeypatch.setattr(cpu, "_load", {"t": None, "busy": 0.0, "own": 0.0, "cpus": (), "free": None, "cap": None})
    monkeypatch.setattr(cpu, "FIXED_THREADS", None)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpu.cores())]
    try:
        time.sleep(0.5)
        cpu.free_cores()
        time.sleep(cpu.LOAD_WINDOW_S + 0.25)
        assert cpu.free_cores() < 0.5
        assert cpu.available_threads() == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_torch_threads_are_capped_for_a_call_and_put_back(monkeypatch):
    """kvcompile's forward runs torch's own ops (the model's matmuls) with at most the free cores' threads,
    never more than the user set, and puts the user's count back."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvcompile
    from kvcompile import Policy
    from kvcompile.templates import cpu

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(cpu, "available_threads", lambda: 1)
        with cpu.capped_torch_threads():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(cpu, "available_threads", lambda: 8)
        with cpu.capped_torch_threads():
            assert torch.get_num_threads() == 2  # never raised above the user's count
        monkeypatch.setattr(cpu, "available_threads", lambda: 1)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).eval()
        seen = []  # torch's thread count whenever the store kernel runs: in the prefill (eager) and each decode step
        from kvcompile.templates import cpu_store
        real = cpu_store.store
        monkeypatch.setattr(cpu_store, "store", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
        kvcompile.apply(model, Policy.int8())
        with torch.no_grad():
            model.generate(torch.randint(3, 64, (1, 5)), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert len(seen) == 3 and set(seen) == {1} and torch.get_num_threads() == 2  # prefill + 2 decode steps
    finally:
        torch.set_num_threads(before)
