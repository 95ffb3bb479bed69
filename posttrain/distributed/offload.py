"""A frozen model kept in CPU memory between uses (the reference or a reward model of online RL, `algo.ref_offload`,
`algo.reward_model_offload`): each forward moves its weights to the training device and back.

    reference = Offloaded(model, device="cuda:0")        # weights in host memory
    reference(input_ids=...)                              # on cuda:0 for this forward only

Under ZeRO-3 the backend offloads with DeepSpeed's own parameter offload instead (the partitions live on the CPU);
this wrapper is for everything else (one process, DDP, ZeRO-1/2). On a CPU-only machine it changes nothing.
"""

from __future__ import annotations

import torch


class Offloaded(torch.nn.Module):
    """Wraps a frozen module as `.module` (like DDP, so code that unwraps `.module` finds the model)."""

    def __init__(self, module: torch.nn.Module, device):
        super().__init__()
        self.module = module.to("cpu").eval()
        self.device = torch.device(device)

    def forward(self, *args, **kwargs):
        self.module.to(self.device)  # a no-op on a CPU-only machine
        try:
            return self.module(*args, **kwargs)
        finally:
            self.module.to("cpu")  # outputs stay on the device; only the weights go back

    @property
    def config(self):
        return self.module.config
