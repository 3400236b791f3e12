"""torch's intra-op thread count for a block of a kernel test, restored however the block ends."""

from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(n: int):
    """Run the block with `torch.set_num_threads(n)`; the count before is set back on the way out."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
