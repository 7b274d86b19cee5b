import os

import pytest
import torch

# Tests compare against float64 references; keep CPU runs reproducible and single-threaded per
# process so that spawned multi-rank tests do not oversubscribe the cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    # Without pytest-timeout, --strict-markers would refuse to collect tests marked with a timeout:
    # declare the marker (the limit is then not enforced; multi-rank tests keep their own deadlines).
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test time limit (enforced by pytest-timeout)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
