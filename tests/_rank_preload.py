"""Imported once by the fork server that starts the ranks of ``tests.launch.run_ranks``: each rank is then
forked with torch, transformers, the tiny models' classes and the package already imported, instead of
spending ~8 s of CPU on imports (the bulk of a short multi-rank test on a 2-core machine).

Only imports happen here (no tensor work, no process group), so nothing that a fork could break is running;
a failing import is left for the rank to hit again and report.
"""

import contextlib
import os

os.environ["OMP_NUM_THREADS"] = "1"  # this process never computes; ranks set their own threads

with contextlib.suppress(Exception):
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM  # noqa: F401

    import hf_blockdiag_cp  # noqa: F401
    import tests.reference  # noqa: F401

    del transformers
