"""What rank 0 tells the other ranks before each forward pass: plain lists, no tensors.

Every rank runs the same forward over the same tokens (its own heads and MLP slice), so it needs
the flattened token ids and positions and the attention batch (query/key lengths and the page
table): exactly what rank 0's model runner built. Page ids are the same on every rank: one
allocator (rank 0's) hands out page ``p``, and page ``p`` of every rank's cache holds that
rank's heads of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.models.attention import AttentionBatch


@dataclass(frozen=True)
class StepMeta:
    input_ids: list[int]  # [T] the step's tokens, sequences flattened (decodes first)
    positions: list[int]  # [T]
    batch: AttentionBatch  # q_lens / kv_lens / page_ids per sequence, num_decodes

    def run(self, model, backend, device: torch.device) -> torch.Tensor:
        """Runs the forward pass on this rank (its all-reduces meet rank 0's); returns hidden
        states [T, H]. Followers never compute logits: only rank 0 samples."""
        meta = backend.plan(self.batch)
        ids = torch.tensor(self.input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(self.positions, dtype=torch.long, device=device)
        return model(ids, pos, backend, meta, None)
