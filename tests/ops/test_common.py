"""Shared op helpers: the metadata upload keeps every piece's values and 16-byte alignment."""

from __future__ import annotations

import torch

from replayssm.ops.common import upload


def test_upload_views_are_16_byte_aligned_whatever_the_sizes():
    """Pieces of odd and even lengths come back equal, each view starting on a 16-byte boundary
    (Triton specializes kernels on pointer alignment: sizes must not change it)."""
    gen = torch.Generator().manual_seed(0)
    for lengths in ([1, 2, 3], [3, 3, 1, 0, 5], [0, 7], [2]):
        pieces = {f"p{i}": torch.randint(-5, 100, (n,), generator=gen) for i, n in enumerate(lengths)}
        pieces["list"] = [4, -1, 9]
        got = upload(pieces, torch.device("cpu"))
        for name, want in pieces.items():
            assert torch.equal(got[name], torch.as_tensor(want).long()), name
            assert got[name].storage_offset() % 2 == 0, (name, lengths)
            assert got[name].data_ptr() % 16 == 0, (name, lengths)
