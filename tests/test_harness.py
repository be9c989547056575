"""The test harness itself (tests/harness.py): what it ends after a test, and what it must leave."""

from __future__ import annotations

import os

import torch

from tests.harness import command_name, end_groups, own_children


def test_ending_a_tests_leftovers_spares_torchs_shared_memory_manager(processes):
    """The first shared tensor of a process starts torch's manager, a session of its own: ended with a
    test's leftovers, the next shared tensor freed (hivemind's step controls hold some) aborts the run."""
    before = own_children()
    shared = torch.zeros(4).share_memory_()
    managers = [pid for pid in os.listdir("/proc") if pid.isdigit() and command_name(int(pid)) == "torch_shm_manag"]
    assert managers, "no torch_shm_manager running after share_memory_()"
    end_groups(own_children() - before)
    assert all(command_name(int(pid)) for pid in managers), "torch's shared-memory manager was ended"
    del shared
    torch.zeros(4).share_memory_()  # with its manager gone, this (or the free above) aborts the process
