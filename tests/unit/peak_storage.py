"""PeakStorage, shared by the fused heads' unit tests (test_fused_head.py, test_fused_grad.py)."""
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakStorage(TorchDispatchMode):
    """Records the largest storage (bytes) behind any tensor an op returns, views included."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, Tensor):
                self.peak = max(self.peak, x.untyped_storage().nbytes())
        return out
