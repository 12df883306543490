"""Building blocks of the hybrid decoder: norms, MLP/MoE, paged attention, Mamba-2 mixer."""
