"""torch.compile's warm start: the compile cache that outlives pods, the AOTAutograd cache's allow-list, and the
transformer blocks compiled ahead of time."""
