"""``trainer.host_heap``: with ``keep`` glibc keeps the memory tensors free in its heap (mallopt),
so a training step's tensors, once the first steps have grown the heap, page-fault no more;
``release`` leaves the C library's defaults. Counted in a fresh interpreter (the setting is the
process's) with the kernel's minor page faults over MNIST CNN steps."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from gradmod.run import checks
from gradmod.run.config import TrainerConfig

GLIBC = platform.libc_ver()[0] == "glibc"

PROBE = """
import json, resource, sys
import torch
import torch.nn.functional as F
from gradmod.models import MnistCNN
from gradmod.run import host_heap
torch.set_num_threads(1)
took = host_heap.keep() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
model = MnistCNN()
opt = torch.optim.Adam(model.parameters())
x, y = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "kept": host_heap.kept, "faults": faults}))
"""


def _probe(setting: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_keep_takes_on_glibc_and_release_leaves_the_defaults():
    kept, released = _probe("keep"), _probe("release")
    assert kept["took"] is GLIBC and kept["kept"] is GLIBC
    assert released["took"] is False and released["kept"] is False


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere keep() says False (above)")
def test_kept_steps_page_fault_no_more_once_the_heap_has_grown():
    faults = _probe("keep")["faults"]
    assert faults[0] > 1000  # the first step maps its activations (about 50 MiB)
    # five later steps together fault less than a quarter of it (glibc's defaults here: each
    # step about half of it again, 5,000 to 8,600 pages)
    assert sum(faults[5:]) < faults[0] / 4, faults


def test_an_unknown_setting_is_one_line():
    with pytest.raises(ValueError, match=r"^trainer.host_heap='always' is not allowed; allowed: keep, release$"):
        checks.trainer(TrainerConfig(host_heap="always"))
